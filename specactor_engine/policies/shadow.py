"""Shadow drafts: acceptance statistics without verifying.

Under position-keyed acceptance (and greedy decoding) draft token j is accepted exactly when it
equals the token plain decoding commits at its position and every earlier draft was accepted: the
target's sample there does not depend on the drafts. So a draft that is never verified can still be
scored, once the row has committed that far: its accepted length is the length of its common
prefix with the committed tokens. Statistics that used to need a verify round at the deepest
length (a probe, ~5x a plain round at full batch on a compute-bound CPU) come for the price of
drafting, which is next to nothing for model-free drafters (suffix, n-gram).

The engine keeps one pending shadow draft per row at most (`ShadowBook`), drafted at the row's
full draft cap while the round verifies fewer; `resolve` scores it when the row has committed as
many tokens as were drafted, or has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence


def matched_prefix(draft: Sequence[int], committed: Sequence[int]) -> int:
    """How many leading draft tokens equal the committed ones: what a verify would have accepted."""
    matched = 0
    for drafted, kept in zip(draft, committed):
        if drafted != kept:
            break
        matched += 1
    return matched


@dataclass(frozen=True)
class ShadowDraft:
    """A draft made for statistics. start: the row's output length when drafted (the draft's first
    token stands for output position `start`); cap: the draft slots it had (a shorter draft counts
    its missing tokens as rejected, as a verify round does)."""

    start: int
    tokens: tuple[int, ...]
    cap: int
    method: str
    request: Hashable


@dataclass
class ShadowBook:
    """Pending shadow drafts by slot."""

    pending: dict[int, ShadowDraft] = field(default_factory=dict)

    def __contains__(self, slot: int) -> bool:
        return slot in self.pending

    def add(self, slot: int, draft: ShadowDraft) -> None:
        self.pending.setdefault(slot, draft)

    def resolve(self, slot: int, output_ids: Sequence[int], finished: bool) -> tuple[ShadowDraft, int] | None:
        """(the slot's pending draft, its accepted length) once the row has committed past the draft
        or finished (then the draft leaves the book); None while still open or without a draft."""
        draft = self.pending.get(slot)
        if draft is None:
            return None
        committed = output_ids[draft.start : draft.start + len(draft.tokens)]
        if len(committed) < len(draft.tokens) and not finished:
            return None
        del self.pending[slot]
        return draft, matched_prefix(draft.tokens, committed)

    def clear(self) -> None:
        self.pending.clear()
