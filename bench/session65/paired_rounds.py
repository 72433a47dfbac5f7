"""`ar` and `specactor` on trace C in one process, a round of each in turn: is `specactor`'s plain verify forward
slower because of what its round does, or because of its process's history?

    PYTHONPATH=. .venv/bin/python bench/session65/paired_rounds.py HISTORY.json [MAX_NEW_TOKENS] [swap]

HISTORY.json: a benchmark run's `runs/history.json` for trace C at the same max new tokens (the earlier rollout the
history drafters know). Both engines are built, warmed up and prepared as the benchmark's workers do them; then their
rollouts advance together, one round of `ar`, one of `specactor` (`swap`: `specactor` first), so the machine's drift
reaches both alike. Prints
each engine's verify-forward seconds and the per-round ratio; their outputs are checked identical. Unlike
`Run.decode` the loop does not trim the heap every 32 rounds (model/heap.py): both engines alike.
"""
import json, statistics, sys
from collections import deque, Counter
import torch
from benchmark.interface import FinishClock, RunSpec
from benchmark.systems import build_system
from benchmark.traces import build_requests, get_trace, sampling_config
from specactor_engine import clock
from specactor_engine.run import Run
from specactor_engine.types import EngineStats

torch.set_num_threads(2)
history_path = sys.argv[1]
trace = get_trace("C")
if len(sys.argv) > 2:
    trace = trace.with_overrides(max_new_tokens=int(sys.argv[2]))
requests, sampling = build_requests(trace), sampling_config(trace)
history = json.loads(open(history_path, encoding="utf-8").read())
systems = {}
for name in ("specactor", "ar") if "swap" in sys.argv[3:] else ("ar", "specactor"):
    spec = RunSpec(system=name, trace=trace, target=trace.model.target, drafter=trace.model.drafter, dtype=trace.dtype)
    system = build_system(spec)
    system.generate(requests[:1], sampling.model_copy(update={"n": 1, "max_new_tokens": 8}), FinishClock())
    system.set_history(requests, history)
    system.prepare(requests, sampling)
    systems[name] = system

runs, queues, verify = {}, {}, {}
for name, system in systems.items():
    engine = system.engine
    sequences = [s for s in engine._prepare(requests, sampling) if s.error is None]
    stats = EngineStats(mode=engine.mode.name, drafted_per_position=[0] * engine.num_draft_tokens,
                        accepted_per_position=[0] * engine.num_draft_tokens)
    if engine.verify_length == "dynamic":
        engine._ensure_length_policy(min(len(sequences), engine.max_batch_size), engine._longest(sequences, sampling))
    run = Run(engine, sampling, stats, engine._reserve(sequences, sampling), clock.now(), total_threads=2)
    run.on_finish, run.waiting = None, Counter(id(s.request) for s in sequences)
    run.kept_logits.clear()
    runs[name], queues[name], verify[name] = run, (deque(sequences), sequences), []
while any(queues[n][0] or runs[n].slot_seq for n in runs):
    for name, run in runs.items():
        pending = queues[name][0]
        if pending and run.free:
            run._admit([pending.popleft() for _ in range(min(len(pending), len(run.free)))])
        if run.slot_seq:
            before = run.stats.verify_s
            run._round()
            verify[name].append(run.stats.verify_s - before)
outputs = {n: [s.output_ids for s in queues[n][1]] for n in runs}
print("identical outputs:", outputs["ar"] == outputs["specactor"])
a, s = verify["ar"], verify["specactor"]
print(f"rounds {len(a)} / {len(s)}; verify forwards ar {sum(a):.2f} s, specactor {sum(s):.2f} s: "
      f"ar / specactor {sum(a) / sum(s):.3f}; per-round median ratio {statistics.median(x / y for x, y in zip(a, s)):.3f}")
for lo, hi in ((0, len(a) // 3), (len(a) // 3, 2 * len(a) // 3), (2 * len(a) // 3, len(a))):
    print(f"  rounds {lo}-{hi}: ar {statistics.median(a[lo:hi]) * 1e3:.1f} ms, "
          f"specactor {statistics.median(s[lo:hi]) * 1e3:.1f} ms")
