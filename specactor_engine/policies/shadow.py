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


# While plain decoding is in force and the best speculative option is expected at most this share of plain
# decoding's rate, idle rows are shadow-drafted only every SPARSE_EVERY-th round (and the choice re-made as often).
# Trace A (32 rows, session 53): at 0.8 about half of `specactor`'s plain rounds expected speculation at 0.80-0.95x
# and were chosen and shadowed every round; within the hysteresis (5%) of plain decoding they still are
SPARSE_MARGIN = 0.95
SPARSE_EVERY = 4
# ... and below FAR_MARGIN only every FAR_EVERY-th, once plain decoding has been far ahead for FAR_EVERY rounds (its
# first choices read the prior, before any shadow draft was scored: a 16-token run would never re-choose). Replays of
# session 54's B and C (128 rows, plain throughout): 45% of B's choices and 73% of C's expected speculation below
# 0.85x, where its rate would have to climb by 12% or more before it came within SPARSE_MARGIN; A's (32 rows, the
# feature drafter in use at times) 45%
FAR_MARGIN = 0.85
FAR_EVERY = 16


def sparse_every(margin: float, far_rounds: int) -> int:
    """Every how many rounds plain decoding in force re-chooses and shadow-drafts, by the last choice's margin
    (`VerifyLengthPolicy.speculation_margin`) and the consecutive far rounds before this one: 1 within SPARSE_MARGIN
    of paying, SPARSE_EVERY below it, FAR_EVERY below FAR_MARGIN after FAR_EVERY far rounds. FAR_EVERY is a multiple
    of SPARSE_EVERY, so a margin that moves between the two keeps the rounds due on one count."""
    if margin >= SPARSE_MARGIN:
        return 1
    return FAR_EVERY if margin < FAR_MARGIN and far_rounds >= FAR_EVERY else SPARSE_EVERY


def shadows_due(cap: int, margin: float, plain_rounds: int) -> bool:
    """Whether this round drafts shadows for idle rows. cap: the round's verify length; margin: the verify-length
    policy's best speculative rate over plain decoding's (`VerifyLengthPolicy.speculation_margin`); plain_rounds:
    consecutive rounds so far (this one included) at cap 0 with the margin below SPARSE_MARGIN. Shadows exist to
    tell when speculation starts to pay: while it is in force or within reach they are drafted every round, and
    while it is far from paying every `sparse_every`-th (trace B, 128 rows: ~2,000 shadow drafts a run at k = 0
    throughout, 0.4 s of drafting plus their scoring and bookkeeping, about 1% of the run)."""
    every = sparse_every(margin, plain_rounds - 1)
    if cap > 0 or every == 1:
        return True
    return plain_rounds % every == 1


def choice_due(plain_rounds: int, margin: float) -> bool:
    """Whether this round's verify length and draft methods are chosen anew; plain_rounds: consecutive rounds before
    this one at cap 0 with speculation far from paying (`shadows_due`'s count); margin: the last choice's (held
    rounds keep it). While plain decoding is that far ahead the choice is re-made every `sparse_every`-th round, the
    one that drafts shadows, and the rounds between decode plainly: weighing every method's assignments at every
    length took ~1 ms a round at 128 rows under cProfile (trace B: ~0.6 s a run at k = 0 throughout, with shadows
    ~1 s; `specactor` trailed `ar` by about that); the price is reacting up to that many rounds late once
    speculation starts to pay."""
    return plain_rounds % sparse_every(margin, plain_rounds) == 0


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
