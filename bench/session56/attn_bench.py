import time, torch, sys
from specactor_engine.kernels.paged_attention import paged_decode_attention, kernel_available
torch.set_num_threads(2)
assert kernel_available()
def bench(R, T, ctx, H, Hkv, D, dtype, layers, slots_n=None):
    N = R
    kc = torch.randn(N, 1024, Hkv, D, dtype=dtype); vc = torch.randn_like(kc)
    q = torch.randn(R, T, H, D, dtype=dtype)
    slots = torch.arange(R)
    pos = ctx + torch.arange(T)[None, :].repeat(R, 1)
    # packed: R*T rows of 1 token
    qp = q.reshape(R * T, 1, H, D); sp = slots.repeat_interleave(T); pp = pos.reshape(-1, 1)
    def run(qq, ss, ppos):
        return paged_decode_attention(qq, kc, vc, ss, ppos, 0.1)
    res = {}
    for name, args in [('padded', (q, slots, pos)), ('packed', (qp, sp, pp)), ('width1', (q[:, :1].contiguous(), slots, pos[:, :1].contiguous()))]:
        for _ in range(3): run(*args)
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(layers): run(*args)
            ts.append(time.perf_counter() - t0)
        res[name] = sorted(ts)[3] * 1000
    print(f'R={R} T={T} ctx={ctx} {dtype}: ' + ', '.join(f'{k} {v:.1f} ms' for k, v in res.items()))
# Qwen2.5-1.5B: 28 layers, 12 heads, 2 kv heads, D 128, bf16 (trace D)
for ctx in (200, 400, 600):
    bench(4, 5, ctx, 12, 2, 128, torch.bfloat16, 28)
bench(4, 3, 400, 12, 2, 128, torch.bfloat16, 28)
# SmolLM2-135M: 30 layers, 9 heads, 3 kv, D 64, fp32 (traces B, C)
for R in (64, 128):
    bench(R, 2, 400, 9, 3, 64, torch.float32, 30)
