"""Trace C's plain verify forward, timed inside a process built as the benchmark's worker builds `ar` or `specactor`:
is `specactor`'s forward slower in its own process, and in which ops?

    PYTHONPATH=. .venv/bin/python bench/session66/forward_probe.py SYSTEM HISTORY.json [CONTEXT ...]

SYSTEM: `ar` or `specactor`; HISTORY.json: a trace C run's `runs/history.json`. The system is loaded, warmed up,
given the history and prepared as `benchmark/worker.py` does; then every one of its 128 slots is set to the same
committed length (default 200, 400 and 600 positions; the cache's contents do not matter to the time) and
`ModelRunner.forward` runs a width-1 step of all rows, as a plain round's verify does: 8 untimed, then 30 timed at
each context, interleaved. A second pass runs 10 more steps under torch's profiler and prints each op's share.
Prints one JSON line per context (median, quartiles) and the op table. Run it for both systems in turn, several
times, nothing else on the machine.
"""
import json
import statistics
import sys
import time

import torch

from benchmark.interface import FinishClock, RunSpec
from benchmark.systems import build_system
from benchmark.traces import build_requests, get_trace, sampling_config

torch.set_num_threads(2)
name, history_path = sys.argv[1], sys.argv[2]
contexts = [int(c) for c in sys.argv[3:]] or [200, 400, 600]
trace = get_trace("C")
requests, sampling = build_requests(trace), sampling_config(trace)
history = json.loads(open(history_path, encoding="utf-8").read())
spec = RunSpec(system=name, trace=trace, target=trace.model.target, drafter=trace.model.drafter, dtype=trace.dtype)
system = build_system(spec)
system.generate(requests[:1], sampling.model_copy(update={"n": 1, "max_new_tokens": 8}), FinishClock())
system.set_history(requests, history)
system.prepare(requests, sampling)
runner = system.engine.runner
# all 128 rows, or (SUBSET=n) n of them picked at random with a fixed seed, sorted, as a rollout's tail leaves them
import os
subset = int(os.environ.get("SUBSET", "0"))
slots = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:subset].sort().values if subset \
    else torch.arange(128)
rows = len(slots)
inputs = torch.randint(0, 1000, (rows, 1))
print(f"{name}: cache {runner.cache.num_slots} slots x {runner.cache.max_len} positions", file=sys.stderr)


def step(context: int) -> float:
    runner.cache.lengths[slots] = context
    started = time.perf_counter()
    runner.forward(inputs, slots, torch.ones(rows, dtype=torch.long))
    return time.perf_counter() - started


with torch.inference_mode():
    for context in contexts:
        for _ in range(8):
            step(context)
    times: dict[int, list[float]] = {c: [] for c in contexts}
    for _ in range(30):
        for context in contexts:
            times[context].append(step(context))
    for context, values in times.items():
        q = statistics.quantiles(values, n=4)
        print(json.dumps({"system": name, "context": context, "median_ms": round(statistics.median(values) * 1e3, 2),
                          "q1_ms": round(q[0] * 1e3, 2), "q3_ms": round(q[2] * 1e3, 2)}))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step(contexts[len(contexts) // 2])
    table = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in table)
    for event in sorted(table, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {name} {event.key:<40} {event.self_cpu_time_total / total:6.1%} "
              f"{event.self_cpu_time_total / 10 / 1e3:8.2f} ms/step  calls/step {event.count / 10:.0f}")
