"""The dynamic verify-length policy on synthetic cost tables and acceptance statistics."""

from __future__ import annotations

import pytest

from specactor_engine.policies.verify_length import AcceptanceStats, CostProfile, CostTable, VerifyLengthPolicy

BATCHES = (1, 8, 32)
WIDTHS = (1, 2, 3, 4, 5)


def linear_table(fixed: float, per_token: float, context: int = 0) -> CostTable:
    """seconds = fixed + per_token x rows x width: a memory-bound floor plus compute per token."""
    return CostTable(BATCHES, WIDTHS, tuple(tuple(fixed + per_token * b * w for w in WIDTHS) for b in BATCHES),
                     context)


def policy_with(table: CostTable, accept_through: list[float], **kwargs) -> VerifyLengthPolicy:
    return VerifyLengthPolicy(table, AcceptanceStats(max_k=4, accept_through=list(accept_through)), probe_every=0,
                              **kwargs)


def analytic_best(table: CostTable | CostProfile, accept_through: list[float], rows: int,
                  context: int | None = None) -> int:
    """Brute force over k of rows x E[k] / cost, E[k] = 1 + sum of the (non-increasing) chain."""
    def rate(k: int) -> float:
        chain, expected = 1.0, 1.0
        for q in accept_through[:k]:
            chain = min(chain, q)
            expected += chain
        return rows * expected / table.cost(rows, k + 1, context)

    return max(range(5), key=rate)


def test_cost_table_interpolates_linearly_in_rows():
    table = linear_table(0.3, 0.01)
    assert table.cost(8, 3) == pytest.approx(0.3 + 0.01 * 8 * 3)
    assert table.cost(20, 2) == pytest.approx(0.3 + 0.01 * 20 * 2)  # between measured sizes
    assert table.cost(64, 5) == pytest.approx(0.3 + 0.01 * 64 * 5)  # beyond the last: extrapolated
    with pytest.raises(ValueError):
        CostTable((8, 1), WIDTHS, ((1.0,) * 5,) * 2)


def test_cost_profile_interpolates_linearly_in_context():
    short, long = linear_table(0.1, 0.01, context=128), linear_table(0.2, 0.03, context=512)
    profile = CostProfile((short, long))
    assert profile.cost(8, 3, 128) == pytest.approx(short.cost(8, 3))
    assert profile.cost(8, 3, 512) == pytest.approx(long.cost(8, 3))
    assert profile.cost(8, 3, 320) == pytest.approx((short.cost(8, 3) + long.cost(8, 3)) / 2)  # halfway
    assert profile.cost(8, 3, 896) == pytest.approx(2 * long.cost(8, 3) - short.cost(8, 3))  # extrapolated
    assert profile.cost(8, 3, 16) == pytest.approx(short.cost(8, 3))  # below the shortest: its cost
    assert profile.max_context == 512 and profile.batch_sizes == BATCHES
    assert CostProfile.from_dict(profile.to_dict()) == profile
    assert CostProfile.from_dict(short.to_dict()) == CostProfile((short,))  # a single-table cache file
    with pytest.raises(ValueError, match="ascending"):
        CostProfile((long, short))
    with pytest.raises(ValueError, match="same batch sizes"):
        CostProfile((short, CostTable((1, 8), WIDTHS, ((1.0,) * 5,) * 2, 512)))


def test_policy_follows_the_batch_context():
    """Long contexts make every verified token dearer (attention): the best length comes down."""
    profile = CostProfile((linear_table(0.3, 0.001, context=128), linear_table(0.3, 0.05, context=2048)))
    accept = [0.7, 0.5, 0.35, 0.25]
    short, long = analytic_best(profile, accept, 32, 128), analytic_best(profile, accept, 32, 2048)
    assert short > long
    assert policy_with(profile, accept).choose(32, 128) == short
    assert policy_with(profile, accept).choose(32, 2048) == long


@pytest.mark.parametrize(("fixed", "per_token", "accept", "rows"), [
    (0.3, 0.001, [0.9, 0.8, 0.7, 0.6], 1),     # memory-bound, good drafts: deep
    (0.3, 0.02, [0.9, 0.8, 0.7, 0.6], 32),     # compute-bound at a big batch: shallower
    (0.3, 0.02, [0.1, 0.02, 0.0, 0.0], 32),    # drafts rarely accepted: plain decoding
    (0.05, 0.004, [0.6, 0.35, 0.2, 0.1], 8),   # in between
])
def test_picks_the_analytically_best_length(fixed, per_token, accept, rows):
    table = linear_table(fixed, per_token)
    policy = policy_with(table, accept)
    expected = analytic_best(table, accept, rows)
    assert policy.choose(rows) == expected


def test_the_extremes_are_reachable():
    """Deep drafts when verify is memory-bound, plain decoding when drafts are useless."""
    assert policy_with(linear_table(0.3, 0.001), [0.9, 0.8, 0.7, 0.6]).choose(1) == 4
    assert policy_with(linear_table(0.3, 0.02), [0.1, 0.02, 0.0, 0.0]).choose(32) == 0


def test_switches_only_past_the_hysteresis():
    table = linear_table(0.3, 0.02)
    policy = policy_with(table, [0.9, 0.8, 0.7, 0.6], hysteresis=0.05)
    start = policy.choose(32)
    # make another length better by less than 5%: no switch
    other = 0
    gap = policy.throughput(32, start) / policy.throughput(32, other)
    assert gap > 1.05
    policy.stats.accept_through = [0.02, 0.0, 0.0, 0.0]
    assert policy.best(32) == 0
    assert policy.throughput(32, 0) > 1.05 * policy.throughput(32, start)
    assert policy.choose(32) == 0  # clearly better: switches

    close = policy_with(table, [0.5, 0.3, 0.1, 0.0], hysteresis=0.05)
    close.current = 1
    best = close.best(32)
    margin = close.throughput(32, best) / close.throughput(32, 1)
    if best != 1:
        assert margin > 1.0
    # raise the hysteresis above the margin: the policy keeps its length
    sticky = policy_with(table, [0.5, 0.3, 0.1, 0.0], hysteresis=margin - 1 + 0.01)
    sticky.current = 1
    assert sticky.choose(32) == 1
    eager = policy_with(table, [0.5, 0.3, 0.1, 0.0], hysteresis=max(margin - 1 - 0.01, 0.0))
    eager.current = 1
    assert eager.choose(32) == best


def test_probes_max_k_while_plain_decoding_backing_off_while_nothing_changes():
    # the interval alone binds: no probe budget, and the probe gate at the all-accepted ceiling (its own test)
    policy = VerifyLengthPolicy(linear_table(0.3, 0.02), AcceptanceStats(max_k=4, accept_through=[0.0] * 4),
                                probe_every=4, max_probe_every=16, probe_budget=1.0, probe_optimism=1.0)
    chosen = [policy.choose(32) for _ in range(60)]
    probes = [i + 1 for i, k in enumerate(chosen) if k == 4]
    assert set(chosen) == {0, 4}
    assert probes == [4, 12, 28, 44, 60]  # intervals 4, 8, 16, then capped at 16


def test_a_probe_that_changes_the_choice_resets_the_interval():
    policy = VerifyLengthPolicy(linear_table(0.3, 0.001), AcceptanceStats(max_k=4, accept_through=[0.0] * 4),
                                probe_every=4, hysteresis=0.0, cheap_probe_every=0)  # the regular probes alone
    chosen = [policy.choose(1) for _ in range(12)]  # probes at rounds 4 and 12
    assert chosen[3] == 4 and chosen[11] == 4 and chosen.count(4) == 2
    policy.stats.accept_through = [0.9, 0.8, 0.7, 0.6]  # what the probe saw: drafts are good now
    assert policy.choose(1) == 4 and policy.current == 4
    policy.stats.accept_through = [0.0] * 4
    after = [policy.choose(1) for _ in range(4)]
    assert after == [0, 0, 0, 4]  # back to the first interval


def test_acceptance_stats_fold_supply_into_acceptance():
    stats = AcceptanceStats(max_k=3, decay=1.0)  # newest round only
    # rows verified with 3 drafts each; accepted 3, 1, 0, 2 of them
    stats.observe([3, 3, 3, 3], [3, 1, 0, 2])
    assert stats.accept_through == pytest.approx([0.75, 0.5, 0.25])
    assert stats.expected_tokens(3) == pytest.approx(1 + 0.75 + 0.5 + 0.25)
    # a row verified with only 1 draft says nothing about positions 2 and 3
    stats.observe([1], [1])
    assert stats.accept_through == pytest.approx([1.0, 0.5, 0.25])


def test_a_regime_with_its_own_profile_is_priced_and_calibrated_by_it():
    """The drafter workers' arm runs the verifier on fewer threads than plain decoding: priced by the profile
    measured on them, and its rounds calibrated against that profile, not the other's."""
    full, fewer = linear_table(0.1, 0.01), linear_table(0.2, 0.04)  # width 3 at 2 rows: 0.16 vs 0.44 s
    policy = policy_with(full, [0.5, 0.3, 0.1, 0.05], decay=1.0)
    policy.regime_costs = {"decoupled": fewer}
    assert policy.verify_seconds(2, 2, regime="decoupled") == pytest.approx(0.44)
    assert policy.verify_seconds(2, 2, regime="solo") == pytest.approx(0.16)  # no profile of its own: `cost`
    policy.observe_round(2, [2, 2], [1, 0], draft_s=0.0, round_s=0.44, rows=2, regime="decoupled")
    assert policy.calibration(3, regime="decoupled", rows=2) == pytest.approx(1.0)  # as its own profile said
    policy.observe_round(2, [2, 2], [1, 0], draft_s=0.0, round_s=0.32, rows=2, regime="solo")
    assert policy.calibration(3, regime="solo", rows=2) == pytest.approx(2.0)


def test_drafting_cost_leaves_out_the_first_round_and_catch_ups():
    """Trace D's `coupled-cheap` (session 40): its first drafting round, the benchmark's warm-up, paid the 0.5B's
    deferred prefill and its one-time costs; taken as the steady cost of a draft position (0.29 s against a ~56 ms
    plain step) it kept every later round plain. The first round is left out, and a catch-up is charged apart."""
    policy = policy_with(linear_table(0.1, 0.0), [0.9, 0.8, 0.7, 0.6], decay=1.0)
    policy.observe_round(1, [1, 1], [1, 1], draft_s=5.7, round_s=5.9, rows=2)
    assert policy.draft_s_per_token == 0.0 and policy.best(2) > 0
    policy.observe_round(1, [1, 1], [1, 1], draft_s=0.52, round_s=0.7, rows=2, catch_up_s=0.5)
    assert policy.draft_s_per_token == pytest.approx(0.02)
    assert policy.best(2) > 0


def test_calibration_and_draft_cost_are_learned_from_rounds():
    policy = policy_with(linear_table(0.1, 0.0), [0.5, 0.3, 0.1, 0.05], decay=1.0)
    assert policy.best(2) == 4  # free drafts, flat verify cost: as deep as possible
    policy.observe_round(2, [2, 2], [1, 0], draft_s=9.0, round_s=9.3, rows=2)  # the first: one-time costs, left out
    assert policy.draft_s_per_token == 0.0
    policy.observe_round(2, [2, 2], [1, 0], draft_s=0.2, round_s=0.5, rows=2)
    assert policy.draft_s_per_token == pytest.approx(0.1)
    assert policy.calibration(3, rows=2) == pytest.approx((0.5 - 0.2) / 0.1)  # observed width 3: 3x the profile
    assert policy.calibration(5, rows=2) == pytest.approx(3.0)  # unobserved widths borrow the nearest observed one
    assert policy.calibration(3, regime="other", rows=2) == 1.0  # another thread arrangement: nothing observed yet
    assert policy.calibration(1, rows=32) == pytest.approx(3.0)  # another batch bucket borrows until it is observed
    policy.stats.accept_through = [0.5, 0.3, 0.1, 0.05]
    # each draft costs a third of the (calibrated) verify: E[1]/0.4 = 3.75 beats E[2]/0.5 = 3.6 and E[0]/0.3
    assert policy.best(2) == 1


