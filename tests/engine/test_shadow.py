"""Shadow drafts: scored against the committed tokens exactly as a position-keyed verify would accept them."""

from __future__ import annotations

import pytest
import torch

from specactor_engine.drafters import Drafter
from specactor_engine.policies.shadow import (FAR_EVERY, FAR_MARGIN, SPARSE_EVERY, SPARSE_MARGIN, ShadowBook,
                                              ShadowDraft, choice_due, matched_prefix, shadows_due, sparse_every)
from specactor_engine.policies.verify_length import AcceptanceStats, CostTable, VerifyLengthPolicy
from specactor_engine.types import DraftProposal
from tests.engine.test_exactness import ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer


def test_matched_prefix_stops_at_the_first_difference():
    assert matched_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert matched_prefix([5, 6, 7], [5, 9, 7]) == 1  # a later match after a miss does not count
    assert matched_prefix([5, 6], []) == 0
    assert matched_prefix([], [1, 2]) == 0


def test_a_shadow_resolves_once_the_row_has_committed_past_it_or_finished():
    book = ShadowBook()
    book.add(3, ShadowDraft(start=2, tokens=(10, 11, 12), cap=4, method="ngram", request=7))
    book.add(3, ShadowDraft(start=2, tokens=(99,), cap=4, method="suffix", request=7))  # one per row: kept first
    assert book.resolve(3, [1, 2, 10, 11], finished=False) is None  # the third drafted position is not committed
    draft, accepted = book.resolve(3, [1, 2, 10, 11, 13], finished=False)
    assert (draft.method, accepted) == ("ngram", 2) and 3 not in book
    book.add(4, ShadowDraft(start=1, tokens=(5, 6, 7), cap=3, method="ngram", request=8))
    assert book.resolve(4, [0, 5, 6], finished=True)[1] == 2  # finished early: scored on what there is
    book.add(5, ShadowDraft(start=0, tokens=(), cap=4, method="suffix", request=9))
    assert book.resolve(5, [], finished=False)[1] == 0  # nothing drafted: nothing accepted, at once
    assert book.resolve(6, [1], finished=False) is None


class _PartlyRight(Drafter):
    """Drafts the plain run's own next tokens with one wrong token at a position that varies with the
    row and step (sometimes past the draft), and records every draft: (sequence key, start, tokens)."""

    name, model_free = "partly-right", True

    def __init__(self, outputs: dict[int, list[int]], vocab_size: int) -> None:
        self.outputs, self.vocab_size = outputs, vocab_size
        self.drafts: list[tuple[int, int, list[int]]] = []

    def propose(self, state, request):
        k = int(request.max_draft_tokens.max())
        token_ids = torch.zeros(len(request.slots), k, dtype=torch.long)
        num_tokens = request.max_draft_tokens.clone()
        for i, slot in enumerate(request.slots.tolist()):
            key, start = int(state.seq_keys[slot]), int(state.lengths[slot] - state.prompt_lengths[slot])
            cap = int(request.max_draft_tokens[i])
            tokens = (self.outputs[key][start : start + cap] + [0] * cap)[:cap]
            wrong = (start * 7 + key) % (cap + 2)
            if wrong < cap:
                tokens[wrong] = (tokens[wrong] + 1) % self.vocab_size
            token_ids[i, :cap] = torch.tensor(tokens)
            self.drafts.append((key, start, tokens))
        return DraftProposal(token_ids=token_ids, num_tokens=num_tokens)


def test_shadow_scores_equal_what_verifying_the_same_drafts_accepts():
    """With every draft verified (fixed k, no shadows) the engine's accepted count equals the drafts'
    common prefix with the plain run's outputs at their positions: the rule shadow drafts are scored by."""
    from specactor_engine.engine import Engine
    from specactor_engine.sampling import sequence_key

    target = make_tiny_model("qwen2", seed=5, dtype=torch.float64)
    params = sampling(1.0, n=2, max_new_tokens=30, ignore_eos=True)
    plain = run(target, ragged_requests(4), params)
    outputs = {sequence_key(0, o.request_id, o.sample_index): o.token_ids for o in plain.outputs}
    drafter = _PartlyRight(outputs, target.config.vocab_size)
    engine = Engine(target, make_tokenizer(), rollout("coupled", num_draft_tokens=4, verify_length="fixed"),
                    drafters=[drafter])
    result = engine.generate(ragged_requests(4), params)
    assert token_ids(result) == token_ids(plain)
    scored = [matched_prefix(tokens, outputs[key][start:]) for key, start, tokens in drafter.drafts]
    assert result.stats.accepted_tokens == sum(scored)
    assert len(set(scored)) >= 4  # rounds that accepted none, some and all of their drafts


class _OneColumn(Drafter):
    """A model-free drafter whose proposals are one column wide whatever it is asked for (a suffix or
    n-gram match shorter than the cap): the plain run's next token."""

    name, model_free = "one-column", True

    def __init__(self, outputs: dict[int, list[int]]) -> None:
        self.outputs = outputs

    def propose(self, state, request):
        token_ids = torch.zeros(len(request.slots), 1, dtype=torch.long)
        for i, slot in enumerate(request.slots.tolist()):
            key, start = int(state.seq_keys[slot]), int(state.lengths[slot] - state.prompt_lengths[slot])
            token_ids[i, 0] = (self.outputs[key][start:] + [0])[0]
        return DraftProposal(token_ids=token_ids, num_tokens=(request.max_draft_tokens > 0).long())


