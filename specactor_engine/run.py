"""One `generate` call's decode loop: admission (prefill), then verify rounds until every sample ends.

One verify round (docs/architecture.md), read top to bottom in `Run._round`:
    schedule -> propose (proposer.py) -> verify (verifier.py: one target forward over [last, d1..dk])
    -> accept, stop checks, commit/roll back every KV, retire finished rows -> observe stats
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch

from specactor_engine import clock
from specactor_engine.decoupled.coordinator import DecoupledCoordinator
from specactor_engine.decoupled.phase import DECOUPLED, SOLO, DecouplingPolicy
from specactor_engine.decoupled.protocol import SamplingSpec
from specactor_engine.decoupled.sync import WorkerDrafterSync
from specactor_engine.drafters import Drafter
from specactor_engine.model.heap import trim_heap
from specactor_engine.model.runner import ModelRunner
from specactor_engine.policies.arbitration import observe_unverified
from specactor_engine.policies.cost_profile import PACKED_MAX_ROWS
from specactor_engine.policies.draft_trim import ConfidenceCalibration, choose_tokens
from specactor_engine.policies.selector import FastestOfNSelector
from specactor_engine.policies.shadow import SPARSE_MARGIN, ShadowBook, choice_due, shadows_due
from specactor_engine.policies.verify_length import VerifyLengthPolicy
from specactor_engine.proposer import WORKERS, Proposer, RoundDrafts
from specactor_engine.sampling import SamplingParams, scaled_log_softmax, token_logprobs, top_logprobs
from specactor_engine.state import SequenceState
from specactor_engine.stopping import StopRules, find_stop_string, truncate_emitted
from specactor_engine.types import DraftProposal, EngineStats, Request
from specactor_engine.verifier import PACK_MAX_ROWS, Verifier

# draft trimming applies to rounds of at most this many rows: packed (a cut saves nothing in a padded round) and priced
# by the startup profile's packed rounds, measured up to PACKED_MAX_ROWS (`Run._trims`)
TRIM_MAX_ROWS = min(PACK_MAX_ROWS, PACKED_MAX_ROWS)
TRIM_HEAP_EVERY = 32  # rounds between checks whether freed heap memory is due back to the OS (heap.py `trim_heap`)
COMBINE_MAX_EXTRA = 0.1  # combination's candidate rows may add at most this share to a round's predicted cost


class EngineView(Protocol):
    """What a run reads of its engine (engine.py's `Engine`), named here so run.py need not import it."""

    runner: ModelRunner
    tokenizer: Any
    drafters: list[Drafter]
    coordinator: DecoupledCoordinator | None
    num_draft_tokens: int
    acceptance_rule: str
    selection: str
    combine_below: int
    shadow_rows: int
    verify_length: str
    length_policy: VerifyLengthPolicy | None
    dynamic_decoupling: bool
    verifier_threads: int | None
    max_model_len: int
    eos_ids: list[int]
    vocab_size: int
    check_invariants: bool
    packed_verify: bool
    trim_calibration: ConfidenceCalibration | None
    draft_arbitration: bool


def trim_rows(engine: EngineView) -> int:
    """Rounds of at most this many rows have their drafts trimmed (0: none): draft trimming on, and the verify packed,
    which it is on a CPU (`Run._trims`; the verify-length policy prices stale wide widths apart there)."""
    packed = engine.packed_verify and engine.runner.device.type == "cpu"
    return TRIM_MAX_ROWS if engine.trim_calibration is not None and packed else 0


def scratch_slots(num_slots: int, combine_below: int) -> int:
    """Target-cache slots past the real ones that hold combination's candidates (verifier.py): none where the real
    slots left free always suffice. Combination runs in rounds of at most `combine_below` rows, and a batch with a
    free slot has nothing waiting (`decode` admits while both are there), so such a round has at least
    num_slots - combine_below free slots: one per row from num_slots >= 2 * combine_below on. Below that, up to
    `combine_below` slots are allocated after the real ones (trace D's 4 rows: 4). Trace C's 128 rows took 8 more
    slots for it, 6% of a 4 GB cache, and `ar`, with the smaller cache, ran ~2% faster than `specactor`'s identical
    plain rounds in every repeat; `ar` given the same cache was not faster in 5 of 6, and without the 8 slots
    `specactor` was at or above `ar` in 5 of 12 (bench/session66)."""
    return 0 if num_slots >= 2 * combine_below else min(combine_below, num_slots)


@dataclass
class SampleRecord:
    """Bookkeeping of one sample while it is decoded."""

    request: Request
    sample_index: int
    prompt_ids: list[int]
    key: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)  # with top_logprobs: [n, N] blocks, in order
    top_values: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None


