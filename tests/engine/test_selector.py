"""Fastest-of-N selection on synthetic per-method statistics."""

from __future__ import annotations

import random

import pytest

from specactor_engine.policies.selector import FastestOfNSelector
from specactor_engine.policies.verify_length import AcceptanceStats, CostTable, VerifyLengthPolicy


def simulate(selector: FastestOfNSelector, accept_means: dict[str, float], rounds: int, rng: random.Random,
             request: str = "r") -> list[str]:
    """Each round the row drafts with the chosen method; accepted ~ mean +- 1 (clipped at 0)."""
    chosen = []
    for _ in range(rounds):
        method = selector.choose([request], verify_s=0.1)[0]
        got = max(0, round(accept_means[method] + rng.uniform(-1, 1)))
        selector.observe([request], [method], [got])
        chosen.append(method)
    return chosen


def test_converges_to_the_best_method():
    rng = random.Random(0)
    selector = FastestOfNSelector(["ngram", "suffix", "model"])
    chosen = simulate(selector, {"ngram": 0.5, "suffix": 3.0, "model": 1.5}, 200, rng)
    assert chosen[-50:].count("suffix") >= 45
    assert set(chosen[:10]) >= {"ngram", "model"}  # the others were explored early


def test_switches_when_the_best_method_changes_mid_rollout():
    rng = random.Random(1)
    selector = FastestOfNSelector(["ngram", "suffix"])
    simulate(selector, {"ngram": 0.3, "suffix": 3.0}, 100, rng)
    after = simulate(selector, {"ngram": 3.0, "suffix": 0.3}, 100, rng)  # e.g. the text turned repetitive
    assert after[-50:].count("ngram") >= 45
    assert after.index("ngram") < 30  # noticed within a few dozen rounds


def test_cost_trades_off_against_acceptance():
    """A method accepting a bit more but costing far more per draft loses."""
    selector = FastestOfNSelector(["ngram", "model"], explore=0.0)
    for _ in range(2):  # the first call of each is its warm-up (left out)
        selector.observe_cost("ngram", 0.001, rows=10)
        selector.observe_cost("model", 2.0, rows=10)  # 0.2 s per row
    for _ in range(20):
        selector.observe(["r"], ["ngram"], [2])
        selector.observe(["r"], ["model"], [3])
    # ngram: 3 tokens / 0.1001 s; model: 4 tokens / 0.3 s
    assert selector.choose(["r"], verify_s=0.1) == ["ngram"]
    # with free drafting the more accurate one wins
    assert FastestOfNSelector(["ngram", "model"], explore=0.0, arms=selector.arms).choose(["r"], 0.1) == ["model"]


def test_shadow_outcomes_count_only_as_deep_as_rounds_verify():
    """At one draft a row a verified draft brings at most 1 token. A method scored by shadow drafts at their full
    cap (2 of 4 accepted) must not outrank one verified at k = 1 whose drafts are accepted more often (session 39,
    trace D: n-gram shadows at 1.02 tokens a draft took rows from the feature drafter, accepted 0.78 of the time)."""
    def run(depth: int | None) -> str:
        selector = FastestOfNSelector(["feature", "ngram"], explore=0.0)
        for _ in range(30):
            selector.observe(["r"], ["feature"], [1])  # verified at k = 1, accepted
            selector.observe(["r"], ["ngram"], [0], depth=depth)  # shadows: one rejected at once ...
            selector.observe(["r"], ["ngram"], [2], depth=depth)  # ... one with 2 of its 4 tokens accepted
        return selector.choose(["r"], verify_s=0.1)[0]

    assert run(depth=None) == "ngram"  # credited at full depth its EMA (~1.18) passes the feature drafter's 1.0
    assert run(depth=1) == "feature"  # credited at the verify length: ~0.59


def test_choices_are_per_request_and_forgotten_when_done():
    selector = FastestOfNSelector(["a", "b"], explore=0.0)
    for _ in range(10):
        selector.observe(["x", "y"], ["a", "b"], [3, 3])
        selector.observe(["x", "y"], ["b", "a"], [0, 0])
    assert selector.choose(["x", "y"], 0.1) == ["a", "b"]
    selector.forget(["x"])
    assert all(key[0] != "x" for key in selector.arms)