class _FixedLength:
    """A verify-length policy that always chooses `k` (between 0 and the full cap)."""

    def __init__(self, policy, k: int) -> None:
        self.policy, self.k, self.probe_deep = policy, k, False

    def choose(self, rows, context=None, regime="", options=None, catch_up_s=None, remaining_tokens=None):
        return self.k

    def __getattr__(self, name):
        return getattr(self.policy, name)


def test_a_proposal_narrower_than_the_round_is_cut_and_shadowed_exactly():
    """Regression (trace A): with a verify length between 0 and the full cap, a model-free drafter that
    returns fewer columns than the round verifies must be padded, its full draft kept as a shadow."""
    from specactor_engine.engine import Engine
    from specactor_engine.sampling import sequence_key
    from specactor_engine.policies.verify_length import AcceptanceStats, VerifyLengthPolicy
    from tests.engine.test_dynamic_verify_length import table

    target = make_tiny_model("qwen2", seed=5, dtype=torch.float64)
    params = sampling(1.0, n=2, max_new_tokens=30, ignore_eos=True)
    plain = run(target, ragged_requests(4), params)
    outputs = {sequence_key(0, o.request_id, o.sample_index): o.token_ids for o in plain.outputs}
    engine = Engine(target, make_tokenizer(), rollout("coupled", num_draft_tokens=4, verify_length="dynamic"),
                    drafters=[_OneColumn(outputs)], cost_table=table(0.01, 0.001), check_invariants=True)
    policy = VerifyLengthPolicy(table(0.01, 0.001), AcceptanceStats(max_k=4), probe_every=0)
    engine.length_policy = _FixedLength(policy, 3)
    result = engine.generate(ragged_requests(4), params)
    assert token_ids(result) == token_ids(plain)
    assert result.stats.shadow_drafts > 0 and result.stats.drafted_tokens > 0
    assert result.stats.accepted_tokens > 0  # the one drafted token is the plain run's own


def test_shadows_are_drafted_every_round_unless_plain_decoding_is_far_ahead():
    assert all(shadows_due(2, 0.1, n) for n in range(1, 9))  # speculating: every round
    assert all(shadows_due(0, SPARSE_MARGIN, n) for n in range(1, 9))  # speculation within reach: every round
    near = [shadows_due(0, FAR_MARGIN, n) for n in range(1, 4 * FAR_EVERY + 1)]  # far from paying
    assert near[0] and near[SPARSE_EVERY] and sum(near) == 4 * FAR_EVERY // SPARSE_EVERY  # then every SPARSE_EVERY-th
    # farther: every SPARSE_EVERY-th for the first FAR_EVERY rounds (their choices read the prior), then FAR_EVERY-th
    far = [shadows_due(0, 0.5, n) for n in range(1, 4 * FAR_EVERY + 1)]
    assert far[:FAR_EVERY] == near[:FAR_EVERY] and far[FAR_EVERY] and sum(far[FAR_EVERY:]) == 3
    assert sparse_every(0.5, FAR_EVERY - 1) == SPARSE_EVERY and sparse_every(0.5, FAR_EVERY) == FAR_EVERY


def test_while_plain_decoding_is_far_ahead_the_choice_is_remade_with_the_shadow_drafts():
    """choice_due counts the far rounds before this one, shadows_due those including it: the rounds that choose
    are the rounds that draft shadows, the first far round's choice included; a margin that moves between the two
    sparse tiers keeps them together (FAR_EVERY is a multiple of SPARSE_EVERY)."""
    assert FAR_EVERY % SPARSE_EVERY == 0 and FAR_MARGIN < SPARSE_MARGIN
    far_before = range(0, 4 * FAR_EVERY)
    for margins in ([0.9] * len(far_before), [0.5] * len(far_before), [0.5, 0.9] * (len(far_before) // 2)):
        due = [choice_due(n, margin) for n, margin in zip(far_before, margins)]
        assert due[0] and due[SPARSE_EVERY] and sum(due) >= 4 + 3
        assert due == [shadows_due(0, margin, n + 1) for n, margin in zip(far_before, margins)]
    assert all(choice_due(n, SPARSE_MARGIN) for n in range(8))


def test_the_policy_reports_how_far_speculation_is_from_paying():
    table = CostTable((4,), (1, 2, 3), ((1.0, 1.9, 2.8),))  # past the ridge: each draft nearly a step
    hopeless = VerifyLengthPolicy(table, AcceptanceStats(max_k=2, accept_through=[0.1, 0.01]), probe_every=0)
    assert hopeless.choose(4) == 0 and hopeless.speculation_margin == pytest.approx(1.1 / 1.9)
    sure = VerifyLengthPolicy(table, AcceptanceStats(max_k=2, accept_through=[1.0, 1.0]), probe_every=0)
    assert sure.choose(4) == 2 and sure.speculation_margin == pytest.approx(3 / 2.8)
