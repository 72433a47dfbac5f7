"""Position-keyed sampling: the noise hash, its uniformity and independence, warping and the Gumbel-max sampler.

Statistical tests are deterministic (every key is fixed); each docstring states the sample size and the
false-positive probability the test would have if the hash were truly random.
"""

from __future__ import annotations

import functools
import math
import zlib

import numpy as np
import pytest
import torch
from scipy import stats

from specactor_engine.counter_hash import GOLDEN, MASK32, MUL_A, MUL_B
from specactor_engine.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RECOVER,
    STREAM_TARGET,
    SamplingParams,
    gumbel_noise,
    noise_bits,
    noise_bits_reference,
    sample_tokens,
    scaled_log_softmax,
    token_logprobs,
    uniform_noise,
    warp_logits,
    warped_probs,
)

STREAMS = [STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RECOVER]
ALPHA = 1e-6  # false-positive probability of each chi-square test below
EDGE_KEYS = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
EDGE_POSITIONS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 3, 2**62 - 1]


def distinct_keys(n: int, offset: int = 0) -> torch.Tensor:
    """n distinct 32-bit sequence keys (an odd multiplier is a bijection mod 2**32)."""
    return (torch.arange(n, dtype=torch.long) * 0x9E3779B1 + offset) & MASK32


def chi2_threshold(dof: int, alpha: float = ALPHA) -> float:
    return float(stats.chi2.isf(alpha, dof))


# ---------------------------------------------------------------- inverting the hash (adversarial keys)


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * MUL_A) & MASK32
    x ^= x >> 15
    x = (x * MUL_B) & MASK32
    x ^= x >> 16
    x = (x * MUL_A) & MASK32
    return x ^ (x >> 15)


