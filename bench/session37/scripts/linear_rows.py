import time, torch
from torch import nn
from specactor_engine.model.packed_linear import PackedLinear
torch.manual_seed(0)
shapes = {"gate_up": (1536, 17920), "down": (8960, 1536), "qkv": (1536, 2048)}
res = {}
for name, (k, n) in shapes.items():
    lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    p = PackedLinear([lin])
    for rep in range(3):
        for m in (4, 8, 12, 16, 20, 24, 32):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            p(x)
            t = time.perf_counter()
            for _ in range(20):
                p(x)
            dt = (time.perf_counter() - t) / 20
            res.setdefault((name, m), []).append(dt)
for (name, m), v in res.items():
    v.sort(); k, n = shapes[name]
    print(name, m, f"{v[0]*1e3:.2f} ms", f"{2*m*k*n/v[0]/1e9:.0f} GFLOP/s", f"{k*n*2/v[0]/1e9:.0f} GB/s")