def test_a_width_not_run_for_a_while_follows_the_widths_observed_since():
    """Trace D: width 3 (k = 2) was observed once, early, at 0.745x the profile while widths 4 and 5 ran at
    0.55-0.57x for the rest of the run, so k = 2 looked a third dearer than it was. A width's own factor stands
    while it is fresh; once stale it moves toward what is observed at other widths, nearer widths faster."""
    policy = policy_with(linear_table(0.1, 0.0), [0.5, 0.3, 0.1, 0.05], decay=0.2)
    table = policy.cost

    def run(k: int, factor: float) -> None:
        policy.history.append(k)  # what `choose` records
        policy.observe_round(k, [k, k], [0, 0], draft_s=0.0, round_s=factor * table.cost(2, k + 1), rows=2)

    run(2, 0.745)  # width 3, once
    run(0, 0.56)   # width 1, once
    for _ in range(policy.stale_rounds - 2):  # width 4 only: the others are still fresh enough to keep their own
        run(3, 0.56)
    assert policy.calibration(3, rows=2) == pytest.approx(0.745)
    assert policy.calibration(1, rows=2) == pytest.approx(0.56)
    for _ in range(30):
        run(3, 0.56)
    assert policy.calibration(3, rows=2) == pytest.approx(0.56, abs=0.01)  # stale: it followed width 4
    assert policy.calibration(4, rows=2) == pytest.approx(0.56)
    policy.scale[("", 1, 1)] = 1.0  # a far width moves slower: 0.2 x 0.5^3 a round instead of 0.2 x 0.5
    policy.scale[("", 1, 3)] = 1.0  # (2 rows: the profile's 1-row bucket)
    run(3, 0.56)
    assert 1.0 - policy.calibration(3, rows=2) == pytest.approx(0.1 * 0.44)
    assert 1.0 - policy.calibration(1, rows=2) == pytest.approx(0.025 * 0.44)
    run(2, 0.9)  # running again, its own rounds rule it
    assert policy.calibration(3, rows=2) == pytest.approx(0.956 + 0.2 * (0.9 - 0.956))
    assert policy.calibration(3, regime="other", rows=2) == 1.0  # other regimes and buckets are left alone


def test_a_width_not_observed_is_read_off_the_line_through_the_observed_widths_seconds():
    """Session 50, trace D: a round's time over the profile is part fixed (plain 4-row rounds ran at ~1.7x the
    profile, k = 3-4 at ~1.0x). k = 2, never observed, borrowed k = 1's factor, was rated below k = 1 and k = 3,
    and never ran. Here rounds cost the profile plus a fixed 0.05 s: from widths 2 and 4 alone the policy prices
    widths 1, 3 and 5 as they are, and picks the length that is best under the true cost."""
    profile, true_cost = linear_table(0.0, 0.01), linear_table(0.05, 0.01)  # 8 rows: 0.08 w vs 0.05 + 0.08 w
    accept = [0.9, 0.8, 0.5, 0.2]
    policy = policy_with(profile, accept, decay=1.0)
    for k in (1, 3):
        policy.observe_round(k, [k] * 8, [0] * 8, draft_s=0.0, round_s=true_cost.cost(8, k + 1), rows=8)
    for width in WIDTHS:
        assert policy.calibration(width, rows=8) == pytest.approx(true_cost.cost(8, width) / profile.cost(8, width))
    policy.stats.accept_through = list(accept)
    # borrowing width 2's factor for width 1 made plain rounds 0.105 s instead of 0.13 and chose k = 0
    assert policy.best(8) == analytic_best(true_cost, accept, 8) == 2


def test_the_line_s_proportional_part_is_at_most_the_smallest_observed_factor():
    """Two nearby widths met in a slow spell (plain rounds at 1.7x the profile, k = 1 at 2.2x) draw a line that
    would put width 5 at 2.5x its profile; a round's excess is a fixed part that is not negative plus a proportional
    part, so the proportional part is at most 1.7: width 5 at 1.8x."""
    profile = linear_table(0.0, 0.01)  # 8 rows: 0.08 s a width
    policy = policy_with(profile, [0.9, 0.8, 0.5, 0.2], decay=1.0)
    for k, factor in ((0, 1.7), (1, 2.2)):
        policy.observe_round(k, [k] * 8, [0] * 8, draft_s=0.0, round_s=factor * profile.cost(8, k + 1), rows=8)
    fixed = (1.7 * 0.08 + 2.2 * 0.16) / 2 - 1.7 * 0.12  # the line of slope 1.7 through the points' mean
    assert policy.calibration(5, rows=8) == pytest.approx((fixed + 1.7 * 0.4) / 0.4)
    assert policy.calibration(5, rows=8) < 2.0  # unclamped: slope 2.7, 1.0 s at width 5, 2.5x


def test_a_stale_plain_width_follows_the_line_not_the_wider_widths_factor():
    """Pulled toward the factor of the widths observed since, a plain width's fixed share was lost: trace D,
    sessions 49-50, plain decoding was expected at 40-47 tokens/s where its rounds ran at 32-33."""
    profile, true_cost = linear_table(0.0, 0.01), linear_table(0.05, 0.01)
    policy = policy_with(profile, [0.9, 0.8, 0.5, 0.2], decay=0.2)

    def run(k: int) -> None:
        policy.history.append(k)  # what `choose` records
        policy.observe_round(k, [k] * 8, [0] * 8, draft_s=0.0, round_s=true_cost.cost(8, k + 1), rows=8)

    run(0)
    for round_index in range(3 * policy.stale_rounds):
        run(1 if round_index % 2 else 3)
    assert policy.calibration(1, rows=8) == pytest.approx(0.13 / 0.08)  # where its own rounds put it
    assert policy.calibration(2, rows=8) == pytest.approx(0.21 / 0.16)
    assert policy.calibration(4, rows=8) == pytest.approx(0.37 / 0.32)
    policy.scale[("", 8, 1)] = 1.0  # a stray plain round: the line pulls it back, nearer widths' rounds faster
    run(1)
    assert policy.calibration(1, rows=8) == pytest.approx(1.0 + 0.2 * 0.5 * (1.625 - 1.0))


@pytest.mark.parametrize("trimmed_rows", [0, 8])
def test_trimmed_wide_widths_follow_the_narrow_widths_drift_not_their_line(trimmed_rows):
    """Draft trimming verifies only the drafts that pay, so wide rounds run far below the profile's line through the
    narrow, untrimmed widths. Trace D, session 58: after a slow spell one `specactor` run decoded at k = 1 for 193
    rounds, and widths 4-5 (last run at ~0.6 of the profile) were pulled to the line through widths 1-2 (~1.1),
    which kept deeper drafts looking dear. Where the engine trims (`trimmed_rows`), a stale width wider than every
    fresh one follows the widest fresh width's drift instead (the machine's state moves every width), so its ratio
    to it stands; narrower stale widths still follow the line, and untrimmed batches are unchanged."""
    profile = linear_table(0.05, 0.02)  # 8 rows: 0.05 + 0.16 x width
    accept = [0.9, 0.7, 0.5, 0.3]  # E[k] 1.9, 2.6, 3.1, 3.4
    policy = policy_with(profile, accept, decay=0.2, trimmed_rows=trimmed_rows)

    def run(k: int, factor: float) -> None:
        policy.history.append(k)  # what `choose` records
        policy.observe_round(k, [k] * 8, [0] * 8, draft_s=0.0, round_s=factor * profile.cost(8, k + 1), rows=8)

    for _ in range(10):  # every width observed: plain and k = 1 at the profile, trimmed k = 3-4 at 0.6 of it
        for k, factor in ((0, 1.0), (1, 1.0), (3, 0.6), (4, 0.6)):
            run(k, factor)
    for _ in range(2 * policy.stale_rounds):  # then k = 1 alone: widths 4-5 go stale
        run(1, 1.0)
    policy.stats.accept_through = list(accept)
    if trimmed_rows:
        assert policy.calibration(5, rows=8) == pytest.approx(0.6, abs=1e-3)
        assert policy.calibration(4, rows=8) == pytest.approx(0.6, abs=0.01)  # one round behind width 5
    for _ in range(3 * policy.stale_rounds):  # a slow spell: k = 1 rounds at 1.1x
        run(1, 1.1)
    policy.stats.accept_through = list(accept)
    if trimmed_rows:
        assert policy.calibration(5, rows=8) == pytest.approx(0.6 * 1.1, abs=1e-3)  # width 2's drift
        assert policy.calibration(4, rows=8) == pytest.approx(0.6 * 1.1, abs=0.01)
        assert policy.best(8) == 3  # 8 x 3.1 tokens / (0.69 s x 0.66) against 8 x 1.9 / (0.37 s x 1.1) at k = 1
        for _ in range(3 * policy.stale_rounds):  # and back, below where it started
            run(1, 0.9)
        assert policy.calibration(5, rows=8) == pytest.approx(0.6 * 0.9, abs=1e-3)
    else:
        assert policy.calibration(5, rows=8) > 1.0  # pulled to the narrow widths' line
        assert policy.best(8) == 1
    assert policy.calibration(1, rows=8) == pytest.approx(1.1 if not trimmed_rows else 0.9, abs=0.02)  # the line


def test_per_width_calibration_undoes_a_profile_that_overestimates_plain_rounds():
    """A profile that says plain rounds cost 0.5 s when they take 0.3 s, but gets wider rounds right,
    made wider rounds look relatively cheap; once both widths are observed the policy decodes plainly."""
    true_cost = linear_table(0.0, 0.01)  # compute-bound: 0.32 s for 32 rows x width 1, 0.64 s at width 2
    skewed = CostTable(BATCHES, WIDTHS, tuple(tuple(c * (5 / 3 if w == 1 else 1.0) for w, c in zip(WIDTHS, row))
                                              for row in true_cost.seconds))
    policy = policy_with(skewed, [0.7, 0.5, 0.3, 0.1], decay=1.0)
    assert policy.best(32) > 0  # misled: 32 x 1.7 / 0.64 beats 32 / 0.53
    for k in (0, 1, 2, 3, 4):  # one observed round at every width, at the true cost
        policy.observe_round(k, [k] * 32, [0] * 32, draft_s=0.0, round_s=true_cost.cost(32, k + 1), rows=32)
    policy.stats.accept_through = [0.7, 0.5, 0.3, 0.1]
    assert policy.best(32) == analytic_best(true_cost, [0.7, 0.5, 0.3, 0.1], 32) == 0



def test_while_speculating_it_probes_plain_decoding_and_the_calibration_then_corrects_a_misleading_profile():
    true_cost = linear_table(0.0, 0.01)
    skewed = CostTable(BATCHES, WIDTHS, tuple(tuple(c * (5 / 3 if w == 1 else 1.0) for w, c in zip(WIDTHS, row))
                                              for row in true_cost.seconds))
    accept = [0.7, 0.5, 0.3, 0.1]
    policy = VerifyLengthPolicy(skewed, AcceptanceStats(max_k=4, accept_through=list(accept)), probe_every=4,
                                decay=1.0, cheap_probe_every=0)  # the regular probes alone
    chosen = []
    for _ in range(12):
        k = policy.choose(32)
        chosen.append(k)
        policy.observe_round(k, [k] * 32, [0] * 32, draft_s=0.0, round_s=true_cost.cost(32, k + 1), rows=32)
        policy.stats.accept_through = list(accept)  # acceptance held fixed: only the cost is learned
    first = chosen[0]
    assert first > 0  # misled by the profile
    assert chosen[:4] == [first, first, first, 0]  # the first probe runs plain decoding, never seen yet
    # its true cost, once seen, wins (analytically best: 0); a deep probe at 32 rows would cost 4 rounds more than a
    # plain one, so it waits until that is 5% of the rounds since (`_length_probe_rounds`: 80 rounds)
    assert chosen[4:] == [0] * 8
    assert analytic_best(true_cost, accept, 32) == 0


