"""Qwen2.5-Coder-1.5B bf16 at 4 rows, context 300: a forward (head included) and its sampling at widths 1-4.

    PYTHONPATH=. .venv/bin/python bench/session42/forward_widths.py [profile]

What a decode step (width 1) and a verify of 1-3 drafts a row cost with the engine's kernels as built; medians of
15 forwards each (3 rounds of the four widths, 5 each); `profile` adds torch's operator table at widths 1 and 3.
"""
import statistics, time, sys, torch
from benchmark.interface import RunSpec, load_target
from benchmark.traces import get_trace
from specactor_engine.model.runner import ModelRunner
from specactor_engine.sampling import SamplingParams, sample_tokens
torch.set_num_threads(2)
trace = get_trace("D")
model, _ = load_target(RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=None, dtype=trace.dtype, threads=2))
runner = ModelRunner(model, packed_linear=True, paged_attention=True)
batch, context = 4, 300
runner.allocate(batch, context + 16)
slots = torch.arange(batch)
g = torch.Generator().manual_seed(0)
runner.forward(torch.randint(runner.vocab_size, (batch, context), generator=g), slots, logits_at="last")
runner.commit(slots, torch.full((batch,), context))
params, keys = SamplingParams(1.0, 0, 1.0), torch.arange(batch)
prof = len(sys.argv) > 1
def fwd(width):
    tokens = torch.randint(runner.vocab_size, (batch, width), generator=g)
    t0 = time.perf_counter(); logits = runner.forward(tokens, slots); t1 = time.perf_counter()
    sample_tokens(logits, params, keys, context + torch.arange(width).expand(batch, width)); t2 = time.perf_counter()
    runner.set_lengths(slots, torch.full((batch,), context))
    return t1 - t0, t2 - t1
for w in (1, 2, 3, 4): fwd(w)
res = {}
for _ in range(3):
    for w in (1, 2, 3, 4):
        for _ in range(5):
            res.setdefault(w, []).append(fwd(w))
for w in (1, 2, 3, 4):
    f = statistics.median(a for a, b in res[w]); s = statistics.median(b for a, b in res[w])
    print(f"width {w}: forward {f*1e3:6.1f} ms  sampling {s*1e3:5.1f} ms  total {(f+s)*1e3:6.1f}")
if prof:
    from torch.profiler import profile, ProfilerActivity
    for w in (1, 3):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5): fwd(w)
        print(f"--- width {w}"); print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
