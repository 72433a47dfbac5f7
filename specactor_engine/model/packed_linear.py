"""Linear projections through oneDNN with weights pre-packed once (CPU, fp32 and bf16).

torch's `F.linear` on CPU goes to MKL's GEMM for fp32, which on this project's AMD machines runs at
~180 GFLOP/s on 2 cores; oneDNN with a weight reordered once into its blocked layout runs the same
shapes at ~440 GFLOP/s (2.3-4x at decode shapes; ~1.3x for bf16). This is what vLLM's CPU backend
does (`create_onednn_mm`); PyTorch exposes the same oneDNN path as `mkldnn._linear_pointwise`.
bf16 weights on a CPU with AVX-512 BF16 and no AMX go to the engine's own kernel instead
(`kernels/bf16_linear.py`: 1.18-1.57x oneDNN on a 4-row decode step of Qwen2.5-1.5B, 1.21-1.25x on a
16-token verify, and a row's bits independent of the other rows of the call).

`PackedLinear` fuses projections that read the same input (q/k/v, gate/up) into one GEMM and
re-packs by itself when any source weight changed in place (a weight sync, an optimizer step):
the key is every weight's storage pointer and autograd version counter. Results equal `F.linear`
up to fp32/bf16 summation order (oneDNN blocks the reduction differently from MKL).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from specactor_engine.kernels import bf16_linear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_HINT = 128  # oneDNN's reorder takes an expected row count; the packed weight serves any count
# oneDNN runs an input of 1 or 2 rows through other kernels than 3 or more: on the AMD EPYC a 1.5B bf16 decode step
# took 109 ms at 1 row and 126 ms at 2 against 94 ms at 4 (the weights streamed ~30% slower), and a row's result
# depended on how many rows shared the call (a 1-row step's logits differed from the same row's inside a 4-row
# step by up to 0.06 in bf16, 5e-4 in fp32). Fewer rows are zero-padded to this many: one kernel for every call,
# so a row's output no longer depends on the batch around it (bench/session36).
MIN_ROWS = 4


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing applies: a CPU tensor of a packable dtype on a torch built with oneDNN, and for bf16 a
    CPU with native bf16 support (oneDNN's bf16 reorder refuses CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT,
    e.g. AVX2-only machines: there the model keeps torch's own linears)."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (inference tensors keep none: -1)."""
    return -1 if tensor.is_inference() else tensor._version


def _source(module: nn.Module, name: str) -> torch.Tensor | None:
    """module.<name>: from its parameters (the fast path), else as an attribute (a tensor set in its place)."""
    parameters = module._parameters
    return parameters[name] if name in parameters else getattr(module, name, None)


class PackedLinear:
    """y = x @ cat(W_i).T + cat(b_i) for linears sharing one input: x [..., K] -> [..., sum N_i]."""

    def __init__(self, modules: Sequence[nn.Linear]) -> None:
        if not modules:
            raise ValueError("PackedLinear needs at least one linear layer")
        self.modules = list(modules)
        self.out_features = [m.out_features for m in self.modules]
        self._key: tuple[tuple[int, int], ...] | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._kernel = False  # the weight is packed for kernels/bf16_linear (else for oneDNN)

    def _source_key(self) -> tuple[tuple[int, int], ...]:
        """Every source weight's and bias's storage pointer and version, read from the modules' parameter dicts:
        `module.weight` goes through `nn.Module.__getattr__`, which took ~2/3 of this check's ~5 us, and the check
        runs for every projection of every forward (112 a forward of Qwen2.5-1.5B)."""
        tensors = [t for m in self.modules for t in (_source(m, "weight"), _source(m, "bias")) if t is not None]
        return tuple((t.data_ptr(), _version(t)) for t in tensors)

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The source linears as one: weight [sum N_i, K] and bias [sum N_i] (zeros for a linear without; None when
        none has one)."""
        weight = torch.cat([m.weight.detach() for m in self.modules]) if len(self.modules) > 1 \
            else self.modules[0].weight.detach()
        biases = [m.bias for m in self.modules]
        if all(b is None for b in biases):
            return weight, None
        return weight, torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                                  for m, b in zip(self.modules, biases)])

    def _pack(self) -> None:
        with torch.no_grad():
            weight, self._bias = self._fused()
            self._kernel = weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and bf16_linear.available()
            self._weight = bf16_linear.pack(weight) if self._kernel else \
                torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT)

    def _repack_if_changed(self) -> None:
        key = self._source_key()
        if key != self._key:  # first call, or a source weight changed in place since the last pack
            self._pack()
            self._key = key

    def prepare(self) -> None:
        """Pack now (if the source weights changed since the last pack) rather than at the next call."""
        self._repack_if_changed()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._repack_if_changed()
        if self._kernel:  # no padding: its rows are computed alike for any row count
            return bf16_linear.linear(x, self._weight, self._bias, sum(self.out_features))
        rows = x.numel() // x.shape[-1]
        if 0 < rows < MIN_ROWS:
            padded = x.new_zeros(MIN_ROWS, x.shape[-1])
            padded[:rows] = x.reshape(rows, x.shape[-1])
            y = torch.ops.mkldnn._linear_pointwise(padded, self._weight, self._bias, "none", [], "")
            return y[:rows].reshape(*x.shape[:-1], y.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-module outputs of a fused result: views of y [..., sum N_i]."""
        return y.split(self.out_features, dim=-1)


class PackedModule(nn.Module):
    """One nn.Linear as a module that runs through `PackedLinear`: a head handed to a runner (a drafter's compact
    head), which the runner uses as is rather than packing it like the model's own linears."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear  # a submodule: its weight counts in the runner's step bytes
        self._packed = PackedLinear([linear])

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._packed(x)
