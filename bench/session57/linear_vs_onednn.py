"""The engine's bf16 kernel against oneDNN's packed bf16 GEMM and torch's F.linear, same shapes, median of 30 calls,
2 threads. Session 57: on this Xeon every path tops out at ~160 GFLOP/s."""
import time, torch
torch.set_num_threads(2)
from specactor_engine.kernels import bf16_linear as bl
assert bl.available()
def t_med(f, reps=30):
    for _ in range(3): f()
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return sorted(ts)[len(ts)//2]
for M in (4,12,20):
    for (N,K) in ((512,1536),(8960,1536)):
        w = torch.randn(N, K).bfloat16(); x = torch.randn(M, K).bfloat16()
        p = bl.pack(w); od = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 128)
        a = t_med(lambda: bl.linear(x, p, None, N))
        b = t_med(lambda: torch.ops.mkldnn._linear_pointwise(x, od, None, "none", [], ""))
        c = t_med(lambda: torch.nn.functional.linear(x, w))
        f = 2*M*N*K/1e9
        print(f"M={M} N={N} K={K}: kernel {f/a:6.1f}  onednn {f/b:6.1f}  F.linear {f/c:6.1f} GFLOP/s", flush=True)
