"""A small causal LM as drafter, with its own per-row KV cache.

Invariant (checked by `check_invariants`): the drafter's committed KV length of a
slot is at most state.lengths - 1 and covers exactly the slot's committed tokens.
Drafting feeds the not-yet-cached committed tokens, then its own drafts; after a
verify round the fed drafts that match the committed tokens stay, the rest roll back.

Cheaper drafting (docs/architecture.md section 11.2), neither of which can change the output (a
draft is only a proposal):
- `quantize: int8`: drafting runs the model's linears in per-channel int8, q/k/v and gate/up fused
  (model/quantize.py `Int8PackedLinear`); the float model stays the one trained and synced, and the
  int8 weights are quantized from it again on each weight update.
- a compact head: drafting computes logits only for the drafter's vocabulary (its trained
  `draft_vocab.json`, or with `draft_vocab: N` the N lowest ids growing with every token of the
  prompts and of what the target commits: model/draft_vocab.py's GrowingVocab) and samples over
  them with each token's own position-keyed noise, so a token outside the vocabulary is never
  drafted and the verifier emits it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from specactor_engine import clock
from specactor_engine.drafters.base import DraftRequest, Drafter, DrafterContext, register_drafter
from specactor_engine.drafters.draft_head import DraftHead, VocabGrowth, growing_vocab, propose_rows
from specactor_engine.model.draft_vocab import GrowingVocab, SubsetHead
from specactor_engine.model.quantize import int8_supported
from specactor_engine.model.runner import ModelRunner, load_hf_model
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal
from specactor_engine.model.weights import load_named_weights


def check_same_tokenizer(target_tokenizer: Any, draft_tokenizer: Any, draft_name: str) -> None:
    """Refuse a drafter whose token ids mean something else than the target's."""
    if target_tokenizer is None:
        return
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            f"drafter {draft_name!r}: its tokenizer differs from the target's "
            f"({len(draft_tokenizer.get_vocab())} vs {len(target_tokenizer.get_vocab())} entries or different ids); "
            "a model drafter must share the target's vocabulary"
        )


