"""Session 32: a ragged verify block of Qwen2.5-1.5B (trace D's target, bf16, 4 rows at context 300) packed
(`ModelRunner.forward_packed`) against padded to its widest row; medians of 7 timings after 2 warm-ups.

    TORCH_EXTENSIONS_DIR=.cache/torch_extensions .venv/bin/python bench/session32/packed_forward_timing.py
"""
import time, statistics, torch
from benchmark.traces import get_trace
from benchmark.interface import RunSpec, load_target
from specactor_engine.model.runner import ModelRunner
torch.set_num_threads(2)
trace = get_trace("D")
loaded, _ = load_target(RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=None, dtype=trace.dtype, threads=2))
runner = ModelRunner(loaded)
R, ctx = 4, 300
runner.allocate(R, ctx + 16)
slots = torch.arange(R)
g = torch.Generator().manual_seed(0)
runner.forward(torch.randint(runner.vocab_size, (R, ctx), generator=g), slots, logits_at="last")
runner.commit(slots, torch.full((R,), ctx))
def padded(T):
    ids = torch.randint(1000, (R, T)); runner.forward(ids, slots)
def packed(widths):
    widths = torch.tensor(widths); T = int(widths.max())
    ids = torch.randint(1000, (R, T))
    rows, cols = (torch.arange(T)[None] < widths[:, None]).nonzero(as_tuple=True)
    runner.forward(ids[rows, cols][:, None], slots[rows], offsets=cols)
def bench(f, *a):
    for _ in range(2): f(*a)
    ts = []
    for _ in range(7):
        t = time.perf_counter(); f(*a); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
for T in (1, 2, 3, 4):
    print("padded", T, "tokens", R*T, "%.1f ms" % bench(padded, T), " packed same", "%.1f ms" % bench(packed, [T]*R))
for w in ([2,2,1,1], [3,3,2,1], [4,3,3,3], [4,4,2,1], [3,2,2,2]):
    print("packed", w, sum(w), "%.1f ms" % bench(packed, w), " padded to", max(w), "%.1f" % bench(padded, max(w)))
