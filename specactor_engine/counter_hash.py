"""The counter-based 32-bit hash behind position-keyed sampling (a leaf module).

`mix32` is a bijective avalanche mix (lowbias32-style) of 32-bit values held in int64; `combine`
folds a value into a key; `token_hash` is the per-token-id hash that noise keys are mixed with.
`specactor_engine.sampling` builds its noise streams from these, and `kernels.gumbel_argmax` fuses
the same arithmetic into one compiled pass: both import it from here, so neither imports the other.

Arithmetic stays in int64 with 32-bit values and multipliers below 2**31, so no product overflows and
the bits are identical on every device and backend; the numpy versions give the same bits on uint32.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x5BD1E995
GOLDEN = 0x61C88647  # 2**32 / phi, below 2**31


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of 32-bit values held in int64 (lowbias32-style)."""
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & MASK32
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    return x ^ (x >> 15)


def combine(key: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """Fold `value` into `key`: a new 32-bit key (same shape as the broadcast of both)."""
    return mix32((key ^ mix32(torch.as_tensor(value, dtype=torch.long) & MASK32)) & MASK32)


def mix32_numpy(x: np.ndarray) -> np.ndarray:
    """`mix32` on uint32 arrays (native wrap-around multiply gives the same bits)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(MUL_A)
    x ^= x >> np.uint32(15)
    x = x * np.uint32(MUL_B)
    x ^= x >> np.uint32(16)
    x = x * np.uint32(MUL_A)
    x ^= x >> np.uint32(15)
    return x


@functools.lru_cache(maxsize=8)
def token_hash_numpy(vocab_size: int) -> np.ndarray:
    return mix32_numpy((np.arange(vocab_size, dtype=np.uint64) * GOLDEN & MASK32).astype(np.uint32))


def token_hash_of(token_ids: torch.Tensor) -> torch.Tensor:
    """`token_hash` at the given token ids: [N] int64 (a drafter head over part of the vocabulary)."""
    return mix32(token_ids.to(torch.long) * GOLDEN & MASK32)


@functools.lru_cache(maxsize=8)
def token_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """mix32(v * golden) for every token id: [V] int64 (the per-token half of the noise key)."""
    return mix32(torch.arange(vocab_size, dtype=torch.long, device=device) * GOLDEN & MASK32)