def test_a_length_probe_waits_until_what_it_costs_beyond_a_round_is_a_small_share_of_the_time():
    """Trace A on the AMD EPYC (session 28): k = 4 at 32 rows took 1.1-1.8 s against 0.31 s for a plain round, and
    the regular probes (every 16 rounds, doubling) ran 4-7 of them a run: `specactor` and `coupled-feature` 6% behind
    `ar`. A probe is due once its cost beyond a round is within `probe_budget` (5%) of the seconds since the last;
    where widths are cheap the interval is `probe_every` as before."""
    def probes(table: CostTable, rounds: int) -> list[int]:
        # the probe gate at the all-accepted ceiling: the budget is the subject here
        policy = VerifyLengthPolicy(table, AcceptanceStats(max_k=4, accept_through=[0.1, 0.0, 0.0, 0.0]),
                                    probe_every=16, cheap_probe_every=0, decay=1.0, probe_optimism=1.0)
        history = []
        for _ in range(rounds):
            k = policy.choose(32)
            history.append(k)
            policy.observe_round(k, [k] * 32, [0] * 32, draft_s=0.0, round_s=table.cost(32, k + 1), rows=32)
            policy.stats.accept_through = [0.1, 0.0, 0.0, 0.0]
        return [(i, k) for i, k in enumerate(history) if k != history[1]]  # rounds off the length in force

    dear = linear_table(0.0, 0.01)  # 32 rows: plain decoding in force; k = 4 costs 4 rounds more: 80 rounds at 5%
    assert probes(dear, 200) == [(79, 4), (159, 4)]
    cheap = linear_table(0.3, 0.0001)  # k = 1 in force, width 5 costs 1.04x width 1: probes of 0 and 4 alternate
    assert probes(cheap, 120) == [(15, 0), (47, 4), (111, 0)]  # 16 rounds, then doubling


def test_a_probe_runs_only_where_what_it_could_reveal_may_pay():
    """Trace A on the AMD EPYC (session 29): at 32 rows the feature drafter's best estimate was 0.82x plain decoding's,
    and a run still paid two k = 4 probes (2.0-2.2 s each against 0.31 s for a plain round), one of the first
    assignment and one of the length. A probe runs only where some length it covers beats the length in force once
    each position's conditional acceptance is raised `probe_optimism` (0.5) of the way to 1: here 0.6 -> 0.8, which at
    32 rows is still below plain decoding (1.8 tokens a row for twice a plain round's seconds), at 4 rows above."""
    table = linear_table(0.02, 0.01)  # compute-bound: at 32 rows width 2 costs 1.94x width 1, at 4 rows 1.7x
    accept = [0.6, 0.36, 0.216, 0.1296]  # conditional 0.6 at every position

    def length_probes(rows: int, **kwargs) -> list[int]:
        policy = VerifyLengthPolicy(table, AcceptanceStats(max_k=4, accept_through=list(accept)), probe_every=4,
                                    probe_budget=1.0, cheap_probe_every=0, **kwargs)
        return [i for i, k in enumerate(policy.choose(rows) for _ in range(40)) if k > 0]

    assert length_probes(32) == []
    assert length_probes(32, probe_optimism=1.0) != []  # all accepted, k = 1 would beat plain: the gate lets it run
    assert len(length_probes(4)) >= 3  # plain in force at 4 rows too, but 0.8 a position would pay there

    def first_option_probes(rows: int) -> list[int]:
        feature, ngram = ["feature"] * rows, ["ngram"] * rows
        policy = VerifyLengthPolicy(table, AcceptanceStats(max_k=4), probe_every=4, probe_budget=1.0,
                                    cheap_probe_every=0)
        policy.by_method["feature"] = AcceptanceStats(max_k=4, accept_through=list(accept), observed=[20] * 4)
        policy.by_method["ngram"] = AcceptanceStats(max_k=4, accept_through=[0.0] * 4, observed=[20] * 4)
        probes = []
        for round_index in range(40):
            k = policy.choose(rows, options=[feature, ngram])
            if policy.probing_first:
                probes.append(round_index)
        return probes

    assert first_option_probes(32) == []
    assert len(first_option_probes(4)) >= 2


def test_calibration_is_kept_per_batch_bucket_so_a_one_row_warm_up_does_not_mislead_the_full_batch():
    """Trace A's coupled-suffix run: a one-row warm-up (or the previous step's tail) where drafts were all
    accepted and plain rounds ran 2x slower than profiled (host work dominates one row) left the policy at
    k=4 (every draft accepted: the unverified deeper positions are extrapolated at that rate); at the full batch, with acceptance low, one shared factor kept plain decoding looking 2x too
    expensive, so it speculated for 40+ rounds. Per batch bucket, the full batch learns its own factor."""
    true_cost = linear_table(0.1, 0.01)  # 1 row: speculation is nearly free; 32 rows: compute-bound
    policy = VerifyLengthPolicy(true_cost, AcceptanceStats(max_k=4, decay=0.1), probe_every=16, decay=0.2)
    warm_up = []
    for _ in range(60):
        k = policy.choose(1)
        warm_up.append(k)
        policy.observe_round(k, [k], [k], draft_s=0.0, round_s=(2.0 if k == 0 else 1.0) * true_cost.cost(1, k + 1),
                             rows=1)
    assert warm_up[-1] == 4 and policy.calibration(1, rows=1) == pytest.approx(2.0)
    chosen = []
    for _ in range(40):  # the full batch: a fifth of the rows accept their first draft, true costs
        k = policy.choose(32)
        chosen.append(k)
        accepted = [1 if row < 32 * 0.2 and k else 0 for row in range(32)]
        policy.observe_round(k, [k] * 32, accepted, draft_s=0.0, round_s=true_cost.cost(32, k + 1), rows=32)
    assert analytic_best(true_cost, policy.stats.accept_through, 32) == 0
    # plain decoding within a few rounds; the deep positions' stale, optimistic estimates make max_k look cheap at
    # first, so it is probed a few times (which corrects them), then no more; k = 1, expected within 15% of plain
    # decoding, runs once every 8 rounds (`_cheap_probe`)
    assert chosen[:1] == [4] and chosen[4:8] == [0] * 4 and chosen[8:].count(4) <= 2
    assert set(chosen[-16:]) <= {0, 1} and chosen[-16:].count(1) <= 2
    assert policy.calibration(1, rows=32) == pytest.approx(1.0)  # learned in its own bucket
    assert policy.calibration(1, rows=1) == pytest.approx(2.0)  # the one-row bucket kept its own


# Trace D on this project's AVX2 machine, fp32, 4 rows (bench/session14): a plain round 0.63 s, a width-5 verify
# 1.08 s (widths between interpolated), a Qwen2.5-Coder-0.5B draft step 0.27 s.
D_FP32 = CostTable((4,), WIDTHS, ((0.63, 0.74, 0.85, 0.96, 1.08),))
D_DRAFT_STEP_S = 0.27
MODEL, SUFFIX = ["model"] * 4, ["suffix"] * 4


def _d_policy() -> VerifyLengthPolicy:
    """After ten rounds in which the draft model drafted 4 tokens per row at its measured cost and none
    was accepted, then rounds in which the suffix drafter's (shadow) drafts were half right at position 1."""
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0)
    for _ in range(10):
        policy.observe_round(4, [4] * 4, [0] * 4, 4 * D_DRAFT_STEP_S, 4 * D_DRAFT_STEP_S + 1.08, 4, methods=MODEL,
                             draft_s_by_method={"model": 4 * D_DRAFT_STEP_S})
    for _ in range(40):
        policy.observe_acceptance([4] * 4, [1, 0, 1, 0], SUFFIX)
    return policy


def test_a_draft_model_s_cost_does_not_stick_to_the_free_methods():
    """Trace D's failure: one pooled drafting cost kept the draft model's seconds after its drafts stopped
    being chosen, so the free suffix drafts (half right at position 1) were never verified again. Per
    method, the suffix assignment verifies one draft and the model's costs stay with the model."""
    policy = _d_policy()
    assert policy.draft_s_by_method == {"model": pytest.approx(D_DRAFT_STEP_S)}
    assert policy.choose(4, options=[MODEL, SUFFIX]) == 1 and policy.option == 1
    # the premise: pooled (no per-row methods), the same observations decode plainly
    assert _d_policy().choose(4) == 0


def test_a_draft_model_whose_drafts_are_accepted_wins_the_round_and_goes_deep():
    """Once the draft model's drafts are all accepted (4 of 4), its assignment beats the free drafts'
    despite costing 0.27 s per position, and the round verifies all four: 20 tokens in 2.16 s beats the
    suffix drafter's 6 in 0.74 s."""
    policy = _d_policy()
    for _ in range(40):
        policy.observe_round(4, [4] * 4, [4] * 4, 4 * D_DRAFT_STEP_S, 4 * D_DRAFT_STEP_S + 1.08, 4, methods=MODEL,
                             draft_s_by_method={"model": 4 * D_DRAFT_STEP_S})
    assert policy.choose(4, options=[MODEL, SUFFIX]) == 4 and policy.option == 0
    # a mixed assignment pays the model's whole step for the rows it drafts
    half = ["model", "model", "suffix", "suffix"]
    assert policy.drafting_seconds(4, half) == pytest.approx(4 * D_DRAFT_STEP_S)
    model, suffix = (policy.method_stats(m).expected_tokens(4) for m in ("model", "suffix"))
    assert model > 4.9 and policy.expected_tokens(4, 4, half) == pytest.approx(2 * model + 2 * suffix)


def test_a_position_starts_as_the_running_mean_of_its_first_rounds_then_forgets():
    """The prior is a start, not evidence: one observed round replaces it (an EMA at 0.1 would still say
    0.55 after a round of all-accepted drafts), the first 1/decay rounds are averaged, later ones decay."""
    stats = AcceptanceStats(max_k=2, decay=0.25)
    stats.observe([2] * 4, [2] * 4)
    assert stats.accept_through == pytest.approx([1.0, 1.0])
    stats.observe([2] * 4, [0] * 4)
    assert stats.accept_through == pytest.approx([0.5, 0.5])  # the mean of two rounds
    for _ in range(2):
        stats.observe([2] * 4, [2] * 4)
    assert stats.accept_through == pytest.approx([0.75, 0.75])  # the mean of four = 1/decay rounds
    stats.observe([2] * 4, [0] * 4)
    assert stats.accept_through == pytest.approx([0.75 * 0.75, 0.75 * 0.75])  # from here an EMA at 0.25


def test_positions_no_round_verified_are_extrapolated_at_the_deepest_conditional_rate():
    """coupled-cheap on trace D verified two drafts per row (87% and 75% accepted): the third and fourth,
    never verified, are not left at the prior's 12% and 6%, which kept the verify length at 2 for good."""
    stats = AcceptanceStats(max_k=4)
    assert stats.rates() == pytest.approx([0.5, 0.25, 0.125, 0.0625])  # nothing observed: the prior
    for _ in range(5):
        stats.observe([2] * 4, [2, 2, 2, 0])  # q1 = q2 = 0.75: conditional rate 1 at position 2
    assert stats.rates() == pytest.approx([0.75] * 4)
    stats = AcceptanceStats(max_k=4, decay=1.0)
    stats.observe([2] * 10, [2] * 6 + [1] * 3 + [0])  # q1 = 0.9, q2 = 0.6
    assert stats.rates() == pytest.approx([0.9, 0.6, 0.4, 0.6 * (2 / 3) ** 2])
    assert stats.expected_tokens(4) == pytest.approx(1 + 0.9 + 0.6 + 0.4 + 0.4 * 2 / 3)


def test_positions_few_rounds_observed_are_blended_with_the_extrapolation():
    """Trace D, session 41: the 0.5B's deeper positions stood at 0.25 from two early rounds while its first stood
    at ~0.9 over hundreds, and the verify length kept one draft a row. A position seen in fewer than
    `trusted_rounds` rounds counts by that share; one seen that often is its own estimate."""
    stats = AcceptanceStats(max_k=4, decay=0.3)
    stats.observe([4] * 4, [1, 1, 0, 0])  # one deep round: q1 = 0.5, q2..q4 = 0
    for _ in range(20):
        stats.observe([1] * 4, [1, 1, 1, 1])  # twenty rounds at one draft, all accepted
    q1, raw = stats.accept_through[0], list(stats.accept_through)
    assert stats.observed == [21, 1, 1, 1] and q1 > 0.99 and raw[1:] == [0.0] * 3
    # position 2: a quarter of its one observation (0), three quarters of q1 x q1 / 1 (the first position's rate)
    expected = [q1]
    for _ in range(3):
        expected.append(0.25 * 0.0 + 0.75 * expected[-1] * q1)
    assert stats.rates() == pytest.approx(expected)
    assert stats.expected_tokens(2) > 1.7  # the second draft is worth verifying again, and a round will tell
    for _ in range(3):
        stats.observe([4] * 4, [4, 1, 1, 1])  # now four rounds at position 2: its own estimate
    assert stats.observed[1] == 4 and stats.rates()[:2] == pytest.approx(stats.accept_through[:2])