def _unxorshift(x: int, shift: int) -> int:
    y = x
    for _ in range(32 // shift + 1):
        y = x ^ (y >> shift)
    return y


def _unmix32_int(x: int) -> int:
    inv_a, inv_b = pow(MUL_A, -1, 2**32), pow(MUL_B, -1, 2**32)
    x = (_unxorshift(x, 15) * inv_a) & MASK32
    x = (_unxorshift(x, 16) * inv_b) & MASK32
    x = (_unxorshift(x, 15) * inv_a) & MASK32
    return _unxorshift(x, 16)


def key_with_bits(bits: int, position: int, token: int, stream: int = STREAM_TARGET) -> int:
    """The sequence key whose noise hash at (position, token, stream) equals `bits` (mix32 is a bijection)."""
    combined = _unmix32_int(bits) ^ _mix32_int((token * GOLDEN) & MASK32)
    keyed_position = _unmix32_int(combined) ^ _mix32_int(stream)
    return _unmix32_int(keyed_position) ^ _mix32_int(position & MASK32)


def test_hash_inversion_helper_matches_reference() -> None:
    for x in [0, 1, 12345, 2**31, MASK32]:
        assert _unmix32_int(_mix32_int(x)) == x
    for bits, position, token, stream in [(MASK32, 5, 0, 0), (0, 0, 3, 1), (0xDEADBEEF, 2**33 + 7, 6, 3)]:
        key = key_with_bits(bits, position, token, stream)
        got = noise_bits_reference(torch.tensor([key]), torch.tensor([[position]]), 8, stream)
        assert int(got[0, 0, token]) == bits


# ---------------------------------------------------------------- the hash: fast path == reference


@pytest.mark.parametrize("vocab_size", [1, 7, 1000])
@pytest.mark.parametrize("stream", STREAMS)
def test_noise_bits_fast_path_equals_reference(vocab_size: int, stream: int) -> None:
    """numpy uint32 fast path == torch int64 reference bit for bit, edge keys/positions included."""
    gen = torch.Generator().manual_seed(1000 + stream)
    keys = torch.cat([torch.tensor(EDGE_KEYS), torch.randint(0, 2**32, (57,), generator=gen)])
    positions = torch.randint(0, 2**40, (len(keys), len(EDGE_POSITIONS) + 4), generator=gen)
    positions[:, : len(EDGE_POSITIONS)] = torch.tensor(EDGE_POSITIONS)
    reference = noise_bits_reference(keys, positions, vocab_size, stream)
    fast = noise_bits(keys, positions, vocab_size, stream)
    assert reference.shape == fast.shape == (len(keys), positions.shape[1], vocab_size)
    assert reference.dtype == torch.long
    assert bool(((reference >= 0) & (reference <= MASK32)).all())
    assert torch.equal(fast.to(torch.long) & MASK32, reference)


def test_noise_streams_and_tokens_differ() -> None:
    keys, positions = distinct_keys(256), torch.arange(4).repeat(256, 1)
    bits = [noise_bits_reference(keys, positions, 16, s) for s in STREAMS]
    for i in range(len(bits)):
        for j in range(i + 1, len(bits)):
            assert (bits[i] == bits[j]).float().mean() < 1e-3
    assert (bits[0][..., 1:] == bits[0][..., :-1]).float().mean() < 1e-3


def test_uniform_noise_strictly_inside_unit_interval_random() -> None:
    """2**20 random-key uniforms (and their Gumbel transforms) are in (0, 1) (finite)."""
    gen = torch.Generator().manual_seed(7)
    keys = torch.randint(0, 2**32, (2**14,), generator=gen)
    positions = torch.randint(0, 2**40, (2**14, 4), generator=gen)
    u = uniform_noise(keys, positions, 16)
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool(torch.isfinite(gumbel_noise(keys, positions, 16)).all())


@pytest.mark.parametrize("bits", [0, 0xFF, 0x7FFFFFFF, 0xFFFFFF00, MASK32], ids=hex)
def test_uniform_noise_strictly_inside_unit_interval_extreme_hashes(bits: int) -> None:
    """Keys built by inverting the hash so the noise bits are extreme (all ones is hit once per 2**24 values;
    with a 150k vocabulary about 0.9% of sampled positions contain such a value)."""
    key = key_with_bits(bits, position=11, token=2)
    keys, positions = torch.tensor([key]), torch.tensor([[11]])
    u = uniform_noise(keys, positions, 4)[0, 0, 2]
    assert 0.0 < float(u) < 1.0, f"uniform_noise = {float(u)!r} for hash bits {bits:#x}"
    assert math.isfinite(float(gumbel_noise(keys, positions, 4)[0, 0, 2]))


def test_masked_token_never_sampled_even_for_extreme_noise() -> None:
    """A token outside the top-k set (score -inf) must never be chosen, whatever the noise bits are.

    Token 0 gets the all-ones hash at position 11; with top_k=1 only token 1 may be sampled. Without
    top-k, token 0 (probability ~e**-20) must not win either.
    """
    key = key_with_bits(MASK32, position=11, token=0)
    keys, positions = torch.tensor([key]), torch.tensor([[11]])
    logits = torch.tensor([[[0.0, 20.0, 0.0, 0.0]]])
    assert int(sample_tokens(logits, SamplingParams(top_k=1), keys, positions)) == 1
    assert int(sample_tokens(logits, SamplingParams(), keys, positions)) == 1


# ---------------------------------------------------------------- uniformity and independence


@pytest.mark.parametrize("stream", [STREAM_TARGET, STREAM_RECOVER])
def test_uniform_noise_chi_square(stream: int) -> None:
    """Chi-square goodness of fit of 2**20 uniforms (2**16 keys x 4 positions x 4 tokens) to U(0, 1).

    Two binnings: 1024 equal bins of u (the high bits), and 1024 bins of frac(u * 2**12) (hash bits 12..21).
    Threshold chi2.isf(1e-6, 1023): false-positive probability 1e-6 each.
    """
    keys = distinct_keys(2**16, 12345)
    positions = torch.arange(4).repeat(2**16, 1) + 77
    u = uniform_noise(keys, positions, 4, stream).double().numpy().ravel()
    assert u.size >= 10**6
    for values in (u, np.modf(u * 2**12)[0]):
        counts = np.bincount(np.minimum((values * 1024).astype(np.int64), 1023), minlength=1024)
        expected = u.size / 1024
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < chi2_threshold(1023), chi2
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / u.size)  # 6 sigma: two-sided odds ~2e-9


