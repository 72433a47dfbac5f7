"""Qwen2.5-1.5B's decoder linears (28 layers of random weights, streamed from memory) on bf16 kernel variants.

    .venv/bin/python bench/session42/linear_prefetch.py "base;8,0,0;12,128,0" 4,8,12,16 [repeats]

Configurations, alternated in one process (the memory state moves over tens of seconds): `base`, the engine's
kernel as built now; `ROWS,DIST,HINT`, session 41's kernel (variants.py) with at most ROWS rows a pass and a
prefetch DIST 64-byte lines ahead (0: none) with hint T0/T1/T2; `8,0,0` is session 41's kernel itself. Every
variant's output is checked bit for bit against the engine's first. Prints the median time of all the linears per
row count (the variants' own build, pre-4a0e99a copies of the same code, gave the runs in linear_prefetch.txt).
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

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # (N, K): qkv, o, gate/up, down
LAYERS = 28


def main() -> None:
    torch.set_num_threads(2)
    assert build.extension_available(), "the engine's kernels did not build"
    build_variant("bf16")
    configs = sys.argv[1].split(";")
    rows = [int(m) for m in sys.argv[2].split(",")]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.ops.specactor.bf16_linear_pack((torch.randn(n, k, generator=generator) * 0.02).bfloat16())
                for n, k in SHAPES] for _ in range(LAYERS)]
    inputs = {m: {k: torch.randn(m, k, generator=generator).bfloat16() for _, k in SHAPES} for m in rows}

    def op(config: str):
        if config == "base":
            return torch.ops.specactor.bf16_linear
        most, dist, hint = (int(v) for v in config.split(","))
        torch.ops.s42.set_rows(most)
        torch.ops.s42.set_dist(dist, hint)
        return torch.ops.s42.bf16_linear

    for config in configs:  # bits first: the down projection at every row count
        for m in rows:
            want = torch.ops.specactor.bf16_linear(inputs[m][8960], weights[0][3], None, 1536)
            assert torch.equal(op(config)(inputs[m][8960], weights[0][3], None, 1536), want), (config, m)

    def timed(config: str, m: int) -> float:
        linear = op(config)
        started = time.perf_counter()
        for layer in weights:
            for (n, k), weight in zip(SHAPES, layer):
                linear(inputs[m][k], weight, None, n)
        return time.perf_counter() - started

    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for m in rows:
            for config in configs:
                results.setdefault((config, m), []).append(timed(config, m))
    for m in rows:
        first = statistics.median(results[(configs[0], m)])
        print(f"M={m:3d} " + "  ".join(
            f"[{c}] {statistics.median(results[(c, m)]) * 1e3:6.1f} ms ({first / statistics.median(results[(c, m)]):.2f}x)"
            for c in configs))


if __name__ == "__main__":
    main()
