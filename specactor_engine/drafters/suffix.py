"""Suffix drafter: suffix matching per prompt over its siblings, history and prompt.

For every prompt (a GRPO group) the drafter keeps its strings: the prompt; the outputs of earlier
rollouts of the same prompt (`SuffixHistory`, bounded, persisted in the run directory); and the
outputs of the group's samples, in flight (read from the committed tokens) and finished. To draft
for a row, the longest suffix of its output (at most `max_depth - 1` tokens, at least `min_match`)
that occurs in those strings followed by a token is found, and the draft follows the most frequent
next token from there, one token at a time, while the matched path is shorter than `max_depth`.
The row's own newest occurrence has no next token yet, so it never proposes itself; earlier
repeats in its own output, siblings that went the same way, and past rollouts do.

These are exactly the drafts of a depth-bounded suffix tree over the same strings, whose nodes
count how often their path occurred (`SuffixTree`, kept as the reference the tests compare with).
The drafter does not build that tree: it computes the counts it needs at query time
(`suffix_continuation`, a vectorised scan of the group's strings). Indexing every committed token
into a tree cost ~25 us per token (one node per open suffix, in Python) whether or not the group
ever drafted again, and at large batches the engine drafts for few rows; a scan costs only when a
row drafts.

Drafts are deterministic (one-hot q under rejection sampling); the engine's acceptance keeps
outputs exact whatever they propose.
"""

from __future__ import annotations

import copy
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from specactor_engine.drafters.base import DraftRequest, Drafter, DrafterContext, register_drafter
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal

SEPARATOR = -1  # between strings of a corpus: never equal to a token, so no match crosses it


def suffix_continuation(corpus: np.ndarray, context: Sequence[int], k: int, min_match: int,
                        max_depth: int, scores: list[float] | None = None) -> list[int]:
    """Up to k tokens a depth-bounded suffix tree over the corpus' strings would draft after `context`.

    corpus: [N] int64 token strings, each preceded and followed by SEPARATOR. The longest suffix
    of `context` (at most max_depth - 1 tokens, at least min_match) occurring in the corpus
    followed by a token is matched; then, while the matched path is shorter than max_depth, the
    most frequent next token over the path's occurrences is drafted (the smallest id on a tie)
    and the path grows by it. scores: where given, each drafted token's `draft_score` is appended.
    """
    longest = min(len(context), max_depth - 1)
    if longest < min_match or k <= 0:
        return []
    # ends: positions of the last token of every occurrence of the path matched so far that has a next token
    ends = np.flatnonzero(corpus[:-1] == context[-1])
    ends = ends[corpus[ends + 1] != SEPARATOR]
    matched = 1
    best, best_depth = (ends, 1) if min_match <= 1 and len(ends) else (None, 0)
    while matched < longest and len(ends):
        # one token further back; a separator (a string's start) ends every occurrence that reaches it
        ends = ends[corpus[ends - matched] == context[-matched - 1]]
        matched += 1
        if len(ends) and matched >= min_match:
            best, best_depth = ends, matched
    if best is None:
        return []
    return _follow(corpus, best, best_depth, k, max_depth, scores)


def draft_score(count: int, total: int) -> float:
    """A suffix draft's confidence: its token's share of the matched path's continuations, with one continuation not
    seen yet counted in (a path seen once scores 0.5, three times alike 0.75). Draft trimming and arbitration map it
    to an acceptance rate per bucket (policies/draft_trim.py `ConfidenceCalibration`), so only its order matters."""
    return count / (total + 1)


def _follow(corpus: np.ndarray, ends: np.ndarray, depth: int, k: int, max_depth: int,
            scores: list[float] | None = None) -> list[int]:
    """Extend a matched path (occurrences ending at `ends`, `depth` tokens long) by its most frequent next tokens."""
    draft: list[int] = []
    while len(draft) < k and depth < max_depth:
        following = corpus[ends + 1]
        ends, following = ends[following != SEPARATOR], following[following != SEPARATOR]
        if not len(following):
            break
        tokens, counts = np.unique(following, return_counts=True)  # ascending: argmax takes the smallest on a tie
        top = int(np.argmax(counts))
        token = int(tokens[top])
        draft.append(token)
        if scores is not None:
            scores.append(draft_score(int(counts[top]), len(following)))
        ends, depth = ends[following == token] + 1, depth + 1
    return draft