@functools.cache
def _pairs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Neighbouring uniforms: (key, t) vs (key, t+1), (key, t) vs (key+1, t), token v vs v+1, stream 0 vs 1."""
    n_keys, n_pos, vocab = 2**15, 33, 1
    keys = torch.arange(n_keys, dtype=torch.long) * 2 + 10**6  # consecutive keys (key and key+1) below
    positions = torch.arange(n_pos).repeat(n_keys, 1)
    u = uniform_noise(keys, positions, vocab).double().numpy()[..., 0]  # [K, T]
    u_next_key = uniform_noise(keys + 1, positions, vocab).double().numpy()[..., 0]
    u_tokens = uniform_noise(keys, positions[:, :1], 32).double().numpy()[:, 0, :]  # [K, 32]
    u_stream = uniform_noise(keys, positions, vocab, STREAM_DRAFT).double().numpy()[..., 0]
    return {
        "position t vs t+1": (u[:, :-1].ravel(), u[:, 1:].ravel()),
        "key vs key+1": (u.ravel(), u_next_key.ravel()),
        "token v vs v+1": (u_tokens[:, :-1].ravel(), u_tokens[:, 1:].ravel()),
        "target vs draft stream": (u.ravel(), u_stream.ravel()),
    }


PAIR_NAMES = ["position t vs t+1", "key vs key+1", "token v vs v+1", "target vs draft stream"]


@pytest.mark.parametrize("name", PAIR_NAMES)
def test_neighbouring_uniforms_uncorrelated(name: str) -> None:
    """Pearson correlation of ~1.05e6 neighbouring pairs: |r| < 6 / sqrt(N).

    Under independence r is ~N(0, 1/N): the two-sided false-positive probability is ~2e-9.
    """
    a, b = _pairs()[name]
    assert a.size >= 10**6
    r = float(np.corrcoef(a, b)[0, 1])
    assert abs(r) < 6 / math.sqrt(a.size), r


@pytest.mark.parametrize("name", PAIR_NAMES)
def test_neighbouring_uniforms_jointly_uniform(name: str) -> None:
    """Chi-square of the joint 16 x 16 histogram of ~1.05e6 neighbouring pairs against uniform on the square
    (catches non-linear dependence too). 255 dof, threshold chi2.isf(1e-6, 255): false-positive prob. 1e-6."""
    a, b = _pairs()[name]
    cells = (a * 16).astype(np.int64) * 16 + (b * 16).astype(np.int64)
    counts = np.bincount(cells, minlength=256)
    expected = a.size / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_threshold(255), chi2


# ---------------------------------------------------------------- warping


def test_warp_logits_hand_made_top_p_top_k() -> None:
    """Exact kept sets on probabilities 0.4, 0.25, 0.2, 0.1, 0.05 (stored in shuffled order)."""
    probs = torch.tensor([0.1, 0.4, 0.05, 0.2, 0.25], dtype=torch.float64)
    logits = probs.log()
    by_rank = [1, 4, 3, 0, 2]  # token ids in decreasing probability

    def kept(params: SamplingParams) -> set[int]:
        scores = warp_logits(logits, params)
        finite = torch.isfinite(scores)
        assert torch.equal(scores[finite], (logits / params.temperature)[finite])  # kept scores untouched
        assert bool((scores[~finite] == float("-inf")).all())
        return set(torch.nonzero(finite).flatten().tolist())

    assert kept(SamplingParams()) == set(range(5))
    # top-p: the smallest top set whose mass reaches top_p
    assert kept(SamplingParams(top_p=0.3)) == set(by_rank[:1])  # 0.4 >= 0.3
    assert kept(SamplingParams(top_p=0.6)) == set(by_rank[:2])  # 0.4 < 0.6 <= 0.65
    assert kept(SamplingParams(top_p=0.66)) == set(by_rank[:3])  # 0.65 < 0.66 <= 0.85
    assert kept(SamplingParams(top_p=0.9)) == set(by_rank[:4])  # 0.85 < 0.9 <= 0.95
    assert kept(SamplingParams(top_p=0.99)) == set(by_rank)
    assert kept(SamplingParams(top_p=1e-9)) == set(by_rank[:1])  # top-1 always kept
    # top-k
    assert kept(SamplingParams(top_k=1)) == set(by_rank[:1])
    assert kept(SamplingParams(top_k=3)) == set(by_rank[:3])
    assert kept(SamplingParams(top_k=5)) == set(by_rank)
    assert kept(SamplingParams(top_k=50)) == set(by_rank)
    # top-k then top-p on the renormalised kept set: {0.4, 0.25, 0.2} / 0.85 = {0.47, 0.29, 0.24}
    assert kept(SamplingParams(top_k=3, top_p=0.6)) == set(by_rank[:2])  # 0.47 < 0.6 <= 0.76
    assert kept(SamplingParams(top_k=3, top_p=0.8)) == set(by_rank[:3])  # 0.76 < 0.8
    # temperature sharpens before top-p: T=0.5 gives 0.16/0.275=0.58 for the top token
    assert kept(SamplingParams(temperature=0.5, top_p=0.5)) == set(by_rank[:1])
    assert kept(SamplingParams(temperature=2.0, top_p=0.5)) == set(by_rank[:2])  # flatter: 0.32 < 0.5


def test_warp_logits_is_row_wise_and_keeps_input_dtype() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.7)
    batched = warp_logits(logits, params)
    assert batched.dtype == torch.float32
    for i in range(3):
        for j in range(5):
            assert torch.equal(warp_logits(logits[i, j], params), batched[i, j])
    assert warp_logits(logits.to(torch.bfloat16), params).dtype == torch.float32


def test_at_temperature_one_the_logits_are_not_copied_and_nothing_changes() -> None:
    """At T = 1 (RL rollouts' usual setting) warping and the log-probs skip the division: x / 1 is x bit for bit,
    and each pass over [R, k+1, V] cost ~9 ms a round at trace A's 32 rows x width 2 x 151,936. float32 logits are
    then warped in place of a copy; the tokens and log-probs are those of the explicit division."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3, 5003, generator=gen) * 4
    one = SamplingParams(temperature=1.0)
    assert warp_logits(logits, one) is logits  # no copy
    assert torch.equal(scaled_log_softmax(logits, 1.0), torch.log_softmax(logits / 1.0, dim=-1))
    keys, positions = torch.arange(4, dtype=torch.int64) + 11, torch.arange(3)[None, :].repeat(4, 1)
    ids = sample_tokens(logits, one, keys, positions)
    # the same choice as the Gumbel-max over the explicitly divided scores
    noise = gumbel_noise(keys, positions, logits.shape[-1])
    assert torch.equal(ids, (logits / 1.0 + noise).argmax(-1))
    # a temperature other than 1 still divides
    assert torch.equal(warp_logits(logits, SamplingParams(temperature=0.5)), logits / 0.5)


def test_warped_probs_greedy_is_one_hot_argmax() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0], [2.0, 1.0, 0.0]])
    expected = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(warped_probs(logits, SamplingParams(temperature=0.0)), expected)


