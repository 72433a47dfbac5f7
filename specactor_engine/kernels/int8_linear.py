"""An int8 linear layer for drafting: per-column int8 weights, activations quantized per row, AVX-512 VNNI.

`csrc/int8_linear.cpp` computes y ~ x @ W.T (+ b) for float32 x from int8 weights packed for VPDPBUSD (64-byte loads
of 16 columns x 4 inputs) on 2 MB pages, with x quantized per row in the call (symmetric, 127 / max |x|). A draft
model's step at a few rows streams every weight once; PyTorch's dynamic int8 linear (fbgemm) streamed Qwen2.5-Coder-
0.5B's int8 weights at ~38 GB/s in a 4-row step (bench/session41). `available()` is where `model/quantize.py`
uses it: an AVX-512 VNNI CPU and the extension built; elsewhere drafting keeps PyTorch's dynamic int8 linear.
`int8_linear_reference` is the same arithmetic in torch, for the tests.

Drafts are only proposals (speculative decoding verifies them), so this quantization costs acceptance, never
correctness; a row's result does not depend on the other rows of the call.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from specactor_engine.kernels.bf16_linear import cpu_flags
from specactor_engine.kernels.build import extension_available


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """The kernel serves int8 drafting linears here: AVX-512 VNNI, and the extension built with it."""
    if "avx512_vnni" not in cpu_flags() or not extension_available():
        return False
    op = getattr(torch.ops.specactor, "int8_linear_supported", None)
    return bool(op is not None and op())


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (Wq [N, K] int8, scale [N] float32), symmetric per output column: W ~ Wq * scale."""
    w = weight.detach().float()
    peak = w.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    quantized = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized, scale.contiguous()


class Int8Linear(nn.Module):
    """y = x @ W.T (+ b) for x [..., K] (computed in float32) through the kernel: the weight quantized and packed
    once, kept as buffers (packed [G, Q, 32, 4] int8, scale [N], colsum [N], bias [N] or None)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not available():  # also loads the extension that registers the ops
            raise RuntimeError("Int8Linear needs a CPU with AVX-512 VNNI and the engine's C++ kernels built; "
                               "model/quantize.py `int8_linear` falls back to PyTorch's dynamic int8 linear")
        self.out_features, self.in_features = weight.shape
        quantized, scale = quantize_weight(weight)
        self.register_buffer("packed", torch.ops.specactor.int8_linear_pack(quantized), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("colsum", quantized.sum(dim=1, dtype=torch.int32), persistent=False)
        self.register_buffer("bias", bias.detach().float().contiguous() if bias is not None else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the packed weight pads the inputs to 4: the kernel cannot tell 31 from 32
            raise ValueError(f"Int8Linear: expected inputs of {self.in_features} features, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        y = torch.ops.specactor.int8_linear(rows, self.packed, self.scale, self.colsum, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)


def int8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in torch: x [M, K] float32, W [N, K] float -> [M, N] float32 (up to the last rounding
    of the scaling: the kernel's compiler may fuse the multiply and the bias add)."""
    quantized, scale = quantize_weight(weight)
    peak = x.abs().amax(dim=1)
    inv = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    xq = torch.round(x * inv[:, None]).to(torch.int64)
    acc = xq @ quantized.to(torch.int64).T
    y = acc.float() * ((peak / 127.0)[:, None] * scale[None, :])
    return y + bias.float() if bias is not None else y
