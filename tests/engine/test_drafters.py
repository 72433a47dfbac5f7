"""The drafter interface and registry: every registered kind builds from its config and keeps a round's caps.

Exactness with the engine lives in test_exactness; each method's own behaviour in its own test file.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specactor_engine.config import FeatureDrafterConfig, ModelDrafterConfig, NgramDrafterConfig, SuffixDrafterConfig
from specactor_engine.drafters import DRAFTER_REGISTRY, Drafter, DraftRequest, DrafterContext, build_drafter
from specactor_engine.drafters.base import FeedCost
from specactor_engine.drafters.feature import FeatureDrafter
from specactor_engine.drafters.model import ModelDrafter
from specactor_engine.model.runner import ModelRunner
from specactor_engine.drafters.ngram import NgramDrafter
from specactor_engine.drafters.suffix import SuffixDrafter
from specactor_engine.sampling import SamplingParams
from specactor_engine.state import SequenceState
from tests.fixtures.tiny_models import VOCAB_SIZE, make_tiny_model, make_tokenizer, save_tiny_model

BUILT = {"model": ModelDrafter, "feature": FeatureDrafter, "ngram": NgramDrafter, "suffix": SuffixDrafter}
MODELS = ("model", "feature")  # kinds that draft with a model (every token they may)
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4]  # repeats, so the model-free methods find something to copy
OUTPUT = [1, 2]  # output so far: what the suffix drafter matches
CAPS = [0, 2, 5, 3]  # per row of a round; 0 skips the row


@pytest.fixture(scope="module")
def context() -> DrafterContext:
    return DrafterContext("cpu", "float32", make_tokenizer(), VOCAB_SIZE)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    draft_dir: Path = save_tiny_model(tmp_path_factory.mktemp("drafters") / "draft", "llama", seed=1, num_layers=1)
    return {"model": ModelDrafterConfig(model=str(draft_dir)), "ngram": NgramDrafterConfig(max_n=3),
            "suffix": SuffixDrafterConfig(min_match=1), "feature": FeatureDrafterConfig()}


def test_every_registered_kind_is_covered_here():
    """A new drafter kind must be added to these tests (and so to the registry's contract)."""
    assert set(DRAFTER_REGISTRY) == set(BUILT)


@pytest.mark.parametrize("kind", sorted(BUILT))
def test_build_drafter_builds_each_kind_from_its_config(kind: str, configs, context):
    drafter = build_drafter(configs[kind], context)
    assert type(drafter) is BUILT[kind]
    assert drafter.name == configs[kind].name
    assert drafter.model_free == (kind not in MODELS)
    assert drafter.needs_target == (kind == "feature")


def test_an_unknown_kind_is_refused_naming_the_known_ones(context):
    with pytest.raises(ValueError, match=r"unknown drafter kind 'eagle'; known: feature, model, ngram, suffix"):
        build_drafter(SimpleNamespace(kind="eagle"), context)


def _state_with_output() -> SequenceState:
    """One row per cap, each with PROMPT and OUTPUT committed."""
    state = SequenceState.allocate(len(CAPS), 32)
    tokens = torch.tensor(PROMPT + OUTPUT)
    state.tokens[:, : len(tokens)] = tokens
    state.lengths[:] = len(tokens)
    state.prompt_lengths[:] = len(PROMPT)
    state.seq_keys[:] = torch.arange(len(CAPS))
    return state


def _propose(drafter: Drafter, state: SequenceState, caps: list[int], coupled_noise: bool = True):
    slots = torch.arange(len(caps))
    if drafter.needs_target:  # a target that has run over the committed tokens (all but the newest), as the engine's
        runner = ModelRunner(make_tiny_model("llama", seed=0), record_features=True)
        runner.allocate(len(caps), state.tokens.shape[1])
        counts = state.lengths[slots] - 1
        runner.forward(state.tokens[slots, : int(counts.max())], slots, counts, logits_at="none")
        runner.commit(slots, counts)
        drafter.bind_target(runner)
    drafter.allocate(len(caps), state.tokens.shape[1])
    drafter.add_rows(state, slots)
    request = DraftRequest(slots, torch.tensor(caps), SamplingParams(temperature=1.0), coupled_noise=coupled_noise)
    return drafter.propose(state, request)


@pytest.mark.parametrize("kind", sorted(BUILT))
def test_propose_keeps_each_rows_cap(kind: str, configs, context):
    """At most max_draft_tokens[r] per row (none for a skipped row), k = the largest cap, ids in the vocabulary;
    a model drafts every token it may, the model-free methods what the text gives (here: something)."""
    proposal = _propose(build_drafter(configs[kind], context), _state_with_output(), CAPS)
    caps = torch.tensor(CAPS)
    assert proposal.token_ids.shape == (len(CAPS), max(CAPS))
    assert bool((proposal.num_tokens >= 0).all()) and bool((proposal.num_tokens <= caps).all())
    assert int(proposal.num_tokens[0]) == 0
    assert int(proposal.num_tokens.sum()) > 0
    if kind in MODELS:
        assert torch.equal(proposal.num_tokens, caps)
    for row, count in enumerate(proposal.num_tokens.tolist()):
        drafted = proposal.token_ids[row, :count]
        assert bool(((drafted >= 0) & (drafted < VOCAB_SIZE)).all())


def test_ngram_drafts_copy_what_followed_the_latest_match(configs, context):
    """PROMPT + OUTPUT ends in '4 1 2' (max_n 3), seen before only at positions 3..5, then '3 4 1 2'."""
    proposal = _propose(build_drafter(configs["ngram"], context), _state_with_output(), CAPS)
    assert proposal.num_tokens.tolist() == [0, 2, 4, 3]  # the 5-cap row: only 4 tokens follow the match
    assert proposal.token_ids[1, :2].tolist() == [3, 4]
    assert proposal.token_ids[2, :4].tolist() == [3, 4, 1, 2]
    assert proposal.token_ids[3, :3].tolist() == [3, 4, 1]


def test_independent_noise_drafts_come_with_their_distributions(configs, context):
    """coupled_noise=False (classic rejection sampling) needs q: a model drafter returns [R, k, V] probabilities."""
    proposal = _propose(build_drafter(configs["model"], context), _state_with_output(), CAPS, coupled_noise=False)
    assert proposal.probs is not None and proposal.probs.shape == (len(CAPS), max(CAPS), VOCAB_SIZE)
    for row, count in enumerate(proposal.num_tokens.tolist()):
        probs = proposal.probs[row, :count]
        torch.testing.assert_close(probs.sum(-1), torch.ones(count, dtype=probs.dtype), rtol=0, atol=1e-5)
        drawn = probs.gather(-1, proposal.token_ids[row, :count, None])
        assert bool((drawn > 0).all())  # each draft was drawn from its own distribution


def test_a_feed_costs_a_call_and_a_rate_per_token():
    """Trace D's feature-level drafter: 1 token fed in 4.9 ms, a 72-token prompt in 9 ms. After one-token catch-ups
    a rate per token priced a 400-token catch-up at over a second; the fitted line prices it at what such a
    forward costs (call + tokens x rate), from a history of mostly small feeds."""
    call_s, token_s = 4.5e-3, 6e-5
    feed = FeedCost()
    assert not feed.measured
    for tokens in [72, 1, 1, 2, 72, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1]:
        feed.observe(tokens, call_s + token_s * tokens)
    assert feed.terms() == pytest.approx((call_s, token_s), rel=1e-6)
    assert feed.seconds(400) == pytest.approx(call_s + 400 * token_s)
    assert feed.seconds(0) == 0.0
    # one size seen: proportional (cautious for a bigger catch-up), not a guessed call cost
    same = FeedCost()
    for _ in range(3):
        same.observe(8, 0.016)
    assert same.terms() == pytest.approx((0.0, 0.002))
    # a fit whose call cost would be negative falls back to the line through the origin
    steep = FeedCost()
    steep.observe(10, 0.001)
    steep.observe(100, 0.1)
    call, rate = steep.terms()
    assert call == 0.0 and rate == pytest.approx((0.001 + 0.1) / 110)
    # newer feeds outweigh older ones (the machine's load changes)
    drift = FeedCost()
    for tokens in [1, 50] * 10:
        drift.observe(tokens, call_s + token_s * tokens)
    for tokens in [1, 50] * 40:
        drift.observe(tokens, 2 * (call_s + token_s * tokens))
    assert drift.seconds(50) == pytest.approx(2 * (call_s + 50 * token_s), rel=0.01)


def test_a_drafter_s_first_feed_is_left_out_of_its_feed_cost(configs, context):
    """A first feed pays one-time costs: trace A's feature-level drafter fed 82 tokens in 325 ms (the warm-up's
    prompt), then 495 in 219 ms; with the first in the fit the line fell with the tokens, the fit became a flat
    272 ms a feed, and a 2,543-token catch-up that took 974 ms was put at 272 ms (the probes' gate and budget weigh
    that estimate). Left out, the fit is the second feed's rate until a third differs in size."""
    drafter = build_drafter(configs["suffix"], context)  # any drafter: the bookkeeping is the base class's
    drafter.observe_feed(0.325, 82)
    assert drafter.feed is None and drafter.feed_warmed
    drafter.observe_feed(0.219, 495)
    assert drafter.feed.terms() == pytest.approx((0.0, 0.219 / 495))
    assert drafter.feed.seconds(2543) == pytest.approx(2543 * 0.219 / 495)  # 1.13 s; it took 0.97 s
    kept = build_drafter(configs["suffix"], context)
    kept.feed_warmed = True  # as the code before: both feeds in the fit
    kept.observe_feed(0.325, 82)
    kept.observe_feed(0.219, 495)
    assert kept.feed.seconds(2543) < 0.3


@pytest.mark.parametrize("kind", sorted(BUILT))
def test_a_draft_model_knows_what_it_would_catch_up_and_at_what_rate(kind: str, configs, context):
    """What the probe budget weighs before a draft model is probed: the committed tokens its cache lacks
    (`behind`) at its measured feed rate. The prompt prefill measures the rate; tokens committed while other
    methods drafted make it fall behind; drafting catches it up. Model-free methods never are behind."""
    drafter, state = build_drafter(configs[kind], context), _state_with_output()
    slots = torch.arange(len(CAPS))
    drafter.feed_warmed = True  # past its first feed (left out: the next test)
    _propose(drafter, state, [0] * len(CAPS))  # admitted and prefilled; no row drafted
    if kind not in MODELS:
        assert drafter.feed is None and int(drafter.behind(state, slots).sum()) == 0
        assert drafter.catch_up_estimate_s(state, slots) == 0.0
        return
    assert drafter.feed is not None and drafter.feed.seconds(1) > 0
    before = drafter.behind(state, slots)
    state.tokens[:, state.lengths[0]: state.lengths[0] + 6] = torch.tensor([5, 6, 7, 5, 6, 7])
    state.lengths += 6  # six more tokens committed while other methods drafted
    assert torch.equal(drafter.behind(state, slots), before + 6)
    drafter.feed_s_prior = 1.0  # measured beats the prior
    assert drafter.catch_up_estimate_s(state, slots) == pytest.approx(drafter.feed.seconds(int((before + 6).sum())))
    # what a round drafting every round feeds anyway (steady: max_k + 1 a row) is not a catch-up
    assert drafter.catch_up_estimate_s(state, slots, steady=6) == pytest.approx(drafter.feed.seconds(int(before.sum())))
    # nothing measured (its prefill deferred): the engine's prior rate, not free (trace A: ~6 s of catch-up
    # counted as nothing)
    feed, drafter.feed = drafter.feed, None
    assert drafter.catch_up_estimate_s(state, slots) == pytest.approx(float((before + 6).sum()) * 1.0)
    drafter.feed = feed
    request = DraftRequest(slots, torch.tensor([2] * len(CAPS)), SamplingParams(temperature=1.0))
    drafter.propose(state, request)
    assert drafter.catch_up_s > 0 and int(drafter.behind(state, slots).max()) == 0



@pytest.mark.parametrize("kind", MODELS)
def test_a_stop_ends_a_model_s_drafting_early_and_leaves_its_next_round_unchanged(kind: str, configs, context):
    """DraftRequest.stop (draft trimming's early end, run.py `_draft_stop`) is asked after each draft step but the
    last with the confidence so far; answering True after the second step leaves two drafts a row, the first two of
    an unstopped drafting, and the drafter's next round drafts what a drafter that was never stopped drafts (the
    model drafter keeps count of the drafts it fed)."""
    state, slots = _state_with_output(), torch.arange(len(CAPS))
    unstopped, stopped = build_drafter(configs[kind], context), build_drafter(configs[kind], context)
    full = _propose(unstopped, state, CAPS)
    if kind == "feature":  # the same target and draft layer for both
        stopped.bind_target(unstopped.target)
        stopped.model.load_state_dict(unstopped.model.state_dict())
    stopped.allocate(len(CAPS), state.tokens.shape[1])
    stopped.add_rows(state, slots)
    asked: list[tuple[int, ...]] = []

    def stop(confidence: torch.Tensor) -> bool:
        asked.append(tuple(confidence.shape))
        return confidence.shape[1] == 2

    params = SamplingParams(temperature=1.0)
    short = stopped.propose(state, DraftRequest(slots, torch.tensor(CAPS), params, confidence=True, stop=stop))
    assert asked == [(3, 1), (3, 2)]  # the three rows with a cap, after steps 1 and 2 of 5
    assert short.token_ids.shape == (len(CAPS), 2) and short.num_tokens.tolist() == [0, 2, 2, 2]
    assert torch.equal(short.token_ids[1:], full.token_ids[1:, :2])
    assert short.confidence is not None and short.confidence.shape == (len(CAPS), 2)
    # every row commits the first draft and a bonus token; the next round is the same for both drafters
    state.tokens[slots, state.lengths[slots]] = full.token_ids[:, 0]
    state.tokens[slots, state.lengths[slots] + 1] = 7
    state.lengths[slots] += 2
    if kind == "feature":  # the target runs over what was committed (all but the newest), as a verify does
        runner = unstopped.target
        tokens, counts = state.gather(slots, runner.lengths[slots], int((state.lengths - 1 - runner.lengths).max()))
        counts = state.lengths[slots] - 1 - runner.lengths[slots]
        runner.forward(tokens, slots, counts, logits_at="none")
        runner.commit(slots, counts)
    for drafter in (stopped, unstopped):
        drafter.observe_commit(state, slots)
    again = DraftRequest(slots, torch.tensor([3, 3, 3, 3]), params)
    assert torch.equal(stopped.propose(state, again).token_ids, unstopped.propose(state, again).token_ids)
