"""The feature-level drafter (EAGLE-style): drafts from the target's own last hidden states.

The model (model/feature_draft.py) is one decoder layer of the target's family over [the token's
embedding; the target's feature at the position before]. The target's runner records every
position's feature beside its keys (`ModelRunner.record_features`, switched on by `bind_target`), so
after each verify round the features of every committed position but the newest are known.

Invariant (checked by `check_invariants`): the drafter's KV covers exactly the committed positions it
has fed with the target's features, at most the committed length. A round feeds the positions
committed since (their features are the target's), then drafts k tokens, feeding its own predicted
features in place of the target's; those draft positions are dropped at the end of the round (the
target's features replace them once it has verified the tokens), so nothing needs rolling back.

The draft model must be bound to the engine's target (`Engine` calls `bind_target`): it shares the
target's embedding and LM head rows and reads its features, so it runs in process only, never in a
drafter worker.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from specactor_engine import clock
from specactor_engine.drafters.base import DraftRequest, Drafter, DrafterContext, register_drafter
from specactor_engine.drafters.draft_head import DraftHead, VocabGrowth, growing_vocab, propose_rows
from specactor_engine.drafters.model import fitting_batches, prefill_prompts
from specactor_engine.model.draft_vocab import GrowingVocab, load_draft_vocab
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.model.packed_linear import PackedLinear, packing_supported
from specactor_engine.model.runner import ModelRunner, tensor_bytes
from specactor_engine.model.weights import load_named_weights
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal


# quantize "int8": the projections drafted in int8 (model/runner.py PROJECTIONS); the others keep the model's dtype
INT8_PROJECTIONS = ("o", "gate_up", "down")


@register_drafter("feature")
class FeatureDrafter(Drafter):
    """Draft with one decoder layer over the target's features (module docstring)."""

    needs_target = True

    def __init__(self, config: Any, context: DrafterContext, model: FeatureDraftModel | None = None) -> None:
        """config: `path` (a trained drafter's directory; None: a fresh, untrained one), `quantize`,
        `draft_vocab`, `temperature_scale`. The model is loaded in `bind_target`, when the target it belongs to is
        known."""
        self.name = getattr(config, "name", None) or "feature"
        self.path = getattr(config, "path", None)
        self.quantize = getattr(config, "quantize", "none") or "none"
        self.vocab_size_wanted = getattr(config, "draft_vocab", None)
        self.temperature_scale_wanted = getattr(config, "temperature_scale", None)
        self.tokenizer = context.target_tokenizer
        self.target_vocab_size = context.target_vocab_size
        self.model = model
        self.target: ModelRunner | None = None
        self.vocab: GrowingVocab | None = None
        self.num_slots = 0
        self._growth: VocabGrowth | None = None  # the growing vocabulary's intake (allocate, bind_target)

    # ------------------------------------------------------------------ binding and building
    def bind_target(self, target: ModelRunner) -> None:
        """Attach to the engine's target runner: it records features from now on; the draft model is loaded
        (or built fresh) for this target, and shares its embedding and head."""
        self.target = target
        target.record_features()
        if self.model is None:
            self.model = self._configured_model()
        bound = min(self.target_vocab_size, target.model.lm_head.weight.shape[0])
        trained = load_draft_vocab(self.path) if self.path else None
        self.trained_vocab = trained is not None  # a trained head's vocabulary stays fixed
        self.vocab = GrowingVocab(trained, bound) if trained is not None else \
            growing_vocab(self.vocab_size_wanted, bound, self.tokenizer)
        self._growth = VocabGrowth(self.vocab, self.num_slots) if self.grows else None
        self._build_runner()

    def _configured_model(self) -> FeatureDraftModel:
        """The trained drafter in `path`, or a fresh one from the bound target."""
        assert self.target is not None
        target = self.target.model
        return FeatureDraftModel.load(self.path, target) if self.path else FeatureDraftModel(target)

    def _build_runner(self) -> None:
        """The drafting runner, fc and head over the current weights. quantize "int8": the layer's MLP and output
        projection run in per-channel int8 (`ModelRunner(int8_projections=...)`, 93% of the layer's weights at
        Qwen2.5-1.5B's shapes), q/k/v, fc and the head in the model's dtype: int8 rows of their inputs, whose outlier
        channels set the row's scale, lost trace D's acceptance (bench/session52)."""
        assert self.target is not None and self.model is not None, "bind_target first"
        target_model = self.target.model
        int8 = self.quantize == "int8"
        self.runner = ModelRunner(self.model, packed_linear=True, int8_projections=INT8_PROJECTIONS if int8 else ())
        self.embed = target_model.get_input_embeddings()
        # fc [2d -> d] runs once per draft step: oneDNN-packed like the layer's linears where they are
        packed = packing_supported(self.runner.dtype, self.runner.device)
        self.fc = PackedLinear([self.model.fc]) if packed else self.model.fc
        # with the full vocabulary, the target's own head module (shared, not copied)
        self.head = DraftHead(lambda: target_model.lm_head.weight, self.vocab, "none", self.target_vocab_size,
                              full_head=target_model.lm_head)
        scale = self.temperature_scale_wanted
        self.temperature_scale = float(scale if scale is not None else getattr(self.model, "temperature_scale", 1.0))
        self.runner.head = self.head.module()
        self.runner.pack()  # its one-time packing here, not in the first drafting round (ModelRunner.pack)
        if isinstance(self.fc, PackedLinear):
            self.fc.prepare()
        if self.num_slots:
            self.runner.allocate(self.num_slots, self.max_len)

    @property
    def grows(self) -> bool:
        return self.vocab is not None and not self.trained_vocab

    def step_bytes(self) -> int:
        """fc, the decoder layer, the norm and the head in use (the embedding rows are a lookup)."""
        if self.target is None:
            return 0
        return self.runner.step_bytes() + tensor_bytes(self.runner.model.fc)

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.num_slots, self.max_len = num_slots, max_len
        self._growth = VocabGrowth(self.vocab, num_slots) if self.grows else None
        if self.target is not None:
            self.runner.allocate(num_slots, max_len)

    # ------------------------------------------------------------------ feeding committed positions
    def _inputs(self, tokens: torch.Tensor, prev_features: torch.Tensor) -> torch.Tensor:
        """x = fc([embed(t); f_prev]) for tokens [R, T] and features [R, T, d]: [R, T, d]."""
        with torch.inference_mode():
            weight = self.embed.weight
            return self.fc(torch.cat([self.embed(tokens.to(weight.device)), prev_features.to(weight.dtype)], dim=-1))

    def _feed(self, state: SequenceState, slots: torch.Tensor, upto: torch.Tensor, logits_at: str
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed positions [drafter length, upto) of each row with the target's features f_{j-1} (zeros at
        j = 0) and commit them; rows with nothing to feed must not be passed. Returns (logits [R, N],
        features [R, d]) at each row's last fed position when logits_at is "last"."""
        assert self.target is not None
        start = self.runner.lengths[slots].clone()
        counts = upto - start
        width = int(counts.max())
        tokens, _ = state.gather(slots, start, width)  # [R, W]
        prev = self.target.features(slots, start - 1, width)  # f_{j-1}: [R, W, d] (position -1 masked below)
        before_zero = (start[:, None] + torch.arange(width)[None, :]) == 0
        prev = prev.masked_fill(before_zero[..., None].to(prev.device), 0.0)
        out = self.runner.forward(tokens, slots, counts, logits_at=logits_at, embeds=self._inputs(tokens, prev),
                                  return_features=logits_at != "none")
        self.runner.commit(slots, counts)
        return out if logits_at != "none" else None

    def add_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        """Feed the prompts (the target has prefilled them, so their features are known) except their last
        token; rows with the same prompt (a GRPO group) share one feed and copy its KV."""
        self.runner.set_lengths(slots, torch.zeros_like(slots))
        if self._growth is not None:
            self._growth.admit(state, slots)
        started = clock.now()
        fed = prefill_prompts(state, slots, self.runner,
                              lambda _, rows, lengths: self._feed(state, rows, lengths, "none"))
        self.observe_feed(clock.now() - started, fed)

    # ------------------------------------------------------------------ drafting
    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        self.catch_up_s = 0.0
        return propose_rows(request, lambda slots, k: self._draft(state, slots, k, request))

    def _draft(self, state: SequenceState, slots: torch.Tensor, k: int, request: DraftRequest
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """k draft steps for `slots` (fewer where the request's `stop` ends them): tokens [R, j], probs [R, j, V]
        or None, confidence [R, j] or None."""
        if self._growth is not None:
            self._growth.before_drafting(state)
        self.runner.head = self.head.module()
        committed = state.lengths[slots]
        # a row drafted again before anything was committed re-feeds its newest position (same result)
        self.runner.set_lengths(slots, torch.minimum(self.runner.lengths[slots], committed - 1))
        self._catch_up(state, slots, committed, k)
        logits, features = self._feed(state, slots, committed, "last")  # at position n - 1: predicts token n
        out_pos = state.output_positions(slots)
        tokens, all_probs, confidence = [], [], []
        for step in range(k):
            if self.temperature_scale != 1.0:  # drafting at temperature T x scale: logits / scale at T
                logits = logits / self.temperature_scale
            token, probs, sure = self.head.sample(logits, state, slots, out_pos + step, request)
            tokens.append(token)
            all_probs.append(probs)
            confidence.append(sure)
            if step + 1 < k and request.stops_after(confidence):
                break
            if step + 1 < k:  # the next position's input: the draft and this position's predicted feature
                x = self._inputs(token[:, None], features[:, None])
                logits, features = self.runner.forward(token[:, None], slots, embeds=x, logits_at="last",
                                                       return_features=True)
                self.runner.commit(slots, torch.ones_like(slots))
        self.runner.set_lengths(slots, committed)  # drop the draft positions (fed predicted features)
        drafts = torch.stack(tokens, dim=1)
        return drafts, (torch.stack(all_probs, dim=1) if all_probs[0] is not None else None), \
            (torch.stack(confidence, dim=1) if confidence[0] is not None else None)

    def _catch_up(self, state: SequenceState, slots: torch.Tensor, committed: torch.Tensor, k: int) -> None:
        """Rows that fell behind (rounds drafted by another method) are fed up to their last k + 1 committed
        tokens in a forward of its own, timed as `catch_up_s` (ModelDrafter._catch_up's reasoning)."""
        started = clock.now()
        behind = committed - self.runner.lengths[slots]
        late = behind > k + 1
        if bool(late.any()):
            rows, upto = slots[late], committed[late] - (k + 1)
            start = self.runner.lengths[rows]
            for part in fitting_batches(start, upto - start, self.runner.cache.max_len):  # padded blocks fit the cache
                self._feed(state, rows[part], upto[part], "none")
            self.catch_up_s = clock.now() - started
            self.observe_feed(self.catch_up_s, int((upto - start).sum()))

    def behind(self, state: SequenceState, slots: torch.Tensor) -> torch.Tensor:
        return (state.lengths[slots] - self.runner.lengths[slots]).clamp_min(0)

    def observe_commit(self, state: SequenceState, slots: torch.Tensor) -> None:
        if self._growth is not None:  # they join the vocabulary before it next drafts
            self._growth.committed(slots)

    def finish_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        if self._growth is not None:
            self._growth.finish(state, slots)

    # ------------------------------------------------------------------ weights
    def trainable_model(self) -> torch.nn.Module | None:
        """fc, the layer and the norm (the embedding and the head are the target's)."""
        return self.model

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        assert self.model is not None
        load_named_weights(self.model, weights)
        self._build_runner()
        self.version = version

    def weights_changed(self) -> None:
        self._build_runner()  # an int8 copy, and the head rows of the (maybe updated) target

    def reset_weights(self) -> None:
        """Back to the configured drafter (the trained one in `path`, or a fresh one from the target): policy v0."""
        assert self.target is not None, "bind_target first"
        fresh = self._configured_model()
        self.model.load_state_dict(fresh.state_dict())
        self._build_runner()

    def head_token_ids(self) -> torch.Tensor | None:
        """The token ids of the drafting head (None: the full vocabulary): what its training should cover."""
        return None if self.vocab is None else self.vocab.ids.clone()

    def check_invariants(self, state: SequenceState, slots: torch.Tensor) -> None:
        if self.target is None:
            return
        kv, committed = self.runner.lengths[slots], state.lengths[slots]
        assert bool((kv <= committed).all()), f"{self.name}: drafter KV {kv.tolist()} past {committed.tolist()}"
        target_kv = self.target.lengths[slots]
        assert bool((target_kv >= committed - 1).all()), "the target's features lag its committed tokens"