def test_chooses_only_among_the_methods_available_this_round():
    """specactor mode: while the drafter workers are paused their method is not on offer."""
    rng = random.Random(1)
    selector = FastestOfNSelector(["decoupled", "suffix", "ngram"])
    simulate(selector, {"decoupled": 3.0, "suffix": 1.0, "ngram": 0.2}, 60, rng)
    assert selector.choose(["r"], 0.1) == ["decoupled"]
    assert selector.choose(["r"], 0.1, methods=["suffix", "ngram"]) == ["suffix"]


# Measured on Qwen2.5-Coder-1.5B (target) and 0.5B (draft model), bf16, 2 cores (issue 24's profile): a verify round
# at 4 rows costs 70 ms at width 1 and 125 ms at width 5 (memory-bound: under the ~10-token compute ridge); at 32
# rows the forward is compute-bound and cost grows with width. A 0.5B draft step costs 32 ms at 4 rows and ~100 ms
# at 32; the 0.5B accepts ~4 of 4 drafts; the suffix drafter ~0.3 at ~0.2 ms per row.
PROFILE = CostTable(batch_sizes=(4, 32), widths=(1, 2, 3, 4, 5),
                    seconds=((0.070, 0.084, 0.098, 0.111, 0.125), (0.27, 0.45, 0.63, 0.82, 1.00)))
DRAFT_STEP_S = {4: 0.032, 32: 0.100}


def _policy(draft_step_s: float) -> VerifyLengthPolicy:
    """The verify-length policy after rounds in which the draft model's 4 drafts were all accepted."""
    policy = VerifyLengthPolicy(PROFILE, AcceptanceStats(max_k=4), probe_every=0)
    for _ in range(60):
        policy.stats.observe([4] * 4, [4] * 4)
    policy.draft_s_per_token = draft_step_s
    return policy


def _selector(rows: int) -> FastestOfNSelector:
    """Fastest-of-N after a few rounds of each method on one request, with the measured drafting costs."""
    selector = FastestOfNSelector(["model", "suffix", "ngram"])
    for round_index in range(12):
        selector.observe(["r"] * 3, ["model", "suffix", "ngram"], [4, int(round_index % 3 == 0), 0])
        selector.observe_cost("model", 4 * DRAFT_STEP_S[rows], rows)  # k = 4 steps for every row at once
        selector.observe_cost("suffix", 0.0002 * rows, rows)
        selector.observe_cost("ngram", 0.0001 * rows, rows)
    return selector


def test_the_draft_model_is_chosen_where_it_pays_and_plain_decoding_where_it_does_not():
    """Per-worker regime (4 rows): the draft model's drafts are worth their cost, so it wins the request over
    the cheap but rarely right model-free methods, and the round verifies drafts. Far past the ridge (32
    rows): the same all-accepted drafts do not pay for the drafting they cost, so the round decodes plainly
    (k = 0), though free drafts of that quality would still be verified (the drafting cost decides it)."""
    verify_row_s = PROFILE.cost(4, 5) / 4  # a row's share of a round
    assert _selector(4).choose(["r"], verify_row_s) == ["model"]
    assert _policy(DRAFT_STEP_S[4]).choose(4) > 0

    assert _policy(DRAFT_STEP_S[32]).choose(32) == 0
    assert _policy(0.0).choose(32) > 0  # the premise: with free drafting the same drafts would be verified


def test_a_method_s_first_drafting_call_is_its_warm_up():
    """The first call compiles and allocates (seconds where later calls take milliseconds): were it counted,
    the method would never be chosen again, so never measured again."""
    selector = FastestOfNSelector(["model", "suffix"], explore=0.0)
    selector.observe_cost("model", 30.0, rows=4)  # the first call compiled a sampling kernel
    assert "model" not in selector.cost
    selector.observe_cost("model", 0.4, rows=4)
    assert selector.cost["model"] == pytest.approx(0.1)
