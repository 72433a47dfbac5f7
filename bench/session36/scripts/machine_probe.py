"""Every ~1 s for N seconds: read bandwidth (sum over a 2 GiB bf16 tensor, 2 threads) and compute (a bf16 matmul held
in cache): is this machine's speed bimodal over time with nothing else running?"""
import sys, time, torch
torch.set_num_threads(2)
big = torch.ones(1 << 30, dtype=torch.bfloat16)  # 2 GiB
a = torch.randn(4, 1536, dtype=torch.bfloat16); w = torch.randn(1536, 1536, dtype=torch.bfloat16)
c1 = torch.randn(512, 512, dtype=torch.bfloat16); c2 = torch.randn(512, 512, dtype=torch.bfloat16)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    t = time.perf_counter(); big.sum(); bw = 2.0 / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(50):
        c1 @ c2
    gf = 50 * 2 * 512 ** 3 / (time.perf_counter() - t) / 1e9
    print(f"{time.strftime('%T')} read {bw:5.1f} GiB/s  matmul {gf:6.1f} GFLOP/s", flush=True)
    time.sleep(0.5)
