"""Draft arbitration (policies/arbitration.py): the expected tokens of a draft from its calibrated confidences, the
choice between a row's model draft and a model-free offer, and exactness against plain decoding with it on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specactor_engine import clock
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.policies.arbitration import better_offers, expected_tokens, observe_unverified, offer_key
from specactor_engine.policies.draft_trim import ConfidenceCalibration
from tests.engine.test_draft_trim import trimming_table
from tests.engine.test_exactness import make_drafter, ragged_requests, run, sampling, token_ids
from tests.engine.test_feature_drafter import engine_with, feature_drafter
from tests.fixtures.tiny_models import make_tiny_model

NAN = float("nan")


def test_expected_tokens_sum_the_chances_that_each_position_is_reached_and_accepted():
    calibration = ConfidenceCalibration(prior_weight=1.0)  # rates start at the buckets' middles
    confidence = np.array([[0.95, 0.95, 0.15], [0.55, NAN, NAN], [0.95, NAN, NAN], [NAN, NAN, NAN]])
    expected = expected_tokens(calibration, "m", confidence, np.array([2, 1, 2, 0]))
    # row 0 counts its first 2 positions only; row 2 has a position without confidence inside its drafts: unknown
    assert expected[0] == pytest.approx(0.95 + 0.95 * 0.95)
    assert expected[1] == pytest.approx(0.55)
    assert np.isnan(expected[2])
    assert expected[3] == 0.0  # no drafts: nothing expected


def test_what_the_calibration_learned_of_a_method_decides_which_draft_a_row_verifies():
    calibration = ConfidenceCalibration(prior_weight=1.0)
    own = expected_tokens(calibration, "feature", np.array([[0.45, 0.45]]), np.array([2]))
    offer_confidence = np.array([[0.75, 0.75]])
    before = expected_tokens(calibration, "suffix", offer_confidence, np.array([2]))
    assert better_offers(own, before).tolist() == [True]  # by the prior, the surer offer wins
    calibration.observe("suffix", [0.75] * 40, [False] * 40)  # such offers turned out rejected
    after = expected_tokens(calibration, "suffix", offer_confidence, np.array([2]))
    assert after[0] < own[0] and better_offers(own, after).tolist() == [False]


def test_an_unknown_or_equal_expectation_keeps_the_row_s_own_draft():
    own = np.array([1.0, NAN, 1.0, 0.5])
    offers = np.array([1.0, 2.0, NAN, 0.6])
    assert better_offers(own, offers).tolist() == [False, False, False, True]


def test_a_draft_not_verified_is_scored_as_far_as_the_row_emitted():
    calibration = ConfidenceCalibration(prior_weight=1.0)
    # drafts 7, 8, 9 against emitted 7, 5: the first accepted, the second rejected, the third never reached
    observe_unverified(calibration, ("suffix",), np.array([7, 8, 9]), np.array([0.75, 0.75, 0.95]), np.array([7, 5]))
    assert calibration.rates("suffix", np.array([0.75]))[0] == pytest.approx((0.75 + 1) / 3)
    assert calibration.rates("suffix", np.array([0.95]))[0] == pytest.approx(0.95)  # unchanged: not reached
    # a draft longer than what was emitted is scored only as far as the emitted tokens go
    observe_unverified(calibration, ("suffix",), np.array([1, 2, 3]), np.array([0.95, 0.95, 0.15]), np.array([1, 2]))
    assert calibration.rates("suffix", np.array([0.95]))[0] == pytest.approx((0.95 + 2) / 3)
    assert calibration.rates("suffix", np.array([0.15]))[0] == pytest.approx(0.15)


def test_an_offer_is_booked_and_expected_in_the_model_s_confidence_context():
    """An offer's acceptance is learned per context, the model's confidence in its first draft: suffix drafts that
    are accepted where the model is sure do not win the rows where it is unsure if they are rejected there."""
    assert [offer_key("suffix", c) for c in (0.0, 0.29, 0.3, 0.6, 0.89, 0.9, 1.0)] == [
        "suffix|0", "suffix|0", "suffix|1", "suffix|2", "suffix|2", "suffix|3", "suffix|3"]
    calibration = ConfidenceCalibration(prior_weight=1.0)
    offer = (np.array([5, 6]), np.array([0.75, 0.75]))
    for _ in range(30):  # sure model: the offer's tokens are what the row emits; unsure model: its first is not
        observe_unverified(calibration, ("suffix", offer_key("suffix", 0.95)), *offer, np.array([5, 6, 1]))
    for _ in range(10):
        observe_unverified(calibration, ("suffix", offer_key("suffix", 0.2)), *offer, np.array([4]))
    assert calibration.outcomes("suffix") == 70 and calibration.outcomes("suffix|3") == 60
    assert calibration.outcomes("suffix|0") == 10 and calibration.outcomes("suffix|1") == 0
    own = expected_tokens(calibration, "feature", np.array([[0.25, 0.25]]), np.array([2]))  # an unsure model
    pooled = expected_tokens(calibration, "suffix", offer[1][None, :], np.array([2]))
    in_context = expected_tokens(calibration, offer_key("suffix", 0.25), offer[1][None, :], np.array([2]))
    assert better_offers(own, pooled).tolist() == [True]  # the pooled rate (mostly sure rows) would swap the row
    assert better_offers(own, in_context).tolist() == [False]  # in its context the offer is rejected: kept


def one_layer_pair(noise: float):
    """A one-layer target and a feature drafter that would compute its features exactly (fc = [I | 0]), its weights
    perturbed by `noise` so that some drafts are rejected and its confidence varies."""
    one_layer = make_tiny_model("llama", seed=5, num_layers=1, dtype=torch.float64)
    model = FeatureDraftModel(one_layer)
    d = one_layer.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, :d] = torch.eye(d, dtype=torch.float64)
        for weight in model.parameters():
            weight.add_(noise * torch.randn(weight.shape, generator=gen, dtype=weight.dtype))
    drafter = feature_drafter(one_layer, model)
    drafter.cost_share = 0.01
    drafter.catch_up_estimate_s = lambda state, slots, steady=0: 0.0
    return one_layer, drafter


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_arbitrated_rounds_emit_what_plain_decoding_does(temperature):
    """Fastest-of-N over a feature drafter and suffix drafts with trimming: some rows the feature drafter drafted
    verify the suffix draft instead (`arbitrated_rows`), and the output equals plain decoding token for token (fp64);
    with arbitration off no row does, and the output is the same."""
    params = sampling(temperature, n=3, max_new_tokens=40, ignore_eos=True)
    requests = ragged_requests(2, seed=4)  # 6 rows: trimming (and arbitration) run in rounds of up to 8

    def generate(arbitration: bool):
        target, drafter = one_layer_pair(0.05)
        engine = engine_with(target, [drafter, make_drafter("suffix", target, torch.float64)], "specactor",
                             cost_table=trimming_table(), verify_length="dynamic", draft_trimming=True,
                             draft_arbitration=arbitration)
        with clock.replaced(lambda: 0.0):  # rounds priced by the table, not by a busy machine's wall clock
            return target, engine, engine.generate(requests, params)

    target, arbitrated_engine, arbitrated = generate(True)
    reference = token_ids(run(target, requests, params))
    assert token_ids(arbitrated) == reference
    assert arbitrated.stats.arbitrated_rows > 0
    assert arbitrated.stats.drafted_per_drafter.get("feature", 0) > 0
    calibration = arbitrated_engine.trim_calibration  # offers were booked in their contexts too
    contexts = sum(calibration.outcomes(offer_key("suffix", c)) for c in (0.0, 0.3, 0.6, 0.9))
    assert 0 < contexts <= calibration.outcomes("suffix")  # "suffix" also has the rows that chose suffix drafts
    _, _, plain = generate(False)
    assert plain.stats.arbitrated_rows == 0
    assert token_ids(plain) == reference