class _Node:
    """A path in the reference tree: how often it occurred and its one-token extensions."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Reference: counts of every substring of length <= max_depth over a set of growing token strings.

    The drafter computes the same drafts without it (`suffix_continuation`); the tests compare the two.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self.open: dict[int, list[_Node]] = {}  # string id -> nodes of its suffixes still shorter than max_depth
        self.num_nodes = 0

    def extend(self, string_id: int, tokens: Iterable[int]) -> None:
        """Append tokens to string `string_id` (a new id starts a new string)."""
        active = self.open.get(string_id, [])
        keep = self.max_depth - 1
        for token in tokens:
            grown = []
            for node in (*active, self.root):  # every open suffix, plus the one starting here
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.num_nodes += 1
                child.count += 1
                grown.append(child)
            # a suffix that reached max_depth stops growing (the oldest one is the first)
            active = grown[-keep:] if keep > 0 else []
        self.open[string_id] = active

    def continuation(self, context: list[int], k: int, min_match: int, scores: list[float] | None = None) -> list[int]:
        """Up to k tokens following the longest suffix of `context` found in the tree (most frequent path);
        scores: where given, each drafted token's `draft_score` is appended."""
        longest = min(len(context), self.max_depth - 1)
        for length in range(longest, min_match - 1, -1):
            node = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is None or not node.children:
                continue
            draft = []
            while node.children and len(draft) < k:
                token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
                if scores is not None:
                    scores.append(draft_score(child.count, sum(c.count for c in node.children.values())))
                node = child
                draft.append(token)
            return draft
        return []


class SuffixHistory:
    """Earlier rollouts' outputs per prompt (bounded), saved as JSON lines."""

    def __init__(self, max_per_prompt: int = 16) -> None:
        self.max_per_prompt = max_per_prompt
        self.outputs: dict[str, deque[list[int]]] = {}

    @staticmethod
    def key(prompt_ids: Iterable[int]) -> str:
        return ",".join(map(str, prompt_ids))

    def add(self, prompt_ids: Iterable[int], output_ids: list[int]) -> None:
        if output_ids:
            self.outputs.setdefault(self.key(prompt_ids), deque(maxlen=self.max_per_prompt)).append(list(output_ids))

    def get(self, prompt_ids: Iterable[int]) -> list[list[int]]:
        return list(self.outputs.get(self.key(prompt_ids), ()))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for key, outputs in self.outputs.items():
                f.write(json.dumps({"prompt": key, "outputs": list(outputs)}) + "\n")
        tmp.replace(path)

    def load(self, path: Path) -> None:
        for line in path.read_text(encoding="utf-8").split("\n"):  # not splitlines: JSON leaves U+2028 unescaped
            if not line.strip():
                continue
            record = json.loads(line)
            self.outputs[record["prompt"]] = deque(record["outputs"], maxlen=self.max_per_prompt)

    def __len__(self) -> int:
        return sum(len(v) for v in self.outputs.values())


@dataclass
class _Group:
    """One prompt's strings that no longer change (prompt, history, finished outputs) and its rows in flight."""

    strings: list[np.ndarray]
    slots: set[int] = field(default_factory=set)
    corpus: np.ndarray | None = None  # the strings joined by separators (None: rebuild)

    def add(self, tokens: Sequence[int]) -> None:
        self.strings.append(np.asarray(tokens, dtype=np.int64))
        self.corpus = None

    def settled(self) -> np.ndarray:
        if self.corpus is None:
            parts = [np.array([SEPARATOR], dtype=np.int64)]
            for string in self.strings:
                parts += [string, parts[0]]
            self.corpus = np.concatenate(parts)
        return self.corpus