@dataclass
class RoundPlan:
    """The scheduler's decisions for one round (R rows in slot order)."""

    slots: torch.Tensor  # [R] rows decoding
    caps: torch.Tensor  # [R] draft tokens each row may verify (0: the row decodes plainly)
    full_caps: torch.Tensor | None  # [R] caps before the verify length; kept where shadows are drafted
    context: int  # the longest KV any row attends to
    arm: str | None  # dynamic decoupling's arm (None: the workers' phases are not switched)
    drafting: bool  # whether any draft source runs this round
    policy: VerifyLengthPolicy | None  # the dynamic verify length that clamped `caps`, if any
    methods: list[str | None] | None = None  # [R] Fastest-of-N's method per row, chosen with the verify length

    @property
    def cap(self) -> int:
        """The verify length chosen for the round (drafts may supply fewer)."""
        return int(self.caps.max()) if len(self.caps) else 0


@dataclass
class RoundOutcome:
    """What one round's acceptance committed."""

    num_accepted: torch.Tensor  # [R] accepted draft tokens per row
    counts: torch.Tensor  # [R] tokens committed per row: accepted + recovered/bonus, cut at stop conditions
    shadows: dict[str, list[int]]  # shadow drafts scored after the commit: method -> [drafts, accepted]
    output: torch.Tensor | None = None  # [R, k+1] the tokens emitted: the first num_accepted + 1 are the target's


