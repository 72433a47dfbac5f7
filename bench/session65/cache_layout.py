"""Trace C's decode step (smollm2-135m-instruct fp32, 128 rows, width 1) under the KV-cache layouts `ar` and
`specactor` allocate, and on huge pages: is specactor's plain decoding slower because of its cache?

    PYTHONPATH=. .venv/bin/python bench/session65/cache_layout.py

`ar` allocates 128 slots of L+1 positions; `specactor` with combinable drafters 128 + 8 scratch slots of L+5
(engine.py `_reserve`). Each runner's 128 slots are prefilled with random tokens (contexts 150-450, as C's rows
midway), then width-1 forwards over all 128 rows are timed, the layouts interleaved step by step (the machine's
drift reaches both alike); medians of 40 steps each (`huge` adds `ar`'s layout on 2 MB pages).
"""
import mmap, statistics, sys, time
import torch
from benchmark.interface import RunSpec, load_target
from benchmark.traces import get_trace
from specactor_engine.model.runner import ModelRunner
from specactor_engine.model.kv_cache import KVCache

torch.set_num_threads(2)
trace = get_trace("C")
model, _ = load_target(RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=None, dtype=trace.dtype,
                               threads=2))
ROWS, L = 128, 700
g = torch.Generator().manual_seed(0)
contexts = torch.randint(150, 450, (ROWS,), generator=g)


def huge_zeros(shape, dtype):
    """zeros on a fresh mapping advised onto 2 MB pages"""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    m = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    off = (-t.data_ptr()) % (2 << 20)
    t = t[off:off + nbytes].view(dtype).view(shape)
    t._keep = m
    return t


def build(slots, max_len, huge=False):
    runner = ModelRunner(model, packed_linear=True, paged_attention=True)
    runner.allocate(slots, max_len)
    if huge:
        c = runner.cache
        c.keys = [huge_zeros(k.shape, k.dtype) for k in c.keys]
        c.values = [huge_zeros(v.shape, v.dtype) for v in c.values]
    rows = torch.arange(ROWS)
    for chunk in rows.split(16):
        width = int(contexts[chunk].max())
        ids = torch.randint(runner.vocab_size, (len(chunk), width), generator=g)
        runner.forward(ids, chunk, num_tokens=contexts[chunk], logits_at="none")
        runner.commit(chunk, contexts[chunk])
    return runner


variants = {"ar 128 x L+1": build(ROWS, L + 1), "specactor 136 x L+5": build(ROWS + 8, L + 5)}
if "huge" in sys.argv:
    variants["ar on 2 MB pages"] = build(ROWS, L + 1, huge=True)
slots = torch.arange(ROWS)
times = {name: [] for name in variants}
for _ in range(40):
    for name, runner in variants.items():
        for _ in range(1):
            ids = torch.randint(runner.vocab_size, (ROWS, 1), generator=g)
            t0 = time.perf_counter()
            runner.forward(ids, slots)
            times[name].append(time.perf_counter() - t0)
            runner.set_lengths(slots, contexts)
base = statistics.median(times["ar 128 x L+1"])
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"{name:22s} median {m * 1e3:7.1f} ms  min {min(ts) * 1e3:7.1f}  vs ar {base / m:.3f}x")
