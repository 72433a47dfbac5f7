"""Dynamic decoupling: the per-phase choice between running the drafter workers and plain decoding."""

from __future__ import annotations

from specactor_engine.decoupled.phase import DECOUPLED, SOLO, DecouplingPolicy


def drive(policy: DecouplingPolicy, rates: dict[str, float], rounds: int, bound: float | None = None) -> list[str]:
    """Run the policy against arms that emit `rates[arm]` tokens per second (1 s rounds)."""
    arms = []
    for _ in range(rounds):
        arm = policy.choose(bound)
        policy.observe(arm, int(rates[arm]), 1.0)
        arms.append(arm)
    return arms


def letters(arms: list[str]) -> str:
    return "".join("d" if a == DECOUPLED else "s" for a in arms)


def test_decoupling_policy_explores_both_then_exploits_the_faster():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=5, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 100, SOLO: 60}, 9)) == "ss" "dd" "ddddd"
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=5, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 60, SOLO: 100}, 9)) == "ss" "dd" "sssss"


def test_decoupling_needs_the_margin_and_re_explores_when_things_change():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, margin=0.05, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 102, SOLO: 100}, 8)) == "ss" "dd" "ssss"  # 2% better is not enough
    # the tail: the batch shrank and the drafter now pays; the next exploration finds it
    assert letters(drive(policy, {DECOUPLED: 150, SOLO: 100}, 8)) == "ss" "dd" "dddd"


def test_warmup_rounds_of_an_arm_are_not_measured():
    policy = DecouplingPolicy(explore_rounds=4, exploit_rounds=4, warmup_rounds=2)
    for _ in range(4):
        policy.observe(policy.choose(), 60, 1.0)
    # decoupled is slow for its first 2 rounds (catch-up), then fast
    for seconds in (5.0, 5.0, 1.0, 1.0):
        arm = policy.choose()
        assert arm == DECOUPLED
        policy.observe(arm, 100, seconds)
    assert policy.rate(DECOUPLED) == 100.0 and policy.rate(SOLO) == 60.0
    assert policy.choose() == DECOUPLED


def test_the_exploit_period_doubles_while_the_same_arm_keeps_winning_and_resets_on_a_change():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, max_exploit_rounds=10, warmup_rounds=0)
    arms = drive(policy, {DECOUPLED: 60, SOLO: 100}, 8 + 12 + 14)
    assert letters(arms) == "ssdd" "ssss" "ssdd" "ssssssss" "ssdd" "ssssssssss"  # 4, then 8, then capped at 10
    # the drafter starts to pay: the next exploration switches arms and the period starts over at 4
    assert letters(drive(policy, {DECOUPLED: 150, SOLO: 100}, 8)) == "ssdd" "dddd"


def test_the_workers_arm_is_not_explored_when_even_its_best_case_cannot_win():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, warmup_rounds=0)
    # a compute-bound full batch: every draft accepted would still give 90 tokens/s against plain 100
    arms = drive(policy, {DECOUPLED: 80, SOLO: 100}, 2 + 4 + 2 + 8, bound=90.0)
    assert letters(arms) == "ss" "ssss" "ss" "ssssssss" and policy.skipped == 2
    # the batch shrank into the tail: the best case could win now, so the arm is measured again
    assert letters(drive(policy, {DECOUPLED: 150, SOLO: 100}, 2 + 2 + 4, bound=400.0)) == "ssdd" "dddd"
