"""Draft trimming (policies/draft_trim.py) and the packed verify it relies on (ModelRunner.forward_packed): the
confidence calibration, the choice of positions, the packed forward's logits and KV, and exactness against plain
decoding with trimming on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specactor_engine import clock
from specactor_engine.model.runner import ModelRunner
from specactor_engine.policies.draft_trim import ConfidenceCalibration, choose_tokens
from specactor_engine.policies.verify_length import CostProfile, CostTable
from tests.engine.test_exactness import ragged_requests, run, sampling, token_ids
from tests.engine.test_feature_drafter import engine_with, feature_drafter
from tests.fixtures.tiny_models import make_tiny_model

NAN = float("nan")


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("qwen2", seed=3, num_layers=2, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- calibration
def test_calibration_starts_at_the_confidence_and_learns_each_bucket_s_acceptance():
    calibration = ConfidenceCalibration(buckets=10, prior_weight=2.0)
    np.testing.assert_allclose(calibration.rates("m", np.array([0.05, 0.55, 1.0])), [0.05, 0.55, 0.95])
    calibration.observe("m", [0.05] * 98, [True] * 49 + [False] * 49)  # low confidence, accepted half the time
    calibration.observe("m", [0.97] * 8, [False] * 8)
    low, high = calibration.rates("m", np.array([0.01, 0.99]))
    assert low == pytest.approx((0.05 * 2 + 49) / 100)
    assert high == pytest.approx(0.95 * 2 / 10)
    assert calibration.rates("other", np.array([0.01]))[0] == pytest.approx(0.05)  # per method


def test_calibration_forgets_past_its_horizon():
    calibration = ConfidenceCalibration(buckets=10, prior_weight=2.0, horizon=50.0)
    calibration.observe("m", [0.95] * 400, [True] * 400)
    calibration.observe("m", [0.95] * 50, [False] * 50)
    assert calibration.rates("m", np.array([0.95]))[0] < 0.5  # a fixed count would still say > 0.85


def test_a_round_s_outcomes_count_only_the_positions_it_reached():
    calibration = ConfidenceCalibration(buckets=10, prior_weight=1e-6)
    confidence = np.array([[0.95, 0.15, 0.15], [0.95, 0.95, 0.95], [NAN, NAN, NAN]])
    # row 0: first accepted, second rejected (third never decided); row 1 verified 1 and accepted it; row 2: none
    calibration.observe_round(confidence, ["m", "m", "m"], np.array([3, 1, 3]), np.array([1, 1, 2]))
    assert calibration.rates("m", np.array([0.95]))[0] == pytest.approx(1.0)  # 2 of 2
    assert calibration.rates("m", np.array([0.15]))[0] == pytest.approx(0.0, abs=1e-5)  # 0 of 1, the third unseen
    assert calibration._seen["m"].sum() == pytest.approx(3, abs=1e-4)


# ---------------------------------------------------------------------------------------------- choosing positions
def step_cost(block: int):
    """Seconds of a round of n real tokens: 1 (drafting, host work) and 1 per started block of `block` tokens
    (oneDNN's row blocking)."""
    return lambda n: 1.0 + math.ceil(n / block)


def test_the_positions_that_fit_the_cheaper_block_are_the_likeliest():
    calibration = ConfidenceCalibration(prior_weight=1.0)  # the confidences as they are (bucket middles)
    confidence = np.array([[0.95, 0.95, 0.95], [0.35, 0.95, 0.95], [0.95, 0.15, 0.95], [0.55, 0.55, 0.55]])
    # 4 rows + 12 drafts; blocks of 6 tokens: up to 6 tokens cost 2, 7-12 cost 3, 13-16 cost 4
    kept = choose_tokens(np.array([3, 3, 3, 3]), confidence, ["m"] * 4, calibration, step_cost(6))
    # 12 tokens (the 8 likeliest positions: 9.21 expected) at 3 beat 6 (5.9) at 2 and 16 (9.95) at 4; each row keeps
    # a prefix, row 1's three 0.35-0.32 chances before row 3's second (0.30)
    np.testing.assert_array_equal(kept, [3, 3, 1, 1])


def test_rows_without_confidence_are_kept_whole_and_occupy_the_budget():
    calibration = ConfidenceCalibration(prior_weight=1.0)
    confidence = np.array([[NAN, NAN], [0.95, 0.95], [0.95, 0.15]])
    kept = choose_tokens(np.array([2, 2, 2]), confidence, ["ngram", "m", None], calibration, step_cost(6))
    # rows 0 and 2 (no confidence / no method) keep their 2 drafts: 3 + 4 tokens fixed, so the second block is
    # already started and both confident positions fit in it
    np.testing.assert_array_equal(kept, [2, 2, 2])
    alone = choose_tokens(np.array([0, 2, 0]), np.array([[NAN] * 2, [0.95, 0.95], [NAN] * 2]), [None, "m", None],
                          calibration, step_cost(4))
    np.testing.assert_array_equal(alone, [0, 1, 0])  # 3 rows + 1 draft fill the first block; a fifth token costs 1


def test_drafts_worth_less_than_their_time_are_all_cut():
    calibration = ConfidenceCalibration(prior_weight=1.0)
    linear = lambda n: 1.0 + 0.5 * n  # noqa: E731 - each token costs half a 1-row round's fixed part
    kept = choose_tokens(np.array([2, 2]), np.array([[0.05, 0.05], [0.95, 0.05]]), ["m", "m"], calibration, linear)
    np.testing.assert_array_equal(kept, [0, 1])


def test_packed_costs_are_measured_and_interpolated():
    table = CostTable((1, 4), (1, 2, 3), ((1.0, 2.0, 3.0), (4.0, 6.0, 8.0)), 0,
                      ((), (4.0, 4.0, 4.0, 5.0, 6.0, 6.5, 7.0, 7.5, 8.0)))
    assert table.packed_cost(4, 6) == 4.0  # measured
    assert table.packed_cost(1, 2) == 2.0  # not measured packed: the width-2 round
    assert table.packed_cost(16, 24) == pytest.approx(table.cost(16, 1) + 0.5 * (table.cost(16, 2) - table.cost(16, 1)))
    restored = CostTable.from_dict(table.to_dict())
    assert restored == table
    profile = CostProfile((table, CostTable((1, 4), (1, 2, 3), table.seconds, 256,
                                           tuple(tuple(2 * x for x in row) for row in table.packed))))
    assert profile.packed_cost(4, 6, context=128) == pytest.approx(6.0)


# ---------------------------------------------------------------------------------------------- the packed forward
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_packed_forward_equals_the_padded_one_at_the_real_positions(dtype):
    """The ragged block's real tokens, one per forward row: the logits and the KV of the padded block (float32 runs
    the CPU kernels: packed linears and the paged attention kernel)."""
    model = make_tiny_model("qwen2", seed=5, num_layers=2, dtype=dtype)
    slots, prompt = torch.tensor([0, 1, 2]), torch.randint(0, 200, (3, 7), generator=torch.Generator().manual_seed(1))
    block = torch.randint(0, 200, (3, 4), generator=torch.Generator().manual_seed(2))
    widths = torch.tensor([4, 1, 2])
    outputs = []
    for packed in (False, True):
        runner = ModelRunner(model)
        runner.allocate(3, 32)
        runner.forward(prompt, slots, logits_at="none")
        runner.commit(slots, torch.full((3,), 7))
        logits = runner.forward_packed(block, slots, widths) if packed else runner.forward(block, slots, widths)
        runner.commit(slots, widths)
        after = runner.forward(torch.tensor([[9], [9], [9]]), slots)  # reads the KV the block wrote
        outputs.append((logits, after))
    (padded, padded_after), (packed, packed_after) = outputs
    real = torch.arange(4)[None, :] < widths[:, None]
    # equal up to the GEMMs' summation order (BLAS and oneDNN block a matmul's rows by their count), as a decode
    # step and a verify block are
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(packed[real], padded[real], **tolerance)
    assert torch.equal(packed[~real], torch.zeros_like(packed[~real]))
    torch.testing.assert_close(packed_after, padded_after, **tolerance)
    assert not torch.allclose(packed[real][1:], packed[real][:-1])  # the comparison is not between zeros


# ---------------------------------------------------------------------------------------------- exactness
def trimming_table(steep: bool = True) -> CostTable:
    """A plain round at 10 ms; packed rounds of 1-16 rows measured with a cost that jumps every 6 tokens."""
    batches, widths = (1, 4, 16), (1, 2, 3, 4, 5)
    seconds = tuple(tuple(0.01 + 0.0001 * b * w for w in widths) for b in batches)
    packed = tuple(tuple(0.01 * math.ceil(n / 6) if steep else 0.01 for n in range(b, b * 5 + 1)) for b in batches)
    return CostTable(batches, widths, seconds, 0, packed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trimmed_rounds_emit_what_plain_decoding_does(target, temperature):
    """With trimming on and a verify cost that jumps every 6 tokens, rounds verify only part of their drafts, in
    packed forwards; the output equals plain decoding token for token (fp64)."""
    params = sampling(temperature, n=2, max_new_tokens=30)
    requests = ragged_requests(4, seed=4)  # 8 rows: trimming prices rounds of up to 8 (PACKED_MAX_ROWS)
    reference = token_ids(run(target, requests, params))
    drafter = feature_drafter(target)
    drafter.cost_share = 0.01
    drafter.catch_up_estimate_s = lambda state, slots, steady=0: 0.0
    engine = engine_with(target, [drafter], "coupled", cost_table=trimming_table(), verify_length="dynamic",
                         draft_trimming=True)
    # a clock that stands still: every round calibrates alike, so the rounds draft and are trimmed as the table says;
    # on the wall clock a busy machine can make the tiny model's rounds look dear against it (the next test's note)
    with clock.replaced(lambda: 0.0):
        result = engine.generate(requests, params)
    assert token_ids(result) == reference
    assert result.stats.trimmed_tokens > 0
    # the verify length prices the trimmed rounds by the tokens they verified (`VerifyLengthPolicy.row_tokens`)
    row_tokens = engine.length_policy.row_tokens
    assert row_tokens and all(1.0 <= t <= width for (_, _, width), t in row_tokens.items())
    assert any(t < width for (_, _, width), t in row_tokens.items())  # cut rounds verified fewer than their width
    untrimmed = engine_with(target, [feature_drafter(target)], "coupled", cost_table=trimming_table(),
                            verify_length="dynamic", draft_trimming=False).generate(requests, params)
    assert untrimmed.stats.trimmed_tokens == 0
    assert token_ids(untrimmed) == reference


def test_drafting_ends_where_every_deeper_draft_would_be_cut_and_output_is_unchanged(target):
    """Where each verified draft costs what a plain round does (packed), trimming cuts every row's deeper drafts: the feature
    drafter's steps end there (`draft_stops`) instead of drafting to the round's length, and the output still equals
    plain decoding (fp64). The same rounds without the early end draft deeper only to have it cut."""
    params = sampling(1.0, n=2, max_new_tokens=30)
    requests = ragged_requests(4, seed=4)  # 8 rows: trimming prices rounds of up to 8 (PACKED_MAX_ROWS)
    reference = token_ids(run(target, requests, params))
    batches, widths = (1, 4, 16), (1, 2, 3, 4, 5)
    seconds = tuple(tuple(0.01 + 0.0001 * b * w for w in widths) for b in batches)  # the verify length drafts deep
    packed = tuple(tuple(0.01 * (1 + n - b) for n in range(b, b * 5 + 1)) for b in batches)  # a token: a round
    steps = []
    drafter = feature_drafter(target)
    drafter.cost_share = 0.01
    drafter.catch_up_estimate_s = lambda state, slots, steady=0: 0.0
    draft = drafter._draft

    def counting(state, slots, k, request):
        out = draft(state, slots, k, request)
        steps.append((k, out[0].shape[1]))
        return out

    drafter._draft = counting
    engine = engine_with(target, [drafter], "coupled", cost_table=CostTable(batches, widths, seconds, 0, packed),
                         verify_length="dynamic", draft_trimming=True)
    # a clock that stands still: every round calibrates alike, so the rounds follow the table; on the wall clock a
    # machine busy with other work made the tiny model's rounds look dear against it, and the policy stopped drafting
    with clock.replaced(lambda: 0.0):
        result = engine.generate(requests, params)
    assert token_ids(result) == reference
    assert result.stats.draft_stops > 0 and result.stats.trimmed_tokens > 0
    assert sum(k > drafted for k, drafted in steps) == result.stats.draft_stops


def test_only_ragged_rounds_of_a_few_rows_are_packed():
    """Up to verifier.PACK_MAX_ROWS rows a ragged round runs packed; above it (and for a uniform round) padded: the
    verify length prices rounds by their padded width (docs/architecture.md 8.6)."""
    from specactor_engine.proposer import RoundDrafts
    from specactor_engine.state import SequenceState
    from specactor_engine.types import DraftProposal, EngineStats
    from specactor_engine.verifier import PACK_MAX_ROWS, Verifier

    calls = []

    class Spy:
        device = torch.device("cpu")

        def forward(self, inputs, slots, num_tokens):
            calls.append("padded")
            return torch.zeros(*inputs.shape, 5)

        def forward_packed(self, inputs, slots, num_tokens):
            calls.append("packed")
            return torch.zeros(*inputs.shape, 5)

    state = SequenceState.allocate(2 * PACK_MAX_ROWS, 8)
    state.lengths[:] = 1
    verifier = Verifier(Spy(), state, None, EngineStats(), False, 5, torch.zeros(0, dtype=torch.long), None, pack=True)
    for rows, ragged in ((PACK_MAX_ROWS, True), (PACK_MAX_ROWS, False), (PACK_MAX_ROWS + 1, True)):
        num = torch.full((rows,), 2)
        num[0] -= int(ragged)
        drafts = RoundDrafts(DraftProposal(torch.ones(rows, 2, dtype=torch.long), num), [None] * rows, num)
        verifier.verify(torch.arange(rows), drafts)
    assert calls == ["packed", "padded", "padded"]