# ---------------------------------------------------------------- the Gumbel-max sampler


def reference_warped(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Independent float64 statement of the target: softmax(logits/T), top-k, then top-p on the renormalised set."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, dtype=bool)
    if top_k:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        mass_before = np.cumsum(q[order]) - q[order]
        keep[order[mass_before >= top_p]] = False
    out = np.where(keep, p, 0.0)
    return out / out.sum()


SAMPLER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("params", SAMPLER_CASES, ids=repr)
def test_sample_tokens_matches_warped_softmax(params: SamplingParams) -> None:
    """Gumbel-max over N = 120,000 distinct (seq_key, position) pairs, V = 12: the empirical frequencies
    match the warped softmax (chi-square over the kept set, threshold chi2.isf(1e-6, kept - 1): false-positive
    probability 1e-6); tokens outside the kept set are never drawn."""
    n, vocab = 120_000, 12
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(42))  # max prob 0.4
    target = reference_warped(logits.numpy(), params.temperature, params.top_k, params.top_p)
    assert np.allclose(warped_probs(logits, params).numpy(), target, atol=1e-12)
    keys = distinct_keys(n, offset=zlib.crc32(repr(params).encode()))
    positions = torch.randint(0, 10**6, (n, 1), generator=torch.Generator().manual_seed(5))
    tokens = sample_tokens(logits.expand(n, 1, vocab), params, keys, positions)[:, 0].numpy()
    counts = np.bincount(tokens, minlength=vocab)
    kept = target > 0
    assert kept.sum() >= 3  # a non-degenerate case
    assert counts[~kept].sum() == 0
    expected = n * target[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_threshold(int(kept.sum()) - 1), (chi2, counts, expected)


def test_greedy_returns_argmax() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 5, 50, generator=gen)
    keys, positions = distinct_keys(64), torch.randint(0, 1000, (64, 5), generator=gen)
    greedy = SamplingParams(temperature=0.0)
    assert greedy.greedy
    assert torch.equal(sample_tokens(logits, greedy, keys, positions), logits.argmax(-1))
    assert torch.equal(sample_tokens(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5), keys, positions),
                       logits.argmax(-1))


