"""Fused position-keyed Gumbel-max: noise hash, Gumbel transform, add and argmax in one pass.

The reference (`specactor_engine.sampling.sample_tokens`) materialises uniforms [N, V], takes two
logs in place, adds them to the warped scores and reduces: about ten passes over N x V floats, which
made sampling most of the host time of a verify round on Qwen's 151,936-token vocabulary (32 rows x
5 positions: 24M scores per round). `gumbel_argmax` is the same arithmetic in one pass per row: on a CPU
with AVX-512 a C++ kernel (csrc/gumbel_argmax.cpp: the hash in 32-bit lanes, Sleef's logf as torch.log, bf16
scores widened on the fly, and blocks of 16 tokens whose scores sit more than the largest possible noise below
a total the row reaches skipped: at T = 1 that is most of a real vocabulary; 48 positions of Qwen 1.5B's own
outputs at 4 rows: 7.6 ms against 46 ms compiled, bench/session34/gumbel_timing.py); elsewhere the reference
compiled by TorchInductor (C++/OpenMP on CPU, a Triton kernel on CUDA). `gumbel_argmax_reference` is the
source of truth, and the fallback when compiling is unavailable. Tests check all three against `sample_tokens`'
reference path bit for bit.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from specactor_engine.counter_hash import mix32
from specactor_engine.kernels.build import extension_available

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


def kernel_available() -> bool:
    """The C++ kernel (csrc/gumbel_argmax.cpp, AVX-512 CPUs) is built and registered."""
    return extension_available() and hasattr(torch.ops.specactor, "gumbel_argmax")


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """`gumbel_argmax_reference`: on a CPU with AVX-512 the C++ kernel (float32 or bfloat16 scores), elsewhere
    compiled by TorchInductor (first call compiles: ~20-40 s on 2 CPU cores, then cached on disk); falls back to
    the reference, with one warning, if compiling fails."""
    global _fallback_logged
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.bfloat16) and kernel_available():
        return torch.ops.specactor.gumbel_argmax(scores, keys, token_hash)
    scores = scores.float()
    try:
        return _compiled()(scores, keys, token_hash)
    except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the (identical) reference path
        if not _fallback_logged:
            logger.warning("compiled Gumbel-max unavailable (%s: %s); using the reference", type(exc).__name__, exc)
            _fallback_logged = True
        return gumbel_argmax_reference(scores, keys, token_hash)
