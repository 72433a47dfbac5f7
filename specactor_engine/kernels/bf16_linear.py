"""A bf16 linear layer whose rows never depend on each other: the packed linears' kernel on AVX-512 BF16 CPUs.

`csrc/bf16_linear.cpp` computes y = x @ W.T (+ b) with one fp32 accumulator per output that runs through the
reduction's pairs in order (one VDPBF16PS each) and rounds to bf16 once; its packed weights sit on 2 MB pages. On
the AMD EPYC (Zen 4) it ran a Qwen2.5-1.5B decode step at 4 rows 1.18-1.57x and a 16-token verify 1.21-1.25x faster
than oneDNN's bf16 GEMM (bench/session39), and a row's bits are the same whatever else is in the call. `available()` is where
`PackedLinear` uses it: bf16 on a CPU with avx512_bf16 and without AMX (oneDNN's AMX kernels are faster there)
and the extension built. `bf16_linear_reference` is the same arithmetic in torch, for the tests.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specactor_engine.kernels.build import extension_available

GROUP = 32  # output columns a packed group holds (csrc/bf16_linear.cpp)


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


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 -> [..., out_features] bf16 with a weight from `pack`."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.specactor.bf16_linear(rows, packed, bias, out_features)
    return y.reshape(*x.shape[:-1], out_features)


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
