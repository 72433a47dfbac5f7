"""Fused position-keyed Gumbel-max: noise hash, Gumbel transform, add and argmax in one pass.

The reference (`specactor_engine.sampling.sample_tokens`) materialises uniforms [N, V], takes two
logs in place, adds them to the warped scores and reduces: about ten passes over N x V floats, which
made sampling most of the host time of a verify round on Qwen's 151,936-token vocabulary (32 rows x
5 positions: 24M scores per round). `gumbel_argmax` is the same arithmetic written once in torch and
compiled by TorchInductor into one loop per row (C++/OpenMP on CPU, a Triton kernel on CUDA).
`gumbel_argmax_reference` is that function uncompiled: the source of truth, and the fallback when
compiling is unavailable. Tests check both against `sample_tokens`' reference path bit for bit.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from specactor_engine.counter_hash import mix32

logger = logging.getLogger(__name__)


def gumbel_argmax_reference(scores: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """argmax_v(scores[n, v] + Gumbel(key n, token v)): [N] int64.

    scores: [N, V] float32 warped logits (-inf outside top-k/top-p); keys: [N] int64 position keys
    (32-bit values, `counter_hash.combine` of sequence key, position and stream); token_hash: [V] int64
    (`mix32(v * golden)`). Uniform = (top 23 bits + 0.5) * 2**-23, Gumbel = -log(-log(uniform)).
    """
    bits = mix32(keys[:, None] ^ token_hash[None, :])
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return (scores + torch.log(uniform).neg().log().neg()).argmax(dim=-1)


@functools.lru_cache(maxsize=1)
def _compiled() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    return torch.compile(gumbel_argmax_reference, dynamic=True)


_fallback_logged = False


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """`gumbel_argmax_reference`, compiled (first call compiles: ~20-40 s on 2 CPU cores, then cached
    on disk); falls back to the reference, with one warning, if compiling fails."""
    global _fallback_logged
    try:
        return _compiled()(scores, keys, token_hash)
    except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the (identical) reference path
        if not _fallback_logged:
            logger.warning("compiled Gumbel-max unavailable (%s: %s); using the reference", type(exc).__name__, exc)
            _fallback_logged = True
        return gumbel_argmax_reference(scores, keys, token_hash)
