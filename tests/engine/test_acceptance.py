"""Lossless acceptance rules: readable exact cases and statistical losslessness of both rules.

Statistical set-up (a context-independent toy): V = 8, the same target p and draft q at every position,
N = 100,000 rows of one batch call (distinct sequence keys). Every statistical assertion states its
false-positive probability under the idealised model in which the noise is truly random.

Total-variation bound: TV(p_hat, p) = max over the 2**V token subsets A of p_hat(A) - p(A). Hoeffding gives
P(p_hat(A) - p(A) >= eps) <= exp(-2 n eps**2) for each A; a union bound over the 2**V subsets gives
P(TV >= eps) <= 2**V exp(-2 n eps**2) (Bretagnolle-Huber-Carol). `tv_bound(n, V, alpha)` is the eps at which
this equals alpha = 1e-6; for V = 8 and n = 100,000 it is 0.0098.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specactor_engine.acceptance import accept_position_keyed, accept_rejection
from specactor_engine.counter_hash import MASK32
from specactor_engine.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RECOVER,
    SamplingParams,
    gumbel_noise,
    sample_tokens,
    uniform_noise,
    warped_probs,
)

V = 8
N = 100_000
ALPHA = 1e-6
HOEFFDING_EPS = 0.01  # |rate - E rate| >= 0.01 over N = 1e5 rows: probability <= 2 exp(-20) = 4e-9
RELATIVE_FACTOR = 5  # TV to p must be < 1/5 of the TV to the nearest wrong reference distribution


def t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------- readable exact cases: position-keyed / greedy

# (draft_token_ids, num_draft_tokens, target_token_ids, expected num_accepted)
POSITION_KEYED_CASES = [
    ([[1, 2, 3]], [3], [[1, 5, 3, 4]], [1]),  # mismatch at pos 1 -> emit 1, 5
    ([[1, 2, 3]], [3], [[7, 2, 3, 4]], [0]),  # mismatch at pos 0; later matches do not count
    ([[1, 2, 3]], [3], [[1, 2, 3, 4]], [3]),  # all accepted -> bonus 4
    ([[1, 2, 3]], [3], [[1, 2, 9, 4]], [2]),  # mismatch at the last draft
    ([[1, 2, 0]], [2], [[1, 2, 7, 4]], [2]),  # 2 drafts of k=3 -> emit 1, 2, 7 (7 is the bonus)
    ([[1, 2, 7]], [2], [[1, 2, 7, 4]], [2]),  # padding that happens to match is not accepted
    ([[5, 5, 5]], [0], [[5, 5, 5, 5]], [0]),  # zero drafts: emit the target's token only
    ([[]], [0], [[6]], [0]),  # no draft slots at all (k = 0)
    ([[1, 2, 3], [1, 2, 3], [4, 0, 0], [9, 9, 9]],  # a batch with ragged draft counts
     [3, 3, 1, 0],
     [[1, 2, 3, 0], [1, 6, 3, 0], [4, 8, 8, 8], [9, 9, 9, 9]],
     [3, 1, 1, 0]),
]


@pytest.mark.parametrize("drafts, num_drafts, targets, expected", POSITION_KEYED_CASES)
def test_position_keyed_cases(drafts: list, num_drafts: list, targets: list, expected: list) -> None:
    num_accepted, output = accept_position_keyed(t(drafts), t(num_drafts), t(targets))
    assert num_accepted.tolist() == expected
    assert torch.equal(output, t(targets))  # the rollout is always the target's own choices
    for r, n in enumerate(expected):
        emitted = output[r, : n + 1].tolist()
        assert emitted[:n] == drafts[r][:n] and emitted[n] == targets[r][n]


def test_position_keyed_draft_equal_to_target_accepts_every_draft() -> None:
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 50, (200, 6), generator=gen)
    num_drafts = torch.randint(0, 6, (200,), generator=gen)
    drafts = torch.where(torch.arange(5) < num_drafts[:, None], targets[:, :5], -1)  # padded with -1
    num_accepted, _ = accept_position_keyed(drafts, num_drafts, targets)
    assert torch.equal(num_accepted, num_drafts)


def test_greedy_acceptance_with_argmax_targets() -> None:
    """Greedy = position-keyed with the argmax as the target's choice."""
    logits = torch.full((2, 4, 6), -1.0)
    for r, row in enumerate([[3, 1, 4, 1], [2, 2, 0, 5]]):
        for pos, tok in enumerate(row):
            logits[r, pos, tok] = 2.0
    targets = sample_tokens(logits, SamplingParams(temperature=0.0), t([0, 1]), t([[0, 1, 2, 3]] * 2))
    assert targets.tolist() == [[3, 1, 4, 1], [2, 2, 0, 5]]
    num_accepted, output = accept_position_keyed(t([[3, 1, 0], [2, 3, 0]]), t([3, 3]), targets)
    assert num_accepted.tolist() == [2, 1]  # row 0: mismatch at pos 2; row 1: mismatch at pos 1
    assert output[0, :3].tolist() == [3, 1, 4] and output[1, :2].tolist() == [2, 2]


