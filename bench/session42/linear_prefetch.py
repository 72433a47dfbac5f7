"""Qwen2.5-1.5B's decoder linears (28 layers of random weights, streamed from memory) on bf16 kernel variants.

    .venv/bin/python bench/session42/linear_prefetch.py "base;8,0,0;12,128,0" 4,8,12,16 [repeats]

Configurations, alternated in one process (the memory state moves over tens of seconds): `base`, the engine's
kernel as built now; `ROWS,DIST,HINT`, bf16_linear_variants.cpp with at most ROWS rows a pass and a prefetch DIST
64-byte lines ahead (0: none) with hint T0/T1/T2. `8,0,0` is session 41's kernel. Every variant's output is
checked bit for bit against the engine's first. Prints the median time of all the linears per row count.
"""
import sys, time, statistics, torch
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
torch.set_num_threads(2)
from specactor_engine.kernels import build
build.extension_available()
from torch.utils.cpp_extension import load
BUILD = Path("/tmp/specactor-bench-s42")
BUILD.mkdir(exist_ok=True)
load(name="s42k", sources=[str(HERE / "bf16_linear_variants.cpp")], build_directory=str(BUILD), verbose=False,
     extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                   f"-I{HERE.parents[1] / 'specactor_engine' / 'kernels' / 'csrc'}"],
     is_python_module=False, extra_ldflags=["-fopenmp"])
configs = [c for c in sys.argv[1].split(";")]  # "base" or "rows,dist,hint"
Ms = [int(m) for m in sys.argv[2].split(",")]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
shapes = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
g = torch.Generator().manual_seed(0)
W = [[torch.ops.specactor.bf16_linear_pack((torch.randn(n, k, generator=g) * 0.02).bfloat16()) for n, k in shapes] for _ in range(28)]
gb = sum(w.numel() * 2 for ws in W for w in ws) / 1e9
xs = {M: {k: torch.randn(M, k, generator=g).bfloat16() for _, k in shapes} for M in Ms}
def run(cfg, M):
    if cfg == "base": op = torch.ops.specactor.bf16_linear
    else:
        r, d, h = (int(v) for v in cfg.split(","))
        torch.ops.s42.set_chunk(r); torch.ops.s42.set_dist(d, h); op = torch.ops.s42.bf16_linear
    t = time.perf_counter()
    for ws in W:
        for (n, k), w in zip(shapes, ws): op(xs[M][k], w, None, n)
    return time.perf_counter() - t
# check bits equal
for cfg in configs:
    if cfg != "base":
        r, d, h = (int(v) for v in cfg.split(",")); torch.ops.s42.set_chunk(r); torch.ops.s42.set_dist(d, h)
        for M in Ms:
            a = torch.ops.specactor.bf16_linear(xs[M][8960], W[0][3], None, 1536); b = torch.ops.s42.bf16_linear(xs[M][8960], W[0][3], None, 1536)
            assert torch.equal(a, b), (cfg, M)
res = {}
for _ in range(reps):
    for M in Ms:
        for cfg in configs:
            res.setdefault((cfg, M), []).append(run(cfg, M))
for M in Ms:
    b = statistics.median(res[(configs[0], M)])
    print(f"M={M:3d} " + "  ".join(f"[{cfg}] {statistics.median(res[(cfg, M)])*1e3:6.1f} ms ({b/statistics.median(res[(cfg, M)]):.2f}x)" for cfg in configs))
