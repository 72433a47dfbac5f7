"""Qwen2.5-1.5B's decoder linears (28 layers, streamed from memory) through both kernel variants, alternated."""
import time, torch
torch.set_num_threads(2)
from specactor_engine.kernels import bf16_linear as bl
assert bl.available()
shapes = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # qkv, o, gate+up, down
layers = [[bl.pack(torch.randn(n, k).bfloat16() * 0.02) for n, k in shapes] for _ in range(28)]
head = bl.pack(torch.randn(151936, 1536).bfloat16() * 0.02)
def step(M, v):
    xs = {k: torch.randn(M, k).bfloat16() for k in (1536, 8960)}
    t = time.perf_counter()
    for layer in layers:
        for (n, k), p in zip(shapes, layer):
            bl.linear(xs[k], p, None, n, v)
    bl.linear(xs[1536], head, None, 151936, v)
    return time.perf_counter() - t
print("bf16 variant chosen:", bl.variant(), bl.time_variants())
for M in (4, 8, 12, 16, 32, 128):
    res = {v: [] for v in bl.VARIANTS}
    for r in range(5):
        for v in bl.VARIANTS:
            res[v].append(step(M, v))
    med = {v: sorted(ts)[2] * 1e3 for v, ts in res.items()}
    flops = 2 * M * sum(n * k for n, k in shapes) * 28 + 2 * M * 151936 * 1536
    print(f"M={M:3d}: " + "  ".join(f"{v} {med[v]:7.1f} ms ({flops / med[v] / 1e6:5.0f} GFLOP/s)" for v in bl.VARIANTS)
          + f"  dpbf16/fma {med['dpbf16'] / med['fma']:.2f}", flush=True)