# ---------------------------------------------------------------- readable exact cases: rejection rule


def probs_rows(*rows: list[float]) -> torch.Tensor:
    """[1, len(rows), V] float64 distributions."""
    return torch.tensor([list(rows)], dtype=torch.float64)


def favour(k_plus_1: int, vocab: int, tokens: list[int]) -> torch.Tensor:
    """Recovery Gumbel noise [1, k+1, V] that makes `tokens[i]` win at position i among tokens of positive mass."""
    g = torch.zeros(1, k_plus_1, vocab, dtype=torch.float64)
    for i, tok in enumerate(tokens):
        g[0, i, tok] = 50.0
    return g


def test_rejection_exact_cases_with_draft_probs() -> None:
    p = [0.5, 0.5, 0.0, 0.0]
    q = [0.25, 0.25, 0.25, 0.25]
    target = probs_rows(p, p, p, p)
    draft = probs_rows(q, q, q)
    # accept 0 (u q = 0.225 < 0.5), reject 2 (p = 0): recover from max(p - q, 0) ~ {0, 1}
    n_acc, out = accept_rejection(t([[0, 2, 1]]), t([3]), draft, target, torch.tensor([[0.9, 0.1, 0.1]]),
                                  favour(4, 4, [3, 1, 3, 3]))
    assert n_acc.tolist() == [1] and out[0, :2].tolist() == [0, 1]
    # a recovered token never has residual mass 0: favouring token 2 (p - q < 0) still yields 0 or 1
    n_acc, out = accept_rejection(t([[0, 2, 1]]), t([3]), draft, target, torch.tensor([[0.9, 0.1, 0.1]]),
                                  favour(4, 4, [3, 2, 3, 3]))
    assert n_acc.tolist() == [1] and out[0, 1].item() in (0, 1)
    # all accepted: the bonus comes from p at position k
    n_acc, out = accept_rejection(t([[0, 1, 1]]), t([3]), draft, target, torch.tensor([[0.1, 0.99, 0.5]]),
                                  favour(4, 4, [3, 3, 3, 1]))
    assert n_acc.tolist() == [3] and out[0].tolist() == [0, 1, 1, 1]
    # u q < p is the test: u = 0.99 with q = 0.25 < p = 0.5 is accepted; with q = 0.6 > p it is rejected
    q2 = [0.6, 0.2, 0.1, 0.1]
    n_acc, out = accept_rejection(t([[0]]), t([1]), probs_rows(q2), probs_rows(p, p), torch.tensor([[0.99]]),
                                  favour(2, 4, [0, 0]))
    assert n_acc.tolist() == [0] and out[0, 0].item() == 1  # residual max(p - q, 0) = {1: 0.3}


