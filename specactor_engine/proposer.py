"""The proposer: everything that drafts in one verify round, returned as one `RoundDrafts` value.

Draft sources (docs/architecture.md): the in-process drafters (in order for the rows still without
drafts, the cascade; or one method per request, Fastest-of-N), the drafter workers' streamed drafts
(never waited for), shadow drafts of model-free drafters kept only to score acceptance statistics
(policies/shadow.py), and in the tail a second method's candidate per row (combination, verified
beside the row's own draft by the verifier).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from specactor_engine import clock
from specactor_engine.decoupled.coordinator import DecoupledCoordinator
from specactor_engine.decoupled.sync import WorkerDrafterSync
from specactor_engine.drafters import DraftRequest, Drafter
from specactor_engine.policies.arbitration import better_offers, expected_tokens, offer_key
from specactor_engine.policies.draft_trim import ConfidenceCalibration
from specactor_engine.policies.selector import FastestOfNSelector
from specactor_engine.policies.shadow import ShadowBook, ShadowDraft
from specactor_engine.policies.verify_length import VerifyLengthPolicy
from specactor_engine.sampling import SamplingParams
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal, EngineStats

WORKERS = WorkerDrafterSync.name  # the drafter workers' name as a draft method


@dataclass
class Candidates:
    """Combination: second drafts from other methods, verified beside the rows' own drafts."""

    rows: torch.Tensor  # [E] indices into the round's slots, one candidate per row
    offers: DraftProposal  # token_ids [E, k], num_tokens [E]
    methods: list[str]  # [E] each candidate's draft method


@dataclass
class RoundDrafts:
    """What one round verifies and how it was drafted (R rows, k = the round's widest draft)."""

    proposal: DraftProposal  # token_ids [R, k], num_tokens [R], probs [R, k, V] (rejection sampling) or None
    sources: list[str | None]  # [R] the method whose tokens each row verifies; None: no drafts
    caps: torch.Tensor  # [R] draft tokens each row may verify (its cap at this round's verify length)
    full_caps: torch.Tensor | None = None  # [R] caps before the verify length; set where shadows are kept
    chosen: list[str] | None = None  # [R] Fastest-of-N's method per row; None: cascade, or the workers alone
    fallback: torch.Tensor | None = None  # [R] bool: drafted by another method after the chosen one gave none
    deferred: torch.Tensor | None = None  # [R] bool: acceptance scored later from a shadow, not this verify
    swapped: torch.Tensor | None = None  # [R] bool: verifies a model-free draft in place of its model's (arbitration)
    # arbitration's drafts not verified: (row, calibration keys, tokens [n], confidence [n]), scored against what
    # the row emits; a swapped row's offer is also booked under its context's key (policies/arbitration.py offer_key)
    unverified: list[tuple[int, tuple[str, ...], torch.Tensor, torch.Tensor]] = field(default_factory=list)
    offer_keys: dict[int, str] = field(default_factory=dict)  # swapped row -> its offer's `offer_key`
    candidates: Candidates | None = None  # combination's second drafts, if this round verifies any
    draft_s: float = 0.0  # seconds proposing the verified drafts (the critical path's drafting)
    shadow_s: float = 0.0  # seconds drafting idle rows for statistics only
    candidate_s: float = 0.0  # seconds drafting the combination's candidates
    verify_s: float = 0.0  # seconds of the round's target forward and acceptance (the verifier), set by run.py
    draft_s_by_drafter: dict[str, float] = field(default_factory=dict)  # in-process drafting seconds by method
    catch_up_s_by_drafter: dict[str, float] = field(default_factory=dict)  # of which catching up (Drafter.catch_up_s)
    # draft trimming's early end of a model's drafting: (method, rows [R'] as indices into the round, their
    # confidence so far [R', j]) -> True where trimming would cut every deeper position (run.py `_draft_stop`)
    draft_stop: Callable[[str, torch.Tensor, torch.Tensor], bool] | None = None

    def steady_draft_s(self) -> dict[str, float]:
        """Drafting seconds by method without catching up: what drafting with it every round costs."""
        catch_up = self.catch_up_s_by_drafter
        return {name: spent - catch_up.get(name, 0.0) for name, spent in self.draft_s_by_drafter.items()}

    def mark_fallback(self, row: int) -> None:
        """Row `row` verifies another method's drafts: no credit (or blame) for its chosen method."""
        if self.fallback is None:
            self.fallback = torch.zeros(len(self.caps), dtype=torch.bool)
        self.fallback[row] = True

    def mark_deferred(self, row: int) -> None:
        """Row `row`'s acceptance is scored from its shadow draft once it has committed that far."""
        if self.deferred is None:
            self.deferred = torch.zeros(len(self.caps), dtype=torch.bool)
        self.deferred[row] = True


