"""Int8 weights for drafting: a draft model's forward at a quarter of its fp32 weight traffic.

A draft step at a few rows streams every weight once (memory-bound), so its cost follows the bytes
of the weights. Per-channel int8 weights with dynamically quantized activations (PyTorch's fbgemm /
x86 dynamic quantization) cut a Qwen2.5-Coder-0.5B step at 4 rows from ~226 ms (fp32, oneDNN packed)
to ~69 ms on a 2-core AVX2 CPU, and its greedy choices agree with the 1.5B target's on 83% of
positions against 88% in fp32 (docs/architecture.md section 11.2). Drafts are only
proposals, so output stays exact; what the quantization costs is acceptance, never correctness.

On a CPU with AVX-512 VNNI the linears run on the engine's own int8 kernel (kernels/int8_linear.py: activations
quantized per row, weights packed for VPDPBUSD on 2 MB pages), elsewhere on PyTorch's dynamic int8 linear.

The quantized model is a copy used for drafting only: training and weight syncs act on the float
master, and the copy is rebuilt from it.
"""

from __future__ import annotations

import warnings
from copy import deepcopy

import torch
from torch import nn

from specactor_engine.kernels import int8_linear as int8_kernel
from specactor_engine.model.packed_linear import PackedLinear

QUANTIZE_CHOICES = ("none", "int8")


def int8_supported() -> bool:
    """Whether this PyTorch build has a dynamic-quantization engine for int8 linears on this machine."""
    return any(engine in torch.backends.quantized.supported_engines for engine in ("x86", "fbgemm"))


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of `model` whose nn.Linear layers hold per-channel int8 weights (activations quantized per
    call); the original is left untouched. The model must be float32 (the kernels' input type)."""
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ValueError(f"int8 drafting quantizes a float32 model, got {dtype}: set the drafter's dtype to float32")
    if int8_kernel.available():
        copy = deepcopy(model)
        for parent in list(copy.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, int8_kernel.Int8Linear(child.weight.detach(), child.bias))
        return copy
    if not int8_supported():
        raise RuntimeError("int8 drafting needs PyTorch's x86/fbgemm quantized engine, which this build lacks "
                           f"(supported: {torch.backends.quantized.supported_engines}); use quantize: none")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # torch.ao's eager quantization warns that torchao is its successor
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=False)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """An int8 (per-channel) linear over `weight` [out, in] and an optional float bias [out] (a drafter's compact
    head; fused projections): the engine's kernel where it runs, else PyTorch's dynamic int8 linear."""
    if int8_kernel.available():
        return int8_kernel.Int8Linear(weight, bias)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=torch.float32)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias.copy_(bias.float())
    return quantize_int8(nn.Sequential(linear))[0]


class Int8PackedLinear(PackedLinear):
    """`PackedLinear`'s contract (linears sharing an input fused into one GEMM, re-packed when a source weight changed
    in place) on per-channel int8 weights with per-call quantized activations, as `quantize_int8` makes them. One
    quantized GEMM for q/k/v and one for gate/up, where the int8 copy of the model ran three and two, each quantizing
    the same input again; the weights stay the float master's (a runner built with `int8=True` needs no copy)."""

    def _pack(self) -> None:
        with torch.no_grad():
            self._weight = int8_linear(*self._fused())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (computed in float32) -> [..., sum N_i] in x's dtype (a bf16 layer's int8 projections)."""
        self._repack_if_changed()
        y = self._weight(x if x.dtype == torch.float32 else x.float())  # torch's dynamic int8 linear takes float32 only
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def nbytes(self) -> int:
        """Bytes a call streams: one byte a weight, a float32 scale a column and the bias."""
        columns, inputs = sum(self.out_features), self.modules[0].in_features
        return columns * inputs + 4 * columns * (2 if any(m.bias is not None for m in self.modules) else 1)
