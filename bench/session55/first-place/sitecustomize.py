"""Per-thread wall seconds of the engine's ops (experiment only; OPTIME_OUT=dir turns it on): at exit each process
writes {thread: {op: [calls, seconds]}} to OPTIME_OUT/optime-<pid>.json."""
import os

if os.environ.get("OPTIME_OUT"):
    import atexit
    import json
    import threading
    import time
    from collections import defaultdict

    table = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))

    def wrap(owner, name, label):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                entry = table[threading.current_thread().name][label]
                entry[0] += 1
                entry[1] += time.perf_counter() - started
        setattr(owner, name, timed)

    from specactor_engine import sampling
    from specactor_engine.kernels import decode_ops, gumbel_argmax
    from specactor_engine.model import packed_linear, runner

    wrap(packed_linear.PackedLinear, "__call__", "linear")
    wrap(runner, "paged_decode_attention", "attention")
    wrap(decode_ops, "rotary_write_kv", "rotary_kv")
    wrap(decode_ops, "add_rms_norm", "norm")
    wrap(decode_ops, "silu_mul", "silu")
    wrap(gumbel_argmax, "gumbel_argmax", "gumbel")
    wrap(runner.ModelRunner, "forward", "forward")

    def dump():
        path = os.path.join(os.environ["OPTIME_OUT"], f"optime-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({thread: dict(ops) for thread, ops in table.items()}, f)
    atexit.register(dump)

if os.environ.get("OPTIME_OUT") and os.environ.get("OPTIME_SCHED"):
    # per turn: every task's on-CPU and run-queue-wait nanoseconds (/proc/self/task/*/schedstat), summed by the
    # turn's holder; and which task is which system's rollout thread
    from benchmark import paired

    sched = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    names: dict = {}
    snapshot: dict = {}

    def read_tasks():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run, wait, _ = f.read().split()
                with open(f"/proc/self/task/{tid}/comm") as f:
                    comm = f.read().strip()
                out[int(tid)] = (int(run), int(wait), comm)
            except (OSError, ValueError):
                pass
        return out

    acquire, release = paired.Turns.acquire, paired.Turns._release

    def sched_acquire(self, name):
        acquire(self, name)
        names[threading.get_native_id()] = name
        snapshot["tasks"] = read_tasks()

    def sched_release(self, name, leaving):
        now = read_tasks()
        before = snapshot.get("tasks", {})
        for tid, (run, wait, comm) in now.items():
            run0, wait0, _ = before.get(tid, (run, wait, comm))
            entry = sched[name][f"{tid}:{names.get(tid, comm)}"]
            entry[0] += run - run0
            entry[1] += wait - wait0
        release(self, name, leaving)

    paired.Turns.acquire, paired.Turns._release = sched_acquire, sched_release

    def dump_sched():
        path = os.path.join(os.environ["OPTIME_OUT"], f"sched-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({holder: dict(tasks) for holder, tasks in sched.items()}, f)
    atexit.register(dump_sched)
