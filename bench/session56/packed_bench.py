"""Round costs: a width-1 step, the padded verify block, and the packed block (one forward row per real token).

Usage (repository root, PYTHONPATH=.): packed_bench.py MODEL_DIR DTYPE ROWS CONTEXT WIDTHS [REPS]
WIDTHS: each row's tokens, cycled over the rows (e.g. 2,1,1,1: a quarter of the rows verify one draft).
`packed_old` runs the packed block by hand, `packed_new` through `ModelRunner.forward_packed`: the same path at
a4d91c3 and after; with ragged-attention.patch applied, `packed_new` is attention over the padded block."""
import statistics, sys, time
import torch
from specactor_engine.model.runner import ModelRunner, load_hf_model

path, dtype, R, ctx, widths = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
reps = int(sys.argv[6]) if len(sys.argv) > 6 else 9
torch.set_num_threads(2)
model = load_hf_model(path, dtype)
runner = ModelRunner(model)
runner.allocate(R, ctx + 64)
gen = torch.Generator().manual_seed(0)
V = model.config.vocab_size
slots = torch.arange(R)
for s0 in range(0, R, 16):  # prefill in groups
    sl = slots[s0:s0 + 16]
    runner.forward(torch.randint(0, V, (len(sl), ctx), generator=gen), sl, logits_at="none")
    runner.commit(sl, torch.full((len(sl),), ctx))
w = [int(x) for x in widths.split(",")]
num = torch.tensor([w[i % len(w)] for i in range(R)])
T = int(num.max())
block = torch.randint(0, V, (R, T), generator=gen)
plain = block[:, :1]

def padded():
    runner.forward(block, slots, num)

def packed_old():
    rows, cols = (torch.arange(T)[None, :] < num[:, None]).nonzero(as_tuple=True)
    runner.forward(block[rows, cols][:, None], slots[rows], offsets=cols)

def packed_new():
    runner.forward_packed(block, slots, num)

def width1():
    runner.forward(plain, slots)

fns = {"width1": width1, "padded": padded, "packed_old": packed_old, "packed_new": packed_new}
times = {k: [] for k in fns}
for f in fns.values():
    f()
for _ in range(reps):  # interleaved
    for k, f in fns.items():
        t0 = time.perf_counter(); f(); times[k].append(time.perf_counter() - t0)
med = {k: statistics.median(v) * 1000 for k, v in times.items()}
print(f"{path.split('/')[-1]} R={R} ctx={ctx} widths={widths} tokens={int(num.sum())}: "
      + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