def test_a_losing_draft_model_is_probed_now_and_then_and_wins_back_when_its_drafts_got_good():
    """The model's statistics are refreshed only by rounds that draft with it: while the free assignment wins
    the model's is still run now and then (intervals doubling while it keeps losing), and once probes show
    its drafts are accepted (each raising its expected rate, so the next comes as soon again), it wins the
    rounds back. Costs: trace D fp32 with the int8 0.5B's 0.105 s per draft step (coupled-cheap, session 15)."""
    step = 0.105
    # probe_budget=1: only the intervals here (the rounds in between are not observed; the budget has its own test);
    # probe_optimism=1: a model none of whose drafts were accepted is still probed (the gate has its own test)
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=4, max_probe_every=16, probe_budget=1.0,
                                probe_optimism=1.0)

    def model_round(k: int, accepted: int) -> None:
        policy.observe_round(k, [k] * 4, [accepted] * 4, k * step, k * step + D_FP32.cost(4, k + 1), 4,
                             methods=MODEL, draft_s_by_method={"model": k * step})

    for _ in range(10):  # the draft model's first rounds: nothing accepted
        model_round(4, 0)
    for _ in range(40):  # the suffix drafter's shadows: half right at position 1
        policy.observe_acceptance([4] * 4, [1, 0, 1, 0], SUFFIX)
    probes = []
    for round_index in range(60):
        k = policy.choose(4, options=[MODEL, SUFFIX])
        if policy.option == 0 and k > 0:
            probes.append(round_index)
            model_round(k, 0)
    assert probes == [3, 11, 27, 43, 59]  # after 4 rounds off it, then 8, then 16 (the cap)
    model_rounds = []  # from now on the model's drafts are all accepted
    for round_index in range(60):
        k = policy.choose(4, options=[MODEL, SUFFIX])
        if policy.option == 0 and k > 0:
            model_rounds.append(round_index)
            model_round(k, k)
    assert model_rounds[1] - model_rounds[0] == 4  # the probe raised its rate: the next one comes as soon
    # within 25 rounds (3 probes) it drafts every round but the policy's own plain-decoding probes
    others = sorted(set(range(25, 60)) - set(model_rounds))
    assert len(others) <= 3 and all(policy.history[r - 60] == 0 for r in others), others


@pytest.mark.parametrize("catch_up_s,remaining,probed", [(0.05, 200.0, True), (0.05, None, True), (0.05, 6.0, False),
                                                          (0.0, 6.0, True)])
def test_a_probe_that_pays_a_catch_up_runs_only_where_the_rows_have_a_stretch_left(catch_up_s, remaining, probed):
    """Trace A, session 46: at a last row's 6 tokens left, a probe of the 0.5B (out of use all run) caught the row up
    over 4.05 s to draft 4 tokens. A probe that pays a catch-up bets it on the stretch after it, so it runs only where
    the rows have `catch_up_rounds` rounds left at the probe's optimistic rate (here 5 tokens a row at k = 4: 40
    rounds for 200 tokens, ~1 for 6); one with nothing to catch up runs at its interval whatever is left."""
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=4, max_probe_every=16, probe_budget=1.0,
                                probe_optimism=1.0)
    policy.draft_s_by_method["model"] = 0.105  # the int8 0.5B's draft step on trace D (coupled-cheap, session 15)
    for _ in range(40):  # the suffix drafter's shadows: half right at position 1
        policy.observe_acceptance([4] * 4, [1, 0, 1, 0], SUFFIX)
    probes = [i for i in range(12) if policy.choose(4, options=[MODEL, SUFFIX], catch_up_s=[catch_up_s, 0.0],
                                                    remaining_tokens=remaining) and policy.option == 0]
    assert probes == ([3, 11] if probed else [])  # after 4 rounds off it, then 8


def test_a_method_s_first_drafting_cost_is_its_warm_up():
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0)
    policy.observe_round(2, [2] * 4, [2] * 4, 30.0, 31.0, 4, methods=MODEL, draft_s_by_method={"model": 30.0})
    assert policy.draft_s_by_method == {}  # compiled a kernel: left out
    policy.observe_round(2, [2] * 4, [2] * 4, 0.2, 1.1, 4, methods=MODEL, draft_s_by_method={"model": 0.2})
    assert policy.draft_s_by_method == {"model": pytest.approx(0.1)}


def test_a_deep_probe_expected_to_cost_little_runs_often():
    """Trace D's start: the draft model's deep positions looked poor after one unlucky round and the policy sat at
    k = 1, where they are never verified. While max_k is expected within `cheap_probe` of the current rate it
    runs every `cheap_probe_every` rounds (a round at max_k, by any cause, restarts the count); the regular
    probes keep their own schedule."""
    table = linear_table(0.3, 0.03)  # 1 row: k = 1 at 0.36 s, k = 4 at 0.45 s
    # rates set by hand and held: trusted from the first round (`trusted_rounds` has its own test)
    policy = VerifyLengthPolicy(table, AcceptanceStats(max_k=4, accept_through=[0.9, 0.1, 0.05, 0.01], trusted_rounds=1),
                                probe_every=16, cheap_probe_every=4, hysteresis=0.0)
    chosen = []
    for _ in range(20):
        k = policy.choose(1)
        chosen.append(k)
        policy.observe_round(k, [k], [min(k, 1)], draft_s=0.0, round_s=table.cost(1, k + 1), rows=1)
        policy.stats.accept_through = [0.9, 0.1, 0.05, 0.01]  # acceptance held fixed
    assert policy.current == 1 and policy.throughput(1, 4) >= 0.85 * policy.throughput(1, 1)
    assert [i + 1 for i, k in enumerate(chosen) if k == 4] == [1, 5, 9, 13, 17]  # round 1: never seen yet
    assert chosen[15] == 0  # the regular probe at round 16 runs plain decoding, on its own schedule
    # far from the current rate (k = 4 expected at half of k = 1's), no cheap probes
    far = VerifyLengthPolicy(table, AcceptanceStats(max_k=4, accept_through=[0.9, 0.0, 0.0, 0.0]),
                             probe_every=0, cheap_probe_every=4, hysteresis=0.0)
    assert [far.choose(1) for _ in range(12)] == [1] * 12


@pytest.mark.parametrize("trimmed_rows", [0, 8])
def test_a_trimmed_batch_probes_a_deep_width_it_never_ran(trimmed_rows):
    """Trace D, session 60: every run's first 4-row round chose k = 2, and widths 4-5, never run at 4 rows, took
    width 3's factor, though a trimmed round verifies only the drafts that pay and ran them at ~0.7-0.8 of the
    profile once measured. The cheap probe did not find them for its first rounds: the warm-up (1 row) had just run
    k = 4, and a k = 4 round in the last `cheap_probe_every` counts at any row count. Where rounds are draft-trimmed,
    max_k runs at the first choice after a narrower width was measured in the batch's bucket and before any width that
    deep was, whatever ran at other row counts; untrimmed batches keep to the cheap-probe rule."""
    table = linear_table(0.05, 0.02)  # 8 rows: 0.05 + 0.16 x width
    accept = [0.9, 0.85, 0.5, 0.3]  # E[k] 1.9, 2.75, 3.25, 3.55: k = 2 best at the profile
    policy = VerifyLengthPolicy(table, AcceptanceStats(max_k=4, accept_through=list(accept), trusted_rounds=1),
                                probe_every=16, cheap_probe_every=8, hysteresis=0.0, trimmed_rows=trimmed_rows)
    for _ in range(3):  # a warm-up of one row at k = 4, then forgotten but for its costs (the benchmark's)
        policy.history.append(4)
        policy.observe_round(4, [4], [4], draft_s=0.0, round_s=table.cost(1, 5), rows=1)
    policy.forget_acceptance()
    policy.stats = AcceptanceStats(max_k=4, accept_through=list(accept), trusted_rounds=1)
    chosen = []
    for _ in range(6):
        k = policy.choose(8)
        chosen.append(k)
        factor = 0.6 if k >= 3 else 1.0  # trimmed deep rounds run below the profile
        policy.observe_round(k, [k] * 8, [min(k, 2)] * 8, draft_s=0.0, round_s=factor * table.cost(8, k + 1), rows=8)
        policy.stats.accept_through = list(accept)
    if trimmed_rows:
        assert chosen == [2, 4, 4, 4, 4, 4]  # width 3 measured at round 0, so width 5 is probed; then k = 4 wins
        assert policy.calibration(5, rows=8) == pytest.approx(0.6)
    else:
        assert chosen == [2] * 6  # the warm-up's k = 4 rounds are recent
        assert (policy.bucket(8) == 8 and ("", 8, 5) not in policy.scale)


def test_the_methods_in_use_are_kept_until_another_assignment_is_better_by_the_hysteresis():
    """Switching draft models pays a catch-up forward the per-round estimates leave out, and near ties flipped
    trace D's `specactor` into long stretches on the slower model (session 17). Like k, the assignment in use is
    kept unless another is expected faster by more than the hysteresis."""
    A, B = ["a"] * 4, ["b"] * 4
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0, cheap_probe_every=0)
    for _ in range(40):
        policy.observe_acceptance([4] * 4, [2, 2, 2, 2], A)
        policy.observe_acceptance([4] * 4, [0, 0, 0, 0], B)
    k = policy.choose(4, options=[A, B])
    assert k > 0 and policy.option == 0 and policy.models_in_use == {"a"}

    def ratio() -> float:
        return max(policy.throughput(4, j, methods=B) for j in range(1, 5)) / \
            max(policy.throughput(4, j, methods=A) for j in range(1, 5))

    for _ in range(40):  # b becomes a little better than a
        policy.observe_acceptance([4] * 4, [2, 2, 3, 3], B)
    assert 1.0 < ratio() < 1 + policy.hysteresis  # the premise: a near tie in b's favour
    policy.choose(4, options=[A, B])
    assert policy.option == 0 and policy.models_in_use == {"a"}
    policy.choose(4, options=[B, A])  # whatever the order of the options
    assert policy.option == 1 and policy.models_in_use == {"a"}
    for _ in range(40):  # b clearly better
        policy.observe_acceptance([4] * 4, [4, 4, 4, 4], B)
    assert ratio() > 1 + policy.hysteresis
    policy.choose(4, options=[A, B])
    assert policy.option == 1 and policy.models_in_use == {"b"}


def test_rounds_of_each_costly_method_have_their_own_verify_calibration():
    """A draft model's rounds cost more than their drafting (its forwards evict the target's weights from the
    cache; its bookkeeping adds host time): trace D's 0.5B rounds took ~20 ms more outside drafting than the
    feature drafter's at the same width. Two methods alike in acceptance and drafting cost, one of whose rounds
    are slower outside drafting: the policy expects it slower and prefers the other, whatever the order of
    the options; model-free methods (drafting cost below `costly_share`) and plain rounds keep the pooled
    calibration."""
    M, F, S = ["m"] * 4, ["f"] * 4, ["s"] * 4
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0, cheap_probe_every=0)
    profiled = D_FP32.cost(4, 4)
    for _ in range(3):  # the first round of each method is its warm-up (its drafting cost left out)
        for methods, extra in ((M, 0.3), (F, 0.0), (S, 0.0)):
            policy.observe_round(3, [3] * 4, [2] * 4, 0.03 if methods is not S else 0.0003, profiled + extra + 0.03,
                                 4, methods=methods, draft_s_by_method={methods[0]: 0.03 if methods is not S else 3e-4})
    assert policy.verify_seconds(4, 3, methods=M) > 1.2 * policy.verify_seconds(4, 3, methods=F)
    assert policy.throughput(4, 3, methods=F) > 1.2 * policy.throughput(4, 3, methods=M)
    for options, chosen in (([M, F], 1), ([F, M], 0)):
        policy.models_in_use = frozenset()
        policy.choose(4, options=options)
        assert policy.option == chosen
    # the suffix method's rounds and k = 0 are priced by the pooled calibration (which saw every round)
    assert policy.verify_seconds(4, 3, methods=S) == policy.verify_seconds(4, 3)
    assert policy.verify_seconds(4, 0, methods=M) == policy.verify_seconds(4, 0)


