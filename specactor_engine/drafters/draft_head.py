"""A model drafter's output head and its sampling, over the full vocabulary or a compact one.

Shared by the draft-LM drafter (model.py) and the feature-level drafter (feature.py): both end in an LM
head, may restrict it to a draft vocabulary (a trained `draft_vocab.json`, or the N lowest ids growing
with the tokens the target uses: model/draft_vocab.py) and may run it in int8, and both sample their
drafts with the target's position-keyed noise (or their own, with probabilities for rejection sampling).
A token outside the vocabulary is never drafted and the verifier emits it, so output stays exact.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from specactor_engine.counter_hash import token_hash_of
from specactor_engine.drafters.base import DraftRequest
from specactor_engine.model.draft_vocab import GrowingVocab, SplitHead, lowest_ids_vocab
from specactor_engine.model.packed_linear import PackedModule, packing_supported
from specactor_engine.model.quantize import int8_linear
from specactor_engine.sampling import STREAM_DRAFT, STREAM_TARGET, sample_tokens, scaled_log_softmax, warped_probs
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal


def growing_vocab(size: int | None, bound: int, tokenizer: Any) -> GrowingVocab | None:
    """The `size` lowest ids and the tokenizer's special tokens, growing with use (None: size None or >= bound)."""
    if size is None or size >= bound:
        return None
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    return GrowingVocab(lowest_ids_vocab(size, bound, special), bound)


