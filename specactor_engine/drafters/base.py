"""The drafter interface and registry.

A drafter proposes up to k tokens per row from the committed tokens in SequenceState.
It knows nothing of the verifier or of other drafters; after every verify round the
engine calls `observe_commit` so stateful drafters (KV caches) can roll back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from specactor_engine.sampling import SamplingParams
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal


@dataclass(frozen=True)
class DraftRequest:
    """What the engine asks of a drafter in one round.

    slots:            [R] rows to draft for
    max_draft_tokens: [R] per-row cap (0 = skip the row); k = max over rows
    coupled_noise:    True -> draw tokens with the target's position-keyed noise
                      (position-keyed acceptance); False -> independent draft noise and
                      return draft probabilities (classic rejection sampling)
    confidence:       also return each drafted token's probability under the drafter (model drafters), or a
                      model-free drafter's score of it (`Drafter.scores_drafts`: suffix drafts); draft trimming
                      and arbitration read it (policies/draft_trim.py, policies/arbitration.py)
    stop:             with `confidence`: asked after each draft step but the last, with the confidence so
                      far [R', j] of the rows drafted (those with a cap); True ends the drafting there, every
                      row with at most j drafts (draft trimming would cut every deeper position: run.py
                      `_draft_stop`). Output is unchanged whatever it answers: fewer drafts only verify less.
    """

    slots: torch.Tensor
    max_draft_tokens: torch.Tensor
    params: SamplingParams
    coupled_noise: bool = True
    confidence: bool = False
    stop: Callable[[torch.Tensor], bool] | None = None

    def stops_after(self, confidence: list[torch.Tensor | None]) -> bool:
        """Whether drafting ends after the steps drafted so far (each step's confidence [R'], `stop`)."""
        if self.stop is None or not confidence or confidence[0] is None:
            return False
        return bool(self.stop(torch.stack(confidence, dim=1)))


@dataclass(frozen=True)
class DrafterContext:
    """Engine facts a drafter may need to build itself."""

    device: str
    dtype: str
    target_tokenizer: Any
    target_vocab_size: int
    cache_dir: str | None = None


@dataclass
class FeedCost:
    """Seconds of a draft model's feed (prompt prefill, catch-up) of n tokens, `call_s + token_s x n`, fitted to its
    feeds by exponentially weighted least squares (`decay`: the newest feed's weight).

    A feed is one forward: a fixed cost per call (the weights stream once, host work) and a cost per token. A rate
    per token taken from small feeds prices big ones as if each token paid the call: trace D's feature-level
    drafter fed 1 token in 4.9 ms and 72 in 9 ms, and after a few one-token catch-ups a 400-token catch-up was
    put at ~1 s (2-3.4 ms a token; a 168-token catch-up took 39 ms). Charged to the round that would draft with
    it, that kept the drafter out for 40-85 rounds, longer the longer it was out. Until two feed sizes differ
    enough to fit both terms, the cost is proportional to the tokens (the cautious side for a catch-up bigger
    than the feeds seen).
    """

    decay: float = 0.1
    weight: float = 0.0  # total weight of the feeds seen (1 once `1 / decay` feeds were seen)
    mean_n: float = 0.0  # weighted means of tokens, seconds, tokens^2 and tokens x seconds
    mean_s: float = 0.0
    mean_nn: float = 0.0
    mean_ns: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        self.weight += 1.0
        w = max(self.decay, 1.0 / self.weight)  # the running mean of the first 1/decay feeds, then an EMA
        n = float(tokens)
        self.mean_n += w * (n - self.mean_n)
        self.mean_s += w * (seconds - self.mean_s)
        self.mean_nn += w * (n * n - self.mean_nn)
        self.mean_ns += w * (n * seconds - self.mean_ns)

    @property
    def measured(self) -> bool:
        return self.weight > 0

    def terms(self) -> tuple[float, float]:
        """(call_s, token_s), both >= 0."""
        spread = self.mean_nn - self.mean_n ** 2
        if spread <= 1e-6 * max(self.mean_nn, 1.0):  # one size seen: proportional
            return 0.0, self.mean_s / max(self.mean_n, 1e-9)
        token_s = max((self.mean_ns - self.mean_n * self.mean_s) / spread, 0.0)
        call_s = self.mean_s - token_s * self.mean_n
        if call_s < 0.0:  # the line through the origin
            return 0.0, self.mean_s / max(self.mean_n, 1e-9)
        return call_s, token_s

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        call_s, token_s = self.terms()
        return call_s + token_s * tokens


class Drafter(ABC):
    """One draft method."""

    name: str = "drafter"
    version: int = 0
    # drafting costs no model forward: the engine may draft past the verify length (or for rows that
    # verify none) only to score the drafts against what the rows commit (specactor_engine/policies/shadow.py)
    model_free: bool = False
    # a model-free drafter that returns its drafts' confidence when asked (`DraftRequest.confidence`): draft
    # arbitration offers its drafts against a draft model's (specactor_engine/policies/arbitration.py)
    scores_drafts: bool = False
    # seconds of the last `propose` spent catching up on tokens committed while other methods drafted (a
    # switching cost, kept apart from the steady drafting cost the verify length weighs)
    catch_up_s: float = 0.0
    # seconds of its feeds outside drafting (prompt prefills, catch-ups) by their tokens, fitted to those it ran
    # (`FeedCost`; set per instance by `observe_feed`)
    feed: FeedCost | None = None
    # its first feed was seen and left out of `feed` (it pays one-time costs)
    feed_warmed: bool = False
    # drafts from the target's own hidden states: the engine calls `bind_target` with its target runner
    needs_target: bool = False
    # `add_rows(..., prefill=False)` leaves the prompts to the catch-up of the rows' first drafting call (the
    # engine defers it for a draft model that is measured costly and not in use: it may never draft for them)
    defers_prefill: bool = False
    # a draft step's expected seconds as a share of a plain target step's, before any was measured: the ratio of
    # the weight bytes each reads (`step_bytes`; both stream their weights at a few rows). Set by the engine for
    # draft models; None: model-free, or not known (policies/verify_length.py's draft-cost prior)
    cost_share: float | None = None
    # seconds per token of a feed before one was measured (the engine's: cost_share x a target token's share of its
    # widest verify); None: unknown, a catch-up then counts as free
    feed_s_prior: float | None = None

    def bind_target(self, target: Any) -> None:
        """Attach to the engine's target runner (model/runner.py ModelRunner); only drafters that set
        `needs_target` are bound."""

    def step_bytes(self) -> int:
        """Bytes of weights one draft step reads (0: no model forward); `cost_share` is taken from it."""
        return 0

    def allocate(self, num_slots: int, max_len: int) -> None:
        """Size per-slot buffers for a generate call with `num_slots` rows of up to `max_len` tokens."""

    def add_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        """New sequences were admitted into `slots` (their prompts are in state)."""

    @abstractmethod
    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        """Draft tokens for request.slots."""

    def observe_commit(self, state: SequenceState, slots: torch.Tensor) -> None:
        """state now holds the committed tokens of `slots` after a verify round."""

    def behind(self, state: SequenceState, slots: torch.Tensor) -> torch.Tensor:
        """Committed tokens of `slots` [R] its cache has not taken in yet: what the next `propose` for them
        feeds before drafting (a draft model after rounds drafted by other methods; 0 without a cache)."""
        return torch.zeros(len(slots), dtype=torch.long)

    def shared_behind(self, state: SequenceState, slots: torch.Tensor) -> torch.Tensor:
        """Of `behind`, what a catch-up of all of `slots` at once feeds for each row [R] (a draft model feeds a prompt
        that rows share once: ModelDrafter)."""
        return self.behind(state, slots)

    def catch_up_estimate_s(self, state: SequenceState, slots: torch.Tensor, steady: int = 0) -> float:
        """Seconds the next `propose` for `slots` would spend catching up, by the feeds it measured (`feed`), else
        at the prior rate (`feed_s_prior`), else 0 (the first call measures it). Trace A: the 0.5B, its prefills
        deferred and no feed measured, was chosen with a catch-up counted free and fed 32 rows' contexts, ~6 s.
        steady: tokens per row a round drafting with it every round feeds anyway (the last round's accepted drafts
        and bonus token: its steady drafting cost holds them), left out; 0 counts everything behind."""
        tokens = int((self.shared_behind(state, slots) - steady).clamp_min(0).sum())
        if self.feed is not None and self.feed.measured:
            return self.feed.seconds(tokens)
        return tokens * self.feed_s_prior if self.feed_s_prior is not None else 0.0

    def observe_feed(self, seconds: float, tokens: int) -> None:
        """Fold one feed of `tokens` tokens that took `seconds` into `feed`, but for the first: it pays one-time
        costs (allocations, kernels' first calls), as a method's first drafting call does (policies/verify_length.py
        `cost_warmed`). Trace A, session 29: the feature-level drafter's first feed (the benchmark's warm-up prompt)
        took 325 ms for 82 tokens, its next 219 ms for 495; the line through both fell with the tokens, the fit
        became a flat 272 ms a feed, and a 2,543-token catch-up that took 974 ms was put at 272 ms."""
        if tokens > 0 and not self.feed_warmed:
            self.feed_warmed = True
            return
        if tokens > 0:
            if self.feed is None:
                self.feed = FeedCost()
            self.feed.observe(tokens, seconds)

    def finish_rows(self, state: SequenceState, slots: torch.Tensor) -> None:
        """`slots` finished (state still holds their tokens); the slots may be reused next."""

    def history_snapshot(self) -> Any:
        """What it keeps across generate calls from earlier rollouts (None: nothing), for `restore_history`."""
        return None

    def restore_history(self, snapshot: Any) -> None:
        """Put back what `history_snapshot` returned: later rollouts do not see the ones in between."""

    def record_rollout(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A finished sample decoded elsewhere (by a rollout replica, replicas/): it joins what this drafter keeps
        from earlier rollouts, as if this drafter had seen it finish (nothing, for drafters that keep nothing)."""

    def save_state(self, directory: Path) -> None:
        """Write non-weight state a resumed run needs (e.g. rollout history) into `directory`."""

    def load_state(self, directory: Path) -> None:
        """Read what `save_state` wrote (a missing file means nothing to restore)."""

    def trainable_model(self) -> torch.nn.Module | None:
        """The module whose weights a policy sync refreshes and a checkpoint saves (None: no weights)."""
        return None

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError(f"drafter {self.name!r} has no weights")

    def weights_changed(self) -> None:
        """`trainable_model()` was trained in place (a drafter sync): rebuild whatever copies its weights."""

    def check_invariants(self, state: SequenceState, slots: torch.Tensor) -> None:
        """Raise AssertionError if internal state disagrees with `state` (tests)."""


DRAFTER_REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register_drafter(kind: str) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    """Class decorator: make a drafter constructible from `{kind: <kind>, ...}` config."""

    def wrap(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        DRAFTER_REGISTRY[kind] = factory
        return factory

    return wrap


def build_drafter(config: Any, context: DrafterContext) -> Drafter:
    """Instantiate the registered drafter for `config.kind` (config: a drafter config model)."""
    if config.kind not in DRAFTER_REGISTRY:
        raise ValueError(f"unknown drafter kind {config.kind!r}; known: {', '.join(sorted(DRAFTER_REGISTRY))}")
    return DRAFTER_REGISTRY[config.kind](config, context)
