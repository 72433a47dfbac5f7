"""Suffix drafter: a depth-bounded suffix tree per prompt over its siblings, history and prompt.

For every prompt (a GRPO group) one `SuffixTree` indexes every suffix, up to `max_depth` tokens
long, of: the prompt; the outputs of earlier rollouts of the same prompt (`SuffixHistory`,
bounded, persisted in the run directory); and the outputs of the group's samples in flight
and finished, added when a row of the group next drafts (see `_catch_up`). Each node counts
how often its path occurred. To draft
for a row, the longest suffix of its output (at most `max_depth - 1` tokens, at least
`min_match`) that is a path in the tree is found, and the draft follows the most frequent child
from there. The row's own newest occurrence has no child yet, so it never proposes itself;
earlier repeats in its own output, siblings that went the same way, and past rollouts do.

Drafts are deterministic (one-hot q under rejection sampling); the engine's acceptance keeps
outputs exact whatever they propose.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import torch

from specactor_engine.drafters.base import DraftRequest, Drafter, DrafterContext, register_drafter
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal


class _Node:
    """A path in the tree: how often it occurred and its one-token extensions."""

    __slots__ = ("count", "children")  # millions of these: no per-node __dict__

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Counts of every substring of length <= max_depth over a set of growing token strings."""

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

    def continuation(self, context: list[int], k: int, min_match: int) -> list[int]:
        """Up to k tokens following the longest suffix of `context` found in the tree (most frequent path)."""
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
                token, node = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
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
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            self.outputs[record["prompt"]] = deque(record["outputs"], maxlen=self.max_per_prompt)

    def __len__(self) -> int:
        return sum(len(v) for v in self.outputs.values())


@register_drafter("suffix")
class SuffixDrafter(Drafter):
    """Drafts from the group's suffix tree (prompt, history, siblings in flight)."""

    PROMPT_STRING = -1

    def __init__(self, config: Any, context: DrafterContext | None = None) -> None:
        self.name = getattr(config, "name", None) or "suffix"
        self.max_depth = int(getattr(config, "max_depth", 24))
        self.min_match = int(getattr(config, "min_match", 2))
        self.history = SuffixHistory(int(getattr(config, "max_history", 16)))
        self.trees: dict[str, SuffixTree] = {}
        self.slot_group: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.group_slots: dict[str, set[int]] = {}  # group -> its slots in flight
        # group -> (string id, tokens) of finished rows not yet in the tree
        self.pending: dict[str, list[tuple[int, list[int]]]] = {}
        self.fed: dict[int, int] = {}  # slot -> output tokens already in its group's tree
        self.next_string = 0

    def allocate(self, num_slots: int, max_len: int) -> None:
        """A new generate call: trees are rebuilt from prompts and history as groups appear."""
        self.trees.clear()
        self.slot_group.clear()
        self.group_slots.clear()
        self.pending.clear()
        self.fed.clear()

    def add_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        prompt_lengths = state.prompt_lengths[slots].tolist()
        for slot, prompt_length in zip(slots.tolist(), prompt_lengths):
            prompt = tuple(state.tokens[slot, :prompt_length].tolist())
            key = SuffixHistory.key(prompt)
            if key not in self.trees:
                tree = self.trees[key] = SuffixTree(self.max_depth)
                tree.extend(self._string(), prompt)
                for past in self.history.get(prompt):
                    tree.extend(self._string(), past)
            self.slot_group[slot] = (key, prompt)
            self.group_slots.setdefault(key, set()).add(slot)
            self.fed[slot] = 0
            self.trees[key].open[self._slot_string(slot)] = []

    def _string(self) -> int:
        self.next_string += 1
        return -self.next_string  # history/prompt/finished strings: negative ids, never a slot's

    def _slot_string(self, slot: int) -> int:
        return slot

    # Committed tokens join the tree lazily, when a row of their group asks for a draft: at large
    # batches the engine rarely drafts (the verify length is 0), and indexing every token of every
    # row each round cost more than the drafts were worth. The tree a draft sees is the same as if
    # every token had been added at its commit (counts do not depend on the order of insertion).
    def _catch_up(self, key: str, state: SequenceState) -> None:
        """Add every committed token of the group's strings not yet in its tree."""
        tree = self.trees[key]
        for string_id, tokens in self.pending.pop(key, ()):
            tree.extend(string_id, tokens)
            tree.open.pop(string_id, None)  # a finished string grows no more
        slots = sorted(self.group_slots.get(key, ()))
        if not slots:
            return
        index = torch.tensor(slots)
        starts = state.prompt_lengths[index].tolist()
        ends = state.lengths[index].tolist()
        tokens = state.tokens.numpy()
        for slot, prompt_length, end in zip(slots, starts, ends):
            start = prompt_length + self.fed[slot]
            if end > start:
                tree.extend(self._slot_string(slot), tokens[slot, start:end].tolist())
                self.fed[slot] = end - prompt_length

    def finish_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        """Finished rows: their outputs join the history, and (lazily) the tree for their siblings."""
        for slot in slots.tolist():
            group = self.slot_group.pop(slot, None)
            if group is None:
                continue
            key, prompt = group
            start, end = len(prompt), int(state.lengths[slot])
            output = state.tokens[slot, start:end].tolist()
            self.history.add(prompt, output)
            self.group_slots[key].discard(slot)
            # the slot id may be reused by another row: its string continues under a fresh id
            string_id, tree = self._string(), self.trees[key]
            tree.open[string_id] = tree.open.pop(self._slot_string(slot), [])
            self.pending.setdefault(key, []).append((string_id, output[self.fed.pop(slot, 0):]))

    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        k = int(request.max_draft_tokens.max()) if len(request.slots) else 0
        token_ids = torch.zeros(len(request.slots), k, dtype=torch.long)
        num_tokens = torch.zeros(len(request.slots), dtype=torch.long)
        rows = [(row, slot, cap) for row, (slot, cap) in
                enumerate(zip(request.slots.tolist(), request.max_draft_tokens.tolist()))
                if cap > 0 and slot in self.slot_group]
        for key in {self.slot_group[slot][0] for _, slot, _ in rows}:
            self._catch_up(key, state)
        for row, slot, cap in rows:
            start = int(state.prompt_lengths[slot])
            end = int(state.lengths[slot])
            context = state.tokens[slot, max(start, end - self.max_depth) : end].tolist()
            found = self.trees[self.slot_group[slot][0]].continuation(context, cap, self.min_match)
            token_ids[row, : len(found)] = torch.tensor(found, dtype=torch.long)
            num_tokens[row] = len(found)
        return DraftProposal(token_ids=token_ids, num_tokens=num_tokens)

    def _history_file(self, directory: Path) -> Path:
        return directory / f"{self.name.replace('/', '_').replace(':', '_')}.history.jsonl"

    def save_state(self, directory: Path) -> None:
        self.history.save(self._history_file(directory))

    def load_state(self, directory: Path) -> None:
        path = self._history_file(directory)
        if path.exists():
            self.history = SuffixHistory(self.history.max_per_prompt)
            self.history.load(path)