class DraftHead:
    """The head module a drafter's runner uses and the sampling of its logits.

    weight(): the full head weight [V, d] (read again on every rebuild, so weight syncs reach it);
    vocab: the compact vocabulary (None: the full one, `full_head` used as is); quantize: "int8" builds
    the compact head's base rows in int8. A growing vocabulary's new tokens sit in a small float head
    beside the base one until EXTRA_ROWS of them have come, then the base is rebuilt over all (quantizing
    32k rows takes longer than a draft step; the vocabulary grows by a few tokens most rounds).
    """

    EXTRA_ROWS = 2048

    def __init__(self, weight: Callable[[], torch.Tensor], vocab: GrowingVocab | None, quantize: str,
                 target_vocab_size: int, full_head: nn.Module | None = None) -> None:
        self.weight = weight
        self.vocab = vocab
        self.quantize = quantize
        self.target_vocab_size = target_vocab_size
        self.full_head = full_head
        self.reset()

    def reset(self) -> None:
        """Forget the built head (the weights changed): the next `module()` rebuilds it."""
        self._version, self._base, self._base_rows = -1, None, 0
        self._module: nn.Module | None = self.full_head
        self.ids: torch.Tensor | None = None
        self.id_hashes: torch.Tensor | None = None  # [N] token_hash_of(ids): each column's noise key, per build

    def module(self) -> nn.Module | None:
        """The head to run (rebuilt if the vocabulary grew); None: the model's own head over the full vocabulary."""
        vocab = self.vocab
        if vocab is None or self._version == vocab.version:
            return self._module
        weight = self.weight().detach()  # [V, d] (tied to the embedding in small models)
        ids = vocab.ids
        if self._base is None or len(ids) - self._base_rows > self.EXTRA_ROWS:
            rows = weight[ids.to(weight.device)]
            self._base = int8_linear(rows) if self.quantize == "int8" else float_linear(rows)
            self._base_rows = len(ids)
        extra = weight[ids[self._base_rows:].to(weight.device)]  # [E, d]
        self._module = SplitHead(self._base, extra) if len(extra) else self._base
        self.ids = ids.clone()
        self.id_hashes = token_hash_of(self.ids)
        self._version = vocab.version
        return self._module

    def _full_width(self, logits: torch.Tensor) -> torch.Tensor:
        """Match the target's vocabulary width so token ids and noise line up: [..., V_target]."""
        width = logits.shape[-1]
        if width > self.target_vocab_size:
            return logits[..., : self.target_vocab_size]
        if width < self.target_vocab_size:
            pad = logits.new_full((*logits.shape[:-1], self.target_vocab_size - width), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def sample(self, logits: torch.Tensor, state: SequenceState, slots: torch.Tensor, out_pos: torch.Tensor,
               request: DraftRequest) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """logits [R, V] (or [R, N] over the compact head's N tokens) at output positions out_pos [R] ->
        (tokens [R], probs [R, V_target] or None: with the target's noise no probabilities are needed,
        confidence [R] (`confidence`) where the request asks for it, else None), on the host whatever the
        logits' device (drafts join the engine's host-side state)."""
        tokens, probs = self._sample(logits, state, slots, out_pos, request)
        confidence = self.confidence(logits, tokens, request.params.temperature).cpu() if request.confidence else None
        return tokens.cpu(), (probs.cpu() if probs is not None else None), confidence

    def confidence(self, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """The drafter's own probability of each drafted token, softmax(logits / T) over its head (T = 1 when
        greedy): [R] float32. Draft trimming maps it to a chance of acceptance (policies/draft_trim.py)."""
        tokens = tokens.to(logits.device)
        if self.ids is not None:  # the column of each drafted token in the compact head
            column = (self.ids.to(logits.device)[None, :] == tokens[:, None]).int().argmax(dim=-1)
        else:
            column = tokens.clamp_max(logits.shape[-1] - 1)
        log_probs = scaled_log_softmax(logits, temperature)
        return log_probs.gather(-1, column[:, None])[:, 0].exp().float()

    def _sample(self, logits: torch.Tensor, state: SequenceState, slots: torch.Tensor, out_pos: torch.Tensor,
                request: DraftRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        stream = STREAM_TARGET if request.coupled_noise else STREAM_DRAFT
        keys, positions = state.seq_keys[slots], out_pos[:, None]
        if self.ids is not None:
            ids = self.ids
            tokens = sample_tokens(logits[:, None], request.params, keys, positions, stream, vocab_ids=ids,
                                   vocab_hashes=self.id_hashes)[:, 0]
            if request.coupled_noise:
                return tokens, None
            probs = logits.new_zeros(len(slots), self.target_vocab_size, dtype=torch.float64)
            probs[:, ids] = warped_probs(logits, request.params)
            return tokens, probs
        logits = self._full_width(logits)[:, None]
        tokens = sample_tokens(logits, request.params, keys, positions, stream)[:, 0]
        probs = None if request.coupled_noise else warped_probs(logits, request.params)[:, 0]
        return tokens, probs


def propose_rows(request: DraftRequest,
                 draft: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
                 ) -> DraftProposal:
    """A model drafter's proposal: the rows with a cap drafted together by `draft(slots, k)` (tokens [R', j],
    probs [R', j, V] or None, confidence [R', j] or None; j = k, or fewer where the request's `stop` ended the
    drafting), every one of them to its cap or j, laid out in the request's rows [R, j]."""
    active = request.max_draft_tokens > 0
    slots, caps = request.slots[active], request.max_draft_tokens[active]
    k = int(caps.max()) if len(slots) else 0
    if k == 0:
        return DraftProposal(token_ids=torch.zeros(len(request.slots), 0, dtype=torch.long),
                             num_tokens=torch.zeros(len(request.slots), dtype=torch.long))
    drafts, probs, confidence = draft(slots, k)
    width = drafts.shape[1]
    out = DraftProposal(token_ids=torch.zeros(len(request.slots), width, dtype=torch.long),
                        num_tokens=torch.where(active, request.max_draft_tokens, 0).clamp_max(width))
    out.token_ids[active] = drafts
    if confidence is not None:
        out.confidence = torch.full((len(request.slots), width), float("nan"))
        out.confidence[active] = confidence
    if probs is not None:
        out.probs = torch.zeros(len(request.slots), width, probs.shape[-1], dtype=probs.dtype)
        out.probs[active] = probs
    return out


def grow_vocab(vocab: GrowingVocab, seen: torch.Tensor, state: SequenceState, slots: torch.Tensor) -> None:
    """Add the tokens of `slots` that `vocab` has not seen yet (seen [num_slots]: tokens of each slot already
    added, advanced here): the prompts when rows are admitted, what the target committed after each round."""
    start = seen[slots]
    recent, counts = state.gather(slots, start, int((state.lengths[slots] - start).max()))
    vocab.add(recent[torch.arange(recent.shape[1])[None, :] < counts[:, None]])
    seen[slots] = state.lengths[slots]


class VocabGrowth:
    """A growing vocabulary's intake of the target's tokens, deferred to when the drafter needs it.

    A row's prompt joins at admission (`admit`). What the target commits after a round only marks the row
    (`committed`); the marked rows' new tokens join before the drafter next drafts (`before_drafting`) or when a
    row finishes (`finish`: the state still holds its tokens, and its slot may be reused next). The vocabulary a
    draft sees is the same as if every round's tokens had joined at once; a drafter that sits idle for most
    rounds (trace D's 0.5B beside the feature-level drafter) no longer gathers every row's new tokens each
    round (~0.06 s of a ~21 s run on the Zen 5 CPU, py-spy at 250 Hz)."""

    def __init__(self, vocab: GrowingVocab, num_slots: int) -> None:
        self.vocab = vocab
        self.seen = torch.zeros(num_slots, dtype=torch.long)  # [S] tokens of each slot already in the vocabulary
        self.due = torch.zeros(num_slots, dtype=torch.bool)  # [S] rows that committed tokens not yet taken in

    def admit(self, state: SequenceState, slots: torch.Tensor) -> None:
        """New rows in `slots`: their prompts join now."""
        self.seen[slots] = 0
        self.due[slots] = False
        grow_vocab(self.vocab, self.seen, state, slots)

    def committed(self, slots: torch.Tensor) -> None:
        """`slots` committed tokens this round."""
        self.due[slots] = True

    def before_drafting(self, state: SequenceState) -> None:
        """Every marked row's new tokens join."""
        self._take(state, self.due.nonzero().flatten())

    def finish(self, state: SequenceState, slots: torch.Tensor) -> None:
        """`slots` finished: their last tokens join before the slots are reused."""
        self._take(state, slots[self.due[slots]])

    def _take(self, state: SequenceState, slots: torch.Tensor) -> None:
        if len(slots):
            grow_vocab(self.vocab, self.seen, state, slots)
            self.due[slots] = False


def float_linear(rows: torch.Tensor) -> nn.Module:
    """A bias-free linear over `rows` [N, d] (a float compact head), packed like the drafter's own linears where
    packing applies (the 0.5B's bf16 draft step at 4 rows over a 32k-token head: 20.9 ms with it packed for the
    engine's kernel, 22.3 ms through torch's matmul, medians of 7 repeats; bench/session40/draft_timing.py)."""
    head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    with torch.no_grad():
        head.weight.copy_(rows)
    head.requires_grad_(False)
    return PackedModule(head) if packing_supported(rows.dtype, rows.device) else head