@pytest.mark.parametrize("relax_rate", [0.0, 0.1])
def test_a_costly_methods_calibration_out_of_use_relaxes_to_the_pooled_one_times_its_long_run_share(relax_rate):
    """Trace D, session 47: three of the 0.5B's rounds met a slow spell, its rounds' own calibration rose far above
    the pooled one, plain rounds brought the pooled one back, and nothing observed the model's again: it stayed out
    for ~420 of 509 rounds. Out of use, its factor moves back toward the pooled factor times the share its rounds
    cost over the pooled ones in the long run (it keeps its real extra cost), and the model is chosen again."""
    M, S = ["m"] * 4, ["s"] * 4
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0, cheap_probe_every=0,
                                relax_rate=relax_rate)
    profiled = D_FP32.cost(4, 2)

    def run(methods, factor: float, draft_s: float) -> None:
        policy.history.append(1)
        policy.observe_round(1, [1] * 4, [1] * 4, draft_s, factor * profiled + draft_s, 4, methods=methods,
                             draft_s_by_method={methods[0]: draft_s})

    for _ in range(30):
        run(M, 1.1, 0.02)  # the model's rounds cost 10% over the free method's, steadily
        run(S, 1.0, 1e-4)
    share = policy.scale[("|m", 4, 2)] / policy.scale[("", 4, 2)]
    assert policy.scale_long[("|m", 4, 2)] == pytest.approx(share, rel=0.02)
    for _ in range(3):
        run(M, 3.0, 0.02)  # the slow spell
    spiked = policy.scale[("|m", 4, 2)]
    for _ in range(60):  # the free method's rounds bring the pooled factor back; nothing observes the model's
        policy.choose(4, options=[S])
        run(S, 1.0, 1e-4)
    relaxed = policy.scale[("|m", 4, 2)]
    if relax_rate == 0.0:
        assert relaxed == pytest.approx(spiked)  # as before: the spell's factor kept
    else:
        assert relaxed == pytest.approx(policy.scale[("", 4, 2)] * policy.scale_long[("|m", 4, 2)], rel=0.02)
        assert 1.02 < relaxed / policy.scale[("", 4, 2)] < 1.2  # its real extra cost kept
    assert (relaxed < 0.8 * spiked) == (relax_rate > 0)


def test_probes_of_a_costly_first_assignment_keep_within_the_probe_budget():
    """A draft model's probe pays a catch-up forward over all it missed, for every row: ~2 s on trace A's 32 rows,
    8 rounds' worth, twice a run. The next probe waits until the last one's seconds are at most `probe_budget` of
    the rounds' seconds since: here a 1.0 s probe among 0.1 s rounds waits 1.0 / (0.05 * 0.1) = 200 rounds, not
    the 4-8-16 of the intervals."""
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=4, max_probe_every=16,
                                probe_budget=0.05)
    policy._probe_may_pay = lambda *args: True  # the gate on what a probe could reveal has its own test
    for _ in range(40):  # the free method wins clearly; the model has been measured as hopeless
        policy.observe_acceptance([4] * 4, [2, 2, 2, 2], SUFFIX)
        policy.observe_acceptance([4] * 4, [0, 0, 0, 0], MODEL)
    policy.draft_s_by_method["model"] = 0.1
    probes = []
    for round_index in range(500):
        k = policy.choose(4, options=[MODEL, SUFFIX])
        if policy.option == 0 and k > 0:
            probes.append(round_index)
            policy.observe_round(k, [k] * 4, [0] * 4, 0.9, 1.0, 4, methods=MODEL, draft_s_by_method={"model": 0.9})
        else:
            policy.observe_round(k, [k] * 4, [2] * 4, 0.0, 0.1, 4, methods=SUFFIX)
    assert probes[0] == 3  # the first probe: nothing known of its cost yet
    assert all(b - a >= 200 for a, b in zip(probes, probes[1:])) and len(probes) >= 2
    assert policy.first_probe_s == 1.0 and policy.round_s == pytest.approx(0.1)


def test_a_catch_up_that_grows_while_a_model_is_out_does_not_keep_it_out():
    """Trace D, session 27: with its catch-up charged whole to one round, the feature drafter's grew with every
    round it was out (7 to 121 ms over 14 rounds, against ~150 ms rounds) and outweighed what it gains a round,
    so `specactor` decoded plainly where drafting with it paid. A catch-up is paid once for the stretch after it:
    a round carries 1 / catch_up_rounds of it, and the model whose steady rounds win comes back."""
    feature = ["feature"] * 4
    table = linear_table(0.1, 0.001)

    def policy(catch_up_rounds: int) -> VerifyLengthPolicy:
        p = policy_with(table, [0.5] * 4, catch_up_rounds=catch_up_rounds)
        for _ in range(20):  # 1.75 tokens a row at k = 2, drafting 4 ms a position
            p.observe_round(2, [2] * 4, [1, 1, 0, 1], 0.008, 0.13, 4, methods=feature,
                            draft_s_by_method={"feature": 0.008})
        return p

    assert policy(8).choose(4, options=[feature], catch_up_s=[0.0]) > 0  # the premise: its steady rounds win
    assert policy(8).choose(4, options=[feature], catch_up_s=[0.12]) > 0
    assert policy(1).choose(4, options=[feature], catch_up_s=[0.12]) == 0  # charged whole to one round: kept out


def test_a_catch_up_is_spread_over_the_rounds_the_rows_have_left():
    """Spread over a fixed 8 rounds, a catch-up that grew over a long stretch out of use still outweighed what the
    model gains a round (trace D: ~1 ms more per round out, rounds of ~160 ms gaining ~10%). Where the rows have
    many tokens left, it is spread over the rounds they would take (up to `max_catch_up_rounds`), and the model whose
    steady rounds win comes back; where they have few left it is not worth paying. A model that never held the rows
    pays its first catch-up over the floor: its estimates alone speak for it (trace D: the 0.5B's deferred prompts)."""
    feature = ["feature"] * 4
    p = policy_with(linear_table(0.1, 0.001), [0.5] * 4)
    for _ in range(20):  # 1.75 tokens a row at k = 2, drafting 4 ms a position: ~1.25x plain decoding's rate
        p.observe_round(2, [2] * 4, [1, 1, 0, 1], 0.008, 0.13, 4, methods=feature,
                        draft_s_by_method={"feature": 0.008})
    catch_up = [0.8]  # what feeding the tokens it missed over a long stretch out of use costs

    def chosen(remaining_tokens: float | None) -> int:
        p.current = None
        return p.choose(4, options=[feature], catch_up_s=catch_up, remaining_tokens=remaining_tokens)

    assert chosen(200.0) == 0  # never in use: it pays to enter over catch_up_rounds (8), 100 ms a round
    assert p.choose(4, options=[feature], catch_up_s=[0.0]) > 0 and p.held == {"feature"}  # it held the rows
    assert chosen(None) == 0  # remaining tokens unknown: over catch_up_rounds
    assert chosen(200.0) > 0  # 100-200 rounds left: spread over 64, ~13 ms a round
    assert p._catch_up_horizon(4, 2, feature) == 64
    assert chosen(10.0) == 0  # a few rounds left: spread over those (the next test)
    assert p._catch_up_horizon(4, 2, feature) == pytest.approx(10.0 / 1.75)


def test_a_catch_up_is_not_spread_over_more_rounds_than_the_rows_have_left():
    """Trace A, session 45: at the end of two repeats of three the 0.5B, never in use before, caught a last row up
    over 0.80-0.89 s (300-odd tokens) to draft for the 6 tokens the row had left. A one-time cost is won back over the
    rounds the rows have left or not at all: the catch-up is spread over `catch_up_rounds` or those rounds if
    fewer (at the option's expected tokens a row), and the same model whose steady rounds win enters where the rows
    have many tokens left and not where they have a few."""
    model = ["model"] * 4
    p = policy_with(linear_table(0.1, 0.001), [0.5] * 4)
    for _ in range(20):  # its 4 drafts accepted, drafting 5 ms a position: ~2.4x plain decoding's rate
        p.observe_round(4, [4] * 4, [4] * 4, 0.02, 0.14, 4, methods=model, draft_s_by_method={"model": 0.005})

    def chosen(remaining_tokens: float | None) -> int:
        p.current, p.held = None, set()  # never in use
        return p.choose(4, options=[model], catch_up_s=[0.6], remaining_tokens=remaining_tokens)

    def horizon(remaining_tokens: float | None, k: int = 4, held: frozenset[str] = frozenset()) -> float:
        p.remaining_tokens, p.held = remaining_tokens, set(held)
        return p._catch_up_horizon(4, k, model)

    assert chosen(200.0) == 4 and horizon(200.0) == 8  # never in use: over catch_up_rounds
    assert horizon(200.0, held=frozenset({"model"})) == 40  # it held the rows: over the 40 rounds they have left
    assert chosen(None) == 4 and horizon(None) == 8  # remaining tokens unknown: over catch_up_rounds
    assert chosen(6.0) == 0  # 6 tokens left, ~1.2 rounds at its 5 tokens a row: the catch-up is not won back
    assert horizon(6.0) == horizon(6.0, held=frozenset({"model"})) == pytest.approx(1.2)
    assert horizon(6.0, k=1) == pytest.approx(3.0)  # 2 tokens a row at k = 1: 3 rounds


@pytest.mark.parametrize("relaxes", [False, True])
def test_a_realised_factor_lowered_by_a_poor_stretch_relaxes_back_while_out_of_use(relaxes):
    """The realised factor counts tokens, so a poor stretch of acceptance lowers it as well as the acceptance
    estimates; the acceptance relaxes back while the method is out of use (`AcceptanceStats.relax`), and a factor no
    round updated kept the stretch (trace D, session 30: the feature drafter's at 0.85 against a run's mean of 0.99,
    out of use for 215 of 466 rounds). It relaxes as well, toward its own long-run record, and the method whose
    record leads comes back; with the factor frozen (as before) it never does."""
    F, N = ["feature"] * 4, ["ngram"] * 4
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0, cheap_probe_every=0)
    good, poor = {"feature": (2, 2, 1, 1), "ngram": (1, 1, 1, 0)}, {"feature": (0, 0, 0, 0), "ngram": (1, 1, 1, 0)}

    def round_(accepted: dict[str, tuple[int, ...]]) -> int:
        k = policy.choose(4, options=[F, N])
        methods = (F, N)[policy.option]
        took = [min(a, k) for a in accepted[methods[0]]]
        policy.observe_round(k, [k] * 4, took, 0.0, D_FP32.cost(4, k + 1), 4, methods=methods)
        if not relaxes:
            policy.realised_long.clear()  # what the policy kept before: nothing to relax toward
        return policy.option

    assert {round_(good) for _ in range(30)} == {0}  # ~1.2x the n-gram drafter's rate
    for _ in range(3):  # a poor stretch: nothing accepted
        round_(poor)
    key = policy._realised_key("", F, policy.bucket(4))
    assert policy.realised[key] < 0.8
    after = [round_(good) for _ in range(60)]
    assert after[0] == 1  # the stretch counts: the n-gram drafter takes over
    if relaxes:
        back = after.index(0)
        assert set(after[back:]) == {0} and policy.realised[key] > 0.9, after
    else:
        assert set(after) == {1}


def test_a_round_that_caught_up_does_not_count_as_realising_less_than_expected():
    """The realised / expected factor of an assignment compares its steady rounds with their estimate: the seconds
    a round spent catching up are charged apart (`catch_up_rounds`), so the round after a switch does not also
    lower the factor (the clamp, 0.5, on trace D's rounds that caught up 0.1 s in 0.25 s)."""
    feature = ["feature"] * 4

    def realised(catch_up_s: float) -> float:
        p = policy_with(linear_table(0.1, 0.001), [0.75] + [0.0] * 3)
        p.realised_warmed.add(p._realised_key("", feature, p.bucket(4)))  # past its first round
        k = p.choose(4, options=[feature])
        assert k > 0 and p.expected is not None
        steady = 7 / p.expected[1]  # 4 + 3 tokens in exactly the seconds its estimate said
        p.observe_round(k, [k] * 4, [1, 1, 1, 0], 0.004 * k + catch_up_s, steady + catch_up_s, 4, methods=feature,
                        draft_s_by_method={"feature": 0.004 * k}, catch_up_s=catch_up_s)
        return p.realised[p._realised_key("", feature, p.bucket(4))]

    assert realised(0.0) == pytest.approx(1.0)
    assert realised(0.1) == pytest.approx(1.0)


