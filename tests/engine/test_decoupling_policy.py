"""Dynamic decoupling: the per-phase choice between running the drafter workers and plain decoding."""

from __future__ import annotations

from specactor_engine.decoupled.phase import DECOUPLED, SOLO, DecouplingPolicy


def drive(policy: DecouplingPolicy, rates: dict[str, float], rounds: int) -> list[str]:
    """Run the policy against arms that emit `rates[arm]` tokens per second (1 s rounds)."""
    arms = []
    for _ in range(rounds):
        arm = policy.choose()
        policy.observe(arm, int(rates[arm]), 1.0)
        arms.append(arm)
    return arms


def test_decoupling_policy_explores_both_then_exploits_the_faster():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=5, warmup_rounds=0)
    arms = drive(policy, {DECOUPLED: 100, SOLO: 60}, 9)
    assert arms == [DECOUPLED] * 2 + [SOLO] * 2 + [DECOUPLED] * 5
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=5, warmup_rounds=0)
    assert drive(policy, {DECOUPLED: 60, SOLO: 100}, 9)[4:] == [SOLO] * 5


def test_decoupling_needs_the_margin_and_re_explores_when_things_change():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, margin=0.05, warmup_rounds=0)
    assert drive(policy, {DECOUPLED: 102, SOLO: 100}, 8)[4:] == [SOLO] * 4  # 2% better is not enough
    # the tail: the batch shrank and the drafter now pays; the next exploration finds it
    arms = drive(policy, {DECOUPLED: 150, SOLO: 100}, 8)
    assert arms == [DECOUPLED] * 2 + [SOLO] * 2 + [DECOUPLED] * 4


def test_warmup_rounds_of_an_arm_are_not_measured():
    policy = DecouplingPolicy(explore_rounds=4, exploit_rounds=4, warmup_rounds=2)
    # decoupled is slow for its first 2 rounds (catch-up), then fast
    seconds = iter([5.0, 5.0, 1.0, 1.0])
    for _ in range(4):
        arm = policy.choose()
        policy.observe(arm, 100, next(seconds))
    assert policy.rate(DECOUPLED) == 100.0
    for _ in range(4):
        arm = policy.choose()
        policy.observe(arm, 60, 1.0)
    assert policy.choose() == DECOUPLED


def test_the_exploit_period_doubles_while_the_same_arm_keeps_winning_and_resets_on_a_change():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, max_exploit_rounds=10, warmup_rounds=0)
    arms = drive(policy, {DECOUPLED: 60, SOLO: 100}, 4 + 4 + 4 + 8 + 4 + 10)
    exploits = "".join("d" if a == DECOUPLED else "s" for a in arms)
    assert exploits == "dd" "ss" "ssss" "dd" "ss" "ssssssss" "dd" "ss" "ssssssssss"  # 4, then 8, then capped at 10
    # the drafter starts to pay: the next exploration switches arms and the period starts over at 4
    arms = drive(policy, {DECOUPLED: 150, SOLO: 100}, 4 + 4)
    assert arms == [DECOUPLED] * 2 + [SOLO] * 2 + [DECOUPLED] * 4