def test_rejection_exact_cases_deterministic_drafts() -> None:
    p = [0.1, 0.6, 0.3, 0.0]
    target = probs_rows(p, p, p)
    # draft 1 with u = 0.7: 0.7 >= p(1) = 0.6 -> reject; recover from p without token 1 -> never 1
    n_acc, out = accept_rejection(t([[1, 1]]), t([2]), None, target, torch.tensor([[0.7, 0.1]]),
                                  favour(3, 4, [1, 0, 0]))
    assert n_acc.tolist() == [0] and out[0, 0].item() in (0, 2)
    # u = 0.5 < 0.6: accept; second draft 3 has p = 0: always rejected, recovered from p without 3
    n_acc, out = accept_rejection(t([[1, 3]]), t([2]), None, target, torch.tensor([[0.5, 1e-9]]),
                                  favour(3, 4, [0, 2, 0]))
    assert n_acc.tolist() == [1] and out[0, :2].tolist() == [1, 2]
    # zero drafts: position 0 is sampled from p itself (the padding token 1 is not removed)
    n_acc, out = accept_rejection(t([[1, 1]]), t([0]), None, target, torch.tensor([[0.99, 0.99]]),
                                  favour(3, 4, [1, 1, 1]))
    assert n_acc.tolist() == [0] and out[0, 0].item() == 1
    # fewer drafts than k: after the only draft, position 1 is a bonus position sampled from p
    n_acc, out = accept_rejection(t([[2, 1]]), t([1]), None, target, torch.tensor([[0.01, 0.99]]),
                                  favour(3, 4, [0, 1, 0]))
    assert n_acc.tolist() == [1] and out[0, :2].tolist() == [2, 1]


def test_rejection_draft_equal_to_target_accepts_every_draft() -> None:
    """q == p accepts every draft whatever the uniforms in (0, 1) (u q < q); so does a one-hot p on the draft."""
    gen = torch.Generator().manual_seed(1)
    rows, k = 500, 4
    probs = torch.softmax(torch.randn(rows, k + 1, 16, generator=gen, dtype=torch.float64), dim=-1)
    drafts = torch.multinomial(probs[:, :k].reshape(-1, 16), 1, generator=gen).view(rows, k)
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    uniforms = torch.rand(rows, k, generator=gen).clamp(1e-7, 1 - 1e-7)
    uniforms[0] = 1 - 2**-24  # the largest uniform_noise value below 1
    noise = torch.zeros(rows, k + 1, 16)
    n_acc, out = accept_rejection(drafts, num_drafts, probs[:, :k], probs, uniforms, noise)
    assert torch.equal(n_acc, num_drafts)
    one_hot = torch.nn.functional.one_hot(torch.cat([drafts, drafts[:, :1]], 1), 16).double()
    n_acc, out = accept_rejection(drafts, num_drafts, None, one_hot, uniforms, noise)
    assert torch.equal(n_acc, num_drafts)
    assert torch.equal(out[:, :k][torch.arange(k) < num_drafts[:, None]], drafts[torch.arange(k) < num_drafts[:, None]])


# ---------------------------------------------------------------- statistics helpers


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def tv_bound(n: int, vocab: int = V, alpha: float = ALPHA) -> float:
    """eps with 2**vocab exp(-2 n eps**2) = alpha (see the module docstring)."""
    return math.sqrt((vocab * math.log(2) + math.log(1 / alpha)) / (2 * n))


def reference_distributions(p: np.ndarray, extra: list[np.ndarray]) -> list[np.ndarray]:
    """Wrong answers for the relative test: seeded Dirichlet(1) draws and `extra` (q, the unwarped softmax),
    kept when at least 0.1 away from p in TV."""
    rng = np.random.default_rng(99)
    refs = [rng.dirichlet(np.ones(len(p))) for _ in range(6)] + extra
    refs = [r for r in refs if tv(r, p) >= 0.1]
    assert len(refs) >= 5
    return refs


