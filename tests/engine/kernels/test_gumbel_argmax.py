"""The fused Gumbel-max kernel equals the sampling module's reference path bit for bit."""

from __future__ import annotations

import pytest
import torch

from specactor_engine.kernels import gumbel_argmax as kernel
from specactor_engine import counter_hash
from specactor_engine.sampling import STREAM_DRAFT, STREAM_TARGET, SamplingParams, gumbel_noise, sample_tokens


def unfused(scores: torch.Tensor, seq_keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """The pre-kernel path: materialised Gumbel noise [R, T, V] (numpy hash), added, argmax."""
    noise = gumbel_noise(seq_keys, positions, scores.shape[-1], stream).to(scores.dtype)
    return (scores + noise).argmax(dim=-1)


def random_case(rows: int, width: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, vocab, generator=gen, dtype=dtype) * 2
    scores[:, :, : vocab // 3] = float("-inf")  # a top-k/top-p cut
    seq_keys = torch.randint(0, 2**32, (rows,), generator=gen, dtype=torch.long)
    positions = torch.randint(0, 4000, (rows, width), generator=gen)
    return scores, seq_keys, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_equals_the_materialised_noise_path(dtype):
    scores, seq_keys, positions = random_case(5, 3, 5000, seed=0, dtype=dtype)
    keys = counter_hash.combine(counter_hash.combine(seq_keys[:, None], positions), STREAM_TARGET)
    token_hash = counter_hash.token_hash(5000, torch.device("cpu"))
    got = kernel.gumbel_argmax_reference(scores.reshape(-1, 5000), keys.reshape(-1), token_hash).view(5, 3)
    assert torch.equal(got, unfused(scores, seq_keys, positions, STREAM_TARGET))


def test_compiled_kernel_and_sample_tokens_equal_the_reference_on_real_vocabulary_sizes():
    """Many rows (and with them near-ties) on SmolLM2's and Qwen's vocabulary widths; both noise streams."""
    params = SamplingParams(1.0, 0, 1.0)
    for rows, width, vocab, stream in ((33, 5, 49152, STREAM_TARGET), (7, 1, 151936, STREAM_DRAFT),
                                       (1, 2, 4096, STREAM_TARGET)):
        scores, seq_keys, positions = random_case(rows, width, vocab, seed=rows)
        expected = unfused(scores, seq_keys, positions, stream)
        assert torch.equal(sample_tokens(scores, params, seq_keys, positions, stream), expected), (rows, vocab)
    assert not kernel._fallback_logged  # the compiled kernel ran, not the fallback