def test_the_first_probe_of_a_costly_assignment_waits_for_its_catch_up_estimate():
    """Trace A: the 0.5B's first round drafted with nothing to catch up, so the probe after it was priced like
    a round, and it caught 30 rows up over 1.8 s. With the catch-up a probe would pay now given, the first
    probe already keeps to the budget: (0.1 + 0.9) / (0.05 * 0.1) = 200 rounds; with no catch-up due it runs at
    the interval."""
    def first_probe(catch_up_s: float) -> int | None:
        policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=4, max_probe_every=16,
                                    probe_budget=0.05)
        policy._probe_may_pay = lambda *args: True  # the gate on what a probe could reveal has its own test
        for _ in range(40):
            policy.observe_acceptance([4] * 4, [2, 2, 2, 2], SUFFIX)
            policy.observe_acceptance([4] * 4, [0, 0, 0, 0], MODEL)
        policy.draft_s_by_method["model"] = 0.1
        for round_index in range(150):
            k = policy.choose(4, options=[MODEL, SUFFIX], catch_up_s=[catch_up_s, 0.0])
            if policy.option == 0 and k > 0:
                return round_index
            policy.observe_round(k, [k] * 4, [2] * 4, 0.0, 0.1, 4, methods=SUFFIX)
        return None

    assert first_probe(0.0) == 3
    assert first_probe(0.9) is None


def test_a_method_whose_rounds_realise_less_than_expected_is_expected_less():
    """Whatever the per-part estimates miss (trace D: the 0.5B's late rounds at 44.5 tokens/s where they put it
    ahead of the feature drafter's 48.1) is charged to the method: the realised / expected tokens per second of
    the rounds chosen with it (probes left out) scales its expected throughput. Two methods alike in every
    estimate: after rounds of one that realise 20% less, the other wins, in either order of the options."""
    M, F = ["m"] * 4, ["f"] * 4
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0, cheap_probe_every=0)
    for methods in (M, F, M, F):  # alike: acceptance, drafting cost, verify calibration
        policy.observe_round(3, [3] * 4, [2] * 4, 0.03, D_FP32.cost(4, 4) + 0.03, 4, methods=methods,
                             draft_s_by_method={methods[0]: 0.03})
    assert policy.throughput(4, 3, methods=M) == pytest.approx(policy.throughput(4, 3, methods=F))
    for _ in range(10):  # rounds chosen with m (the only option offered) realise 80% of what was expected of them
        k = policy.choose(4, options=[M])
        assert k > 0 and policy.expected is not None and policy.expected[0] == "|m@4"
        expected_tps = policy.expected[1]
        emitted = 4 + 4 * 2
        policy.observe_round(k, [k] * 4, [2] * 4, 0.0, emitted / (0.8 * expected_tps), 4, methods=M)
        policy.stats = AcceptanceStats(max_k=4)  # keep the pooled statistics out of it
    assert policy.realised["|m@4"] == pytest.approx(0.8, rel=0.05)
    for options, chosen in (([M, F], 1), ([F, M], 0)):
        policy.models_in_use = frozenset()
        policy.choose(4, options=options)
        assert policy.option == chosen


def test_probe_rounds_are_left_out_of_the_realised_factor():
    """Trace D, session 31: the feature drafter's first k = 4 probe (round 10) was expected to emit 20 tokens, its
    deep positions extrapolated from one perfect k = 2 round, and emitted 8; counted, it set the drafter's realised
    factor to the 0.5 floor and `specactor` decoded plainly or with n-gram drafts for 230 rounds. Only rounds at the
    length in force set an expectation to realise; probes of other lengths do not."""
    feature = ["feature"] * 4
    policy = VerifyLengthPolicy(linear_table(0.1, 0.001), AcceptanceStats(max_k=4, accept_through=[0.9, 0.8, 0.0, 0.0]),
                                probe_every=4, cheap_probe_every=0)
    probes, in_force = [], []
    for _ in range(24):
        k = policy.choose(4, options=[feature])
        (in_force if k == policy.current else probes).append((k, policy.expected))
        policy.observe_round(k, [k] * 4, [min(k, 2)] * 4, 0.0, 0.12, 4, methods=feature)
    assert any(k == policy.max_k for k, _ in probes), probes  # the premise: deep probes ran
    assert all(expected is None for _, expected in probes)
    assert all(expected is not None for k, expected in in_force if k > 0) and any(k > 0 for k, _ in in_force)


def test_the_first_round_of_an_assignment_does_not_set_its_realised_factor():
    """A first round pays one-time costs (trace D, session 28: the feature drafter's first 4-row round took 1.09 s,
    later ones ~0.2 s); had it counted, the factor would start at the 0.5 floor and price the drafter at half its
    rate until rounds drafted with it, now rare, brought it back. It is left out; the next round counts."""
    feature = ["feature"] * 4
    policy = policy_with(linear_table(0.1, 0.001), [0.75] + [0.0] * 3)
    key = policy._realised_key("", feature, policy.bucket(4))
    for slowdown in (5.0, 1.25):  # the first round 5x slower than expected, the next 1.25x
        k = policy.choose(4, options=[feature])
        assert k > 0 and policy.expected is not None
        policy.observe_round(k, [k] * 4, [1, 1, 1, 0], 0.0, slowdown * 7 / policy.expected[1], 4, methods=feature)
        if slowdown == 5.0:
            assert key not in policy.realised and policy._realised("", feature, k, 4) == 1.0
    assert policy.realised[key] == pytest.approx(0.8)


def test_what_rounds_of_a_few_rows_realised_does_not_price_a_large_batch():
    """Trace B: n-gram rounds of the engine's warm-up call (one row) realised 1.8x their estimate, and the policy keeps
    its statistics across calls; applied at 95 rows, that factor put a k = 1 round ahead of plain decoding, and the
    round took 0.32 s where plain ones took 0.19 s. The realised factor is kept per batch bucket: the large batch
    stays priced by its own estimates (plain decoding), the few-row rounds keep their factor."""
    table = linear_table(0.01, 0.001)  # one row: memory-bound (width 2 costs ~1.1x); 32 rows: width 2 costs ~1.8x
    rates = [0.3, 0.1, 0.03, 0.01]
    policy = policy_with(table, rates, cheap_probe_every=0)
    NG = ["ngram"]
    for _ in range(10):  # one-row rounds drafted with the n-gram drafter realise 1.8x what was expected of them
        k = policy.choose(1, options=[NG])
        assert k > 0 and policy.expected is not None
        policy.observe_round(k, [k], [0], 0.0, 1 / (1.8 * policy.expected[1]), 1, methods=NG)
        policy.stats, policy.by_method = AcceptanceStats(max_k=4, accept_through=list(rates)), {}  # acceptance kept
    assert policy._realised("", NG, 1, 1) == pytest.approx(1.8, rel=0.05)  # kept where observed
    rows = 32
    assert policy.bucket(rows) != policy.bucket(1)
    assert policy._realised("", NG * rows, 1, rows) == 1.0
    plain, one = policy.throughput(rows, 0), policy.throughput(rows, 1, methods=NG * rows)
    assert one < plain < 1.8 * one  # the n-gram drafts' 0.3 tokens do not pay a width-2 round's ~1.8x
    policy.current = 0
    assert policy.choose(rows, options=[NG * rows]) == 0


def test_a_draft_model_not_measured_yet_is_priced_by_its_size():
    """Trace D: the feature-level drafter (3% of the target's bytes) measured, half its first drafts accepted,
    the 0.5B (13%) not measured yet. Counted free, the 0.5B at its optimistic prior beat the measured drafter
    and won probes that cost more than they found; priced at its share of a plain round, it is not chosen, and
    the feature drafter's rounds go on. A model-free method not measured yet still counts as free."""
    feature, big = ["feature"] * 4, ["big"] * 4
    table = linear_table(0.1, 0.001)

    def measured(prior_share):
        policy = policy_with(table, [0.5] * 4, prior_share=prior_share)
        for _ in range(20):
            policy.observe_round(3, [3] * 4, [1, 0, 0, 1], 0.012, 0.13, 4, methods=feature,
                                 draft_s_by_method={"feature": 0.012})
        return policy

    free = measured({})
    assert free.drafting_seconds(4, big) == 0.0 and free.choose(4, options=[feature, big]) > 0 and free.option == 1
    priced = measured({"big": 0.13, "feature": 0.03})
    assert priced.method_draft_s("big", 4) == pytest.approx(0.13 * table.cost(4, 1))
    assert priced.method_draft_s("feature", 4) == pytest.approx(0.004)  # measured: the prior is left
    assert priced.method_draft_s("suffix", 4) == 0.0
    assert priced.choose(4, options=[feature, big]) > 0 and priced.option == 0
    # its prior says it drafts a position in more than `idle_share` of a plain round: its prefill waits
    assert priced.idle_and_costly("big", 4) and not free.idle_and_costly("big", 4)


def test_an_option_s_catch_up_is_charged_to_its_round():
    """Trace D: the 0.5B won single rounds on a few rows of a mixed assignment by its per-round estimate, and each
    such round first fed those rows' whole context. With each option's catch-up given, a model that has fallen
    behind wins only if it is worth that feed too, spread over the `catch_up_rounds` rounds after it (in session
    27 the 0.5B's catch-up on trace D was 0.85-1.7 s, its prompts' prefills deferred)."""
    feature, big = ["feature"] * 4, ["big"] * 4
    table = linear_table(0.1, 0.001)

    def policy():
        p = policy_with(table, [0.5] * 4)
        for methods, accepted, draft_s in ((feature, [1, 0, 0, 1], 0.012), (big, [3, 3, 2, 3], 0.06)):
            for _ in range(20):
                p.observe_round(3, [3] * 4, accepted, draft_s, 0.13 + draft_s, 4, methods=methods,
                                draft_s_by_method={methods[0]: draft_s})
        return p

    free = policy()
    assert free.choose(4, options=[feature, big]) > 0 and free.option == 1  # the premise: it wins a round
    charged = policy()
    assert charged.choose(4, options=[feature, big], catch_up_s=[0.0, 2.0]) > 0 and charged.option == 0
    assert charged.first_catch_up_s == 0.0  # the first option's, for the probe budget
    caught_up = policy()
    assert caught_up.choose(4, options=[feature, big], catch_up_s=[0.0, 0.0]) > 0 and caught_up.option == 1


def test_relaxing_moves_a_stale_estimate_back_to_the_long_run_mean():
    stats = AcceptanceStats(max_k=2, decay=0.3)
    for _ in range(30):
        stats.observe([2] * 4, [2] * 4)  # both drafts accepted, round after round
    for _ in range(3):
        stats.observe([2] * 4, [0] * 4)  # then a bad stretch
    slump = stats.rates()[0]
    assert slump < 0.4 and stats.long_run[0] > 0.8  # the recent estimate chased it, the long-run mean did not
    for _ in range(10):
        stats.relax(0.1)
    assert stats.rates()[0] == pytest.approx(stats.long_run[0] + (slump - stats.long_run[0]) * 0.9**10)
    untouched = AcceptanceStats(max_k=2)
    untouched.relax(0.5)
    assert untouched.rates() == [0.5, 0.25]  # nothing observed: the prior stays


