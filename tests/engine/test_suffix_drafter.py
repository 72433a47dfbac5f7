"""The suffix drafter: its tree, siblings and history, persistence; exactness lives in test_exactness."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specactor_engine.drafters.base import DraftRequest
from specactor_engine.drafters.suffix import SEPARATOR, SuffixDrafter, SuffixHistory, SuffixTree, suffix_continuation
from specactor_engine.engine import Engine
from specactor_engine.sampling import SamplingParams
from specactor_engine.state import SequenceState
from specactor_engine.types import Request
from tests.engine.test_exactness import MAX_LEN, rollout, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer


def test_tree_continues_the_longest_match_by_frequency():
    tree = SuffixTree(max_depth=6)
    tree.extend(1, [1, 2, 3, 4, 5])
    tree.extend(2, [9, 2, 3, 7, 8])
    tree.extend(3, [0, 2, 3, 7, 6])
    # "2 3" was followed by 7 twice and by 4 once: the most frequent wins
    assert tree.continuation([5, 2, 3], k=2, min_match=1) == [7, 6]  # 7->8 and 7->6 tie: smaller id
    # a longer match is preferred: "1 2 3" occurred once, followed by 4 5
    assert tree.continuation([1, 2, 3], k=3, min_match=1) == [4, 5]
    assert tree.continuation([4, 4], k=3, min_match=2) == []  # no match of length >= 2
    assert tree.continuation([42], k=3, min_match=1) == []


def test_tree_depth_is_bounded():
    tree = SuffixTree(max_depth=3)
    tree.extend(1, list(range(100)))
    # each position starts at most 3 nodes deep: at most 3 * 100 nodes
    assert tree.num_nodes <= 3 * 100
    node, depth = tree.root, 0
    while node.children:
        node = next(iter(node.children.values()))
        depth += 1
    assert depth <= 3


def test_history_is_bounded_and_round_trips(tmp_path):
    history = SuffixHistory(max_per_prompt=2)
    for i in range(3):
        history.add([1, 2], [i, i + 1])
    history.add([3], [7])
    assert history.get([1, 2]) == [[1, 2], [2, 3]] and len(history) == 3
    history.save(tmp_path / "suffix_history.jsonl")
    loaded = SuffixHistory(max_per_prompt=2)
    loaded.load(tmp_path / "suffix_history.jsonl")
    assert loaded.get([1, 2]) == [[1, 2], [2, 3]] and loaded.get([3]) == [[7]]


def test_siblings_and_history_drive_the_drafts():
    """Samples of one prompt share a tree: a second run of the same prompt (history) is drafted
    almost entirely from the first, and outputs stay identical to plain decoding."""
    target = make_tiny_model("qwen2", seed=3, dtype=torch.float64)
    drafter = SuffixDrafter(SimpleNamespace(name="suffix", max_depth=16, min_match=1, max_history=8))
    engine = Engine(target, make_tokenizer(), rollout("coupled", num_draft_tokens=4),
                    max_model_len=MAX_LEN, drafters=[drafter], check_invariants=True)
    plain = Engine(target, make_tokenizer(), rollout("ar"), max_model_len=MAX_LEN)
    requests = [Request("p", prompt_token_ids=[5, 6, 7, 8, 9])]
    params = sampling(0.0, n=3, max_new_tokens=30)  # greedy: the 3 samples are the same text
    first = engine.generate(requests, params)
    assert token_ids(first) == token_ids(plain.generate(requests, params))
    assert len(drafter.history) == 3  # every finished sample joined the history
    again = engine.generate(requests, params)
    assert token_ids(again) == token_ids(first)
    assert again.stats.acceptance_rate > first.stats.acceptance_rate
    assert again.stats.mean_acceptance_length > 2.0  # the history knows the whole answer


def test_history_survives_save_and_load_state(tmp_path):
    drafter = SuffixDrafter(SimpleNamespace(name="suffix", max_depth=8, min_match=1, max_history=4))
    drafter.history.add([1, 2, 3], [4, 5, 6])
    drafter.save_state(tmp_path / "drafters")
    restored = SuffixDrafter(SimpleNamespace(name="suffix", max_depth=8, min_match=1, max_history=4))
    restored.load_state(tmp_path / "drafters")
    assert restored.history.get([1, 2, 3]) == [[4, 5, 6]]
    SuffixDrafter(SimpleNamespace(name="other")).load_state(tmp_path / "drafters")  # nothing saved: no error


def _corpus(strings):
    parts = [[SEPARATOR]]
    for string in strings:
        parts += [list(string), [SEPARATOR]]
    return np.array([t for part in parts for t in part], dtype=np.int64)


@pytest.mark.parametrize("max_depth,min_match", [(2, 1), (3, 2), (5, 1), (8, 3)])
def test_the_scan_drafts_exactly_what_the_reference_tree_drafts(max_depth, min_match):
    """`suffix_continuation` (what the drafter runs) against the depth-bounded suffix tree, on random
    strings over a small vocabulary (many repeats, ties and partial matches)."""
    rng = np.random.default_rng(max_depth * 10 + min_match)
    for trial in range(40):
        strings = [rng.integers(0, 4, size=rng.integers(0, 30)).tolist() for _ in range(rng.integers(1, 5))]
        tree = SuffixTree(max_depth)
        for string_id, string in enumerate(strings):
            tree.extend(string_id, string)
        corpus = _corpus(strings)
        for _ in range(10):
            context = rng.integers(0, 4, size=rng.integers(0, 12)).tolist()
            if strings[0] and rng.random() < 0.5:  # a context that is a string's own end, as for a row
                context = strings[0][-rng.integers(1, len(strings[0]) + 1):]
            k = int(rng.integers(1, 6))
            scores: list[float] = []
            reference_scores: list[float] = []
            assert suffix_continuation(corpus, context, k, min_match, max_depth, scores) == \
                tree.continuation(context, k, min_match, reference_scores), (trial, strings, context, k)
            assert scores == reference_scores, (trial, strings, context, k)  # the paths' counts, as the tree holds them


def test_drafts_see_every_sibling_string_in_flight_or_finished():
    """What a draft sees must equal a tree holding the prompt and every sibling's committed output,
    in flight or finished, even when a finished row's slot is reused by a later row of the group."""
    drafter = SuffixDrafter(SimpleNamespace(name="suffix", max_depth=5, min_match=1, max_history=0))
    state = SequenceState.allocate(num_slots=3, max_len=64)
    prompt = [1, 2, 3]
    drafter.allocate(3, 64)

    def admit(slots):
        slots = torch.tensor(slots)
        for slot in slots.tolist():
            state.tokens[slot, :3] = torch.tensor(prompt)
            state.lengths[slot] = state.prompt_lengths[slot] = 3
        drafter.add_rows(state, slots)

    def commit(slots, rows):
        slots = torch.tensor(slots)
        state.append(slots, torch.tensor(rows), torch.tensor([len(r) for r in rows]))
        drafter.observe_commit(state, slots)

    generator = torch.Generator().manual_seed(0)
    outputs = {0: [], 1: [], 2: []}
    admit([0, 1, 2])
    finished = []
    checked = 0
    for step in range(12):
        live = [s for s in (0, 1, 2) if s in drafter.slot_group]
        rows = [torch.randint(1, 6, (3,), generator=generator).tolist() for _ in live]
        commit(live, rows)
        for slot, row in zip(live, rows):
            outputs[slot] += row
        if step == 3:  # slot 1 finishes; a new row of the same prompt takes its slot
            drafter.finish_rows(state, torch.tensor([1]))
            finished.append(outputs[1])
            outputs[1] = []
            admit([1])
        eager = SuffixTree(max_depth=5)
        for string_id, tokens in enumerate([prompt, *finished, outputs[0], outputs[1], outputs[2]]):
            eager.extend(string_id, tokens)
        for slot in (0, 1, 2):
            request = DraftRequest(torch.tensor([slot]), torch.tensor([3]), SamplingParams(), confidence=True)
            proposal = drafter.propose(state, request)
            drafted = proposal.token_ids[0, : int(proposal.num_tokens[0])].tolist()
            scores: list[float] = []
            expected = eager.continuation(outputs[slot][-4:], 3, 1, scores)
            assert drafted == expected, (step, slot)
            # each draft's confidence: its share of the path's continuations (drafters/suffix.py `draft_score`)
            assert proposal.confidence[0, : len(drafted)].tolist() == pytest.approx(scores), (step, slot)
            assert bool(proposal.confidence[0, len(drafted) :].isnan().all())
            checked += bool(expected)
    assert checked > 10  # the comparison saw real drafts, not only empty ones
