"""Seeded, position-keyed sampling (docs/architecture.md section 4).

The noise that samples position t of sample j of request r is a pure function of
(seed, r, j, t): a counter-based 32-bit hash of those numbers and the token id. The
target token is the Gumbel-max choice over the warped distribution, so a rollout is
a deterministic function of (weights, prompts, seed), whatever the drafters, draft
length or batch composition. Drafters that use the same noise propose exactly the
target's token whenever their distributions agree closely enough (Gumbel coupling).

Hash arithmetic stays in int64 with 32-bit values and multipliers below 2**31, so no
product overflows and the stream is identical on every device and backend.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from specactor_engine.counter_hash import (MASK32, combine, mix32, mix32_numpy, token_hash, token_hash_numpy,
                                           token_hash_of)

# Noise streams: the target and coupled drafters share TARGET; the classic rejection
# rule needs independent streams for the draft sample, the accept test and recovery.
STREAM_TARGET = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RECOVER = 3


def request_key(request_id: str) -> int:
    """Stable 32-bit key of a request id (independent of its batch position)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


def sequence_key(seed: int, request_id: str, sample_index: int) -> int:
    """32-bit key of sample `sample_index` of request `request_id` under `seed`."""
    key = combine(torch.tensor(seed & MASK32), request_key(request_id))
    return int(combine(key, sample_index))


def noise_bits_reference(seq_keys: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                         stream: int = STREAM_TARGET) -> torch.Tensor:
    """The 32-bit noise hash, pure torch (any device): [R], [R, T] -> [R, T, V] int64 in [0, 2**32)."""
    key = combine(combine(seq_keys[:, None], positions), stream)  # [R, T]
    return mix32(key[..., None] ^ token_hash(vocab_size, key.device))


def noise_bits(seq_keys: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = STREAM_TARGET
               ) -> torch.Tensor:
    """Same bits as `noise_bits_reference`; on CPU computed with numpy uint32 (5x faster than torch int ops).

    Returns [R, T, V] int64 (reference) or int32-viewed uint32 bits (CPU fast path).
    """
    if positions.device.type != "cpu":
        return noise_bits_reference(seq_keys, positions, vocab_size, stream)
    key = combine(combine(seq_keys[:, None], positions), stream).numpy().astype(np.uint32)  # [R, T]
    bits = mix32_numpy(key[..., None] ^ token_hash_numpy(vocab_size))
    return torch.from_numpy(bits.view(np.int32))


_ROW_LOOP_MIN_VOCAB = 4096


