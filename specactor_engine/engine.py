"""The rollout engine: batched, per-row speculative decoding that emits exactly what
plain decoding emits.

One verify round (ARCHITECTURE.md section 3):
    schedule -> propose (drafters) -> verify (one target forward over [last, d1..dk])
    -> accept (pure rule) -> stop checks -> commit/roll back every KV -> observe stats

The engine knows nothing about Prefect, DeepSpeed or W&B; it is built from a config
(or from in-memory models in tests) and driven with `generate` / `update_weights`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from specactor_engine import acceptance
from specactor_engine.policies.cost_profile import load_or_measure
from specactor_engine.config import RolloutConfig, SpecActorConfig
from specactor_engine.decoupled.launch import DrafterWorkers, start_workers
from specactor_engine.decoupled.phase import DECOUPLED, SOLO, DecouplingPolicy
from specactor_engine.decoupled.protocol import SamplingSpec
from specactor_engine.decoupled.sync import WorkerDrafterSync
from specactor_engine.drafters import DraftRequest, Drafter, DrafterContext, build_drafter
from specactor_engine.model.heap import release_free_memory
from specactor_engine.model.runner import ModelRunner, load_hf_model
from specactor_engine.sampling import (
    STREAM_ACCEPT,
    STREAM_RECOVER,
    SamplingParams,
    gumbel_noise,
    sample_tokens,
    sequence_key,
    scaled_log_softmax,
    token_logprobs,
    top_logprobs,
    uniform_noise,
    warped_probs,
)
from specactor_engine.policies.selector import FastestOfNSelector
from specactor_engine.policies.shadow import ShadowBook, ShadowDraft
from specactor_engine.state import SequenceState
from specactor_engine.stopping import StopRules, find_stop_string, truncate_emitted
from specactor_engine.tokenize import encode_request, eos_token_ids
from specactor_engine.types import DraftProposal, EngineStats, Request, RolloutResult, SequenceOutput
from specactor_engine.policies.verify_length import AcceptanceStats, CostProfile, CostTable, VerifyLengthPolicy
from specactor_engine.model.weights import load_named_weights
from specactor_engine.modes import MODES

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
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


TRIM_HEAP_EVERY = 32  # rounds between returning freed heap memory to the OS (~5 ms each)


class Engine:
    """Target model + drafters + the decode loop, built from a validated `RolloutConfig`."""

    def __init__(self, target: torch.nn.Module, tokenizer: Any, rollout: RolloutConfig, *, max_model_len: int = 2048,
                 chat_template: bool = True, cpu_kernels: bool = True, drafters: Sequence[Drafter] = (),
                 workers: DrafterWorkers | None = None, cost_table: CostTable | CostProfile | None = None,
                 check_invariants: bool = False) -> None:
        """drafters: the in-process draft methods (`from_config` builds them from rollout.drafters);
        workers: running drafter workers (decoupled/launch.py) for the modes that use them. RolloutConfig
        has validated its own fields; only what depends on these arguments is checked here."""
        self.rollout = rollout
        self.mode = MODES[rollout.mode]
        self.tokenizer = tokenizer
        self.num_draft_tokens = rollout.num_draft_tokens if self.mode.speculative else 0
        self.acceptance_rule = rollout.acceptance
        self.max_batch_size = rollout.max_batch_size
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.drafters = list(drafters) if self.mode.in_process else []
        self.workers = workers if self.mode.workers != "never" else None
        self._check_draft_sources()
        self.coordinator = self.workers.coordinator if self.workers is not None else None
        self.verifier_threads = self.workers.verifier_threads if self.workers is not None else None
        # the verifier's copy of the workers' draft model (pipeline drafter sync), when started from a config
        self.worker_drafter: WorkerDrafterSync | None = self.workers.sync if self.workers is not None else None
        self.dynamic_decoupling = self.coordinator is not None and rollout.decoupled.dynamic
        self.selection = "fastest_of_n" if self.mode.fastest_of_n else rollout.selection
        # combination: with Fastest-of-N, several in-process drafters and position-keyed acceptance,
        # rounds with at most this many rows also verify a second method's candidate per row
        combinable = self.selection == "fastest_of_n" and len(self.drafters) > 1 \
            and rollout.acceptance == "position_keyed"
        self.combine_below = rollout.combine_below if combinable else 0
        self.check_invariants = check_invariants
        # dynamic verify length with model-free drafters and position-keyed acceptance: acceptance
        # statistics from shadow drafts (shadow.py) instead of probe rounds at the deepest length
        self.shadow_rows = rollout.shadow_rows
        # dynamic: a VerifyLengthPolicy picks k in 0..num_draft_tokens each round (built on first use,
        # from `cost_table` or the cached startup profile); it keeps its statistics across calls.
        self.verify_length = rollout.verify_length if self.drafters or self.coordinator else "fixed"
        self.cost_table = cost_table
        self.length_policy: VerifyLengthPolicy | None = None
        self.policy_version = 0
        self.vocab_size = target.config.vocab_size
        # cpu_kernels: oneDNN pre-packed linears and the paged decode-attention kernel (model_runner.py)
        self.runner = ModelRunner(target, packed_linear=cpu_kernels, paged_attention=cpu_kernels)
        self.eos_ids = eos_token_ids(tokenizer, target)

    def _check_draft_sources(self) -> None:
        """The draft sources this mode needs, among those handed in (the config cannot see them)."""
        name = self.mode.name
        if self.mode.workers == "required" and self.workers is None:
            raise ValueError(f"mode {name!r} needs drafter workers (decoupled.launch.start_workers)")
        if self.mode.speculative and not self.drafters and self.workers is None:
            raise ValueError(f"mode {name!r} needs drafters, drafter workers, or both")
        if self.workers is not None and self.acceptance_rule == "rejection":
            raise ValueError(f"mode {name!r} streams worker drafts without their probabilities: use position_keyed "
                             "acceptance")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: SpecActorConfig, *, drafters: Sequence[Drafter] | None = None,
                    cost_table: CostTable | CostProfile | None = None) -> "Engine":
        """Load the target and tokenizer, build the in-process drafters from `config.rollout.drafters`
        (unless `drafters` is given: the benchmark's oracle) and start the drafter workers the mode uses."""
        from transformers import AutoTokenizer

        from specactor_engine.model.registry import resolve_model

        if config.threads:
            torch.set_num_threads(config.threads)
        path = resolve_model(config.model.target, dtype=config.model.dtype, cache_dir=config.model.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(path)
        target = load_hf_model(path, config.model.dtype, config.model.device)
        mode = MODES[config.rollout.mode]
        if drafters is None and mode.in_process:
            context = DrafterContext(
                device=config.model.device, dtype=config.model.dtype, target_tokenizer=tokenizer,
                target_vocab_size=target.config.vocab_size, cache_dir=config.model.cache_dir,
            )
            drafters = [build_drafter(d, context) for d in config.rollout.drafters]
        workers = None
        if mode.starts_workers(config.rollout.decoupled):
            workers = start_workers(config.rollout.decoupled, config.model, tokenizer, target.config.vocab_size,
                                    config.threads)
        return cls(target, tokenizer, config.rollout, max_model_len=config.model.max_model_len,
                   chat_template=config.model.chat_template, cpu_kernels=config.model.cpu_kernels,
                   drafters=drafters or (), workers=workers, cost_table=cost_table)

    def close(self) -> None:
        """Stop the decoupled drafter workers, if any (idempotent)."""
        if self.coordinator is not None:
            self.coordinator.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int,
                       component: str = "target") -> None:
        """Load new weights in place: `component` is "target" or a drafter's name."""
        if component == "target":
            load_named_weights(self.runner.model, weights)
            self.policy_version = version
            return
        by_name = {d.name: d for d in self.drafters}
        if component not in by_name:
            raise KeyError(f"no drafter named {component!r}; drafters: {', '.join(by_name) or 'none'}")
        by_name[component].update_weights(weights, version)

    # ------------------------------------------------------------------ generate
    def generate(self, requests: Sequence[Request], sampling: Any,
                 progress: Callable[[int, int], None] | None = None) -> RolloutResult:
        """Roll out `sampling.n` samples of every request; outputs in (request, sample) order.

        progress(finished_sequences, total_sequences) is called after every round.
        """
        started = time.perf_counter()
        stats = EngineStats(mode=self.mode.name, drafted_per_position=[0] * self.num_draft_tokens,
                            accepted_per_position=[0] * self.num_draft_tokens)
        sequences = self._prepare(requests, sampling)
        runnable = [s for s in sequences if s.error is None]
        threads = torch.get_num_threads()
        if self.verifier_threads:  # decoupled: the workers' threads are not ours to use
            torch.set_num_threads(self.verifier_threads)
        try:
            if self.verify_length == "dynamic" and runnable:
                self._ensure_length_policy(min(len(runnable), self.max_batch_size), self._longest(runnable, sampling))
            run = _Run(self, sampling, stats, self._reserve(runnable, sampling), started, total_threads=threads)
            run.decode(runnable, progress)
        finally:
            torch.set_num_threads(threads)
            if self.coordinator is not None and self.coordinator.buffers is not None:
                stats.decoupled = self.coordinator.stats()
        stats.total_s = time.perf_counter() - started
        stats.num_sequences = len(sequences)
        stats.output_tokens = sum(len(s.output_ids) for s in sequences)
        return RolloutResult([self._to_output(s) for s in sequences], stats)

    def prepare_length_policy(self, requests: Sequence[Request], sampling: Any) -> None:
        """Measure (or read) the verify-cost profile a `generate` of these requests will need, so the
        measurement happens now rather than inside that call (benchmarks keep it out of makespans)."""
        if self.verify_length != "dynamic":
            return
        runnable = [s for s in self._prepare(requests, sampling) if s.error is None]
        if runnable:
            self._ensure_length_policy(min(len(runnable), self.max_batch_size), self._longest(runnable, sampling))

    def _longest(self, sequences: list[_Sequence], sampling: Any) -> int:
        """The longest context (prompt + output) any of these sequences can reach."""
        return min(self.max_model_len, max(len(s.prompt_ids) for s in sequences) + sampling.max_new_tokens)

    def _ensure_length_policy(self, max_rows: int, max_context: int) -> None:
        """Build the verify-length policy; re-profile if this call's batch or context outgrows the profile."""
        table = self.cost_table
        if table is None or table.batch_sizes[-1] < max_rows or (table.max_context and table.max_context < max_context):
            table = self.cost_table = load_or_measure(self.runner, max_rows, self.num_draft_tokens,
                                                      max_context=max_context)
        if self.length_policy is None:
            self.length_policy = VerifyLengthPolicy(table, AcceptanceStats(max_k=self.num_draft_tokens))
        else:
            self.length_policy.cost = table

    def reserve(self, requests: Sequence[Request], sampling: Any) -> None:
        """Size the KV caches for a `generate` of these requests now rather than inside it.

        A later call of at most this size reuses the buffers (as every step of a training run does);
        this moves the one-off allocation (gigabytes at large batches) to start-up, where vLLM's own
        KV cache allocation is too.
        """
        runnable = [s for s in self._prepare(requests, sampling) if s.error is None]
        if runnable:
            num_slots, max_len = self._reserve(runnable, sampling)
            if self.coordinator is not None and not self.coordinator.reserve(num_slots, max_len):
                logger.warning("a drafter worker did not size its KV cache in time; it will on the first generate")

    def _reserve(self, sequences: list[_Sequence], sampling: Any) -> tuple[int, int]:
        """Allocate target and drafter caches for this call: (slots, tokens per slot)."""
        num_slots = max(1, min(self.max_batch_size, len(sequences)))
        longest = max((len(s.prompt_ids) for s in sequences), default=1) + sampling.max_new_tokens
        max_len = min(self.max_model_len, longest) + self.num_draft_tokens + 1
        # scratch slots after the real ones (target cache only) hold the combination candidates
        self.runner.allocate(num_slots + min(self.combine_below, num_slots), max_len)
        for drafter in self.drafters:
            drafter.allocate(num_slots, max_len)
        return num_slots, max_len

    def _prepare(self, requests: Sequence[Request], sampling: Any) -> list[_Sequence]:
        sequences = []
        for request in requests:
            prompt_ids, error = encode_request(request, self.tokenizer, self.chat_template)
            if error is None and len(prompt_ids) >= self.max_model_len:
                error = f"prompt has {len(prompt_ids)} tokens; the context limit (model.max_model_len) is " \
                        f"{self.max_model_len} including at least one generated token"
            for j in range(sampling.n):
                seq = _Sequence(request, j, prompt_ids or [], sequence_key(sampling.seed, request.request_id, j))
                if error is not None:
                    seq.error, seq.finish_reason = error, "error"
                sequences.append(seq)
        return sequences

    def _to_output(self, seq: _Sequence) -> SequenceOutput:
        text = seq.text if seq.text is not None else self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        top = (torch.cat(seq.top_ids), torch.cat(seq.top_values)) if seq.top_ids else None
        return SequenceOutput(seq.request.request_id, seq.sample_index, seq.prompt_ids, seq.output_ids, text,
                              seq.logprobs, seq.finish_reason or "length", self.policy_version, seq.error, top)


class _Run:
    """State of one `generate` call: slots, sequences in flight, the round loop."""

    def __init__(self, engine: Engine, sampling: Any, stats: EngineStats, capacity: tuple[int, int],
                 started: float, total_threads: int | None = None) -> None:
        self.engine = engine
        self.started = started
        self.total_threads = total_threads or torch.get_num_threads()
        self.round_cap = 0  # the verify length chosen for the current round (drafts may supply fewer)
        # Fastest-of-N: a per-request choice among the drafters (and, in specactor mode, the drafter
        # workers' streamed drafts) instead of the cascade
        names = [d.name for d in engine.drafters]
        if engine.coordinator is not None and engine.drafters:
            names = [WorkerDrafterSync.name, *names]
        self.selector = FastestOfNSelector(names) if engine.selection == "fastest_of_n" and len(names) > 1 else None
        self.chosen: list[str] | None = None
        self.round_draft_s: dict[str, float] = {}  # this round's drafting seconds per in-process drafter
        self.round_shadows: dict[str, list[int]] = {}  # shadow drafts scored this round: method -> [drafts, accepted]
        self.fallback: torch.Tensor | None = None  # [R] rows drafted by the workers after their method gave none
        self.runner = engine.runner
        self.stats = stats
        self.params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p)
        self.top_logprobs = getattr(sampling, "top_logprobs", 0)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(engine.eos_ids))
        self.rules = StopRules(frozenset(stop_ids), tuple(sampling.stop), sampling.max_new_tokens,
                               engine.max_model_len)
        num_slots, max_len = capacity
        self.state = SequenceState.allocate(num_slots, max_len)
        self.slot_seq: dict[int, _Sequence] = {}
        self.free = list(range(num_slots - 1, -1, -1))
        self.rejection = engine.acceptance_rule == "rejection" and not self.params.greedy
        # shadow drafts (shadow.py): the dynamic verify length's acceptance statistics, and the selector's,
        # from model-free drafts scored against what rows commit, instead of probe rounds at max_k
        self.shadow_drafters = [d for d in engine.drafters if d.model_free]
        shadowing = engine.shadow_rows > 0 and engine.verify_length == "dynamic" and not self.rejection
        self.shadows = ShadowBook() if shadowing and self.shadow_drafters else None
        self.shadow_cursor = 0  # rows drafted only for statistics take turns by slot
        self.full_caps: torch.Tensor | None = None  # [R] this round's draft caps before the verify length
        self.deferred: torch.Tensor | None = None  # [R] rows whose drafts this round are scored as shadows
        self.coordinator = engine.coordinator
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
        # combination: target-cache slots past the real ones, one per candidate (see _verify_candidates)
        self.scratch = torch.arange(num_slots, num_slots + min(engine.combine_below, num_slots))
        self.own_accepted: torch.Tensor | None = None  # [R] each row's own method's acceptance this round

    def decode(self, sequences: list[_Sequence], progress: Callable[[int, int], None] | None = None) -> None:
        pending = deque(sequences)
        rounds = 0
        while pending or self.slot_seq:
            if pending and self.free:
                self._admit([pending.popleft() for _ in range(min(len(pending), len(self.free)))])
            if self.slot_seq:
                self._round()
                rounds += 1
                if rounds % TRIM_HEAP_EVERY == 0:
                    release_free_memory()  # freed attention temporaries fragment glibc's heap (heap.py)
            if progress is not None:
                progress(len(sequences) - len(pending) - len(self.slot_seq), len(sequences))

    # ------------------------------------------------------------------ admission / prefill
    def _admit(self, batch: list[_Sequence]) -> None:
        """Prefill new sequences (one forward per distinct prompt) and sample their first token."""
        started = time.perf_counter()
        slots = torch.tensor([self.free.pop() for _ in batch])
        for slot, seq in zip(slots.tolist(), batch):
            self.slot_seq[slot] = seq
            prompt = torch.tensor(seq.prompt_ids)
            self.state.tokens[slot, : len(prompt)] = prompt
            self.state.lengths[slot] = self.state.prompt_lengths[slot] = len(prompt)
            self.state.seq_keys[slot] = seq.key
        first_of: dict[int, int] = {}
        for i, seq in enumerate(batch):
            first_of.setdefault(id(seq.request), i)
        leaders = sorted(set(first_of.values()))
        lead_slots = slots[leaders]
        self.runner.set_lengths(slots, torch.zeros_like(slots))
        tokens, counts = self.state.gather(lead_slots, torch.zeros_like(lead_slots), int(self.state.lengths[lead_slots].max()))
        lead_logits = self.runner.forward(tokens, lead_slots, counts, logits_at="last")  # [P, V]
        self.runner.commit(lead_slots, counts)
        row_of_leader = {lead: row for row, lead in enumerate(leaders)}
        rows = torch.tensor([row_of_leader[first_of[id(seq.request)]] for seq in batch])
        followers = torch.tensor([i for i in range(len(batch)) if i not in row_of_leader], dtype=torch.long)
        if len(followers):
            self.runner.cache.copy_prefix(lead_slots[rows[followers]], slots[followers], counts[rows[followers]])
        logits = lead_logits[rows][:, None]  # [R, 1, V]
        if self.coordinator is not None:
            self.coordinator.add_rows(slots.numpy(), self.state.seq_keys[slots].numpy(),
                                      [np.asarray(seq.prompt_ids, dtype=np.int64) for seq in batch])
        for drafter in self.engine.drafters:
            drafter.add_rows(self.state, slots)
        self.stats.prefill_s += time.perf_counter() - started
        no_drafts = torch.zeros(len(slots), 0, dtype=torch.long)
        self._emit(slots, logits, no_drafts, torch.zeros(len(slots), dtype=torch.long), None, prefill=True)

    # ------------------------------------------------------------------ one verify round
    def _round(self) -> None:
        round_started = time.perf_counter()
        self.round_draft_s = {}
        self.round_shadows = {}
        self.deferred = None
        slots = torch.tensor(sorted(self.slot_seq))
        caps = self._draft_caps(slots)
        self.full_caps = caps if self.shadows is not None else None
        context = int(self.runner.lengths[slots].max())  # attention reads every row this far
        arm = self._choose_arm(len(slots), context)
        # a paused-workers (solo) phase still drafts in process when there are in-process drafters
        drafting = arm != SOLO or bool(self.engine.drafters)
        policy = self.engine.length_policy if self.engine.verify_length == "dynamic" and drafting else None
        if not drafting:
            caps = torch.zeros_like(caps)
        elif policy is not None:
            policy.probe_deep = self.shadows is None  # shadow drafts keep the deep positions' statistics fresh
            caps = caps.clamp_max(policy.choose(len(slots), context, regime=arm or ""))
        self.round_cap = int(caps.max()) if len(caps) else 0
        started = time.perf_counter()
        if self.coordinator is None:
            proposal, sources = self._propose(slots, caps)
        elif not self.engine.drafters:
            proposal, sources = self._take(slots, caps)
        else:
            proposal, sources = self._propose_mixed(slots, caps, workers_on=arm != SOLO)
        draft_s = time.perf_counter() - started
        shadow_s = 0.0
        if self.shadows is not None and drafting:
            started = time.perf_counter()
            self._shadow_idle_rows(slots, caps)
            shadow_s = time.perf_counter() - started
        self.stats.draft_s += draft_s + shadow_s
        self.own_accepted = None
        candidates = None
        if len(self.scratch) and len(slots) <= self.engine.combine_below and self.chosen is not None:
            started = time.perf_counter()
            candidates = self._candidates(slots, caps, proposal, sources)
            self.stats.draft_s += time.perf_counter() - started
        started = time.perf_counter()
        if candidates is None:
            last = self.state.tokens[slots, self.state.lengths[slots] - 1]
            inputs = torch.cat([last[:, None], proposal.token_ids], dim=1)  # [R, k+1]
            logits = self.runner.forward(inputs, slots, proposal.num_tokens + 1)  # [R, k+1, V]
        else:
            logits, proposal, sources = self._verify_candidates(slots, proposal, sources, *candidates)
        self.stats.verify_s += time.perf_counter() - started
        self.stats.verify_rounds += 1
        self.stats.row_rounds += len(slots)
        num_accepted = self._emit(slots, logits, proposal.token_ids, proposal.num_tokens, proposal.probs, sources)
        if self.selector is not None and self.chosen is not None:
            drafted = caps > 0 if self.deferred is None else (caps > 0) & ~self.deferred  # shadows credit later
            keys = self.state.seq_keys[slots][drafted].tolist()
            methods = [m for m, d in zip(self.chosen, drafted.tolist()) if d]
            # credit each row's chosen method with its own drafts' acceptance (not a winning candidate's);
            # a row whose method drafted nothing (the workers filled in) counts as nothing accepted for it
            own = num_accepted if self.own_accepted is None else self.own_accepted
            credited = own if self.fallback is None else torch.where(self.fallback, 0, own)
            self.selector.observe(keys, methods, credited[drafted].tolist())
        if policy is not None:
            k = int(caps.max()) if len(caps) else 0
            verified = caps if self.deferred is None else torch.where(self.deferred, 0, caps)
            # the shadow drafting of idle rows is left out: it is not part of any width's cost
            policy.observe_round(k, verified.numpy(), num_accepted.numpy(), draft_s,
                                 time.perf_counter() - round_started - shadow_s, len(slots), context, regime=arm or "")
        if self.phase is not None:
            self.phase.observe(arm, self.stats.timeline[-1]["emitted"], time.perf_counter() - round_started)

    def _choose_arm(self, rows: int, context: int) -> str | None:
        """Dynamic decoupling: this round's arm; switching pauses/resumes the workers and moves threads."""
        if self.phase is None:
            return None
        arm = self.phase.choose(self._decoupled_bound(rows, context))
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
        length that suits the acceptance seen so far (the prior before any), at the verify cost on the
        verifier's threads (profiled on them, scaled by what rounds of that arm actually took), with no
        drafting on the critical path."""
        policy = self.engine.length_policy
        if policy is None or not rows:
            return None
        return max(policy.throughput(rows, k, context, regime=DECOUPLED, drafting=False)
                   for k in range(1, policy.max_k + 1))

    def _draft_caps(self, slots: torch.Tensor) -> torch.Tensor:
        """Per-row draft count so a round never passes max_new_tokens or the context: [R]."""
        k = self.engine.num_draft_tokens
        out_left = self.rules.max_new_tokens - self.state.output_positions(slots) - 1
        ctx_left = self.rules.max_model_len - self.state.lengths[slots] - 1
        return torch.minimum(torch.minimum(out_left, ctx_left), torch.tensor(k)).clamp_min(0)

    def _propose(self, slots: torch.Tensor, caps: torch.Tensor) -> tuple[DraftProposal, list[str | None]]:
        """Cascade: each drafter in order drafts for the rows still without drafts. Fastest-of-N:
        the selector gives each row one drafter (self.chosen), which alone drafts for it."""
        self.chosen, self.fallback = None, None
        if not len(caps) or int(caps.max()) == 0 or not self.engine.drafters:
            return self._no_drafts(slots, caps)
        if self.selector is not None:
            self.chosen = self.selector.choose(self.state.seq_keys[slots].tolist(), self._row_verify_s())
        return self._draft_rows(slots, caps, caps > 0)

    def _no_drafts(self, slots: torch.Tensor, caps: torch.Tensor) -> tuple[DraftProposal, list[str | None]]:
        k = int(caps.max()) if len(caps) else 0
        empty = DraftProposal(torch.zeros(len(slots), k, dtype=torch.long), torch.zeros(len(slots), dtype=torch.long))
        return empty, [None] * len(slots)

    def _row_verify_s(self) -> float:
        """A row's share of a verify round so far (what every draft method pays per round)."""
        return self.stats.verify_s / max(self.stats.row_rounds, 1)

    def _draft_rows(self, slots: torch.Tensor, caps: torch.Tensor,
                    need: torch.Tensor) -> tuple[DraftProposal, list[str | None]]:
        """In-process drafters for the rows in `need` [R] bool: each row's chosen drafter (self.chosen),
        or without a choice the cascade."""
        merged, sources = self._no_drafts(slots, caps)
        need = need.clone()
        probs_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for drafter in self.engine.drafters:
            mine = need if self.chosen is None else need & torch.tensor([c == drafter.name for c in self.chosen])
            rows = mine.nonzero().flatten()
            if len(rows) == 0:
                continue
            shadowing = self.full_caps is not None and drafter.model_free
            asked = self.full_caps[rows] if shadowing else caps[rows]
            request = DraftRequest(slots[rows], asked, self.params, coupled_noise=not self.rejection)
            started = time.perf_counter()
            proposal = drafter.propose(self.state, request)
            if shadowing:  # drafted to the cap: what this round does not verify is scored as a shadow
                proposal = self._shadow_beyond(slots, rows, caps, proposal, drafter.name)
            spent = time.perf_counter() - started
            self.round_draft_s[drafter.name] = self.round_draft_s.get(drafter.name, 0.0) + spent
            timed = self.stats.draft_s_per_drafter
            timed[drafter.name] = timed.get(drafter.name, 0.0) + spent
            if self.selector is not None:
                self.selector.observe_cost(drafter.name, spent, len(rows))
            got = proposal.num_tokens > 0
            taken = rows[got]
            width = proposal.token_ids.shape[1]
            merged.token_ids[taken, :width] = proposal.token_ids[got]
            merged.num_tokens[taken] = proposal.num_tokens[got]
            if proposal.probs is not None:
                probs_parts.append((taken, proposal.probs[got]))
            for row in taken.tolist():
                sources[row] = drafter.name
            need[taken] = False
        if self.rejection and probs_parts:
            merged.probs = self._merge_probs(merged, probs_parts)
        return merged, sources

    # ------------------------------------------------------------------ shadow drafts (shadow.py)
    def _shadow(self, slot: int, tokens: torch.Tensor, cap: int, method: str) -> None:
        """Keep a row's draft [n] (made with `cap` slots) to score once the row has committed that far."""
        seq = self.slot_seq[slot]
        self.shadows.add(slot, ShadowDraft(len(seq.output_ids), tuple(tokens.tolist()), cap, method, seq.key))

    def _shadow_beyond(self, slots: torch.Tensor, rows: torch.Tensor, caps: torch.Tensor, proposal: DraftProposal,
                       method: str) -> DraftProposal:
        """A model-free drafter drafted `rows` (indices into `slots`) to their full caps: rows whose verify
        length this round is shorter keep the whole draft as a shadow (their acceptance is then scored
        from it, not from the verify: `self.deferred`); the proposal is cut to this round's caps."""
        assert self.shadows is not None and self.full_caps is not None
        if self.deferred is None:
            self.deferred = torch.zeros(len(slots), dtype=torch.bool)
        cut = caps[rows]
        for i, row in enumerate(rows.tolist()):
            slot, full = int(slots[row]), int(self.full_caps[row])
            if full > int(cut[i]) and slot not in self.shadows:
                self._shadow(slot, proposal.token_ids[i, : int(proposal.num_tokens[i])], full, method)
                self.deferred[row] = True
        # a drafter may return fewer columns than asked (its longest draft), so the round's width can be
        # wider or narrower than the proposal: copy what fits into a zero-padded [rows, width]
        width = int(caps.max()) if len(caps) else 0
        num = torch.minimum(proposal.num_tokens, cut)
        tokens = torch.zeros(len(rows), width, dtype=proposal.token_ids.dtype)
        kept = min(width, proposal.token_ids.shape[1])
        tokens[:, :kept] = proposal.token_ids[:, :kept]
        tokens[torch.arange(width)[None, :] >= num[:, None]] = 0
        return DraftProposal(token_ids=tokens, num_tokens=num, probs=proposal.probs)

    def _shadow_idle_rows(self, slots: torch.Tensor, caps: torch.Tensor) -> None:
        """Draft, for statistics only, up to `shadow_rows` rows that verify no drafts this round (taking
        turns by slot), each with the selector's model-free method for its request (the cascade without
        a selector)."""
        assert self.shadows is not None and self.full_caps is not None
        full = self.full_caps
        idle = [row for row in ((caps == 0) & (full > 0)).nonzero().flatten().tolist()
                if int(slots[row]) not in self.shadows]
        if not idle:
            return
        idle.sort(key=lambda row: (int(slots[row]) < self.shadow_cursor, int(slots[row])))
        picked = idle[: self.engine.shadow_rows]
        self.shadow_cursor = int(slots[picked[-1]]) + 1
        names = [d.name for d in self.shadow_drafters]
        chosen = dict(zip(picked, self.selector.choose(self.state.seq_keys[slots[picked]].tolist(),
                                                       self._row_verify_s(), names))) if self.selector else {}
        waiting = list(picked)
        for position, drafter in enumerate(self.shadow_drafters):
            mine = [row for row in waiting if chosen.get(row, drafter.name) == drafter.name]
            if not mine:
                continue
            index = torch.tensor(mine)
            started = time.perf_counter()
            proposal = drafter.propose(self.state, DraftRequest(slots[index], full[index], self.params))
            spent = time.perf_counter() - started
            self.round_draft_s[drafter.name] = self.round_draft_s.get(drafter.name, 0.0) + spent
            self.stats.draft_s_per_drafter[drafter.name] = self.stats.draft_s_per_drafter.get(drafter.name, 0.0) + spent
            if self.selector is not None:
                self.selector.observe_cost(drafter.name, spent, len(mine))
            last = position == len(self.shadow_drafters) - 1
            for i, row in enumerate(mine):
                n = int(proposal.num_tokens[i])
                if n or chosen or last:  # the cascade leaves a row without drafts to the next drafter
                    self._shadow(int(slots[row]), proposal.token_ids[i, :n], int(full[row]), drafter.name)
                    waiting.remove(row)

    def _score_shadows(self) -> None:
        """Score the shadow drafts of rows that have now committed past them (or finished); feed the
        verify length's acceptance statistics and the selector."""
        assert self.shadows is not None
        caps, accepted, requests, methods = [], [], [], []
        for slot in list(self.shadows.pending):
            seq = self.slot_seq[slot]
            done = self.shadows.resolve(slot, seq.output_ids, seq.finish_reason is not None)
            if done is None:
                continue
            draft, got = done
            caps.append(draft.cap)
            accepted.append(got)
            requests.append(draft.request)
            methods.append(draft.method)
        if not caps:
            return
        stats = self.stats
        stats.shadow_drafts += len(caps)
        stats.shadow_accepted += sum(accepted)
        for method, got in zip(methods, accepted):
            stats.shadow_drafts_per_drafter[method] = stats.shadow_drafts_per_drafter.get(method, 0) + 1
            stats.shadow_accepted_per_drafter[method] = stats.shadow_accepted_per_drafter.get(method, 0) + got
            scored = self.round_shadows.setdefault(method, [0, 0])
            scored[0], scored[1] = scored[0] + 1, scored[1] + got
        if self.engine.length_policy is not None:
            self.engine.length_policy.stats.observe(caps, accepted)
        if self.selector is not None:
            self.selector.observe(requests, methods, accepted)

    def _propose_mixed(self, slots: torch.Tensor, caps: torch.Tensor,
                       workers_on: bool) -> tuple[DraftProposal, list[str | None]]:
        """specactor: the selector gives each row one method, the workers' streamed drafts or an
        in-process drafter; a row whose in-process drafter supplies nothing takes the workers'
        drafts if any have arrived. With the workers paused (workers_on False) only in-process
        drafters are chosen. Never waits for the workers."""
        assert self.coordinator is not None
        self.chosen, self.fallback = None, None
        self.coordinator.poll()
        started = time.perf_counter()
        stream_tokens, stream_num = (torch.from_numpy(a) for a in self.coordinator.take(slots.numpy(), caps.numpy()))
        take_s = time.perf_counter() - started
        if not len(caps) or int(caps.max()) == 0:
            return self._no_drafts(slots, caps)
        workers = WorkerDrafterSync.name
        methods = [d.name for d in self.engine.drafters]
        if workers_on:
            methods = [workers, *methods]
        if self.selector is not None:
            self.chosen = self.selector.choose(self.state.seq_keys[slots].tolist(), self._row_verify_s(), methods)
            if workers_on:
                self.selector.observe_cost(workers, take_s, len(slots))
        else:
            self.chosen = [methods[0]] * len(slots)
        by_workers = torch.tensor([c == workers for c in self.chosen])
        merged, sources = self._draft_rows(slots, caps, (caps > 0) & ~by_workers)
        fill = (caps > 0) & (merged.num_tokens == 0) & (stream_num > 0) if workers_on else torch.zeros_like(caps > 0)
        self.fallback = fill & ~by_workers
        rows = fill.nonzero().flatten()
        width = stream_tokens.shape[1]
        merged.token_ids[rows, :width] = stream_tokens[rows]
        merged.num_tokens[rows] = stream_num[rows]
        for row in rows.tolist():
            sources[row] = workers
        return merged, sources

    # ------------------------------------------------------------------ combination (the tail)
    def _candidates(self, slots: torch.Tensor, caps: torch.Tensor, proposal: DraftProposal,
                    sources: list[str | None]) -> tuple[torch.Tensor, DraftProposal, list[str]] | None:
        """Second candidates from the other in-process methods for rows of this round.

        Returns (rows [E] into `slots`, their candidates [E, k], each candidate's method), at most
        one per row and one per scratch slot, or None. A candidate that is a prefix of the row's
        own draft gains nothing and is dropped; a row whose own method drafted nothing simply
        takes the candidate as its draft (no second row needed).
        """
        open_rows = (caps > 0).nonzero().flatten().tolist()
        found: dict[int, tuple[torch.Tensor, int, str]] = {}
        for drafter in self.engine.drafters:
            rows = [r for r in open_rows if r not in found and sources[r] != drafter.name]
            if not rows:
                continue
            picked = torch.tensor(rows)
            started = time.perf_counter()
            offer = drafter.propose(self.state, DraftRequest(slots[picked], caps[picked], self.params,
                                                             coupled_noise=True))
            if self.selector is not None:
                self.selector.observe_cost(drafter.name, time.perf_counter() - started, len(rows))
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
                    if self.fallback is None:  # not the chosen method's drafts: no credit for it
                        self.fallback = torch.zeros(len(slots), dtype=torch.bool)
                    self.fallback[row] = True
                    continue
                found[row] = (tokens, n, drafter.name)
        rows = sorted(found)[: len(self.scratch)]
        if not rows:
            return None
        k = proposal.token_ids.shape[1]
        offers = DraftProposal(torch.zeros(len(rows), k, dtype=torch.long), torch.zeros(len(rows), dtype=torch.long))
        for i, row in enumerate(rows):
            tokens, n, _ = found[row]
            n = min(n, k)
            offers.token_ids[i, :n], offers.num_tokens[i] = tokens[:n], n
        return torch.tensor(rows), offers, [found[row][2] for row in rows]

    def _verify_candidates(self, slots: torch.Tensor, proposal: DraftProposal, sources: list[str | None],
                           rows: torch.Tensor, offers: DraftProposal, methods: list[str]
                           ) -> tuple[torch.Tensor, DraftProposal, list[str | None]]:
        """One target forward over the rows' own drafts and the candidates; each row keeps the
        longer accepted continuation. Returns the rows' (logits [R, k+1, V], drafts, sources).

        A candidate runs on a scratch slot holding a copy of its row's KV prefix. Acceptance is
        position-keyed: along either path, accepted tokens are exactly what plain decoding would
        emit, so keeping the longer path is exact. The winner's new KV entries are copied back.
        """
        R, E = len(slots), len(rows)
        scratch = self.scratch[:E]
        owners = slots[rows]
        kv_lengths = self.runner.lengths[owners].clone()
        self.runner.cache.copy_prefix(owners, scratch, kv_lengths)
        last = self.state.tokens[slots, self.state.lengths[slots] - 1]
        drafts = torch.cat([proposal.token_ids, offers.token_ids])  # [R + E, k]
        num = torch.cat([proposal.num_tokens, offers.num_tokens])
        inputs = torch.cat([torch.cat([last, last[rows]])[:, None], drafts], dim=1)
        logits = self.runner.forward(inputs, torch.cat([slots, scratch]), num + 1)  # [R + E, k+1, V]
        accepted, _ = self._choose(torch.cat([slots, owners]), logits, drafts, num, None)
        self.own_accepted = accepted[:R].clone()
        if self.selector is not None:  # the tail's spare capacity buys statistics for the other methods
            self.selector.observe(self.state.seq_keys[owners].tolist(), methods, accepted[R:].tolist())
        wins = (accepted[R:] > accepted[rows]).nonzero().flatten()
        self.stats.candidate_rows += E
        self.stats.candidate_wins += len(wins)
        pick = torch.arange(R)  # which verified row's logits each row keeps
        for i in wins.tolist():
            row, start, count = int(rows[i]), int(kv_lengths[i]), int(accepted[R + i]) + 1
            self.runner.cache.copy_range(int(scratch[i]), int(slots[row]), start, count)
            pick[row] = R + i
            proposal.token_ids[row], proposal.num_tokens[row] = offers.token_ids[i], offers.num_tokens[i]
            sources[row] = methods[i]
        self.runner.set_lengths(scratch, torch.zeros_like(scratch))
        return logits[pick], proposal, sources

    def _take(self, slots: torch.Tensor, caps: torch.Tensor) -> tuple[DraftProposal, list[str | None]]:
        """Decoupled: whatever drafts have streamed in for these rows, up to their caps; never waits."""
        assert self.coordinator is not None
        self.chosen, self.fallback = None, None
        self.coordinator.poll()
        tokens, num = self.coordinator.take(slots.numpy(), caps.numpy())
        sources: list[str | None] = [WorkerDrafterSync.name if n else None for n in num.tolist()]
        return DraftProposal(torch.from_numpy(tokens), torch.from_numpy(num)), sources

    def _merge_probs(self, merged: DraftProposal, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Draft distributions [R, k, V]: given ones where a drafter sampled, one-hot elsewhere."""
        R, k = merged.token_ids.shape
        probs = torch.zeros(R, k, self.engine.vocab_size, dtype=torch.float64)
        probs.scatter_(-1, merged.token_ids[..., None], 1.0)
        for rows, part in parts:
            probs[rows, : part.shape[1]] = part.to(torch.float64)
        return probs

    def _choose(self, slots: torch.Tensor, logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the acceptance rule: (num_accepted [R], output tokens [R, k+1])."""
        positions = self.state.output_positions(slots)[:, None] + torch.arange(logits.shape[1])[None, :]
        keys = self.state.seq_keys[slots]
        if not self.rejection:
            targets = sample_tokens(logits, self.params, keys, positions)
            return acceptance.accept_position_keyed(drafts, num_drafts, targets)
        k = drafts.shape[1]
        target_probs = warped_probs(logits, self.params)
        uniforms = uniform_noise(keys, positions[:, :k], 1, STREAM_ACCEPT)[..., 0]
        recovery = gumbel_noise(keys, positions, self.engine.vocab_size, STREAM_RECOVER)
        return acceptance.accept_rejection(drafts, num_drafts, draft_probs, target_probs, uniforms, recovery)

    def _emit(self, slots: torch.Tensor, logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
              draft_probs: torch.Tensor | None, sources: list[str | None] | None = None,
              prefill: bool = False) -> torch.Tensor:
        """Accept, apply stop rules, commit every cache and retire finished rows.

        A verify block fed [last, d1..dk], so `counts` of its entries become committed KV;
        after prefill the KV already holds the prompt and the new token is not in it yet.
        """
        num_accepted, output = self._choose(slots, logits, drafts, num_drafts, draft_probs)
        top, log_probs = None, None
        if self.top_logprobs:
            log_probs = scaled_log_softmax(logits, self.params.temperature)  # [R, k+1, V]
            top = top_logprobs(log_probs, self.top_logprobs)
        logprobs = token_logprobs(logits, output.to(logits.device), self.params.temperature, log_probs)
        del log_probs
        counts = self._apply_stops(slots, output, num_accepted + 1, logprobs, top)
        self.state.append(slots, output, counts)
        if not prefill:
            self.runner.commit(slots, counts)
        if self.shadows is not None and self.shadows.pending:
            self._score_shadows()
        for drafter in self.engine.drafters:
            drafter.observe_commit(self.state, slots)
        self._observe(num_drafts, num_accepted, sources)
        if not prefill:
            self._record_round(drafts.shape[1], num_drafts, num_accepted, counts, sources)
        if self.coordinator is not None:
            self.coordinator.after_round(slots.numpy(), output.numpy(), counts.numpy())
        if self.engine.check_invariants:
            self._assert_invariants(slots)
        finished = [slot for slot in slots.tolist() if self.slot_seq[slot].finish_reason is not None]
        if finished:
            for drafter in self.engine.drafters:
                drafter.finish_rows(self.state, torch.tensor(finished))
        for slot in finished:
            del self.slot_seq[slot]
            self.free.append(slot)
        if finished and self.coordinator is not None:
            self.coordinator.remove_rows(np.asarray(finished, dtype=np.int64))
        return num_accepted

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

    def _observe(self, num_drafts: torch.Tensor, num_accepted: torch.Tensor, sources: list[str | None] | None) -> None:
        if sources is None:
            return
        stats = self.stats
        stats.drafted_tokens += int(num_drafts.sum())
        stats.accepted_tokens += int(num_accepted.sum())
        deepest = int(num_drafts.max()) if len(num_drafts) else 0
        for i in range(min(len(stats.drafted_per_position), deepest)):
            stats.drafted_per_position[i] += int((num_drafts > i).sum())
            stats.accepted_per_position[i] += int((num_accepted > i).sum())
        for row, name in enumerate(sources):
            if name is not None:
                stats.drafted_per_drafter[name] = stats.drafted_per_drafter.get(name, 0) + int(num_drafts[row])
                stats.accepted_per_drafter[name] = stats.accepted_per_drafter.get(name, 0) + int(num_accepted[row])

    def _record_round(self, width: int, num_drafts: torch.Tensor, num_accepted: torch.Tensor, counts: torch.Tensor,
                      sources: list[str | None] | None) -> None:
        by_drafter: dict[str, int] = {}  # rows each method drafted for this round
        accepted_by: dict[str, int] = {}  # and how many of its tokens were accepted
        for row, name in enumerate(sources or []):
            if name is not None:
                by_drafter[name] = by_drafter.get(name, 0) + 1
                accepted_by[name] = accepted_by.get(name, 0) + int(num_accepted[row])
        self.stats.timeline.append({
            "t": round(time.perf_counter() - self.started, 4), "rows": len(counts), "k": width,
            "cap": self.round_cap,
            "emitted": int(counts.sum()), "drafted": int(num_drafts.sum()), "accepted": int(num_accepted.sum()),
            "by_drafter": by_drafter, "accepted_by_drafter": accepted_by,
            "draft_s_by_drafter": {name: round(spent, 6) for name, spent in self.round_draft_s.items()},
            "shadow_by_drafter": dict(self.round_shadows),
            **({"arm": self.arm} if self.phase is not None else {}),
        })

    def _assert_invariants(self, slots: torch.Tensor) -> None:
        """Target KV holds every committed token but the last; drafters check their own."""
        kv, committed = self.runner.lengths[slots], self.state.lengths[slots]
        assert torch.equal(kv, committed - 1), f"target KV lengths {kv.tolist()} != {(committed - 1).tolist()}"
        for drafter in self.engine.drafters:
            drafter.check_invariants(self.state, slots)