@register_drafter("suffix")
class SuffixDrafter(Drafter):
    """Drafts by suffix matching over the group's strings (prompt, history, siblings in flight and finished)."""

    model_free = True
    scores_drafts = True  # `draft_score` per drafted token when asked

    def __init__(self, config: Any, context: DrafterContext | None = None) -> None:
        self.name = getattr(config, "name", None) or "suffix"
        self.max_depth = int(getattr(config, "max_depth", 24))
        self.min_match = int(getattr(config, "min_match", 2))
        self.history = SuffixHistory(int(getattr(config, "max_history", 16)))
        self.groups: dict[str, _Group] = {}
        self.slot_group: dict[int, tuple[str, tuple[int, ...]]] = {}

    def allocate(self, num_slots: int, max_len: int) -> None:
        """A new generate call: groups are rebuilt from prompts and history as they appear."""
        self.groups.clear()
        self.slot_group.clear()

    def add_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        prompt_lengths = state.prompt_lengths[slots].tolist()
        for slot, prompt_length in zip(slots.tolist(), prompt_lengths):
            prompt = tuple(state.tokens[slot, :prompt_length].tolist())
            key = SuffixHistory.key(prompt)
            if key not in self.groups:
                self.groups[key] = _Group([np.asarray(prompt, dtype=np.int64)])
                for past in self.history.get(prompt):
                    self.groups[key].add(past)
            self.slot_group[slot] = (key, prompt)
            self.groups[key].slots.add(slot)

    def finish_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        """Finished rows: their outputs join the history, and the group's settled strings for their siblings."""
        for slot in slots.tolist():
            group = self.slot_group.pop(slot, None)
            if group is None:
                continue
            key, prompt = group
            output = state.tokens[slot, len(prompt) : int(state.lengths[slot])].tolist()
            self.history.add(prompt, output)
            self.groups[key].slots.discard(slot)
            self.groups[key].add(output)

    def record_rollout(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.history.add(prompt_ids, output_ids)

    def history_snapshot(self) -> SuffixHistory:
        return copy.deepcopy(self.history)

    def restore_history(self, snapshot: Any) -> None:
        self.history = snapshot

    def corpus(self, key: str, state: SequenceState) -> np.ndarray:
        """The group's strings as one array [N]: the settled ones, then each row in flight's output so far."""
        group = self.groups[key]
        tokens = state.tokens.numpy()
        parts = [group.settled()]
        separator = parts[0][:1]
        for slot in sorted(group.slots):
            parts += [tokens[slot, int(state.prompt_lengths[slot]) : int(state.lengths[slot])], separator]
        return np.concatenate(parts)

    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        k = int(request.max_draft_tokens.max()) if len(request.slots) else 0
        token_ids = torch.zeros(len(request.slots), k, dtype=torch.long)
        num_tokens = torch.zeros(len(request.slots), dtype=torch.long)
        confidence = torch.full((len(request.slots), k), float("nan")) if request.confidence else None
        corpora: dict[str, np.ndarray] = {}  # one per group per call
        tokens = state.tokens.numpy()
        for row, (slot, cap) in enumerate(zip(request.slots.tolist(), request.max_draft_tokens.tolist())):
            if cap <= 0 or slot not in self.slot_group:
                continue
            key = self.slot_group[slot][0]
            if key not in corpora:
                corpora[key] = self.corpus(key, state)
            start, end = int(state.prompt_lengths[slot]), int(state.lengths[slot])
            context = tokens[slot, max(start, end - self.max_depth) : end]
            scores: list[float] | None = [] if confidence is not None else None
            found = suffix_continuation(corpora[key], context, cap, self.min_match, self.max_depth, scores)
            token_ids[row, : len(found)] = torch.tensor(found, dtype=torch.long)
            num_tokens[row] = len(found)
            if confidence is not None and found:
                confidence[row, : len(found)] = torch.tensor(scores, dtype=torch.float32)
        return DraftProposal(token_ids=token_ids, num_tokens=num_tokens, confidence=confidence)

    def _history_file(self, directory: Path) -> Path:
        return directory / f"{self.name.replace('/', '_').replace(':', '_')}.history.jsonl"

    def save_state(self, directory: Path) -> None:
        self.history.save(self._history_file(directory))

    def load_state(self, directory: Path) -> None:
        path = self._history_file(directory)
        if path.exists():
            self.history = SuffixHistory(self.history.max_per_prompt)
            self.history.load(path)