def _uniform_numpy(keys: np.ndarray, vocab_size: int) -> np.ndarray:
    """CPU fast path of `uniform_noise`: keys [N] uint32 -> [N, V] float32.

    One row at a time so the intermediates stay in cache (about 5x faster than whole-tensor ops).
    """
    hashes = token_hash_numpy(vocab_size)
    if vocab_size < _ROW_LOOP_MIN_VOCAB:  # small vocabularies (tests): one vectorized pass
        bits = mix32_numpy(keys[:, None] ^ hashes) >> np.uint32(9)
        return (bits.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    out = np.empty((len(keys), vocab_size), dtype=np.float32)
    for row, key in enumerate(keys):
        bits = mix32_numpy(hashes ^ key)
        bits >>= np.uint32(9)
        np.add(bits, np.float32(0.5), out=out[row], casting="unsafe")
    out *= np.float32(2.0**-23)
    return out


def uniform_noise(seq_keys: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = STREAM_TARGET
                  ) -> torch.Tensor:
    """Uniforms on the 2**-23 grid strictly inside (0, 1), float32.

    seq_keys: [R] int64 sequence keys; positions: [R, T] output positions -> [R, T, V].
    Only the top 23 bits are used: (m + 0.5) * 2**-23 needs 24 significant bits, which
    float32 holds exactly, so the largest value is 1 - 2**-24 and never rounds to 1.0
    (a 24-bit grid would, giving infinite Gumbel noise).
    """
    if positions.device.type == "cpu":
        keys = combine(combine(seq_keys[:, None], positions), stream).numpy().astype(np.uint32)  # [R, T]
        flat = _uniform_numpy(keys.reshape(-1), vocab_size)
        return torch.from_numpy(flat).view(*positions.shape, vocab_size)
    top = noise_bits_reference(seq_keys, positions, vocab_size, stream) >> 9
    return (top.to(torch.float32) + 0.5) * 2.0**-23


def gumbel_noise(seq_keys: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = STREAM_TARGET
                 ) -> torch.Tensor:
    """Standard Gumbel noise [R, T, V] (float32) keyed like `uniform_noise`."""
    return uniform_noise(seq_keys, positions, vocab_size, stream).log_().neg_().log_().neg_()


@dataclass(frozen=True)
class SamplingParams:
    """The warping and randomness of one generate call (temperature 0 = greedy)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied: [..., V] scores, -inf outside the kept set."""
    scores = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if params.temperature != 1.0:  # x / 1 is x, bit for bit: at T = 1 the pass over [..., V] (and its copy) is skipped
        scores = scores / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (top-1 always kept)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from: [..., V] (one-hot argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    return warp_logits(logits, params).to(torch.float64).softmax(dim=-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, seq_keys: torch.Tensor, positions: torch.Tensor,
                  stream: int = STREAM_TARGET, vocab_ids: torch.Tensor | None = None,
                  vocab_hashes: torch.Tensor | None = None) -> torch.Tensor:
    """Position-keyed Gumbel-max choice.

    logits: [R, T, V]; seq_keys: [R]; positions: [R, T] output positions -> [R, T] token ids.
    vocab_ids: [V] the token id of each logit column (a drafter head over part of the vocabulary);
    each column then gets its token's noise, so the choice equals the full-vocabulary one with every
    other token at -inf (when no top-k/top-p warping cuts differently). Default: column v is token v.
    vocab_hashes: [V] `token_hash_of(vocab_ids)` when the caller keeps it (a drafter's head is fixed between
    rebuilds; hashing its 32k ids took 0.18 ms of every draft step, median of 200 on 2 threads).
    """
    if params.greedy:
        chosen = logits.argmax(dim=-1)
        return chosen if vocab_ids is None else vocab_ids[chosen]
    scores = warp_logits(logits, params)
    vocab_size = logits.shape[-1]
    if vocab_ids is not None:
        keys = combine(combine(seq_keys[:, None], positions), stream).to(scores.device)  # [R, T]
        hashes = (vocab_hashes if vocab_hashes is not None else token_hash_of(vocab_ids)).to(scores.device)  # [V]
        if vocab_size >= FUSED_MIN_VOCAB:
            from specactor_engine.kernels.gumbel_argmax import gumbel_argmax

            chosen = gumbel_argmax(scores.reshape(-1, vocab_size).float(), keys.reshape(-1), hashes)
        else:
            from specactor_engine.kernels.gumbel_argmax import gumbel_argmax_reference

            chosen = gumbel_argmax_reference(scores.reshape(-1, vocab_size).float(), keys.reshape(-1), hashes)
        return vocab_ids.to(chosen.device)[chosen].view(positions.shape)
    if vocab_size >= FUSED_MIN_VOCAB:  # one compiled pass instead of ~10 over [R, T, V] (specactor_engine/kernels/gumbel_argmax.py)
        from specactor_engine.kernels.gumbel_argmax import gumbel_argmax

        keys = combine(combine(seq_keys[:, None], positions), stream).to(scores.device)  # [R, T]
        chosen = gumbel_argmax(scores.reshape(-1, vocab_size), keys.reshape(-1), token_hash(vocab_size,
                                                                                                     scores.device))
        return chosen.view(positions.shape)
    noise = gumbel_noise(seq_keys, positions, vocab_size, stream).to(scores.device, scores.dtype)
    return (scores + noise).argmax(dim=-1)


FUSED_MIN_VOCAB = 4096  # below this (test vocabularies) the fused kernel's compile time is not worth it


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) (T = 1 when greedy), in float32 (float64 logits stay float64): [..., V]."""
    scale = temperature if temperature > 0 else 1.0
    scores = logits.float() if logits.dtype != torch.float64 else logits
    # x / 1 is x, bit for bit: at T = 1 (RL rollouts' usual setting) the division's pass over [..., V] is skipped
    # (trace A, 32 rows x width 2 x 151,936: ~9 ms of each round's host work)
    return torch.log_softmax(scores / scale if scale != 1.0 else scores, dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float,
                   log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / T) at `token_ids` (T = 1 when greedy): [R, T] float32.

    This is what an RL trainer recomputes; top-k/top-p are deliberately not applied.
    log_probs: `scaled_log_softmax(logits, temperature)` when the caller already has it (top_logprobs).
    Computed as log_softmax then gather, op for op what the trainer recomputes (tasks/grpo.py), so
    an on-policy importance ratio is exactly 1.
    """
    if log_probs is None:
        log_probs = scaled_log_softmax(logits, temperature)
    return log_probs.gather(-1, token_ids[..., None]).squeeze(-1).float()


def top_logprobs(log_probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely tokens at every position: (ids int32 [..., n], log-probs float32 [..., n]),
    from `scaled_log_softmax` output [..., V]."""
    values, indices = log_probs.topk(min(n, log_probs.shape[-1]), dim=-1)
    return indices.to(torch.int32), values.float()
