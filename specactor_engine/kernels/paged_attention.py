"""Attention of new queries against their rows' slots of the static KV cache, without a gather.

`paged_decode_attention` is a C++ kernel (`csrc/paged_decode_attention.cpp`, built once per machine
by torch's extension loader with the other kernels: kernels/build.py) that reads every cached key and value
of a row once per KV head, for all 1..k+1 queries of that head group, straight from the cache slot.
`paged_decode_attention_reference` is the same contract in torch (gather, masked SDPA with fp32
accumulation): the source of truth, and the fallback, with one warning, where no compiler is at hand.

Contract: q [R, T, H, D]; key_cache, value_cache [N, L, H_kv, D] (contiguous); slots [R] int64;
positions [R, T] int64. Query t of row r sees keys [lo, positions[r, t]] of slot slots[r], lo = 0 or,
with a sliding window w > 0, positions[r, t] - w + 1. Returns [R, T, H, D] in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specactor_engine.kernels.build import extension_available


def paged_decode_attention_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     slots: torch.Tensor, positions: torch.Tensor, scale: float,
                                     window: int = 0) -> torch.Tensor:
    """The kernel's contract in torch (see the module docstring): [R, T, H, D]."""
    upto = int(positions.max()) + 1 if positions.numel() else 1
    keys = key_cache[slots, :upto].transpose(1, 2).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    values = value_cache[slots, :upto].transpose(1, 2).to(keys.dtype)  # [R, H_kv, S, D]
    index = torch.arange(upto)
    mask = index[None, None, :] <= positions[:, :, None]  # [R, T, S]
    if window > 0:
        mask &= index[None, None, :] > positions[:, :, None] - window
    out = F.scaled_dot_product_attention(q.transpose(1, 2).to(keys.dtype), keys, values, attn_mask=mask[:, None],
                                         scale=scale, enable_gqa=key_cache.shape[2] != q.shape[2])
    return out.transpose(1, 2).to(q.dtype)


def kernel_available() -> bool:
    """The compiled kernel is loaded (built on first use: kernels/build.py)."""
    return extension_available()


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """The compiled kernel on CPU tensors, else the reference: [R, T, H, D] (module docstring)."""
    if q.device.type != "cpu" or not kernel_available():
        return paged_decode_attention_reference(q, key_cache, value_cache, slots, positions, scale, window)
    return torch.ops.specactor.paged_decode_attention(q, key_cache, value_cache, slots, positions, scale, window)
