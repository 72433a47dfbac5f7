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


def cpu_kernel_or_skip():
    if not kernel.kernel_available():
        pytest.skip("the C++ Gumbel-max kernel needs an AVX-512 CPU and a compiler")


@pytest.mark.parametrize("spread", [1.0, 6.0])
@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_the_reference_bit_for_bit(rows, dtype, spread):
    """float32 and bfloat16 scores (widened in the kernel as `.float()` does), a vocabulary that is not a multiple
    of the vector width, few rows (one row's vocabulary split among the threads, parts merged in order), and scores
    spread as wide as real logits (most blocks then skipped: no noise lifts them to the row's best)."""
    cpu_kernel_or_skip()
    vocab = 151936 + 5
    scores, seq_keys, positions = random_case(rows, 3, vocab, seed=rows, dtype=torch.float32)
    scores = (scores * spread).to(dtype)
    keys = counter_hash.combine(counter_hash.combine(seq_keys[:, None], positions), STREAM_TARGET).reshape(-1)
    token_hash = counter_hash.token_hash(vocab, torch.device("cpu"))
    flat = scores.reshape(-1, vocab)
    got = torch.ops.specactor.gumbel_argmax(flat, keys, token_hash)
    assert torch.equal(got, kernel.gumbel_argmax_reference(flat.float(), keys, token_hash))
    assert torch.equal(got, kernel._compiled()(flat.float(), keys, token_hash))  # the non-AVX-512 path agrees


def test_cpu_kernel_breaks_ties_and_nans_as_torch_argmax_does():
    """Equal totals: the first index wins, also across the lanes and the threads' parts; a NaN wins over numbers,
    the first NaN over later ones (torch.argmax's rule, which the reference inherits)."""
    cpu_kernel_or_skip()
    vocab = 40000
    keys = torch.tensor([17, 99, 123456789], dtype=torch.long)
    token_hash = torch.zeros(vocab, dtype=torch.long)  # every token the same noise: totals tie where scores do
    scores = torch.full((3, vocab), -5.0)
    scores[0, [7, 20000, 39999]] = 3.0  # ties in different lanes and parts: 7 wins
    scores[1, [33, 30001]] = float("nan")  # the first NaN wins
    scores[1, 5] = 100.0
    scores[2, [20003, 20019]] = 1.0  # same lane (16 apart) in the second half: the earlier wins
    got = torch.ops.specactor.gumbel_argmax(scores, keys, token_hash)
    assert got.tolist() == [7, 33, 20003]
    assert torch.equal(got, kernel.gumbel_argmax_reference(scores, keys, token_hash))
    for row in range(3):  # alone, a row's vocabulary is split among the threads
        assert int(torch.ops.specactor.gumbel_argmax(scores[row : row + 1], keys[row : row + 1], token_hash)) == \
            got[row]


def test_cpu_kernel_refuses_bad_inputs_with_a_message():
    cpu_kernel_or_skip()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.specactor.gumbel_argmax(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.long),
                                          torch.zeros(8, dtype=torch.long))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.specactor.gumbel_argmax(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long),
                                          torch.zeros(8, dtype=torch.long))
