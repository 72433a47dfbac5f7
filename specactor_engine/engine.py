"""The rollout engine: batched, per-row speculative decoding that emits exactly what
plain decoding emits.

`Engine` holds the target model, the draft sources its mode uses (modes.py) and the policies that
outlive one call (the verify-length policy, its cost profile); `generate` hands each call to a
`Run` (run.py), whose `_round` reads one verify round top to bottom (docs/architecture.md).

The engine knows nothing about Prefect, DeepSpeed or W&B; it is built from a `RolloutConfig` (or
`from_config` for a whole `SpecActorConfig`) and driven with `generate` / `update_weights`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

import torch

from specactor_engine import clock
from specactor_engine.config import RolloutConfig, SpecActorConfig
from specactor_engine.decoupled.launch import DrafterWorkers, start_workers
from specactor_engine.decoupled.phase import DECOUPLED
from specactor_engine.decoupled.sync import WorkerDrafterSync
from specactor_engine.drafters import Drafter, DrafterContext, build_drafter
from specactor_engine.model.runner import ModelRunner, load_hf_model
from specactor_engine.model.weights import load_named_weights
from specactor_engine.modes import MODES
from specactor_engine.policies.cost_profile import load_or_measure
from specactor_engine.policies.verify_length import AcceptanceStats, CostProfile, CostTable, VerifyLengthPolicy
from specactor_engine.policies.draft_trim import ConfidenceCalibration
from specactor_engine.run import Run, SampleRecord, scratch_slots, trim_rows
from specactor_engine.sampling import sequence_key
from specactor_engine.tokenize import encode_request, eos_token_ids
from specactor_engine.types import EngineStats, Request, RolloutResult, SequenceOutput

logger = logging.getLogger(__name__)


# what `Engine.plain_decoding` switches off and puts back
_SPECULATION_STATE = ("mode", "num_draft_tokens", "drafters", "coordinator", "verify_length", "combine_below",
                      "dynamic_decoupling", "verifier_threads", "selection")


class Engine:
    """Target model + drafters, built from a validated `RolloutConfig`; `generate` runs the decode loop (run.py)."""

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
        self.packed_verify = rollout.packed_verify
        # draft trimming's map from drafter confidence to acceptance, kept across calls as the policy's statistics are
        self.trim_calibration = ConfidenceCalibration() if rollout.draft_trimming else None
        self.draft_arbitration = rollout.draft_arbitration  # run.py, where trimming runs (policies/arbitration.py)
        # dynamic: a VerifyLengthPolicy picks k in 0..num_draft_tokens each round (built on first use,
        # from `cost_table` or the cached startup profile); it keeps its statistics across calls.
        self.verify_length = rollout.verify_length if self.drafters or self.coordinator else "fixed"
        self.cost_table = cost_table
        self.length_policy: VerifyLengthPolicy | None = None
        self.policy_version = 0
        self.vocab_size = target.config.vocab_size
        # cpu_kernels: oneDNN pre-packed linears and the paged decode-attention kernel (model/runner.py)
        self.runner = ModelRunner(target, packed_linear=cpu_kernels, paged_attention=cpu_kernels)
        for drafter in self.drafters:  # feature-level drafters read the target's hidden states (drafters/feature.py)
            if drafter.needs_target:
                drafter.bind_target(self.runner)
        self._set_cost_shares()
        self.eos_ids = eos_token_ids(tokenizer, target)

    def _set_cost_shares(self) -> None:
        """Each draft model's prior drafting cost: its step's weight bytes over the target's (Drafter.cost_share);
        a drafter that set its own (a replay's stand-in) keeps it."""
        unset = [d for d in self.drafters if d.cost_share is None and not d.model_free]
        target_bytes = self.runner.step_bytes() if unset else 0
        for drafter in unset:
            drafted = drafter.step_bytes() if target_bytes else 0
            drafter.cost_share = drafted / target_bytes if drafted else None

    def _cost_shares(self) -> dict[str, float]:
        return {d.name: d.cost_share for d in self.drafters if d.cost_share is not None}

    @property
    def speculative(self) -> bool:
        """The mode drafts at all (every mode but `ar`)."""
        return self.mode.speculative

    @contextlib.contextmanager
    def plain_decoding(self) -> Iterator[None]:
        """Decode without speculation inside the block (mode `ar`: no drafters, no workers, k = 0) with the same
        weights, kernels and sampling: the baseline a speculative rollout is measured against, on the same
        prompts and noise (its outputs must be identical). The drafters keep their state; the verify-length
        policy keeps its statistics."""
        saved = {name: getattr(self, name) for name in _SPECULATION_STATE}
        self.mode, self.num_draft_tokens, self.drafters, self.coordinator = MODES["ar"], 0, [], None
        self.verify_length, self.combine_below, self.dynamic_decoupling = "fixed", 0, False
        self.verifier_threads, self.selection = None, "cascade"
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    @contextlib.contextmanager
    def history_kept(self) -> Iterator[None]:
        """Rollouts inside the block leave no trace in the drafters' cross-rollout history (the suffix drafter's
        earlier rollouts of each prompt): a held-out evaluation must not supply drafts to the next evaluation of
        the same prompts, which would measure a speedup training rollouts never see."""
        saved = [(drafter, drafter.history_snapshot()) for drafter in self.drafters]
        try:
            yield
        finally:
            for drafter, snapshot in saved:
                if snapshot is not None:
                    drafter.restore_history(snapshot)

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
                 progress: Callable[[int, int], None] | None = None, *, skip: Collection[tuple[str, int]] = (),
                 on_output: Callable[[SequenceOutput], None] | None = None) -> RolloutResult:
        """Roll out `sampling.n` samples of every request; outputs in (request, sample) order.

        progress(finished_sequences, total_sequences) is called after every round.
        skip: (request id, sample index) pairs not to roll out (a resumed rollout's finished samples: a sample
        does not depend on which others share the call); they are left out of the outputs and the counts.
        on_output(output) is called for each sample as it finishes (its round retires it), before the call returns.
        """
        started = clock.now()
        stats = EngineStats(mode=self.mode.name, drafted_per_position=[0] * self.num_draft_tokens,
                            accepted_per_position=[0] * self.num_draft_tokens)
        sequences = self._prepare(requests, sampling)
        if skip:
            skip = set(skip)
            sequences = [s for s in sequences if (s.request.request_id, s.sample_index) not in skip]
        runnable = [s for s in sequences if s.error is None]
        finished = None if on_output is None else (lambda seq: on_output(self._to_output(seq)))
        if finished is not None:
            for seq in sequences:
                if seq.error is not None:
                    finished(seq)
        threads = torch.get_num_threads()
        if self.verifier_threads:  # decoupled: the workers' threads are not ours to use
            torch.set_num_threads(self.verifier_threads)
        try:
            if self.verify_length == "dynamic" and runnable:
                self._ensure_length_policy(min(len(runnable), self.max_batch_size), self._longest(runnable, sampling),
                                           threads)
            run = Run(self, sampling, stats, self._reserve(runnable, sampling), started, total_threads=threads)
            run.decode(runnable, progress, finished)
        finally:
            torch.set_num_threads(threads)
            if self.coordinator is not None and self.coordinator.buffers is not None:
                stats.decoupled = self.coordinator.stats()
        stats.total_s = clock.now() - started
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

    def forget_acceptance(self) -> None:
        """The verify-length policy forgets the acceptance it observed (`VerifyLengthPolicy.forget_acceptance`),
        keeping its cost measurements: after a warm-up call whose few rows say nothing of the next call's."""
        if self.length_policy is not None:
            self.length_policy.forget_acceptance()

    def _longest(self, sequences: list[SampleRecord], sampling: Any) -> int:
        """The longest context (prompt + output) any of these sequences can reach."""
        return min(self.max_model_len, max(len(s.prompt_ids) for s in sequences) + sampling.max_new_tokens)

    def _ensure_length_policy(self, max_rows: int, max_context: int, total_threads: int | None = None) -> None:
        """Build the verify-length policy; re-profile if this call's batch or context outgrows the profile.

        Each profile is measured on the threads its rounds run on (total_threads: the call's, default the
        current count): plain and in-process rounds on all of them, the drafter workers' arm on the
        verifier's (a second profile, `VerifyLengthPolicy.regime_costs`, where dynamic decoupling switches
        between the two), a decoupled engine that never pauses its workers on the verifier's alone."""
        table, regimes = self.cost_table, None
        if table is None or table.batch_sizes[-1] < max_rows or (table.max_context and table.max_context < max_context):
            total = total_threads or torch.get_num_threads()
            workers_only = self.verifier_threads and not self.dynamic_decoupling
            table = self.cost_table = self._measure_costs(max_rows, max_context,
                                                          self.verifier_threads if workers_only else total)
            regimes = {}
            if self.dynamic_decoupling and self.verifier_threads and self.verifier_threads != total:
                regimes[DECOUPLED] = self._measure_costs(max_rows, max_context, self.verifier_threads)
        if self.length_policy is None:
            self.length_policy = VerifyLengthPolicy(table, AcceptanceStats(max_k=self.num_draft_tokens),
                                                    prior_share=self._cost_shares())
        else:
            self.length_policy.cost = table
        self.length_policy.trimmed_rows = trim_rows(self)  # trimmed rounds run wide widths below the profile's line
        if regimes is not None:  # measured now: the policy's per-regime profiles go with the new table
            self.length_policy.regime_costs = regimes
        # a feed (prefill, catch-up) is a wide forward: a target token of the widest profiled verify, times the share
        rows, width = table.batch_sizes[-1], self.num_draft_tokens + 1
        per_token = table.cost(rows, width) / (rows * width)
        for drafter in self.drafters:
            if drafter.cost_share is not None:
                drafter.feed_s_prior = drafter.cost_share * per_token

    def _measure_costs(self, max_rows: int, max_context: int, threads: int | None) -> CostProfile:
        return load_or_measure(self.runner, max_rows, self.num_draft_tokens, max_context=max_context,
                               packed=self.trim_calibration is not None, threads=threads)

    def reserve(self, requests: Sequence[Request], sampling: Any) -> None:
        """Size the KV caches for a `generate` of these requests now rather than inside it.

        A later call of at most this size reuses the buffers (as every step of a training run does);
        this moves the one-off allocation (gigabytes at large batches) to start-up, where vLLM's own
        KV cache allocation is too. A dynamic verify length's cost profile for this size is measured (or
        loaded) here too, so a timed `generate` after it holds decoding only.
        """
        runnable = [s for s in self._prepare(requests, sampling) if s.error is None]
        if runnable:
            if self.verify_length == "dynamic":
                self._ensure_length_policy(min(len(runnable), self.max_batch_size), self._longest(runnable, sampling))
            num_slots, max_len = self._reserve(runnable, sampling)
            if self.coordinator is not None and not self.coordinator.reserve(num_slots, max_len):
                logger.warning("a drafter worker did not size its KV cache in time; it will on the first generate")

    def _reserve(self, sequences: list[SampleRecord], sampling: Any) -> tuple[int, int]:
        """Allocate target and drafter caches for this call: (slots, tokens per slot)."""
        num_slots = max(1, min(self.max_batch_size, len(sequences)))
        longest = max((len(s.prompt_ids) for s in sequences), default=1) + sampling.max_new_tokens
        # the target's cache is `ar`'s size: a row's real tokens (drafts included, `Run._draft_caps`) end by
        # position longest - 2, and pads of padded verify rows near their budget go to its last position, longest
        # (`ModelRunner._clamp_pads`). Drafters' caches and the token state keep the draft headroom.
        target_len = min(self.max_model_len, longest) + 1
        max_len = target_len + self.num_draft_tokens
        # slots after the real ones (target cache only) hold the combination candidates where free ones cannot
        self.runner.allocate(num_slots + scratch_slots(num_slots, self.combine_below), target_len)
        for drafter in self.drafters:
            drafter.allocate(num_slots, max_len)
        return num_slots, max_len

    def _prepare(self, requests: Sequence[Request], sampling: Any) -> list[SampleRecord]:
        sequences = []
        for request in requests:
            prompt_ids, error = encode_request(request, self.tokenizer, self.chat_template)
            if error is None and len(prompt_ids) >= self.max_model_len:
                error = f"prompt has {len(prompt_ids)} tokens; the context limit (model.max_model_len) is " \
                        f"{self.max_model_len} including at least one generated token"
            for j in range(sampling.n):
                seq = SampleRecord(request, j, prompt_ids or [], sequence_key(sampling.seed, request.request_id, j))
                if error is not None:
                    seq.error, seq.finish_reason = error, "error"
                sequences.append(seq)
        return sequences

    def _to_output(self, seq: SampleRecord) -> SequenceOutput:
        text = seq.text if seq.text is not None else self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        top = (torch.cat(seq.top_ids), torch.cat(seq.top_values)) if seq.top_ids else None
        return SequenceOutput(seq.request.request_id, seq.sample_index, seq.prompt_ids, seq.output_ids, text,
                              seq.logprobs, seq.finish_reason or "length", self.policy_version, seq.error, top)
