"""A bf16 linear layer whose rows never depend on each other: the packed linears' kernel on AVX-512 BF16 CPUs.

`csrc/bf16_linear.cpp` computes y = x @ W.T (+ b) with one fp32 accumulator per output that runs through the
reduction's pairs in order (one VDPBF16PS each) and rounds to bf16 once; its packed weights sit on 2 MB pages. On
the AMD EPYC (Zen 4) it ran a Qwen2.5-1.5B decode step at 4 rows 1.18-1.57x and a 16-token verify 1.21-1.25x faster
than oneDNN's bf16 GEMM (bench/session39), and a row's bits are the same whatever else is in the call. `available()` is where
`PackedLinear` uses it: bf16 on a CPU with avx512_bf16 and without AMX (oneDNN's AMX kernels are faster there)
and the extension built. `bf16_linear_reference` is the same arithmetic in torch, for the tests.

The kernel runs that arithmetic one of two ways with the same bits (csrc/bf16_linear.cpp): VDPBF16PS, or two fp32
FMAs per pair on the weight widened in registers. Which is faster depends on the CPU: on the Intel Xeon of sessions
54-59 one VDPBF16PS issues every 2 cycles against 2 FMAs a cycle, and the FMAs ran a 12-row product 1.6x faster;
on the AMD EPYC (Zen 4) VDPBF16PS reached ~850-900 GFLOP/s on 2 cores (session 42), where the FMAs were not timed. `variant()` times both once per process on a product whose weight
stays in cache and keeps the faster; SPECACTOR_BF16_KERNEL=dpbf16 or fma chooses instead.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

from specactor_engine.kernels.build import extension_available

logger = logging.getLogger(__name__)

GROUP = 32  # output columns a packed group holds (csrc/bf16_linear.cpp)
VARIANTS = ("dpbf16", "fma")  # the kernel's `variant` argument is the index
VARIANT_ENV = "SPECACTOR_BF16_KERNEL"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """The kernel serves bf16 linears here: AVX-512 BF16 without AMX, and the extension built with it."""
    flags = cpu_flags()
    if "avx512_bf16" not in flags or "amx_bf16" in flags or not extension_available():
        return False
    op = getattr(torch.ops.specactor, "bf16_linear_supported", None)
    return bool(op is not None and op())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 (K even) -> the kernel's layout [ceil(N/32), K/2, 2, 32]."""
    return torch.ops.specactor.bf16_linear_pack(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           kernel: str | None = None) -> torch.Tensor:
    """x [..., K] bf16 -> [..., out_features] bf16 with a weight from `pack`; kernel: one of VARIANTS (None:
    `variant()`), which changes the speed, never the bits."""
    rows = x.reshape(-1, x.shape[-1])
    index = _variant_index() if kernel is None else VARIANTS.index(kernel)
    y = torch.ops.specactor.bf16_linear(rows, packed, bias, out_features, index)
    return y.reshape(*x.shape[:-1], out_features)


@functools.lru_cache(maxsize=1)
def variant() -> str:
    """The faster way to run the kernel here: SPECACTOR_BF16_KERNEL if set, else the one that ran a 12-row product
    over a 1024 x 1536 weight (in cache) faster, timed now (a few ms, once per process)."""
    forced = os.environ.get(VARIANT_ENV, "").strip()
    if forced:
        if forced not in VARIANTS:
            raise ValueError(f"{VARIANT_ENV}={forced!r}: expected one of {', '.join(VARIANTS)} (or unset to time both)")
        return forced
    times = time_variants()
    chosen = min(VARIANTS, key=times.__getitem__)
    logger.info("bf16 linear kernel: %s (a 12-row product took %s)", chosen,
                ", ".join(f"{times[v] * 1e3:.3f} ms with {v}" for v in VARIANTS))
    return chosen


@functools.lru_cache(maxsize=1)
def _variant_index() -> int:
    """`variant()` as the op's argument (every linear call passes it)."""
    return VARIANTS.index(variant())


def time_variants(rows: int = 12, n: int = 1024, k: int = 1536, calls: int = 9) -> dict[str, float]:
    """Each variant's best time (s) for one rows x k by k x n product, the variants' calls interleaved."""
    generator = torch.Generator().manual_seed(0)
    packed = pack(torch.randn(n, k, generator=generator).bfloat16())
    x = torch.randn(rows, k, generator=generator).bfloat16()
    best = {v: float("inf") for v in VARIANTS}
    for call in range(calls + 1):
        for index, name in enumerate(VARIANTS):
            started = time.perf_counter()
            torch.ops.specactor.bf16_linear(x, packed, None, n, index)
            if call:  # the first call of each warms up
                best[name] = min(best[name], time.perf_counter() - started)
    return best


def bf16_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in torch: x [M, K], W [N, K] bf16 -> [M, N] bf16.

    acc starts at 0 in fp32; for each pair p in order, acc += x[2p+1] w[2p+1] (rounded), then += x[2p] w[2p]
    (rounded); the products of two bf16 values are exact in fp32. Then + bias in fp32 and one rounding to bf16.
    Slow (a loop over K/2): for tests on small shapes.
    """
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for p in range(x.shape[1] // 2):
        acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(torch.bfloat16)
