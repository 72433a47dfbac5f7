"""Does a width-1 step's time depend on where the KV cache landed in memory? One process, `ar` built as the
benchmark's worker builds it for trace B; the cache (128 slots x 680 positions, as B's) is freed and allocated again
ALLOCS times, and after each allocation a width-1 step of all 128 rows at context 400 is timed STEPS times.

    PYTHONPATH=. .venv/bin/python bench/session67/alloc_probe.py [ALLOCS] [STEPS]

Prints per allocation the median step and the process's AnonHugePages (kB). Run it with and without
THP_MEM_ALLOC_ENABLE=1 (torch then asks for 2 MB pages for every allocation of at least 2 MB), nothing else on the
machine. The spread between allocations against the spread within one says whether the placement matters.
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
allocs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
trace = get_trace("B")
requests, sampling = build_requests(trace), sampling_config(trace)
spec = RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=trace.model.drafter, dtype=trace.dtype)
system = build_system(spec)
system.generate(requests[:1], sampling.model_copy(update={"n": 1, "max_new_tokens": 8}), FinishClock())
runner = system.engine.runner
rows, context = 128, 400
slots, inputs = torch.arange(rows), torch.randint(0, 1000, (rows, 1))


def huge_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])
    return 0


with torch.inference_mode():
    for alloc in range(allocs):
        runner.cache = None  # free the old buffers before the new ones, as ModelRunner.allocate does
        runner.cache = runner._new_cache(rows, 680)
        times = []
        for i in range(steps + 3):
            runner.cache.lengths[slots] = context
            started = time.perf_counter()
            runner.forward(inputs, slots, torch.ones(rows, dtype=torch.long))
            if i >= 3:
                times.append(time.perf_counter() - started)
        q = statistics.quantiles(times, n=4)
        print(json.dumps({"alloc": alloc, "median_ms": round(statistics.median(times) * 1e3, 1),
                          "q1_ms": round(q[0] * 1e3, 1), "q3_ms": round(q[2] * 1e3, 1),
                          "anon_huge_kb": huge_kb()}), flush=True)
