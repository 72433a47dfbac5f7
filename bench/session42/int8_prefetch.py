"""Qwen2.5-0.5B-shaped int8 drafting linears (24 layers and a 32k head, random weights) with and without prefetch.

    .venv/bin/python bench/session42/int8_prefetch.py 0,128 4,8

Session 41's int8 kernel (variants.py) with a prefetch DIST 64-byte lines ahead (0: none, as then), alternated in
one process; the median of 7 of all the linears per row count.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specactor_engine.kernels import build  # noqa: E402
from variants import build as build_variant  # noqa: E402

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (N, K): qkv, o, gate/up, down
LAYERS, HEAD = 24, 32768


def packed(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    wq = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    return torch.ops.specactor.int8_linear_pack(wq), torch.rand(n) * 0.01, wq.sum(1, dtype=torch.int32), n, k


def main() -> None:
    torch.set_num_threads(2)
    assert build.extension_available(), "the engine's kernels did not build"
    build_variant("int8")
    distances = [int(d) for d in sys.argv[1].split(",")]
    rows = [int(m) for m in sys.argv[2].split(",")]
    generator = torch.Generator().manual_seed(0)
    linears = [packed(n, k, generator) for _ in range(LAYERS) for n, k in SHAPES] + [packed(HEAD, 896, generator)]
    inputs = {m: {k: torch.randn(m, k, generator=generator) for k in (896, 4864)} for m in rows}

    def timed(distance: int, m: int) -> float:
        torch.ops.s42i.set_dist(distance)
        started = time.perf_counter()
        for weight, scale, colsum, n, k in linears:
            torch.ops.s42i.int8_linear(inputs[m][k], weight, scale, colsum, None, n)
        return time.perf_counter() - started

    results: dict[tuple[int, int], list[float]] = {}
    for _ in range(7):
        for m in rows:
            for distance in distances:
                results.setdefault((distance, m), []).append(timed(distance, m))
    for m in rows:
        first = statistics.median(results[(distances[0], m)])
        print(f"M={m} " + "  ".join(
            f"[{d}] {statistics.median(results[(d, m)]) * 1e3:6.2f} ms ({first / statistics.median(results[(d, m)]):.2f}x)"
            for d in distances))


if __name__ == "__main__":
    main()
