"""Qwen2.5-0.5B-shaped int8 drafting linears (24 layers and a 32k head, random weights) with and without prefetch.

    .venv/bin/python bench/session42/int8_prefetch.py 0,128 4,8

int8_linear_variants.cpp is csrc/int8_linear.cpp as of session 41 with a prefetch DIST 64-byte lines ahead
(set_dist; 0: none, as then); alternated in one process; median of 7 of all the linears per row count.
"""
import sys, time, statistics, torch
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
torch.set_num_threads(2)
from specactor_engine.kernels import build
build.extension_available()
from torch.utils.cpp_extension import load
BUILD = Path("/tmp/specactor-bench-s42i")
BUILD.mkdir(exist_ok=True)
load(name="s42i", sources=[str(HERE / "int8_linear_variants.cpp")], build_directory=str(BUILD), verbose=False,
     extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                   f"-I{HERE.parents[1] / 'specactor_engine' / 'kernels' / 'csrc'}"],
     is_python_module=False, extra_ldflags=["-fopenmp"])
dists = [int(d) for d in sys.argv[1].split(",")]
Ms = [int(m) for m in sys.argv[2].split(",")]
shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
g = torch.Generator().manual_seed(0)
W = []
for _ in range(24):
    ws = []
    for n, k in shapes:
        wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        ws.append((torch.ops.specactor.int8_linear_pack(wq), torch.rand(n) * 0.01, wq.sum(1, dtype=torch.int32), n))
    W.append(ws)
head = torch.randint(-127, 128, (32768, 896), generator=g, dtype=torch.int8)
W.append([(torch.ops.specactor.int8_linear_pack(head), torch.rand(32768) * 0.01, head.sum(1, dtype=torch.int32), 32768)])
xs = {M: {k: torch.randn(M, k, generator=g) for k in (896, 4864)} for M in Ms}
def run(d, M):
    torch.ops.s42i.set_dist(d)
    t = time.perf_counter()
    for ws in W:
        for packed, sc, cs, n in ws: torch.ops.s42i.int8_linear(xs[M][packed.shape[1] * 4 if packed.shape[1]*4 in (896, 4864) else 896], packed, sc, cs, None, n)
    return time.perf_counter() - t
res = {}
for _ in range(7):
    for M in Ms:
        for d in dists: res.setdefault((d, M), []).append(run(d, M))
for M in Ms:
    b = statistics.median(res[(dists[0], M)])
    print(f"M={M} " + "  ".join(f"[{d}] {statistics.median(res[(d, M)])*1e3:6.2f} ms ({b/statistics.median(res[(d, M)]):.2f}x)" for d in dists))
