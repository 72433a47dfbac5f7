"""A decoder layer's elementwise work in four ops: RMSNorm, residual add + RMSNorm, rotary + KV write, SiLU-mul.

At the per-worker batch (a few rows) a decode step's linears stream the weights and the rest is tiny
tensors: ~35 torch ops per layer of norms, rotary, cache writes, activations and adds were ~12% of a
4-row Qwen2.5-1.5B step, nearly all of it per-op dispatch. `csrc/decode_layer_ops.cpp` does each group in
one C++ op (built with the other kernels, kernels/build.py); the functions here call it on CPU tensors
and otherwise run their `*_reference`, the same contract in torch ops, which is also what the runner
does when the kernels are off (`model.cpu_kernels: false`).

Numerics (tests/engine/kernels/test_decode_ops.py): rotary, the KV write and the residual add equal
their references bit for bit; the norm sums squares in its own fixed order and SiLU uses glibc's exp,
so those agree with torch to float rounding. Every token is computed the same way whatever else is in
the call, so plain decoding and verification of a block stay identical (the engine's exactness).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specactor_engine.kernels.build import extension_available


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2/Qwen3/Mistral RMSNorm: w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)."""
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual add and the next sublayer's norm."""
    total = h + delta
    return total, rms_norm_reference(total, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: x [R, T, H, D]; cos, sin: [R, T, D]."""
    return x * cos[:, :, None] + _rotate_half(x) * sin[:, :, None]


def rotary_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                              num_heads: int) -> torch.Tensor:
    """Split a fused projection qkv [R, T, (H + 2 H_kv) D] into q, k, v, rotate q and k, store k and v at
    key/value_cache[slots[r], positions[r, t]] ([N, L, H_kv, D]), and return q [R, T, H, D]."""
    R, T, _ = qkv.shape
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.reshape(R, T, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.reshape(R, T, kv_heads, head_dim), cos, sin)
    index = (slots[:, None], positions)
    key_cache[index] = k
    value_cache[index] = v.reshape(R, T, kv_heads, head_dim)
    return q


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate|up projection [..., 2I] -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _compiled(x: torch.Tensor) -> bool:
    """The C++ op serves `x` (and the tensors that go with it: the caches, the weights): a CPU tensor and a
    built extension. Called for every op of every layer, so no more than that."""
    return x.device.type == "cpu" and extension_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _compiled(x):
        return torch.ops.specactor.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _compiled(h):
        return torch.ops.specactor.add_rms_norm(h, delta, weight, eps)
    return add_rms_norm_reference(h, delta, weight, eps)


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    num_heads: int) -> torch.Tensor:
    if _compiled(qkv) and key_cache.device.type == "cpu":
        return torch.ops.specactor.rotary_write_kv(qkv, cos, sin, key_cache, value_cache, slots, positions, num_heads)
    return rotary_write_kv_reference(qkv, cos, sin, key_cache, value_cache, slots, positions, num_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _compiled(gate_up):
        return torch.ops.specactor.silu_mul(gate_up)
    return silu_mul_reference(gate_up)