@pytest.mark.parametrize("relax_rate", [0.0, 0.1])
def test_a_method_dropped_after_a_bad_stretch_is_used_again_once_its_record_says_so(relax_rate):
    """Trace D: the feature-level drafter accepted 1, 1 and 0 of 12 drafts in three rounds, its recent estimate
    fell below the n-gram drafter's, and being out of use nothing observed it again: `specactor` ran plain rounds
    and n-gram drafts for 130 rounds. With its statistics relaxing back toward its long-run mean while it is out of
    use, it wins the rows back within a few rounds (and is judged afresh by what it then drafts)."""
    feature, ngram = ["feature"] * 4, ["ngram"] * 4
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0, relax_rate=relax_rate)
    for _ in range(30):
        policy.observe_acceptance([4] * 4, [3] * 4, feature)
        policy.observe_acceptance([4] * 4, [1] * 4, ngram)
    for _ in range(6):  # the bad stretch (6 rounds: a method observed every round moves at the pooled 0.1 a round)
        policy.observe_acceptance([4] * 4, [0] * 4, feature)
    chosen = []
    for _ in range(30):
        policy.choose(4, options=[feature, ngram])
        chosen.append(policy.option)
        if policy.option == 1:
            policy.observe_acceptance([4] * 4, [1] * 4, ngram)  # what a round drafted with it observes
        else:
            policy.observe_acceptance([4] * 4, [3] * 4, feature)
    assert chosen[0] == 1  # the stretch counts: the n-gram drafter takes over at first
    if relax_rate:
        back = chosen.index(0)
        assert back <= 10 and set(chosen[back:]) == {0}, chosen
    else:
        assert set(chosen) == {1}  # without relaxing, the feature drafter never comes back


def test_rounds_held_at_plain_decoding_count_toward_the_probes():
    """The engine re-chooses only every few rounds while plain decoding is far ahead (`hold` between): the held
    rounds are recorded as k = 0 and count toward the probe interval, so a probe that falls due in them runs at the
    next choice instead of four times as many rounds later."""
    # the interval alone binds (a k = 4 probe: 4 rounds more; the probe gate at the all-accepted ceiling)
    policy = VerifyLengthPolicy(linear_table(0.0, 0.01), AcceptanceStats(max_k=4, accept_through=[0.1, 0.01, 0.0, 0.0]),
                                probe_every=4, probe_budget=1.0, probe_optimism=1.0)
    assert policy.choose(32) == 0
    for _ in range(3):
        assert policy.hold() == 0
    assert policy.history == [0, 0, 0, 0]
    assert policy.choose(32) == 4  # the probe at max_k, due after 4 rounds at k = 0
    kept = VerifyLengthPolicy(linear_table(0.0, 0.01), AcceptanceStats(max_k=4, accept_through=[0.1, 0.01, 0.0, 0.0]),
                              probe_every=4, probe_budget=1.0, probe_optimism=1.0)
    assert [kept.choose(32) for _ in range(2)] == [0, 0]  # without the held rounds: not due yet


def test_a_method_s_statistics_follow_at_the_pooled_pace_per_round():
    """Per-method acceptance moves `1 - (1 - 0.1)^gap` for an observation `gap` rounds after the method's last, at
    most `method_decay` (0.3): a method drafting every round is as steady as the pooled statistics (trace D, session
    27: at 0.3 a round, `specactor` with the feature drafter alone chose k = 2 where `coupled-feature`, on the
    pooled 0.1, chose k = 1 and was faster), one measured only every few rounds still moves on each observation."""
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0)
    every, sparse = ["feature"] * 4, ["model"] * 4
    for _ in range(40):  # settled: both accept every draft
        policy.hold()
        policy.observe_acceptance([4] * 4, [4] * 4, every)
        if len(policy.history) % 4 == 0:
            policy.observe_acceptance([4] * 4, [4] * 4, sparse)
    policy.hold()
    policy.observe_acceptance([4] * 4, [0] * 4, every)  # one round rejects everything
    assert policy.method_stats("feature").rates()[0] == pytest.approx(0.9)
    for _ in range(3):
        policy.hold()
    policy.observe_acceptance([4] * 4, [0] * 4, sparse)  # 4 rounds after its last: 1 - 0.9^4 = 0.34, capped at 0.3
    assert policy.method_stats("model").rates()[0] == pytest.approx(0.7)
    policy.hold()
    policy.observe_acceptance([4] * 4, [4] * 4, every)  # the every-round method missed 3 rounds: weight 0.3 too
    assert policy.method_stats("feature").rates()[0] == pytest.approx(0.9 + 0.3 * 0.1)


def test_while_plain_decoding_is_in_force_a_method_expected_close_behind_is_still_measured():
    """Trace D, session 28: in a poor stretch the feature drafter's estimate fell 4% below plain decoding's, and with
    nothing drafting with it its estimate never moved again: `specactor` decoded plainly for 150 rounds while
    `coupled-feature`, drafting with it throughout, ran 15% faster than plain rounds. While plain decoding is in
    force, the best speculative length runs once every `cheap_probe_every` rounds when it is expected within
    `cheap_probe` of plain decoding, with the assignment best at that length (here the second: the first, a costly
    model, is far behind); a method far behind is left alone."""
    def chosen_rounds(feature_draft_s: float) -> list[tuple[int, int]]:
        policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=64, hysteresis=0.0)
        model, feature = ["model"] * 4, ["feature"] * 4
        policy.draft_s_by_method.update(model=1.0, feature=feature_draft_s)
        for name in ("model", "feature"):
            policy.method_stats(name).observed = [40] * 4
        chosen = []
        for _ in range(24):
            policy.method_stats("feature").accept_through = [0.1, 0.0, 0.0, 0.0]  # held: what it drafts is not fed back
            policy.method_stats("model").accept_through = [0.9, 0.8, 0.7, 0.6]
            k = policy.choose(4, options=[model, feature])
            chosen.append((k, policy.option if k else 0))
        return chosen

    near = chosen_rounds(0.005)  # k = 1 with it: 0.96 of plain decoding's rate
    assert [i for i, (k, _) in enumerate(near) if k] == [0, 8, 16]
    assert {near[i] for i in (0, 8, 16)} == {(1, 1)}
    assert chosen_rounds(0.2) == [(0, 0)] * 24  # k = 1 with it: 0.67 of plain decoding's rate


@pytest.mark.parametrize("shadowed", [frozenset(), frozenset({"ngram"})])
def test_deep_probes_skip_assignments_whose_methods_shadow_drafts_measure(shadowed):
    """Trace A, session 45: with the 0.5B beside n-gram and suffix drafts (a costly drafter keeps `probe_deep` on)
    two repeats of three ran a k = 4 probe of n-gram and suffix drafts at 32 rows, 1.06-1.09 s against 0.31 s for a
    plain round, to learn what their shadow drafts already told. Deep probes (the regular ones at max_k, and the cheap
    ones) run only for an assignment with a method that shadows do not measure (`shadowed`); plain probes, and the
    deep probes of a draft model's assignment, are kept."""
    def chosen(methods: list[str]) -> list[int]:
        policy = VerifyLengthPolicy(linear_table(0.3, 0.02), AcceptanceStats(max_k=4), probe_every=4,
                                    max_probe_every=16, probe_budget=1.0, probe_optimism=1.0, shadowed=shadowed)
        policy.method_stats(methods[0]).observed = [40] * 4  # its rates, trusted: plain decoding wins on its merits
        policy.method_stats(methods[0]).accept_through = [0.5, 0.25, 0.125, 0.0625]
        return [policy.choose(32, options=[methods]) for _ in range(40)]

    free, model = chosen(["ngram"] * 32), chosen(["model"] * 32)
    assert set(model) == {0, 1, 4} and model.count(4) >= 3  # the model's deep positions: probed either way
    if shadowed:
        assert free == [0] * 40  # n-gram's deep positions are its shadows' to measure
    else:
        assert free == model  # the same probes as a model's (1: cheap probes, 4: regular ones)


def test_forgetting_acceptance_keeps_what_was_measured_of_costs():
    """After a warm-up (the benchmark's 8 tokens of one row, its drafts accepted whole) the policy goes back to the prior
    acceptance, pooled and per method, with no length in force and no method that held the rows; calibration, drafting
    seconds and realised factors, measured per batch bucket, stay."""
    feature = ["feature"] * 4
    policy = VerifyLengthPolicy(D_FP32, AcceptanceStats(max_k=4), probe_every=0)
    for _ in range(6):
        k = policy.choose(4, options=[feature])
        policy.observe_round(k, [k] * 4, [k] * 4, 0.01 * k, D_FP32.cost(4, k + 1) * 1.5 + 0.01 * k, 4,
                             methods=feature, draft_s_by_method={"feature": 0.01 * k})
    assert policy.stats.rates()[0] == 1.0 and policy.method_stats("feature").rates()[0] == 1.0
    scale, draft_s, realised = dict(policy.scale), dict(policy.draft_s_by_method), dict(policy.realised)
    assert scale and draft_s and realised and policy.held == {"feature"}
    policy.forget_acceptance()
    assert policy.stats.rates() == [0.5, 0.25, 0.125, 0.0625] and policy.by_method == {} and policy.current is None
    assert policy.held == set()  # a warm-up's rounds do not make a method one that held the rows
    assert policy.method_stats("feature").rates() == [0.5, 0.25, 0.125, 0.0625]
    assert (policy.scale, policy.draft_s_by_method, policy.realised) == (scale, draft_s, realised)


def test_the_profile_keeps_each_cell_s_undisturbed_timing_through_a_disturbance_of_several_rounds(monkeypatch):
    """A stretch of slow rounds (another process busy for a while) must not price any cell: each cell is timed
    once per sweep over all cells and keeps its least timing (a cell timed back to back kept the stretch's)."""
    import torch

    from specactor_engine.model.runner import ModelRunner
    from specactor_engine.policies import cost_profile
    from tests.fixtures.tiny_models import make_tiny_model

    calls = []

    def timed(runner, tokens, slots, keys, widths, context, params):
        calls.append(int(widths.sum()))
        cost = 0.001 * int(widths.sum())
        return cost * 10 if 8 <= len(calls) < 14 else cost  # six slow rounds in a row

    monkeypatch.setattr(cost_profile, "_timed_round", timed)
    runner = ModelRunner(make_tiny_model("qwen2", seed=0, num_layers=1, dtype=torch.float32))
    table = cost_profile.measure_verify_costs(runner, (1, 2), (1, 2, 3), context=8, packed=True)
    assert len(calls) == (cost_profile.REPEATS + 1) * (6 + 5)  # 6 plain cells, 5 packed ones of 2 rows
    assert table.seconds == ((0.001, 0.002, 0.003), (0.002, 0.004, 0.006))
    assert table.packed == ((), (0.002, 0.003, 0.004, 0.005, 0.006))


def test_an_assignment_far_behind_is_weighed_again_only_every_few_rounds():
    """Weighing every assignment at every length each round was most of `specactor`'s extra host work on trace D
    (session 53). An assignment whose best rate trails the chosen round's by more than `far_share` is skipped for
    `far_every` rounds (its catch-up not estimated either), then weighed again, so one that got better wins back
    within that many rounds; the first assignment (the probed one) and the one in use are always weighed."""
    feature, free, big = ["feature"] * 4, ["suffix"] * 4, ["big"] * 4
    p = policy_with(linear_table(0.1, 0.001), [0.5] * 4, prior_share={"big": 0.5})
    for _ in range(20):  # the feature drafter's drafts mostly accepted at 4 ms a position; n-gram's never
        p.observe_round(3, [3] * 4, [3, 3, 2, 3], 0.012, 0.13, 4, methods=feature, draft_s_by_method={"feature": 0.012})
        p.observe_acceptance([3] * 4, [0] * 4, free)
        p.observe_acceptance([3] * 4, [3] * 4, big)  # the big model's drafts all accepted, but it is dear
    options = [feature, free, big]
    weighed = []
    throughput = p.throughput

    def spy(rows, k, *args, methods=None, **kwargs):
        weighed.append(methods[0] if methods else None)
        return throughput(rows, k, *args, methods=methods, **kwargs)

    p.throughput = spy
    assert p.choose(4, options=options) > 0 and p.option == 0
    assert {"suffix", "big"} <= set(weighed)  # the first choice weighs all
    assert p.far_options(options) == {1, 2}  # both far behind the feature drafter's round
    skipped = 0
    for _ in range(p.far_every - 1):
        weighed.clear()
        p.choose(4, options=options)
        skipped += "big" not in weighed and "suffix" not in weighed
    assert skipped == p.far_every - 1
    weighed.clear()
    p.choose(4, options=options)
    assert "big" in weighed  # weighed again after far_every rounds
    p.draft_s_by_method["big"] = 0.001  # the big model got cheap: it wins within far_every rounds
    for j in range(p.far_every + 1):
        p.choose(4, options=options)
        if p.option == 2:
            break
    assert p.option == 2 and j < p.far_every
    assert 2 not in p.far_options(options)  # in use: always weighed
    p.forget_acceptance()
    assert p.far_until == {}