def assert_distribution(tokens: np.ndarray, p: np.ndarray, refs: list[np.ndarray], min_n: int) -> None:
    """Empirical distribution of `tokens` vs p: no mass outside supp(p); TV < tv_bound(n) (false-positive
    probability 1e-6); TV to p < 1/5 of the TV to every reference distribution (vLLM-style relative test)."""
    n = tokens.size
    assert n >= min_n, n
    emp = np.bincount(tokens, minlength=len(p)) / n
    assert emp[p == 0].sum() == 0, emp
    dist = tv(emp, p)
    assert dist < tv_bound(n), (dist, tv_bound(n), emp, p)
    nearest_wrong = min(tv(emp, r) for r in refs)
    assert dist < nearest_wrong / RELATIVE_FACTOR, (dist, nearest_wrong)


def assert_conditionally_independent(first: np.ndarray, second: np.ndarray, p: np.ndarray) -> None:
    """Chi-square of the (first, second) contingency table against count(first = x) * p(y): the second emitted
    token is distributed as p whatever the first. dof = (#first values) * (|supp p| - 1); false-positive
    probability 1e-6 (chi2.isf(1e-6, dof))."""
    support = np.flatnonzero(p > 0)
    table = np.zeros((len(p), len(p)))
    np.add.at(table, (first, second), 1)
    assert table[:, p == 0].sum() == 0
    row_totals = table.sum(1)
    rows = row_totals > 0
    expected = row_totals[rows, None] * p[None, support]
    chi2 = float(((table[rows][:, support] - expected) ** 2 / expected).sum())
    dof = int(rows.sum()) * (len(support) - 1)
    assert chi2 < stats.chi2.isf(ALPHA, dof), (chi2, dof)


def keys_and_positions(n: int, k: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = (torch.arange(n, dtype=torch.long) * 0x9E3779B1 + offset) & MASK32  # distinct keys
    base = torch.randint(0, 10**6, (n, 1), generator=torch.Generator().manual_seed(offset))
    return keys, base + torch.arange(k + 1)


TARGET_LOGITS = torch.randn(V, generator=torch.Generator().manual_seed(2024)) * 1.2
DRAFT_LOGITS = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 1.2
DRAFT_PARAMS = SamplingParams(temperature=1.0)
TARGET_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
]


def toy_distributions(target_params: SamplingParams) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    p = warped_probs(TARGET_LOGITS, target_params).numpy()
    q = warped_probs(DRAFT_LOGITS, DRAFT_PARAMS).numpy()
    unwarped = torch.softmax(TARGET_LOGITS.double(), -1).numpy()
    assert tv(p, q) > 0.2  # the drafter is really different from the target
    return p, q, reference_distributions(p, [q, unwarped])


# ---------------------------------------------------------------- (a) position-keyed rule with Gumbel coupling


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("target_params", TARGET_PARAMS, ids=repr)
def test_position_keyed_lossless(target_params: SamplingParams, k: int) -> None:
    """Coupled drafter (draft q sampled with the SAME keyed noise) + position-keyed acceptance, N = 100,000:
    the first emitted token ~ p (TV < 0.0098 at alpha 1e-6, relative factor 5); for k = 3 the second emitted
    token ~ p given the first (chi-square, alpha 1e-6; TV bound at its own count >= 10,000); the first-draft acceptance
    rate lies in [(1 - TV)/(1 + TV), 1 - TV] (Gumbel coupling bounds) up to 0.01 (Hoeffding, 4e-9)."""
    p, q, refs = toy_distributions(target_params)
    keys, positions = keys_and_positions(N, k, offset=11 + k)
    targets = sample_tokens(TARGET_LOGITS.expand(N, k + 1, V), target_params, keys, positions)
    drafts = sample_tokens(DRAFT_LOGITS.expand(N, k, V), DRAFT_PARAMS, keys, positions[:, :k])
    num_drafts = torch.full((N,), k)
    num_accepted, output = accept_position_keyed(drafts, num_drafts, targets)
    first = output[:, 0].numpy()
    assert_distribution(first, p, refs, min_n=N)
    tv_pq = tv(p, q)
    rate = float((num_accepted >= 1).double().mean())
    assert (1 - tv_pq) / (1 + tv_pq) - HOEFFDING_EPS < rate < 1 - tv_pq + HOEFFDING_EPS, (rate, tv_pq)
    if k >= 2:
        two = (num_accepted >= 1).numpy()
        second = output[:, 1].numpy()[two]
        assert_distribution(second, p, refs, min_n=10_000)
        assert_conditionally_independent(first[two], second, p)
    # the rollout is the target's choices whatever the drafts
    assert torch.equal(output, targets)


