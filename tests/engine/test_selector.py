"""Fastest-of-N selection on synthetic per-method statistics."""

from __future__ import annotations

import random

from specactor_engine.policies.selector import FastestOfNSelector


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
    selector.observe_cost("ngram", 0.001, rows=10)
    selector.observe_cost("model", 2.0, rows=10)  # 0.2 s per row
    for _ in range(20):
        selector.observe(["r"], ["ngram"], [2])
        selector.observe(["r"], ["model"], [3])
    # ngram: 3 tokens / 0.1001 s; model: 4 tokens / 0.3 s
    assert selector.choose(["r"], verify_s=0.1) == ["ngram"]
    # with free drafting the more accurate one wins
    assert FastestOfNSelector(["ngram", "model"], explore=0.0, arms=selector.arms).choose(["r"], 0.1) == ["model"]


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