def no_drafts(rows: int, caps: torch.Tensor) -> DraftProposal:
    """An all-empty proposal [rows, max cap]."""
    k = int(caps.max()) if len(caps) else 0
    return DraftProposal(torch.zeros(rows, k, dtype=torch.long), torch.zeros(rows, dtype=torch.long))


class Proposer:
    """Drafts for one `generate` call's rounds; owns the selector's choices and the shadow drafts."""

    def __init__(self, state: SequenceState, params: SamplingParams, stats: EngineStats, drafters: list[Drafter],
                 coordinator: DecoupledCoordinator | None, selector: FastestOfNSelector | None,
                 shadows: ShadowBook | None, shadow_rows: int, rejection: bool, vocab_size: int,
                 output_of: Callable[[int], tuple[list[int], int, bool]]) -> None:
        """output_of(slot): the row's (output ids, sequence key, finished), for shadow drafts."""
        self.confidence = False  # ask model drafters for their confidence (draft trimming: run.py sets it)
        # draft arbitration's acceptance map (policies/arbitration.py; run.py sets it): None, no arbitration
        self.arbiter: ConfidenceCalibration | None = None
        self.state = state
        self.params = params
        self.stats = stats
        self.drafters = drafters
        self.coordinator = coordinator
        self.selector = selector
        self.shadows = shadows
        self.shadow_drafters = [d for d in drafters if d.model_free]
        # methods whose drafting costs the critical path next to nothing: model-free drafters, streamed worker drafts
        self.free_methods = {d.name for d in self.shadow_drafters} | {WORKERS}
        self.has_costly_drafter = any(not d.model_free for d in drafters)  # an in-process draft model
        # methods whose acceptance shadow drafts measure at every depth (the verify length's deep probes skip them)
        self.shadowed = frozenset(d.name for d in self.shadow_drafters) if shadows is not None else frozenset()
        self.shadow_rows = shadow_rows
        self.shadow_cursor = 0  # rows drafted only for statistics take turns by slot
        self.rejection = rejection
        self.vocab_size = vocab_size
        self.output_of = output_of

    # ------------------------------------------------------------------ the round's drafts
    def method_options(self, slots: torch.Tensor, caps: torch.Tensor, workers_on: bool) -> list[list[str | None]] | None:
        """Fastest-of-N's assignments of a draft method per row [R] for the verify length to weigh (None: no
        selector), distinct, in this order: every row on one in-process draft model (one per such drafter), the
        selector's per-request choice, and the selector's choice among the free methods only (model-free
        drafters, the workers' streamed drafts: they cost the critical path next to nothing). A draft model costs
        about the same per call at 1 row as at 4 (its weights stream once per step), so the per-row accounting
        of the selector undervalues it on a few rows: it gave trace D's rows to suffix drafts that accepted 0.5
        tokens where the model accepted 3.4. Only the round-level cost model can tell, so it is offered the
        whole-batch choice. The first option is the one the verify length keeps probed while another wins: the
        draft model cheapest per row, measured or, before its first round, by its size (`_row_cost`), so the
        probes cost least (trace D: probing the 0.5B model every few rounds, with the catch-up forward each
        probe needs, cost more than it found while the feature-level drafter won). A costlier model is tried
        only where the verify length expects it to win, its size-based cost and catch-up included. Rows with no
        room to draft (`caps` 0) get None."""
        if self.selector is None:
            return None
        keys, verify_s = self.state.seq_keys[slots].tolist(), self._row_verify_s()
        names = self._methods(workers_on)
        free = [m for m in names if m in self.free_methods]
        costly = sorted((d for d in self.drafters if not d.model_free), key=lambda d: self._row_cost(d, verify_s))
        costly = [d.name for d in costly]
        assignments = [[name] * len(keys) for name in costly]
        assignments.append(self.selector.choose(keys, verify_s, names))
        if free:
            assignments.append(self.selector.choose(keys, verify_s, free))
        room = (caps > 0).tolist()
        options: list[list[str | None]] = []
        for assignment in assignments:
            option = [m if open_ else None for m, open_ in zip(assignment, room)]
            if option not in options:
                options.append(option)
        return options

    def _row_cost(self, drafter: Drafter, verify_s: float) -> tuple[float, float]:
        """A draft model's drafting seconds per row (the selector's measure) and its size-based share: a model
        not measured yet is ranked by its prior, share x a row's verify seconds (Drafter.cost_share; without
        one it counts as free and goes first, so that it gets measured)."""
        assert self.selector is not None
        share = drafter.cost_share if drafter.cost_share is not None else 0.0
        measured = self.selector.cost.get(drafter.name)
        return (measured if measured is not None else share * verify_s, share)

    def catch_up_estimate_s(self, slots: torch.Tensor, option: list[str | None], steady: int = 0) -> float:
        """Seconds the draft models of `option` (each row's method [R]) would spend catching up on what the rows
        committed while other methods drafted, before drafting this round (Drafter.catch_up_estimate_s; steady:
        tokens per row a model drafting every round feeds anyway, the verify length's max_k + 1: a model in
        steady use is charged none, trace A's feature drafter had been charged 32 rows' last tokens a round)."""
        total = 0.0
        for drafter in self.drafters:
            if drafter.model_free:
                continue
            mine = [row for row, method in enumerate(option) if method == drafter.name]
            if mine:
                total += drafter.catch_up_estimate_s(self.state, slots[mine], steady)
        return total

    def _methods(self, workers_on: bool) -> list[str]:
        """The draft methods a round may use: the in-process drafters, after the workers' drafts when they run."""
        names = [d.name for d in self.drafters]
        return [WORKERS, *names] if self.coordinator is not None and workers_on else names

    def propose(self, slots: torch.Tensor, caps: torch.Tensor, full_caps: torch.Tensor | None, workers_on: bool,
                shadow_idle: bool, chosen: list[str | None] | None = None,
                draft_stop: Callable[[str, torch.Tensor, torch.Tensor], bool] | None = None,
                arbitrate: bool = False) -> RoundDrafts:
        """Drafts for `slots` [R] up to `caps` [R]; `full_caps` [R] (shadow drafting) the caps before the
        verify length. workers_on: the drafter workers are drafting this round (not paused);
        shadow_idle: also draft idle rows as shadows (statistics only); chosen: each row's method, as
        already decided with the verify length (None: the selector chooses here); draft_stop: `RoundDrafts.draft_stop`;
        arbitrate: rows a draft model drafted may verify a model-free draft instead (`_arbitrate`, needs `arbiter`)."""
        drafts = RoundDrafts(no_drafts(len(slots), caps), [None] * len(slots), caps, full_caps, draft_stop=draft_stop)
        started = clock.now()
        if self.coordinator is None:
            self._propose_in_process(slots, drafts, chosen)
        elif not self.drafters:
            self._take(slots, drafts)
        else:
            self._propose_mixed(slots, drafts, workers_on, chosen)
        if arbitrate and self.arbiter is not None:
            self._arbitrate(slots, drafts, self.arbiter)
        drafts.draft_s = clock.now() - started
        if shadow_idle:
            started = clock.now()
            self._shadow_idle_rows(slots, drafts)
            drafts.shadow_s = clock.now() - started
        return drafts

    def add_candidates(self, slots: torch.Tensor, drafts: RoundDrafts, max_rows: int, free_only: bool = False) -> None:
        """Combination: second candidates from the other in-process methods, at most `max_rows`; free_only:
        only from model-free methods (a dynamic verify length weighed the round's drafting cost, and a draft
        model's candidates would add a whole drafting call it did not weigh)."""
        started = clock.now()
        drafts.candidates = self._candidates(slots, drafts, max_rows, free_only)
        drafts.candidate_s = clock.now() - started

    def _row_verify_s(self) -> float:
        """A row's share of a verify round so far (what every draft method pays per round)."""
        return self.stats.verify_s / max(self.stats.row_rounds, 1)

    def _choose(self, slots: torch.Tensor, methods: list[str], chosen: list[str | None] | None) -> list[str]:
        """Each row's method: the one decided with the verify length, else the selector's choice now."""
        assert self.selector is not None
        if chosen is not None and None not in chosen:
            return list(chosen)  # type: ignore[arg-type]
        picked = self.selector.choose(self.state.seq_keys[slots].tolist(), self._row_verify_s(), methods)
        return picked if chosen is None else [c if c is not None else p for c, p in zip(chosen, picked)]

    def _propose_in_process(self, slots: torch.Tensor, drafts: RoundDrafts, chosen: list[str | None] | None) -> None:
        """Cascade: each drafter in order drafts for the rows still without drafts. Fastest-of-N:
        the selector gives each row one drafter (drafts.chosen), which alone drafts for it."""
        caps = drafts.caps
        if not len(caps) or int(caps.max()) == 0 or not self.drafters:
            return
        if self.selector is not None:
            drafts.chosen = self._choose(slots, self._methods(False), chosen)
        self._draft_rows(slots, drafts, caps > 0)

    def _take(self, slots: torch.Tensor, drafts: RoundDrafts) -> None:
        """Workers only: whatever drafts have streamed in for these rows, up to their caps; never waits."""
        assert self.coordinator is not None
        self.coordinator.poll()
        tokens, num = self.coordinator.take(slots.numpy(), drafts.caps.numpy())
        drafts.proposal = DraftProposal(torch.from_numpy(tokens), torch.from_numpy(num))
        drafts.sources = [WORKERS if n else None for n in num.tolist()]

    def _propose_mixed(self, slots: torch.Tensor, drafts: RoundDrafts, workers_on: bool,
                       chosen: list[str | None] | None) -> None:
        """Workers and in-process drafters: the selector gives each row one method, the workers'
        streamed drafts or an in-process drafter; a row whose in-process drafter supplies nothing takes
        the workers' drafts if any have arrived. With the workers paused only in-process drafters are
        chosen. Never waits for the workers."""
        assert self.coordinator is not None
        caps = drafts.caps
        self.coordinator.poll()
        if not len(caps) or int(caps.max()) == 0:
            return
        if workers_on:  # what has streamed in (paused, the rows' buffers are not kept up: nothing to take)
            started = clock.now()
            stream_tokens, stream_num = (torch.from_numpy(a) for a in self.coordinator.take(slots.numpy(),
                                                                                            caps.numpy()))
            take_s = clock.now() - started
        methods = self._methods(workers_on)
        if self.selector is not None:
            drafts.chosen = self._choose(slots, methods, chosen)
            if workers_on:
                self.selector.observe_cost(WORKERS, take_s, len(slots))
        else:
            drafts.chosen = [methods[0]] * len(slots)
        by_workers = torch.tensor([c == WORKERS for c in drafts.chosen])
        self._draft_rows(slots, drafts, (caps > 0) & ~by_workers)
        if not workers_on:  # paused: their streamed drafts are not taken (`DecoupledCoordinator.after_round`)
            drafts.fallback = torch.zeros_like(caps > 0)
            return
        merged = drafts.proposal
        fill = (caps > 0) & (merged.num_tokens == 0) & (stream_num > 0)
        drafts.fallback = fill & ~by_workers
        rows = fill.nonzero().flatten()
        width = stream_tokens.shape[1]
        merged.token_ids[rows, :width] = stream_tokens[rows]
        merged.num_tokens[rows] = stream_num[rows]
        for row in rows.tolist():
            drafts.sources[row] = WORKERS

    def _draft_rows(self, slots: torch.Tensor, drafts: RoundDrafts, need: torch.Tensor) -> None:
        """In-process drafters for the rows in `need` [R] bool: each row's chosen drafter (drafts.chosen),
        or without a choice the cascade. Fills drafts.proposal and drafts.sources."""
        merged, caps, full_caps = drafts.proposal, drafts.caps, drafts.full_caps
        need = need.clone()
        probs_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        confidence_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for drafter in self.drafters:
            mine = need if drafts.chosen is None else need & torch.tensor([c == drafter.name for c in drafts.chosen])
            rows = mine.nonzero().flatten()
            if len(rows) == 0:
                continue
            shadowing = full_caps is not None and drafter.model_free
            asked = full_caps[rows] if shadowing else caps[rows]
            # a model-free drafter's scores only where arbitration reads them (trimming then reads them too)
            confident = self.confidence and (not drafter.model_free or self.arbiter is not None)
            request = DraftRequest(slots[rows], asked, self.params, coupled_noise=not self.rejection,
                                   confidence=confident, stop=self._stop_for(drafts, drafter, rows[asked > 0]))
            started = clock.now()
            proposal = drafter.propose(self.state, request)
            if shadowing:  # drafted to the cap: what this round does not verify is scored as a shadow
                proposal = self._shadow_beyond(slots, rows, drafts, proposal, drafter.name)
            self._observe_cost(drafts, drafter.name, clock.now() - started, len(rows), drafter.catch_up_s)
            got = proposal.num_tokens > 0
            taken = rows[got]
            width = proposal.token_ids.shape[1]
            merged.token_ids[taken, :width] = proposal.token_ids[got]
            merged.num_tokens[taken] = proposal.num_tokens[got]
            if proposal.probs is not None:
                probs_parts.append((taken, proposal.probs[got]))
            if proposal.confidence is not None:
                confidence_parts.append((taken, proposal.confidence[got]))
            for row in taken.tolist():
                drafts.sources[row] = drafter.name
            need[taken] = False
        if self.rejection and probs_parts:
            merged.probs = self._merge_probs(merged, probs_parts)
        if confidence_parts:  # NaN: rows whose drafter reports no confidence (draft trimming leaves them whole)
            merged.confidence = torch.full(merged.token_ids.shape, float("nan"))
            for rows, part in confidence_parts:
                width = min(part.shape[1], merged.confidence.shape[1])
                merged.confidence[rows, :width] = part[:, :width]

    def _arbitrate(self, slots: torch.Tensor, drafts: RoundDrafts, calibration: ConfidenceCalibration) -> None:
        """Draft arbitration (policies/arbitration.py): the rows a draft model drafted with its confidence are also
        drafted by each model-free method that scores its drafts (`Drafter.scores_drafts`), up to the same caps; a
        row verifies the draft expected to emit the most tokens (`drafts.swapped` where that is an offer: its
        acceptance is booked to the offer's method). An offer's expectation comes from its method's calibration in
        the row's context (`offer_key`: the model's confidence in its first draft). The drafts a row does not verify
        are kept (`drafts.unverified`) to be scored against what it emits, so each calibration learns from every
        arbitrated row, not only from the drafts that won."""
        proposal, sources = drafts.proposal, drafts.sources
        offering = [d for d in self.shadow_drafters if d.scores_drafts]
        if proposal.confidence is None or proposal.probs is not None or not offering:
            return
        costly = {d.name for d in self.drafters if not d.model_free}
        rows = [row for row, source in enumerate(sources) if source in costly
                and int(proposal.num_tokens[row]) > 0 and not bool(torch.isnan(proposal.confidence[row, 0]))]
        if not rows:
            return
        index, width = torch.tensor(rows), proposal.token_ids.shape[1]
        num = proposal.num_tokens[index]
        confidence = proposal.confidence[index].numpy()
        # each row's drafts (method, tokens [R', k], confidence [R', k], num [R']), its own first, then the offers,
        # and the calibration keys each is expected and scored under
        drafted = [([str(sources[row]) for row in rows], proposal.token_ids[index].clone(),
                    proposal.confidence[index].clone(), num.clone())]
        keys = [[(str(sources[row]),) for row in rows]]
        expected = [np.zeros(len(rows))]
        for method in set(drafted[0][0]):
            mine = np.array([m == method for m in drafted[0][0]])
            expected[0][mine] = expected_tokens(calibration, method, confidence[mine], num.numpy()[mine])
        for drafter in offering:
            started = clock.now()
            offer = drafter.propose(self.state, DraftRequest(slots[index], drafts.caps[index], self.params,
                                                             coupled_noise=True, confidence=True))
            self._observe_cost(drafts, drafter.name, clock.now() - started, len(rows))
            if offer.confidence is None:
                continue
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            sure = torch.full((len(rows), width), float("nan"))
            shared = min(width, offer.token_ids.shape[1])
            tokens[:, :shared], sure[:, :shared] = offer.token_ids[:, :shared], offer.confidence[:, :shared]
            offered = offer.num_tokens.clamp(max=width)
            drafted.append(([drafter.name] * len(rows), tokens, sure, offered))
            contexts = [offer_key(drafter.name, float(c)) for c in confidence[:, 0]]
            keys.append([(drafter.name, context) for context in contexts])
            mine = np.full(len(rows), np.nan)
            for context in set(contexts):
                at = np.array([c == context for c in contexts])
                mine[at] = expected_tokens(calibration, context, sure.numpy()[at], offered.numpy()[at])
            expected.append(np.where(offered.numpy() > 0, mine, np.nan))
        pick = np.zeros(len(rows), dtype=np.int64)
        best = expected[0].copy()
        for j in range(1, len(drafted)):
            better = better_offers(best, expected[j])
            pick[better], best[better] = j, expected[j][better]
        for i, row in enumerate(rows):
            for j, (methods, tokens, sure, counts) in enumerate(drafted):
                n = int(counts[i])
                if j != pick[i]:
                    if n:
                        drafts.unverified.append((row, keys[j][i], tokens[i, :n], sure[i, :n]))
                    continue
                if j == 0:
                    continue
                proposal.token_ids[row], proposal.num_tokens[row] = tokens[i], n
                proposal.confidence[row] = sure[i]
                sources[row] = methods[i]
                drafts.offer_keys[row] = keys[j][i][-1]
                if drafts.swapped is None:
                    drafts.swapped = torch.zeros(len(sources), dtype=torch.bool)
                drafts.swapped[row] = True
                self.stats.arbitrated_rows += 1

    @staticmethod
    def _stop_for(drafts: RoundDrafts, drafter: Drafter, rows: torch.Tensor) -> Callable[[torch.Tensor], bool] | None:
        """`DraftRequest.stop` for a draft model's rows (`rows`: those it drafts, indices into the round)."""
        stop = drafts.draft_stop
        if stop is None or drafter.model_free:
            return None
        return lambda confidence: stop(drafter.name, rows, confidence)

    def _observe_cost(self, drafts: RoundDrafts, name: str, spent: float, rows: int, catch_up: float = 0.0) -> None:
        """Book an in-process drafter's seconds: this round's, the call's, and the selector's cost model (which,
        like the verify length, weighs the steady cost: without `catch_up`, the seconds spent on tokens
        committed while other methods drafted)."""
        drafts.draft_s_by_drafter[name] = drafts.draft_s_by_drafter.get(name, 0.0) + spent
        if catch_up:
            drafts.catch_up_s_by_drafter[name] = drafts.catch_up_s_by_drafter.get(name, 0.0) + catch_up
        self.stats.draft_s_per_drafter[name] = self.stats.draft_s_per_drafter.get(name, 0.0) + spent
        if self.selector is not None:
            self.selector.observe_cost(name, spent - catch_up, rows)

    def _merge_probs(self, merged: DraftProposal, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Draft distributions [R, k, V]: given ones where a drafter sampled, one-hot elsewhere."""
        R, k = merged.token_ids.shape
        probs = torch.zeros(R, k, self.vocab_size, dtype=torch.float64)
        probs.scatter_(-1, merged.token_ids[..., None], 1.0)
        for rows, part in parts:
            probs[rows, : part.shape[1]] = part.to(torch.float64)
        return probs

    # ------------------------------------------------------------------ combination (the tail)
    def _candidates(self, slots: torch.Tensor, drafts: RoundDrafts, max_rows: int, free_only: bool) -> Candidates | None:
        """Second candidates from the other in-process methods for rows of this round.

        At most one per row and `max_rows` in all. A candidate that is a prefix of the row's own draft
        gains nothing and is dropped; a row whose own method drafted nothing simply takes the
        candidate as its draft (no second row needed).
        """
        caps, proposal, sources = drafts.caps, drafts.proposal, drafts.sources
        open_rows = (caps > 0).nonzero().flatten().tolist()
        found: dict[int, tuple[torch.Tensor, int, str]] = {}
        for drafter in self.shadow_drafters if free_only else self.drafters:
            rows = [r for r in open_rows if r not in found and sources[r] != drafter.name]
            if not rows:
                continue
            picked = torch.tensor(rows)
            started = clock.now()
            offer = drafter.propose(self.state, DraftRequest(slots[picked], caps[picked], self.params,
                                                             coupled_noise=True))
            if self.selector is not None:
                self.selector.observe_cost(drafter.name, clock.now() - started, len(rows))
            for i, row in enumerate(rows):
                n = int(offer.num_tokens[i])
                if n == 0:
                    continue
                own = int(proposal.num_tokens[row])
                tokens = offer.token_ids[i, :n]
                if n <= own and torch.equal(tokens, proposal.token_ids[row, :n]):
                    continue  # a prefix of the row's own draft
                if own == 0:  # nothing of its own: the candidate becomes the row's draft
                    width = min(n, proposal.token_ids.shape[1])
                    proposal.token_ids[row, :width] = tokens[:width]
                    proposal.num_tokens[row] = width
                    sources[row] = drafter.name
                    drafts.mark_fallback(row)  # not the chosen method's drafts: no credit for it
                    continue
                found[row] = (tokens, n, drafter.name)
        rows = sorted(found)[:max_rows]
        if not rows:
            return None
        k = proposal.token_ids.shape[1]
        offers = DraftProposal(torch.zeros(len(rows), k, dtype=torch.long), torch.zeros(len(rows), dtype=torch.long))
        for i, row in enumerate(rows):
            tokens, n, _ = found[row]
            n = min(n, k)
            offers.token_ids[i, :n], offers.num_tokens[i] = tokens[:n], n
        return Candidates(torch.tensor(rows), offers, [found[row][2] for row in rows])

    # ------------------------------------------------------------------ shadow drafts (policies/shadow.py)
    def _shadow(self, slot: int, tokens: torch.Tensor, cap: int, method: str) -> None:
        """Keep a row's draft [n] (made with `cap` slots) to score once the row has committed that far."""
        assert self.shadows is not None
        output, key, _ = self.output_of(slot)
        self.shadows.add(slot, ShadowDraft(len(output), tuple(tokens.tolist()), cap, method, key))

    def _shadow_beyond(self, slots: torch.Tensor, rows: torch.Tensor, drafts: RoundDrafts, proposal: DraftProposal,
                       method: str) -> DraftProposal:
        """A model-free drafter drafted `rows` (indices into `slots`) to their full caps: rows whose verify
        length this round is shorter keep the whole draft as a shadow (their acceptance is then scored
        from it, not from the verify: drafts.deferred); the proposal is cut to this round's caps."""
        assert self.shadows is not None and drafts.full_caps is not None
        caps = drafts.caps
        cut = caps[rows]
        for i, row in enumerate(rows.tolist()):
            slot, full = int(slots[row]), int(drafts.full_caps[row])
            if full > int(cut[i]) and slot not in self.shadows:
                self._shadow(slot, proposal.token_ids[i, : int(proposal.num_tokens[i])], full, method)
                drafts.mark_deferred(row)
        # a drafter may return fewer columns than asked (its longest draft), so the round's width can be
        # wider or narrower than the proposal: copy what fits into a zero-padded [rows, width]
        width = int(caps.max()) if len(caps) else 0
        num = torch.minimum(proposal.num_tokens, cut)
        tokens = torch.zeros(len(rows), width, dtype=proposal.token_ids.dtype)
        kept = min(width, proposal.token_ids.shape[1])
        tokens[:, :kept] = proposal.token_ids[:, :kept]
        tokens[torch.arange(width)[None, :] >= num[:, None]] = 0
        confidence = None
        if proposal.confidence is not None:  # a scored model-free draft's (`Drafter.scores_drafts`), cut alike
            confidence = torch.full((len(rows), width), float("nan"))
            confidence[:, :kept] = proposal.confidence[:, :kept]
            confidence[torch.arange(width)[None, :] >= num[:, None]] = float("nan")
        return DraftProposal(token_ids=tokens, num_tokens=num, probs=proposal.probs, confidence=confidence)

    def _shadow_idle_rows(self, slots: torch.Tensor, drafts: RoundDrafts) -> None:
        """Draft, for statistics only, up to `shadow_rows` rows that verify no drafts this round (taking
        turns by slot), each with the selector's model-free method for its request (the cascade without
        a selector)."""
        assert self.shadows is not None and drafts.full_caps is not None
        full = drafts.full_caps
        slot_of = slots.tolist()
        idle = [row for row in ((drafts.caps == 0) & (full > 0)).nonzero().flatten().tolist()
                if slot_of[row] not in self.shadows]
        if not idle:
            return
        idle.sort(key=lambda row: (slot_of[row] < self.shadow_cursor, slot_of[row]))
        picked = idle[: self.shadow_rows]
        self.shadow_cursor = slot_of[picked[-1]] + 1
        names = [d.name for d in self.shadow_drafters]
        chosen = dict(zip(picked, self.selector.choose(self.state.seq_keys[slots[picked]].tolist(),
                                                       self._row_verify_s(), names))) if self.selector else {}
        waiting = list(picked)
        for position, drafter in enumerate(self.shadow_drafters):
            mine = [row for row in waiting if chosen.get(row, drafter.name) == drafter.name]
            if not mine:
                continue
            index = torch.tensor(mine)
            started = clock.now()
            proposal = drafter.propose(self.state, DraftRequest(slots[index], full[index], self.params))
            self._observe_cost(drafts, drafter.name, clock.now() - started, len(mine))
            last = position == len(self.shadow_drafters) - 1
            for i, row in enumerate(mine):
                n = int(proposal.num_tokens[i])
                if n or chosen or last:  # the cascade leaves a row without drafts to the next drafter
                    self._shadow(int(slots[row]), proposal.token_ids[i, :n], int(full[row]), drafter.name)
                    waiting.remove(row)

    def score_shadows(self, length_policy: VerifyLengthPolicy | None) -> dict[str, list[int]]:
        """Score the shadow drafts of rows that have now committed past them (or finished); feed the
        verify length's acceptance statistics and the selector. Returns method -> [drafts, accepted]."""
        scored: dict[str, list[int]] = {}
        if self.shadows is None or not self.shadows.pending:
            return scored
        caps, accepted, requests, methods = [], [], [], []
        for slot in list(self.shadows.pending):
            output, _, finished = self.output_of(slot)
            done = self.shadows.resolve(slot, output, finished)
            if done is None:
                continue
            draft, got = done
            caps.append(draft.cap)
            accepted.append(got)
            requests.append(draft.request)
            methods.append(draft.method)
        if not caps:
            return scored
        stats = self.stats
        stats.shadow_drafts += len(caps)
        stats.shadow_accepted += sum(accepted)
        for method, got in zip(methods, accepted):
            stats.shadow_drafts_per_drafter[method] = stats.shadow_drafts_per_drafter.get(method, 0) + 1
            stats.shadow_accepted_per_drafter[method] = stats.shadow_accepted_per_drafter.get(method, 0) + got
            counts = scored.setdefault(method, [0, 0])
            counts[0], counts[1] = counts[0] + 1, counts[1] + got
        if length_policy is not None:
            length_policy.observe_acceptance(caps, accepted, methods)
        if self.selector is not None:  # credited as deep as rounds now verify (at least the first position)
            depth = max(length_policy.current or 0, 1) if length_policy is not None else None
            self.selector.observe(requests, methods, accepted, depth=depth)
        return scored

    # ------------------------------------------------------------------ after the verify
    def credit(self, slots: torch.Tensor, drafts: RoundDrafts, accepted: torch.Tensor) -> None:
        """Fastest-of-N: credit each row's chosen method with its own drafts' acceptance `accepted` [R]
        (not a winning candidate's); a row whose method drafted nothing (another filled in) counts as
        nothing accepted for it, and rows scored from shadows are credited when those resolve."""
        if self.selector is None or drafts.chosen is None:
            return
        caps = drafts.caps
        drafted = caps > 0 if drafts.deferred is None else (caps > 0) & ~drafts.deferred
        if drafts.swapped is not None:  # the chosen model's drafts were not verified: neither credit nor blame
            drafted &= ~drafts.swapped
        keys = self.state.seq_keys[slots][drafted].tolist()
        methods = [m for m, d in zip(drafts.chosen, drafted.tolist()) if d]
        credited = accepted if drafts.fallback is None else torch.where(drafts.fallback, 0, accepted)
        self.selector.observe(keys, methods, credited[drafted].tolist())