@pytest.mark.parametrize("target_params", TARGET_PARAMS, ids=repr)
def test_position_keyed_same_distribution_accepts_everything(target_params: SamplingParams) -> None:
    """q == p with shared keyed noise: the drafter proposes exactly the target's choices (rate 1.0)."""
    k, n = 4, 20_000
    keys, positions = keys_and_positions(n, k, offset=5)
    logits = TARGET_LOGITS.expand(n, k + 1, V)
    targets = sample_tokens(logits, target_params, keys, positions)
    drafts = sample_tokens(logits[:, :k], target_params, keys, positions[:, :k])
    num_accepted, _ = accept_position_keyed(drafts, torch.full((n,), k), targets)
    assert bool((num_accepted == k).all())


# ---------------------------------------------------------------- (b) classic rejection rule


def rejection_noise(keys: torch.Tensor, positions: torch.Tensor, k: int, source: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept uniforms [R, k] and recovery Gumbel noise [R, k+1, V], independent of the draft stream."""
    if source == "keyed":
        uniforms = uniform_noise(keys, positions[:, :k], 1, STREAM_ACCEPT)[..., 0]
        return uniforms, gumbel_noise(keys, positions, V, STREAM_RECOVER)
    gen = torch.Generator().manual_seed(int(keys[0]) + k)
    uniforms = torch.rand(len(keys), k, generator=gen, dtype=torch.float64).clamp_min(1e-12)
    exp = torch.empty(len(keys), k + 1, V, dtype=torch.float64).exponential_(generator=gen)
    return uniforms, -torch.log(exp)  # -log Exp(1) is standard Gumbel


def run_rejection(target_params: SamplingParams, k: int, drafter: str, source: str, offset: int,
                  ragged: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    keys, positions = keys_and_positions(N, k, offset)
    target_probs = warped_probs(TARGET_LOGITS, target_params).expand(N, k + 1, V)
    if drafter == "q":
        drafts = sample_tokens(DRAFT_LOGITS.expand(N, k, V), DRAFT_PARAMS, keys, positions[:, :k], STREAM_DRAFT)
        draft_probs = warped_probs(DRAFT_LOGITS, DRAFT_PARAMS).expand(N, k, V)
        accept_first = np.minimum(target_probs[0, 0].numpy(), draft_probs[0, 0].numpy()).sum()
    else:  # deterministic drafts (n-gram style): a fixed token per row and slot, chosen before any noise
        drafts = torch.randint(0, V, (N, k), generator=torch.Generator().manual_seed(offset + 1))
        draft_probs = None
        accept_first = float(target_probs[0, 0].numpy()[drafts[:, 0].numpy()].mean())
    num_drafts = (torch.arange(N) % (k + 1)) if ragged else torch.full((N,), k)
    uniforms, recovery = rejection_noise(keys, positions, k, source)
    num_accepted, output = accept_rejection(drafts, num_drafts, draft_probs, target_probs, uniforms, recovery)
    assert bool((num_accepted <= num_drafts).all())
    slots = torch.arange(k)[None, :] < num_accepted[:, None]
    assert torch.equal(output[:, :k][slots], drafts[slots])  # accepted drafts are emitted unchanged
    return num_accepted, output, num_drafts, np.array(accept_first)


@pytest.mark.parametrize("k, source", [(2, "keyed"), (3, "keyed"), (3, "torch")])
@pytest.mark.parametrize("drafter", ["q", "deterministic"])
@pytest.mark.parametrize("target_params", TARGET_PARAMS, ids=repr)
def test_rejection_lossless(target_params: SamplingParams, k: int, drafter: str, source: str) -> None:
    """Rejection rule, N = 100,000 rows, drafts from q (own stream) or deterministic (draft_probs=None), accept
    uniforms and recovery Gumbel noise from STREAM_ACCEPT / STREAM_RECOVER ("keyed") or a torch Generator:
    first emitted token ~ p (TV < 0.0098 at alpha 1e-6 and relative factor 5); second emitted token ~ p given
    the first, over rows that emitted >= 2 tokens (chi-square alpha 1e-6; TV bound at its count, >= 10,000);
    first-draft acceptance rate = sum min(p, q) (or mean p(draft)) within 0.01 (Hoeffding, 4e-9)."""
    p, _, refs = toy_distributions(target_params)
    offset = 1000 * k + 100 * (drafter == "q") + 10 * (source == "keyed") + TARGET_PARAMS.index(target_params)
    num_accepted, output, _, accept_first = run_rejection(target_params, k, drafter, source, offset)
    first = output[:, 0].numpy()
    assert_distribution(first, p, refs, min_n=N)
    rate = float((num_accepted >= 1).double().mean())
    assert abs(rate - accept_first) < HOEFFDING_EPS, (rate, accept_first)
    two = (num_accepted >= 1).numpy()
    second = output[:, 1].numpy()[two]
    assert_distribution(second, p, refs, min_n=10_000)
    assert_conditionally_independent(first[two], second, p)


@pytest.mark.parametrize("drafter", ["q", "deterministic"])
def test_rejection_lossless_ragged_draft_counts(drafter: str) -> None:
    """Rows with 0, 1, 2 or 3 drafts (k = 3) in one batch of N = 100,000: the first emitted token ~ p overall and
    within each draft count (25,000 rows: TV < 0.0197 at alpha 1e-6, relative factor 5); for counts >= 2 the
    second emitted token ~ p given the first (rows that emitted >= 2 tokens, chi-square alpha 1e-6)."""
    target_params = TARGET_PARAMS[2]
    p, _, refs = toy_distributions(target_params)
    num_accepted, output, num_drafts, _ = run_rejection(target_params, 3, drafter, "keyed", offset=77, ragged=True)
    first = output[:, 0].numpy()
    assert_distribution(first, p, refs, min_n=N)
    for count in range(4):
        rows = (num_drafts == count).numpy()
        assert_distribution(first[rows], p, refs, min_n=N // 4)
        if count >= 2:
            two = rows & (num_accepted >= 1).numpy()
            assert_distribution(output[:, 1].numpy()[two], p, refs, min_n=3_000)
            assert_conditionally_independent(first[two], output[:, 1].numpy()[two], p)


@pytest.mark.parametrize("target_params", TARGET_PARAMS, ids=repr)
def test_rejection_same_distribution_accepts_everything(target_params: SamplingParams) -> None:
    """q == p, drafts sampled from q with keyed noise: acceptance rate exactly 1.0."""
    k, n = 4, 20_000
    keys, positions = keys_and_positions(n, k, offset=9)
    probs = warped_probs(TARGET_LOGITS, target_params).expand(n, k + 1, V)
    drafts = sample_tokens(TARGET_LOGITS.expand(n, k, V), target_params, keys, positions[:, :k], STREAM_DRAFT)
    uniforms, recovery = rejection_noise(keys, positions, k, "keyed")
    num_accepted, output = accept_rejection(drafts, torch.full((n,), k), probs[:, :k], probs, uniforms, recovery)
    assert bool((num_accepted == k).all())
    assert torch.equal(output[:, :k], drafts)