def test_sample_tokens_deterministic_and_batch_invariant() -> None:
    """Same inputs give the same tokens; each row alone, in a permuted batch or split by position gives the
    same token as in the full batch (the noise depends only on (key, position, token))."""
    gen = torch.Generator().manual_seed(12)
    rows, steps, vocab = 48, 3, 40
    logits = torch.randn(rows, steps, vocab, generator=gen) * 2
    keys = torch.randint(0, 2**32, (rows,), generator=gen)
    positions = torch.randint(0, 2**20, (rows, steps), generator=gen)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
    full = sample_tokens(logits, params, keys, positions)
    assert torch.equal(full, sample_tokens(logits.clone(), params, keys.clone(), positions.clone()))
    for r in range(rows):
        row = slice(r, r + 1)
        assert torch.equal(sample_tokens(logits[row], params, keys[row], positions[row]), full[row])
    perm = torch.randperm(rows, generator=gen)
    assert torch.equal(sample_tokens(logits[perm], params, keys[perm], positions[perm]), full[perm])
    for t in range(steps):
        one = sample_tokens(logits[:, t : t + 1], params, keys, positions[:, t : t + 1])
        assert torch.equal(one[:, 0], full[:, t])
    # padding the batch with other rows does not change the original rows
    bigger = sample_tokens(torch.cat([logits, logits.flip(0)]), params, torch.cat([keys, keys + 1]),
                           torch.cat([positions, positions]))
    assert torch.equal(bigger[:rows], full)
    # and different keys do change some tokens (the noise is really keyed)
    assert not torch.equal(sample_tokens(logits, params, keys + 1, positions), full)


def test_token_logprobs_equals_log_softmax_gathered() -> None:
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(6, 4, 30, generator=gen, dtype=torch.float64) * 3
    ids = torch.randint(0, 30, (6, 4), generator=gen)
    for temperature in (1.0, 0.7, 1.5):
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[..., None])[..., 0]
        got64 = token_logprobs(logits, ids, temperature)
        assert got64.dtype == torch.float32 and got64.shape == (6, 4)
        torch.testing.assert_close(got64, expected.float(), rtol=0, atol=1e-6)
        got32 = token_logprobs(logits.float(), ids, temperature)
        torch.testing.assert_close(got32.double(), expected, rtol=0, atol=1e-5)
    expected_t1 = torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None])[..., 0].float()
    torch.testing.assert_close(token_logprobs(logits, ids, 0.0), expected_t1, rtol=0, atol=1e-6)  # greedy: T = 1
    got_bf16 = token_logprobs(logits.to(torch.bfloat16), ids, 1.0)
    expected_bf16 = torch.log_softmax(logits.to(torch.bfloat16).double(), dim=-1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(got_bf16.double(), expected_bf16, rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab_size", [7, 4096, 5003])
def test_uniform_noise_cpu_paths_equal_the_torch_reference(vocab_size):
    """Both CPU paths (vectorized for small V, row loop for large V) give the reference's values."""
    from specactor_engine.sampling import noise_bits_reference, uniform_noise

    keys = torch.tensor([0, 5, 2**32 - 1])
    positions = torch.tensor([[0, 1], [7, 2**31], [3, 4]])
    expected = ((noise_bits_reference(keys, positions, vocab_size) >> 9).float() + 0.5) * 2.0**-23
    assert torch.equal(uniform_noise(keys, positions, vocab_size), expected)