def packed_linear_table(fixed: float, per_token: float) -> CostTable:
    """`linear_table` with packed rounds measured up to 8 rows: a round costs fixed + per_token x its real tokens."""
    packed = tuple(tuple(fixed + per_token * n for n in range(b, b * WIDTHS[-1] + 1)) if b <= 8 else ()
                   for b in BATCHES)
    return CostTable(BATCHES, WIDTHS, tuple(tuple(fixed + per_token * b * w for w in WIDTHS) for b in BATCHES), 0,
                     packed)


@pytest.mark.parametrize("trimmed_rows", [0, 8])
def test_a_trimmed_batch_prices_a_round_by_the_tokens_it_verifies(trimmed_rows):
    """Trace D, session 60: trimmed rounds of widths 4-5 ran at 0.7-0.8 of the profile and plain and k = 1 rounds at
    1.1-1.3, so each width's factor carried its own trimming as well as the machine's drift, and a width not run was
    read off a line through such factors (k = 3 at 1.2-1.36x in one paired run). Where the engine trims and the
    profile measured packed rounds, a round is priced by the packed cost of the tokens it verifies: here every round
    costs a fixed 50 ms of host work over that, the factors fall with width by that fixed part alone, and a width not
    run is priced at the tokens its neighbours verify, read between them, on the line through the others: exactly
    what such a round costs. Untrimmed batches keep pricing by width."""
    table = packed_linear_table(0.05, 0.02)  # 8 rows: 0.05 + 0.02 x real tokens
    accept = [0.9, 0.8, 0.6, 0.4]  # E[k] 1.9, 2.7, 3.3, 3.7
    policy = policy_with(table, accept, decay=0.2, trimmed_rows=trimmed_rows, hysteresis=0.0)
    kept = {0: 1.0, 1: 2.0, 2: 2.5, 4: 3.0}  # tokens a row verified: deeper rounds trimmed further below k + 1

    def seconds(tokens: float) -> float:
        return 0.05 + 0.05 + 0.02 * tokens

    def run(k: int) -> None:
        policy.history.append(k)
        policy.observe_round(k, [k] * 8, [0] * 8, draft_s=0.0, round_s=seconds(8 * kept[k]), rows=8,
                             tokens=round(8 * kept[k]))

    for _ in range(40):  # k = 3 never runs
        for k in (0, 1, 2, 4):
            run(k)
    policy.stats.accept_through = list(accept)
    for k in (0, 1, 2, 4):
        assert policy.verify_seconds(8, k) == pytest.approx(seconds(8 * kept[k]), rel=1e-3)
    if trimmed_rows:
        assert policy._tokens_per_row("", 8, 3) == pytest.approx(2.75)  # between k = 2 and k = 4
        assert policy.verify_seconds(8, 3) == pytest.approx(seconds(22), rel=1e-3)
        assert policy.row_tokens[("", 8, 5)] == pytest.approx(3.0)
        assert policy.calibration(5, rows=8) == pytest.approx(seconds(24) / (0.05 + 0.02 * 24), rel=1e-3)
    else:  # by width: each width's factor carries its trimming, and width 4 is read off a line bent by it
        assert policy.calibration(5, rows=8) == pytest.approx(seconds(24) / (0.05 + 0.02 * 40))
        assert policy.verify_seconds(8, 3) < 0.995 * seconds(22)
        assert policy.row_tokens == {}


def test_the_tokens_of_a_length_not_run_are_read_off_the_lengths_run():
    """`_tokens_per_row`: observed at k; between two observed lengths on the line between them (k = 0 verifies 1);
    past the deepest as many per further draft as it kept per draft (an upper estimate: deeper drafts are kept less);
    the whole width with nothing observed, and never more."""
    policy = policy_with(packed_linear_table(0.05, 0.02), [0.9, 0.8, 0.6, 0.4], trimmed_rows=8)
    assert [policy._tokens_per_row("", 8, k) for k in range(5)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    policy.history.append(2)
    policy.observe_round(2, [2] * 8, [0] * 8, draft_s=0.0, round_s=0.5, rows=8, tokens=20)  # 2.5 a row
    assert policy._tokens_per_row("", 8, 2) == pytest.approx(2.5)
    assert policy._tokens_per_row("", 8, 1) == pytest.approx(1.75)  # on the line from (0, 1)
    assert policy._tokens_per_row("", 8, 4) == pytest.approx(2.5 + 0.75 * 2)
    policy.history.append(1)
    policy.observe_round(1, [1] * 8, [0] * 8, draft_s=0.0, round_s=0.5, rows=8, tokens=16)  # k = 1 not trimmed
    assert policy._tokens_per_row("", 8, 4) == pytest.approx(2.5 + 0.75 * 2)  # still from the deepest
    assert policy._tokens_per_row("", 1, 3) == 4.0  # another bucket: nothing observed there
    policy.history.append(4)
    policy.observe_round(4, [4] * 8, [0] * 8, draft_s=0.0, round_s=0.5, rows=8, tokens=24)
    assert policy._tokens_per_row("", 8, 3) == pytest.approx(2.75)


def test_a_token_priced_width_is_not_set_by_one_slow_first_round_nor_kept_there_while_stale():
    """Trace D, session 61: in a token-priced bucket a first k = 3 round took 147 ms against ~65 ms for its
    neighbours, which set width 4 at 1.63x while the other widths stood at 1.0-1.2x; stale, it then followed the drift
    of a slow spell of k = 2 rounds up to 1.85x, and that run never ran k = 3 again. There the factors are all the same
    drift, so a width's first round starts from the line through the others (and moves `decay` of the way), and a
    stale width is pulled to the line, not carried by the drift."""
    table = packed_linear_table(0.05, 0.02)
    policy = policy_with(table, [0.9, 0.8, 0.6, 0.4], decay=0.2, trimmed_rows=8)
    kept = {0: 1.0, 1: 2.0, 2: 2.5, 3: 2.75, 4: 3.0}

    def run(k: int, factor: float) -> None:
        policy.history.append(k)
        tokens = round(8 * kept[k])
        seconds = factor * (table.cost(8, 1) if k == 0 else table.packed_cost(8, tokens))
        policy.observe_round(k, [k] * 8, [0] * 8, draft_s=0.0, round_s=seconds, rows=8, tokens=tokens)

    for _ in range(20):
        for k in (0, 1, 2, 4):
            run(k, 1.0)
    run(3, 1.6)  # its first round, disturbed
    assert policy.calibration(4, rows=8) == pytest.approx(1.0 + 0.2 * 0.6, abs=1e-3)
    for _ in range(3 * policy.stale_rounds):  # a slow spell of k = 2 rounds: width 4 goes stale
        run(2, 1.2)
    assert policy.calibration(4, rows=8) == pytest.approx(1.2, abs=0.03)  # the line through the fresh widths
    assert policy.calibration(3, rows=8) == pytest.approx(1.2, abs=1e-3)


def _two_bucket_table(fixed: float, per_token: float) -> CostTable:
    """Batches of 1 and 4 rows (trace D's profile), packed rounds measured at 4: fixed + per_token x tokens."""
    batches = (1, 4)
    packed = ((), tuple(fixed + per_token * n for n in range(4, 4 * WIDTHS[-1] + 1)))
    return CostTable(batches, WIDTHS, tuple(tuple(fixed + per_token * b * w for w in WIDTHS) for b in batches), 0,
                     packed)


@pytest.mark.parametrize("per_token, pays", [(5e-4, False), (5e-5, True)])
def test_combination_is_priced_as_the_padded_forward_that_runs_it(per_token, pays):
    """Combination's candidates run in one padded forward of rows + candidates rows x (k + 1) tokens. Trace D, session
    62: 4-row rounds priced at ~57 ms by the ~12 tokens they verified took 115-175 ms with 1-4 candidates, where the
    check had priced 8 rows of the same trimmed tokens a row (within 10% on some rounds). Here trimmed rounds verify
    1.5 tokens a row: 8 such rows would cost 6% more, but the padded forward of 8 x 5 tokens costs 32% more past the
    ridge (per_token 5e-4 of a 0.05 s round) and 4% more where the forward is memory-bound (5e-5)."""
    table = _two_bucket_table(0.05, per_token)
    policy = policy_with(table, [0.9, 0.8, 0.6, 0.4], trimmed_rows=8, decay=0.5)
    for _ in range(20):
        policy.history.append(4)
        policy.observe_round(4, [4] * 4, [4] * 4, draft_s=0.0, round_s=table.packed_cost(4, 6), rows=4, tokens=6)
    alone = policy.verify_seconds(4, 4)
    assert alone == pytest.approx(table.packed_cost(4, 6), rel=1e-3)
    if not pays:  # what the check weighed before: 8 rows at the trimmed rounds' tokens, within its 10%
        assert table.packed_cost(8, 12) <= 1.1 * alone
    assert policy.padded_verify_seconds(8, 4) == pytest.approx(table.cost(8, 5) * policy.calibration(1, rows=4))
    assert policy.combination_pays(4, 4, 4, max_extra=0.1) is pays
    assert not policy.combination_pays(4, 4, 0, max_extra=0.1)  # nothing to combine in a plain round
    assert not policy.combination_pays(4, 0, 4, max_extra=0.1)


def _staircase_table() -> CostTable:
    """Batches of 1 and 4 rows, packed rounds measured at 4 on a staircase: 4-12 tokens 50-54 ms, 13-20 tokens 75-89 ms
    (trace D's profile on the Zen 5 CPU of session 62: 12 tokens ~55 ms, 13 ~75 ms)."""
    def packed(n: int) -> float:
        return 0.050 + 0.0005 * (n - 4) if n <= 12 else 0.075 + 0.002 * (n - 13)

    seconds = (tuple(0.045 + 0.001 * w for w in WIDTHS), tuple(packed(4 * w) for w in WIDTHS))
    return CostTable((1, 4), WIDTHS, seconds, 0, ((), tuple(packed(n) for n in range(4, 21))))


def test_a_width_run_is_priced_at_the_mean_cost_of_its_rounds_not_the_cost_of_their_mean_tokens():
    """Trace D, session 62: one run's first k = 4 round kept all 20 of its drafted tokens, its later k = 4 rounds 12.
    Priced at the packed cost of the rounds' mean tokens (an EMA that took the first round whole), k = 4 stood past the
    profile's step at 12 tokens (~80 ms where its rounds took 52-67), and the run held k = 2 for 157 rounds. A width
    run is priced at the mean of what its rounds cost (`row_cost_share`), and a width's first rounds are a running
    mean."""
    table = _staircase_table()
    policy = policy_with(table, [0.9, 0.8, 0.7, 0.6], trimmed_rows=8, hysteresis=0.0)

    def run(k: int, tokens: int) -> None:
        policy.history.append(k)
        policy.observe_round(k, [k] * 4, [k] * 4, draft_s=0.0, round_s=table.packed_cost(4, tokens), rows=4,
                             tokens=tokens)

    run(2, 12)
    run(4, 20)  # a first deep round whose drafts were all kept
    for _ in range(3):
        run(4, 12)
    mean = (table.packed_cost(4, 20) + 3 * table.packed_cost(4, 12)) / 4
    assert policy.row_tokens[("", 4, 5)] == pytest.approx(3.5)  # the running mean of its first rounds' tokens
    assert table.packed_cost(4, 14) > 1.2 * mean  # what those mean tokens cost: past the step
    assert policy.verify_seconds(4, 4) == pytest.approx(mean, rel=1e-3)
    assert policy.verify_seconds(4, 2) == pytest.approx(table.packed_cost(4, 12), rel=1e-3)
    # E[k = 4] / E[k = 2] = 3.75 / 2.7 tokens a row: k = 4 at ~63 ms beats k = 2 at 54 ms (at ~81 ms it would not)
    policy.stats.accept_through = [0.9, 0.8, 0.6, 0.45]
    assert policy.best(4) == 4
    for _ in range(40):  # then an EMA: what its rounds cost lately
        run(4, 12)
    assert policy.verify_seconds(4, 4) == pytest.approx(table.packed_cost(4, 12), rel=1e-3)
