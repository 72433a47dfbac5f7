"""The engine's bf16 linear kernel (kernels/bf16_linear.py) on one shape at a time, weights resident or streamed:
GFLOP/s and weight GB/s, median of 30 calls, 2 threads. Session 57: this Xeon's bf16 peak (~160-180 GFLOP/s)."""
import time, torch
torch.set_num_threads(2)
from specactor_engine.kernels import bf16_linear as bl
assert bl.available()
def bench(M, N, K, reps=30):
    w = torch.randn(N, K).bfloat16(); p = bl.pack(w); x = torch.randn(M, K).bfloat16()
    for _ in range(3): bl.linear(x, p, None, N)
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); bl.linear(x, p, None, N); ts.append(time.perf_counter()-t)
    t=sorted(ts)[len(ts)//2]
    return 2*M*N*K/t/1e9, N*K*2/t/1e9, t*1e3
for M in (1,4,8,12,16,20,24):
    for (N,K) in ((512,1536),(8960,1536),(1536,8960),(17920,1536)):
        gf, gb, ms = bench(M,N,K)
        print(f"M={M:3d} N={N:5d} K={K:5d}: {gf:6.1f} GFLOP/s {gb:6.1f} GB/s {ms:7.3f} ms", flush=True)