def prefill_prompts(state: SequenceState, slots: torch.Tensor, runner: ModelRunner,
                    prefill: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> int:
    """A drafter's prefill of the prompts of `slots` without their last token, once per distinct prompt (a GRPO
    group): prefill(tokens [P, W], slots [P], lengths [P]) runs the leaders, the other rows copy their KV.
    Returns the tokens the leaders fed."""
    if not len(slots) or int(state.prompt_lengths[slots].max()) <= 1:
        return 0
    tokens, prompt_lengths, leader_of = prompt_leaders(state, slots)  # leader_of: the row each row reuses
    leaders = torch.unique(leader_of)
    leaders = leaders[prompt_lengths[leaders] > 0]
    if len(leaders):
        prefill(tokens[leaders], slots[leaders], prompt_lengths[leaders])
    followers = (leader_of != torch.arange(len(slots))).nonzero().flatten()
    if len(followers):
        runner.cache.copy_prefix(slots[leader_of[followers]], slots[followers], prompt_lengths[followers])
    return int(prompt_lengths[leaders].sum())


def prompt_leaders(state: SequenceState, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts of `slots` without their last token, tokens [R, W] and lengths [R], and per row the index (into
    `slots`) of the first row with the same prompt, itself if none is earlier (`share_prefill`) [R]."""
    prompt_lengths = (state.prompt_lengths[slots] - 1).clamp_min(0)
    width = int(prompt_lengths.max()) if len(slots) else 0
    tokens, _ = state.gather(slots, torch.zeros_like(slots), width)
    return tokens, prompt_lengths, share_prefill(tokens, prompt_lengths)


def fitting_batches(start: torch.Tensor, counts: torch.Tensor, max_len: int) -> list[torch.Tensor]:
    """Rows feeding counts[i] tokens after start[i] [R], split into forwards whose padded blocks fit the cache:
    a forward pads every row to the longest count, and a row far along (start near max_len) padded to a row fed
    from 0 (a deferred prefill) would write past the cache's end. Rows ordered by start, a new batch wherever the
    next row would overflow. Returns index tensors into the R rows (one batch when all fit)."""
    order = torch.argsort(start, stable=True).tolist()
    batches: list[list[int]] = []
    widest, furthest = 0, 0
    for i in order:
        width, end = max(widest, int(counts[i])), int(start[i])
        if batches and max(furthest, end) + width <= max_len:
            batches[-1].append(i)
            widest, furthest = width, max(furthest, end)
        else:
            batches.append([i])
            widest, furthest = int(counts[i]), end
    return [torch.tensor(sorted(b), dtype=torch.long) for b in batches]


def share_prefill(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """For rows tokens [R, W] with `lengths` [R] valid tokens: the index of the first row with the same
    tokens and length (itself if none is earlier), so identical prompts are prefilled once: [R]."""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(row[:n].tolist()), i) for i, (row, n) in enumerate(zip(tokens, lengths.tolist()))]
    return torch.tensor(rows, dtype=torch.long)


@register_drafter("model")
class ModelDrafter(Drafter):
    """Draft with a small LM; position-keyed noise couples its samples to the target's."""

    def __init__(self, config: Any, context: DrafterContext, model: torch.nn.Module | None = None,
                 tokenizer: Any = None) -> None:
        self.name = getattr(config, "name", None) or f"model:{getattr(config, 'model', 'draft')}"
        if model is None:
            model, tokenizer = self._load(config, context)
        if tokenizer is not None:
            check_same_tokenizer(context.target_tokenizer, tokenizer, self.name)
        self.model = model  # the float weights: trained, synced and saved (drafting may run on a copy)
        self.quantize = getattr(config, "quantize", "none") or "none"
        self.target_vocab_size = context.target_vocab_size
        self.vocab = self._vocabulary(model, getattr(config, "draft_vocab", None), context.target_tokenizer)
        self._build_runner()
        self.allocate(0, 0)

    def _vocabulary(self, model: torch.nn.Module, size: int | None, tokenizer: Any) -> GrowingVocab | None:
        """The drafter's vocabulary (None: the full one): a trained sub-vocabulary's ids (fixed), or the `size`
        lowest ids and the special tokens, growing with the tokens the target uses."""
        head = model.lm_head
        bound = min(self.target_vocab_size, head.weight.shape[0])  # ids both vocabularies have
        if isinstance(head, SubsetHead):
            return GrowingVocab(head.token_ids.cpu(), bound)
        return growing_vocab(size, bound, tokenizer)

    @property
    def grows(self) -> bool:
        """The vocabulary takes in the tokens the target uses (a configured size, not a trained head)."""
        return self.vocab is not None and not isinstance(self.model.lm_head, SubsetHead)

    def _build_runner(self) -> None:
        """The runner drafting runs on the model, its linears packed or in int8 (fused, quantized from the float
        weights), with the compact head built now rather than in the first draft round (both rebuilt after weight
        updates)."""
        if self.quantize == "int8" and not int8_supported():
            raise RuntimeError("int8 drafting needs PyTorch's x86/fbgemm quantized engine, which this build lacks "
                               f"(supported: {torch.backends.quantized.supported_engines}); use quantize: none")
        self.runner = ModelRunner(self.model, int8=self.quantize == "int8")
        self.head = DraftHead(lambda: self.model.lm_head.weight, self.vocab, self.quantize, self.target_vocab_size)
        self._refresh_head()
        self.runner.pack()  # the int8 weights too (ModelRunner.pack): 2.6 s for the 0.5B, not in its first round

    def _refresh_head(self) -> None:
        """The compact head over the current vocabulary, rebuilt when it grew (draft_head.py)."""
        self.runner.head = self.head.module()

    @staticmethod
    def _load(config: Any, context: DrafterContext) -> tuple[torch.nn.Module, Any]:
        from transformers import AutoTokenizer

        from specactor_engine.model.registry import resolve_model

        dtype = getattr(config, "dtype", None) or context.dtype
        path = resolve_model(config.model, dtype=dtype, cache_dir=context.cache_dir)
        return load_hf_model(path, dtype, context.device), AutoTokenizer.from_pretrained(path)

    def step_bytes(self) -> int:
        """The drafting runner's weights (the int8 copy and the compact head where configured)."""
        self._refresh_head()
        return self.runner.step_bytes()

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.runner.allocate(num_slots, max_len)
        self._fed = torch.zeros(num_slots, 0, dtype=torch.long)  # drafts fed into the KV, per slot
        self._fed_base = torch.zeros(num_slots, dtype=torch.long)  # state length when they were fed
        self._fed_count = torch.zeros(num_slots, dtype=torch.long)
        self._growth = VocabGrowth(self.vocab, num_slots) if self.grows else None
        # per slot admitted without its prefill: the slot admitted with it whose prompt it shares (itself if none
        # earlier), so that the estimate of its catch-up counts a GRPO group's prompt once; and the admission
        # (`add_rows` call) each slot's row came in, so a leader's slot taken by a later row is not counted
        self._prompt_leader = torch.arange(num_slots)
        self._admitted_in = torch.zeros(num_slots, dtype=torch.long)
        self._admissions = 0

    defers_prefill = True

    def add_rows(self, state: SequenceState, slots: torch.Tensor, prefill: bool = True) -> None:
        """Prefill the prompts (without their last token) so the first propose is cheap; rows with the
        same prompt (a GRPO group) share one prefill and copy its KV. prefill=False: the rows start empty
        and the first `propose` for them catches up (`_catch_up`), prompt included."""
        self.runner.set_lengths(slots, torch.zeros_like(slots))
        self._fed_count[slots] = 0
        self._admissions += 1
        self._admitted_in[slots] = self._admissions
        self._prompt_leader[slots] = slots
        if self._growth is not None:
            self._growth.admit(state, slots)
        if prefill:
            started = clock.now()
            fed = prefill_prompts(state, slots, self.runner, self._prefill)
            self.observe_feed(clock.now() - started, fed)
        else:
            self._prompt_leader[slots] = slots[prompt_leaders(state, slots)[2]]

    def _prefill(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        self.runner.forward(tokens, slots, lengths, logits_at="none")
        self.runner.commit(slots, lengths)

    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        self.catch_up_s = 0.0
        return propose_rows(request, lambda slots, k: self._draft(state, slots, k, request))

    def _draft(self, state: SequenceState, slots: torch.Tensor, k: int, request: DraftRequest
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """k autoregressive draft steps for `slots` (fewer where the request's `stop` ends them): tokens [R, j],
        probs [R, j, V] or None, confidence [R, j] or None."""
        if self._growth is not None:
            self._growth.before_drafting(state)
        self._refresh_head()
        self._catch_up(state, slots, k)
        start = self.runner.lengths[slots].clone()
        pending, counts = state.gather(slots, start, int((state.lengths[slots] - start).max()))
        logits = self.runner.forward(pending, slots, counts, logits_at="last")
        self.runner.commit(slots, counts)
        out_pos = state.output_positions(slots)
        tokens, step_probs, all_probs, confidence = [], [], [], []
        for step in range(k):
            token, probs, sure = self.head.sample(logits, state, slots, out_pos + step, request)
            tokens.append(token)
            all_probs.append(probs)
            confidence.append(sure)
            if step + 1 < k and request.stops_after(confidence):
                break
            if step + 1 < k:
                logits = self.runner.forward(token[:, None], slots, logits_at="last")
                self.runner.commit(slots, torch.ones_like(slots))
        drafts = torch.stack(tokens, dim=1)
        k = drafts.shape[1]  # fewer than asked where `stop` ended the drafting: k - 1 drafts were fed
        self._fed_base[slots] = state.lengths[slots]
        self._fed_count[slots] = k - 1
        if self._fed.shape[1] < k - 1:
            self._fed = torch.zeros(self._fed.shape[0], k - 1, dtype=torch.long)
        self._fed[slots, : k - 1] = drafts[:, : k - 1]
        probs_out = torch.stack(all_probs, dim=1) if all_probs[0] is not None else None
        return drafts, probs_out, (torch.stack(confidence, dim=1) if confidence[0] is not None else None)

    def _catch_up(self, state: SequenceState, slots: torch.Tensor, k: int) -> None:
        """Feed rows that fell behind (rounds drafted by another method) up to their last k + 1 committed
        tokens in a forward of its own, timed as `catch_up_s`: what a round drafting with this model in
        every round feeds (the accepted drafts and the bonus token) stays in the first draft step, so the
        steady drafting cost is measured apart from the cost of switching to it."""
        started = clock.now()
        # rows admitted without their prefill: their prompts first, a GRPO group's once (its rows copy the KV). Fed
        # with the rest, trace D's group of 4 fed its 85-token prompt 4 times over (0.46 s against ~0.12 s)
        unfed = slots[(self.runner.lengths[slots] == 0) & (state.prompt_lengths[slots] > 1)]
        fed = prefill_prompts(state, unfed, self.runner, self._prefill) if len(unfed) else 0
        behind = state.lengths[slots] - 1 - self.runner.lengths[slots]  # committed tokens not in the KV yet
        late = behind > k + 1
        if bool(late.any()):
            rows = slots[late]
            counts = behind[late] - k  # leave k + 1 to the first draft step
            for part in fitting_batches(self.runner.lengths[rows], counts, self.runner.cache.max_len):
                tokens, _ = state.gather(rows[part], self.runner.lengths[rows[part]], int(counts[part].max()))
                self.runner.forward(tokens, rows[part], counts[part], logits_at="none")
                self.runner.commit(rows[part], counts[part])
            fed += int(counts.sum())
        if fed:
            self.catch_up_s = clock.now() - started
            self.observe_feed(self.catch_up_s, fed)

    def behind(self, state: SequenceState, slots: torch.Tensor) -> torch.Tensor:
        return (state.lengths[slots] - 1 - self.runner.lengths[slots]).clamp_min(0)

    def shared_behind(self, state: SequenceState, slots: torch.Tensor) -> torch.Tensor:
        """`behind`, less the prompt of each row admitted without its prefill whose prompt an earlier such row among
        `slots` shares: the catch-up feeds that prompt once (`_catch_up`)."""
        behind = self.behind(state, slots)
        leaders = self._prompt_leader[slots]
        unfed = self.runner.lengths == 0
        follower = unfed[slots] & (leaders != slots) & unfed[leaders] & torch.isin(leaders, slots) & \
            (self._admitted_in[leaders] == self._admitted_in[slots])
        return behind - torch.where(follower, (state.prompt_lengths[slots] - 1).clamp_min(0), 0)

    def observe_commit(self, state: SequenceState, slots: torch.Tensor) -> None:
        """Keep the fed drafts that became committed tokens; roll the rest back."""
        if self._growth is not None:  # they join the vocabulary before it next drafts
            self._growth.committed(slots)
        slots = slots[self._fed_count[slots] > 0]
        if len(slots) == 0:
            return
        base, fed = self._fed_base[slots], self._fed_count[slots]
        width = int(fed.max())
        committed, counts = state.gather(slots, base, width)
        # the last committed token is never in the KV (it is fed next round), hence counts - 1
        valid = torch.arange(width)[None, :] < torch.minimum(counts - 1, fed)[:, None]
        match = (committed == self._fed[slots, :width]) & valid
        kept = match.long().cumprod(dim=1).sum(dim=1)
        self.runner.set_lengths(slots, base + kept)
        self._fed_count[slots] = 0

    def finish_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        if self._growth is not None:
            self._growth.finish(state, slots)

    def trainable_model(self) -> torch.nn.Module:
        """The draft LM (distilled on each policy sync, saved beside each checkpoint): the float weights."""
        return self.model

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        load_named_weights(self.model, weights)
        self._build_runner()  # the int8 copy and the compact head copy the float weights
        self.version = version

    def weights_changed(self) -> None:
        if self.quantize != "none" or self.vocab is not None:  # an int8 copy or a compact head copy the weights
            self._build_runner()

    def check_invariants(self, state: SequenceState, slots: torch.Tensor) -> None:
        kv, committed = self.runner.lengths[slots], state.lengths[slots]
        assert bool((kv <= committed - 1).all()), f"{self.name}: drafter KV {kv.tolist()} past {committed.tolist()}"