class Run:
    """State of one `generate` call: slots, sequences in flight, the round loop."""

    def __init__(self, engine: EngineView, sampling: Any, stats: EngineStats, capacity: tuple[int, int],
                 started: float, total_threads: int | None = None) -> None:
        self.engine = engine
        self.started = started
        self.total_threads = total_threads or torch.get_num_threads()
        self.runner = engine.runner
        self.stats = stats
        self.params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p)
        self.top_logprobs = getattr(sampling, "top_logprobs", 0)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(engine.eos_ids))
        self.rules = StopRules(frozenset(stop_ids), tuple(sampling.stop), sampling.max_new_tokens,
                               engine.max_model_len)
        num_slots, max_len = capacity
        self.state = SequenceState.allocate(num_slots, max_len)
        self.slot_seq: dict[int, SampleRecord] = {}
        self.on_finish: Callable[[SampleRecord], None] | None = None  # `decode`'s
        self.waiting: Counter[int] = Counter()  # id(request) -> its samples not yet admitted (`decode`)
        self.kept_logits: dict[int, torch.Tensor] = {}  # id(request) -> its prompt's logits [V] while some wait
        self.free = list(range(num_slots - 1, -1, -1))
        rejection = engine.acceptance_rule == "rejection" and not self.params.greedy
        self.coordinator = engine.coordinator
        selector = self._selector()
        # combination: target-cache slots past the real ones, one per candidate (verifier.py); none where free real
        # slots hold the candidates (`scratch_slots`, `_scratch`)
        self.dedicated_scratch = torch.arange(num_slots, num_slots + scratch_slots(num_slots, engine.combine_below))
        # consecutive rounds at k = 0 with speculation far from paying (`_shadows_due`): while there are any, the
        # verify length and methods are re-chosen only every few rounds (policies/shadow.py `choice_due`)
        self.plain_rounds = 0
        self.proposer = Proposer(self.state, self.params, stats, engine.drafters, self.coordinator, selector,
                                 self._shadow_book(rejection), engine.shadow_rows, rejection, engine.vocab_size,
                                 self._output_of)
        self.verifier = Verifier(self.runner, self.state, self.params, stats, rejection, engine.vocab_size,
                                 self.dedicated_scratch, selector,
                                 pack=engine.packed_verify and self.runner.device.type == "cpu")
        self.trim_rows = trim_rows(engine)
        self.proposer.confidence = self.trim_rows > 0
        if self.trim_rows > 0 and engine.draft_arbitration and selector is not None and not rejection:
            self.proposer.arbiter = engine.trim_calibration  # arbitration maps confidences as trimming does
        if self.coordinator is not None:
            spec = SamplingSpec(sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_new_tokens)
            self.coordinator.reset(num_slots, max_len, spec, window=2 * engine.num_draft_tokens,
                                   output_of=lambda slot: self.slot_seq[slot].output_ids)
        # dynamic decoupling: phases with the workers drafting, or paused with every thread verifying
        self.phase = DecouplingPolicy() if self.coordinator is not None and engine.dynamic_decoupling else None
        self.arm = DECOUPLED
        if self.phase is not None and self.phase.arm == SOLO:
            # pause before the rows arrive: a running worker would start prefilling them on the verifier's
            # cores and slow down exactly the plain-decoding window the policy measures first
            self.coordinator.pause(True)
            torch.set_num_threads(self.total_threads)
            self.arm = SOLO

    def _selector(self) -> FastestOfNSelector | None:
        """Fastest-of-N: a per-request choice among the drafters (and the drafter workers' streamed
        drafts, where the mode runs both) instead of the cascade."""
        engine = self.engine
        names = [d.name for d in engine.drafters]
        if engine.coordinator is not None and engine.drafters:
            names = [WorkerDrafterSync.name, *names]
        return FastestOfNSelector(names) if engine.selection == "fastest_of_n" and len(names) > 1 else None

    def _shadow_book(self, rejection: bool) -> ShadowBook | None:
        """Shadow drafts (policies/shadow.py): the dynamic verify length's acceptance statistics, and the
        selector's, from model-free drafts scored against what rows commit, instead of probe rounds."""
        engine = self.engine
        shadowing = engine.shadow_rows > 0 and engine.verify_length == "dynamic" and not rejection
        return ShadowBook() if shadowing and any(d.model_free for d in engine.drafters) else None

    def _output_of(self, slot: int) -> tuple[list[int], int, bool]:
        """A row's (output ids so far, sequence key, finished) for its shadow drafts."""
        seq = self.slot_seq[slot]
        return seq.output_ids, seq.key, seq.finish_reason is not None

    def decode(self, sequences: list[SampleRecord], progress: Callable[[int, int], None] | None = None,
               on_finish: Callable[[SampleRecord], None] | None = None) -> None:
        """Decode `sequences` to their stop conditions, admitting them as slots free up.

        progress(finished, total) after every round; on_finish(sequence) as each one retires."""
        self.on_finish = on_finish
        pending = deque(sequences)
        self.waiting = Counter(id(seq.request) for seq in sequences)
        self.kept_logits.clear()
        rounds = 0
        while pending or self.slot_seq:
            if pending and self.free:
                self._admit([pending.popleft() for _ in range(min(len(pending), len(self.free)))])
            if self.slot_seq:
                self._round()
                rounds += 1
                if rounds % TRIM_HEAP_EVERY == 0:
                    trim_heap()  # freed attention temporaries fragment glibc's heap (heap.py)
            if progress is not None:
                progress(len(sequences) - len(pending) - len(self.slot_seq), len(sequences))

    # ------------------------------------------------------------------ admission / prefill
    def _admit(self, batch: list[SampleRecord]) -> None:
        """Prefill new sequences (one forward per distinct prompt) and sample their first token.

        A sample whose request has a row decoding already (a GRPO group admitted piecemeal as rows free up, trace
        D) copies that row's prompt KV and takes the prompt's logits kept from its prefill (`kept_logits`) instead
        of prefilling the prompt again: both are what the forward would recompute, bit for bit, since a prompt's
        prefill is a forward of its own (`_prefill`). Trace D, session 30: `specactor`'s rows finish unevenly, and
        its 16 samples took 12 prefills of ~0.5 s where 4 prompts needed 4."""
        started = clock.now()
        live = {id(seq.request): slot for slot, seq in self.slot_seq.items()}  # a decoding row of each request
        slots = torch.tensor([self.free.pop() for _ in batch])
        for slot, seq in zip(slots.tolist(), batch):
            self.slot_seq[slot] = seq
            prompt = torch.tensor(seq.prompt_ids)
            self.state.tokens[slot, : len(prompt)] = prompt
            self.state.lengths[slot] = self.state.prompt_lengths[slot] = len(prompt)
            self.state.seq_keys[slot] = seq.key
            self.waiting[id(seq.request)] -= 1
        first_of: dict[int, int] = {}
        for i, seq in enumerate(batch):
            first_of.setdefault(id(seq.request), i)
        reused = {key for key in first_of if key in live and key in self.kept_logits}
        leaders = sorted(i for key, i in first_of.items() if key not in reused)
        lead_slots = slots[leaders]
        self.runner.set_lengths(slots, torch.zeros_like(slots))
        lead_logits = self._prefill(lead_slots)[0] if leaders else None  # [P, V]
        row_of_leader = {lead: row for row, lead in enumerate(leaders)}
        rows, sources, copies = [], [], []  # each row's logits [V]; prompt KV copied from sources to copies
        for i, seq in enumerate(batch):
            key = id(seq.request)
            if key in reused:
                rows.append(self.kept_logits[key])
                sources.append(live[key])
            else:
                lead = row_of_leader[first_of[key]]
                rows.append(lead_logits[lead])
                if i == first_of[key]:
                    continue
                sources.append(int(lead_slots[lead]))
            copies.append(i)
        if copies:
            targets = slots[copies]
            self.runner.cache.copy_prefix(torch.tensor(sources), targets, self.state.prompt_lengths[targets])
        for key, i in first_of.items():  # a prompt's logits are kept while samples of its request wait
            if self.waiting[key] <= 0:
                self.kept_logits.pop(key, None)
            elif key not in reused:
                self.kept_logits[key] = lead_logits[row_of_leader[i]].clone()
        logits = torch.stack(rows)[:, None]  # [R, 1, V]
        if self.coordinator is not None:
            self.coordinator.add_rows(slots.numpy(), self.state.seq_keys[slots].numpy(),
                                      [np.asarray(seq.prompt_ids, dtype=np.int64) for seq in batch])
        policy = self.engine.length_policy if self.engine.verify_length == "dynamic" else None
        for drafter in self.engine.drafters:
            if drafter.defers_prefill and policy is not None and policy.idle_and_costly(drafter.name, len(slots)):
                drafter.add_rows(self.state, slots, prefill=False)  # it may never draft for them
            else:
                drafter.add_rows(self.state, slots)
        self.stats.prefill_s += clock.now() - started
        no_drafts = DraftProposal(torch.zeros(len(slots), 0, dtype=torch.long), torch.zeros(len(slots), dtype=torch.long))
        self._accept_and_commit(slots, logits, no_drafts, prefill=True)

    def _prefill(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill each of `slots` (distinct prompts) in a forward of its own, commit them, and return the logits
        at each prompt's last token [P, V] and the prompt lengths [P]. One prompt per forward, unpadded: its keys,
        values and first logits are a function of the prompt alone, whatever else is admitted with it, so an
        output does not depend on which requests share its engine (rollout replicas, docs/distributed.md); a
        padded batch of prompts rounds differently with its shape (fp32 logprobs moved by ~1e-5)."""
        counts = self.state.lengths[slots].clone()
        logits = []
        for slot, count in zip(slots.tolist(), counts.tolist()):
            one = torch.tensor([slot])
            tokens, _ = self.state.gather(one, torch.zeros_like(one), count)
            logits.append(self.runner.forward(tokens, one, torch.tensor([count]), logits_at="last"))  # [1, V]
        self.runner.commit(slots, counts)
        return torch.cat(logits), counts

    # ------------------------------------------------------------------ one verify round
    def _round(self) -> None:
        """One verify round, top to bottom (docs/architecture.md): schedule -> propose -> verify ->
        accept and commit -> observe."""
        started = clock.now()
        plan = self._schedule(torch.tensor(sorted(self.slot_seq)))  # caps [R] at this round's verify length
        slots = plan.slots
        drafts = self.proposer.propose(slots, plan.caps, plan.full_caps, workers_on=plan.arm != SOLO,
                                       shadow_idle=self.proposer.shadows is not None and plan.drafting
                                       and self._shadows_due(plan),
                                       chosen=plan.methods, draft_stop=self._draft_stop(plan),
                                       arbitrate=self._trims(plan))
        self._trim(plan, drafts)
        scratch = self._scratch() if len(slots) <= self.engine.combine_below else self.dedicated_scratch[:0]
        if len(scratch) and drafts.chosen is not None and self._combination_pays(plan, len(scratch)):
            self.verifier.scratch = scratch
            self.proposer.add_candidates(slots, drafts, max_rows=len(scratch), free_only=plan.policy is not None)
        self.stats.draft_s += drafts.draft_s + drafts.shadow_s + drafts.candidate_s
        verify_started = clock.now()
        verified = self.verifier.verify(slots, drafts)  # logits [R, k+1, V]; winning candidates swapped in
        drafts.verify_s = clock.now() - verify_started
        self.stats.verify_s += drafts.verify_s
        self.stats.verify_rounds += 1
        self.stats.row_rounds += len(slots)
        outcome = self._accept_and_commit(slots, verified.logits, drafts.proposal)
        calibration = self.engine.trim_calibration
        if calibration is not None and drafts.proposal.confidence is not None and plan.policy is not None:
            calibration.observe_round(drafts.proposal.confidence.numpy(), drafts.sources,
                                      drafts.proposal.num_tokens.numpy(), outcome.num_accepted.numpy())
            if drafts.offer_keys:  # swapped rows: their offers' context keys too (policies/arbitration.py)
                calibration.observe_round(drafts.proposal.confidence.numpy(),
                                          [drafts.offer_keys.get(row) for row in range(len(slots))],
                                          drafts.proposal.num_tokens.numpy(), outcome.num_accepted.numpy())
        if calibration is not None and drafts.unverified and outcome.output is not None:
            emitted = outcome.output.numpy()
            for row, keys, ids, confidence in drafts.unverified:
                observe_unverified(calibration, keys, ids.numpy(), confidence.numpy(),
                                   emitted[row, : int(outcome.num_accepted[row]) + 1])
        tokens = len(slots) + int(drafts.proposal.num_tokens.sum())  # the real tokens verified, all rows
        self._record(plan, drafts, outcome, tokens)
        own = outcome.num_accepted if verified.own_accepted is None else verified.own_accepted  # [R]
        self.proposer.credit(slots, drafts, own)
        if plan.policy is not None:
            verified_caps = plan.caps if drafts.deferred is None else torch.where(drafts.deferred, 0, plan.caps)
            # a trimmed position counts as not accepted: the statistics at length k are what rounds drafting k and
            # trimming emit (policies/draft_trim.py), and the real tokens verified price them (`row_tokens`)
            # the shadow drafting of idle rows and the candidates' drafting are left out: they are not part of
            # any width's verify cost
            # each row's acceptance counts for the method whose drafts it verified (its chosen one if none came)
            chosen = drafts.chosen or [None] * len(slots)
            methods = [source or choice for source, choice in zip(drafts.sources, chosen)]
            plan.policy.observe_round(plan.cap, verified_caps.numpy(), outcome.num_accepted.numpy(), drafts.draft_s,
                                      clock.now() - started - drafts.shadow_s - drafts.candidate_s,
                                      len(slots), plan.context,
                                      regime=plan.arm or "", methods=methods if drafts.chosen else None,
                                      draft_s_by_method=drafts.steady_draft_s(),
                                      catch_up_s=sum(drafts.catch_up_s_by_drafter.values()),
                                      tokens=None if drafts.candidates is not None else tokens)
        if self.phase is not None:
            self.phase.observe(plan.arm, int(outcome.counts.sum()), clock.now() - started)

    def _trims(self, plan: RoundPlan) -> bool:
        """Draft trimming applies to this round: on, under the dynamic verify length, drafting, packed (a cut saves
        nothing in a padded round), and at most PACKED_MAX_ROWS rows: the startup profile measures packed rounds up
        to there, and past it a cut would be priced by the padded widths' interpolation."""
        return plan.policy is not None and plan.cap > 0 and len(plan.slots) <= self.trim_rows

    def _trim_seconds(self, plan: RoundPlan, drafting_s: float) -> Callable[[int], float]:
        """What draft trimming prices a round at: `drafting_s` plus a packed verify of n real tokens."""
        policy, rows, regime = plan.policy, len(plan.slots), plan.arm or ""
        assert policy is not None
        return lambda tokens: drafting_s + policy.packed_verify_seconds(rows, tokens, plan.context, regime)

    def _draft_stop(self, plan: RoundPlan) -> Callable[[str, torch.Tensor, torch.Tensor], bool] | None:
        """Draft trimming's early end of a draft model's steps (`RoundDrafts.draft_stop`): once `_trim` would cut
        the deepest draft of every row still drafting, a deeper one (its chance is at most the cut one's) would be
        cut too, and its draft step is saved. Judged as `_trim` judges the round, with the other rows' drafts kept
        whole at their caps and the drafting seconds spent so far. On trace D with the feature drafter, trimming
        had cut 1,120 of 2,509 drafted positions (session 49), every one of them drafted at a step's cost. The check
        costs ~0.07 ms a step (`choose_tokens` at 4 rows); there it about breaks even (9-13 stops of a ~5.5 ms step
        against ~460 checks a 2-prompt run), and it pays where a step costs more (the 0.5B's bf16 step over a 32k-token head: 20.9 ms at 4 rows, session 40)."""
        if not self._trims(plan):
            return None
        calibration = self.engine.trim_calibration
        assert calibration is not None
        rows, caps, started = len(plan.slots), plan.caps.numpy(), clock.now()

        def stop(method: str, mine: torch.Tensor, confidence: torch.Tensor) -> bool:
            depth, index = confidence.shape[1], mine.numpy()
            num = caps.copy()
            num[index] = np.minimum(caps[index], depth)
            sure = np.full((rows, depth), np.nan)
            sure[index] = confidence.numpy()
            methods: list[str | None] = [None] * rows
            for row in index.tolist():
                methods[row] = method
            kept = choose_tokens(num, sure, methods, calibration, self._trim_seconds(plan, clock.now() - started))
            going = index[caps[index] > depth]
            ends = bool(len(going)) and bool((kept[going] < depth).all())
            self.stats.draft_stops += int(ends)
            return ends

        return stop

    def _trim(self, plan: RoundPlan, drafts: RoundDrafts) -> None:
        """Draft trimming (policies/draft_trim.py): under the dynamic verify length, verify the drafted positions
        whose chance of being reached and accepted pays for their verify time, the rest cut."""
        proposal, calibration = drafts.proposal, self.engine.trim_calibration
        if not self._trims(plan) or proposal.confidence is None:
            return
        assert calibration is not None
        kept = torch.from_numpy(choose_tokens(proposal.num_tokens.numpy(), proposal.confidence.numpy(),
                                              drafts.sources, calibration, self._trim_seconds(plan, drafts.draft_s)))
        cut = int((proposal.num_tokens - kept).sum())
        if cut:
            self.stats.trimmed_tokens += cut
            proposal.num_tokens = kept
            proposal.token_ids[torch.arange(proposal.token_ids.shape[1])[None, :] >= kept[:, None]] = 0

    def _schedule(self, slots: torch.Tensor) -> RoundPlan:
        """Each row's draft cap [R] for this round: room left in its budget, the dynamic decoupling arm,
        and the dynamic verify length's choice of k."""
        caps = self._draft_caps(slots)
        full_caps = caps if self.proposer.shadows is not None else None
        context = int(self.runner.lengths[slots].max())  # attention reads every row this far
        arm = self._choose_arm(slots, caps, context)
        # a paused-workers (solo) phase still drafts in process when there are in-process drafters
        drafting = arm != SOLO or bool(self.engine.drafters)
        policy = self.engine.length_policy if self.engine.verify_length == "dynamic" and drafting else None
        methods = None
        if not drafting:
            caps = torch.zeros_like(caps)
        elif policy is not None and not choice_due(self.plain_rounds, policy.speculation_margin):
            # plain decoding far ahead: kept (the margin is the last choice's)
            caps = caps.clamp_max(policy.hold())
        elif policy is not None:
            # shadows keep the deep positions' statistics fresh, but only for the model-free methods
            policy.probe_deep = self.proposer.shadows is None or self.proposer.has_costly_drafter
            policy.shadowed = self.proposer.shadowed
            # Fastest-of-N: the verify length and the rows' methods are chosen together (a draft model's
            # drafts may pay at one length and not at another, where the model-free methods' still do)
            options = self.proposer.method_options(slots, caps, workers_on=arm != SOLO)
            # an option's draft models first feed what they missed (a probe of the first option too: the probe
            # budget weighs it): its round is charged that catch-up
            steady = self.engine.num_draft_tokens + 1
            skip = policy.far_options(options)  # not weighed this round: their catch-ups are not estimated either
            catch_up_s = [0.0 if i in skip else self.proposer.catch_up_estimate_s(slots, o, steady)
                          for i, o in enumerate(options)] if options else None
            # the tokens the rows have left bound the stretch a catch-up is spread over
            remaining = float((self.rules.max_new_tokens - self.state.output_positions(slots)).float().mean())
            caps = caps.clamp_max(policy.choose(len(slots), context, regime=arm or "", options=options,
                                                catch_up_s=catch_up_s, remaining_tokens=remaining))
            methods = options[policy.option] if options else None
        plan = RoundPlan(slots, caps, full_caps, context, arm, drafting, policy, methods)
        far = policy is not None and plan.cap == 0 and policy.speculation_margin < SPARSE_MARGIN
        self.plain_rounds = self.plain_rounds + 1 if far else 0
        return plan

    def _shadows_due(self, plan: RoundPlan) -> bool:
        """Shadow-draft idle rows this round (policies/shadow.py `shadows_due`: every round unless plain decoding
        is in force and speculation is expected far from paying)."""
        margin = plan.policy.speculation_margin if plan.policy is not None else 1.0
        return shadows_due(plan.cap, margin, self.plain_rounds)

    def _scratch(self) -> torch.Tensor:
        """This round's slots for combination candidates: the dedicated ones after the real slots where the engine
        allocated them (`scratch_slots`), else up to `combine_below` of the free real slots (their rows finished;
        admission resets a slot's KV length before it takes a row)."""
        if len(self.dedicated_scratch):
            return self.dedicated_scratch
        return torch.tensor(self.free[: self.engine.combine_below], dtype=torch.long)

    def _combination_pays(self, plan: RoundPlan, scratch: int) -> bool:
        """Combination verifies up to one candidate row per row in the same forward: nearly free while the
        forward is memory-bound, not where extra rows cost real time (trace D on a 2-core AVX2 CPU: 8 rows of
        width 3 took 0.87 s against 0.65 s for 4, for a few tokens more). Under a dynamic verify length it
        runs only where the cost model puts the padded forward with the candidates within COMBINE_MAX_EXTRA of the
        round as priced (`VerifyLengthPolicy.combination_pays`)."""
        policy = plan.policy
        if policy is None:
            return True
        rows = len(plan.slots)
        return policy.combination_pays(rows, min(scratch, rows), plan.cap, plan.context, plan.arm or "",
                                       plan.methods, COMBINE_MAX_EXTRA)

    def _choose_arm(self, slots: torch.Tensor, caps: torch.Tensor, context: int) -> str | None:
        """Dynamic decoupling: this round's arm; switching pauses/resumes the workers and moves threads."""
        if self.phase is None:
            return None
        bound = expected = None
        if self.phase.deciding():  # the estimates are read only where the arm is decided
            bound, expected = self._decoupled_bound(len(slots), context), self._solo_expected(slots, caps, context)
        arm = self.phase.choose(bound, expected)
        if arm != self.arm:
            assert self.coordinator is not None
            self.coordinator.pause(arm == SOLO)
            torch.set_num_threads(self.total_threads if arm == SOLO else (self.engine.verifier_threads or 1))
            self.arm = arm
        self.stats.arm_rounds[arm] = self.stats.arm_rounds.get(arm, 0) + 1
        self.stats.arm_skips = self.phase.skipped
        return arm

    def _decoupled_bound(self, rows: int, context: int) -> float | None:
        """Tokens per second the workers' arm can be expected to reach this round at best: the verify
        length that suits the acceptance of the workers' own drafts (`WORKERS`' statistics, the prior before a
        round verified any), at the verify cost on the verifier's threads (profiled on them, scaled by what rounds
        of that arm actually took), with no drafting on the critical path. The pooled acceptance it read until
        session 47 was the in-process methods' (on trace D at round 12, n-gram and suffix drafts and their shadows):
        it let every run explore the workers' arm for 12 rounds on 2 cores, where its measured rate was ~0.7x the
        paused arm's, and the worker was busy 7-12 s a run."""
        policy = self.engine.length_policy
        if policy is None or not rows:
            return None
        workers = [WORKERS] * rows
        return max(policy.throughput(rows, k, context, regime=DECOUPLED, drafting=False, methods=workers)
                   for k in range(1, policy.max_k + 1))

    def _solo_expected(self, slots: torch.Tensor, caps: torch.Tensor, context: int) -> float | None:
        """Tokens per second the paused-workers arm is expected to keep up: its best verify length and assignment
        of in-process draft methods (plain decoding included), drafting time included, no catch-up (a phase's
        one-time cost). None without in-process drafters or a dynamic verify length (its rate is then measured)."""
        policy = self.engine.length_policy
        if policy is None or not len(slots) or not self.engine.drafters or self.engine.verify_length != "dynamic":
            return None
        options = self.proposer.method_options(slots, caps, workers_on=False) or [None]
        return max(policy.throughput(len(slots), k, context, regime=SOLO, methods=option)
                   for k in range(policy.max_k + 1) for option in options)

    def _draft_caps(self, slots: torch.Tensor) -> torch.Tensor:
        """Per-row draft count so a round never passes max_new_tokens or the context: [R]."""
        k = self.engine.num_draft_tokens
        out_left = self.rules.max_new_tokens - self.state.output_positions(slots) - 1
        ctx_left = self.rules.max_model_len - self.state.lengths[slots] - 1
        return torch.minimum(torch.minimum(out_left, ctx_left), torch.tensor(k)).clamp_min(0)

    # ------------------------------------------------------------------ accept, stop, commit, retire
    def _accept_and_commit(self, slots: torch.Tensor, logits: torch.Tensor, proposal: DraftProposal,
                           prefill: bool = False) -> RoundOutcome:
        """Accept, apply stop rules, commit every cache and retire finished rows.

        A verify block fed [last, d1..dk], so `counts` of its entries become committed KV;
        after prefill the KV already holds the prompt and the new token is not in it yet.
        """
        # half-precision logits converted once, for the sampler and the log-probs alike (each made its own copy: 8.3 ms
        # for 32 rows x width 2 x 151,936 bf16 logits in a microbenchmark on this machine)
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        num_accepted, output = self.verifier.accept(slots, logits, proposal.token_ids, proposal.num_tokens,
                                                    proposal.probs)  # [R], [R, k+1]
        top, log_probs = None, None
        if self.top_logprobs:
            log_probs = scaled_log_softmax(logits, self.params.temperature)  # [R, k+1, V]
            top = top_logprobs(log_probs, self.top_logprobs)
        logprobs = token_logprobs(logits, output.to(logits.device), self.params.temperature, log_probs)  # [R, k+1]
        del log_probs
        counts = self._apply_stops(slots, output, num_accepted + 1, logprobs, top)  # [R]
        self.state.append(slots, output, counts)
        if not prefill:
            self.runner.commit(slots, counts)
        shadows = self.proposer.score_shadows(self.engine.length_policy)
        for drafter in self.engine.drafters:
            drafter.observe_commit(self.state, slots)
        if self.coordinator is not None:
            self.coordinator.after_round(slots.numpy(), output.numpy(), counts.numpy())
        if self.engine.check_invariants:
            self._assert_invariants(slots)
        self._retire(slots)
        return RoundOutcome(num_accepted, counts, shadows, output)

    def _retire(self, slots: torch.Tensor) -> None:
        """Free the slots of rows that finished this round, in every cache and draft source."""
        finished = [slot for slot in slots.tolist() if self.slot_seq[slot].finish_reason is not None]
        if not finished:
            return
        for drafter in self.engine.drafters:
            drafter.finish_rows(self.state, torch.tensor(finished))
        for slot in finished:
            seq = self.slot_seq.pop(slot)
            self.free.append(slot)
            if self.on_finish is not None:
                self.on_finish(seq)
        if self.coordinator is not None:
            self.coordinator.remove_rows(np.asarray(finished, dtype=np.int64))

    def _apply_stops(self, slots: torch.Tensor, output: torch.Tensor, emitted: torch.Tensor,
                     logprobs: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Truncate each row's emitted tokens at its stop condition; record them: counts [R].

        top: the top-N (ids, log-probs) at each emitted position ([R, k+1, N] each), when requested."""
        counts = emitted.clone()
        out_rows, lp_rows, lengths = output.tolist(), logprobs.tolist(), self.state.lengths[slots].tolist()
        for row, slot in enumerate(slots.tolist()):
            seq = self.slot_seq[slot]
            new = out_rows[row][: int(emitted[row])]
            keep, reason = truncate_emitted(new, len(seq.output_ids), lengths[row], self.rules)
            seq.output_ids.extend(new[:keep])
            seq.logprobs.extend(lp_rows[row][:keep])
            if top is not None:
                seq.top_ids.append(top[0][row, :keep].cpu())
                seq.top_values.append(top[1][row, :keep].cpu())
            hit = find_stop_string(seq.output_ids, keep, self.rules, self._decode)
            if hit is not None:
                drop = len(seq.output_ids) - hit[0]
                del seq.output_ids[hit[0]:], seq.logprobs[hit[0]:]
                if top is not None:
                    seq.top_ids = [torch.cat(seq.top_ids)[: hit[0]]]
                    seq.top_values = [torch.cat(seq.top_values)[: hit[0]]]
                keep, reason, seq.text = keep - drop, "stop", hit[1]
            seq.finish_reason = reason
            counts[row] = keep
        return counts

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def _record(self, plan: RoundPlan, drafts: RoundDrafts, outcome: RoundOutcome, tokens: int) -> None:
        """The round's statistics: drafted and accepted tokens by position and by method, and its
        timeline entry (the drafter-mix and verify-length plots read it); tokens: the real tokens it verified."""
        stats, sources = self.stats, drafts.sources
        num_drafts, num_accepted = drafts.proposal.num_tokens, outcome.num_accepted  # [R], [R]
        stats.drafted_tokens += tokens - len(num_drafts)
        stats.accepted_tokens += int(num_accepted.sum())
        deepest = int(num_drafts.max()) if len(num_drafts) else 0
        for i in range(min(len(stats.drafted_per_position), deepest)):
            stats.drafted_per_position[i] += int((num_drafts > i).sum())
            stats.accepted_per_position[i] += int((num_accepted > i).sum())
        by_drafter: dict[str, int] = {}  # rows each method drafted for this round
        accepted_by: dict[str, int] = {}  # and how many of its tokens were accepted
        for row, name in enumerate(sources):
            if name is not None:
                stats.drafted_per_drafter[name] = stats.drafted_per_drafter.get(name, 0) + int(num_drafts[row])
                stats.accepted_per_drafter[name] = stats.accepted_per_drafter.get(name, 0) + int(num_accepted[row])
                by_drafter[name] = by_drafter.get(name, 0) + 1
                accepted_by[name] = accepted_by.get(name, 0) + int(num_accepted[row])
        stats.timeline.append({
            "t": round(clock.now() - self.started, 4), "rows": len(outcome.counts),
            "k": drafts.proposal.token_ids.shape[1], "cap": plan.cap,
            "emitted": int(outcome.counts.sum()), "drafted": int(num_drafts.sum()), "accepted": int(num_accepted.sum()),
            "by_drafter": by_drafter, "accepted_by_drafter": accepted_by,
            "draft_s_by_drafter": {name: round(spent, 6) for name, spent in drafts.draft_s_by_drafter.items()},
            "shadow_by_drafter": dict(outcome.shadows),
            **({"arm": plan.arm} if self.phase is not None else {}),
            # the verify length's expected tokens/s per k when it chose this round, and the calibration each used
            # (observed / profiled seconds: diagnostics; none when held)
            # and the verify seconds it priced each k at; "tokens": the real tokens the round verified (all rows);
            # "verify_s": the verifier's seconds; "candidates": combination's candidate rows, where it ran
            "tokens": tokens, "verify_s": round(drafts.verify_s, 5),
            **({"candidates": len(drafts.candidates.rows)} if drafts.candidates is not None else {}),
            **({"scores": [round(x, 2) for x in plan.policy.scores],
                "factors": [round(x, 3) for x in plan.policy.factors],
                "priced_s": [round(x, 4) for x in plan.policy.priced]} if plan.policy is not None and plan.policy.scores
               else {}),
        })

    def _assert_invariants(self, slots: torch.Tensor) -> None:
        """Target KV holds every committed token but the last; drafters check their own."""
        kv, committed = self.runner.lengths[slots], self.state.lengths[slots]
        assert torch.equal(kv, committed - 1), f"target KV lengths {kv.tolist()} != {(committed - 1).tolist()}"
        for drafter in self.engine.drafters:
            drafter.check_invariants(self.state, slots)
