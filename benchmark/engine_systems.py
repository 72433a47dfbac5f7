"""This project's engine in every configuration the benchmark compares, as one table.

A row (`EngineVariant`) names a system and says how it configures the engine: the mode, the draft
methods, a fixed or dynamic verify length, whether the trace's draft model runs in a drafter worker
process, and whether the target uses the CPU kernels. One class, `EngineSystem`, turns a row and a
run spec into a `SpecActorConfig` and builds the engine with `Engine.from_config`, the constructor
`specactor rollout` uses: a benchmarked system is what a user gets from the same config, and every
setting a row does not name (combine_below, shadow_rows, worker threads, ...) is the config's default.
The draft length comes from the run spec (`--num-draft-tokens`, or K of `NAME@K`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from benchmark.interface import FinishClock, Generation, RunSpec, SequenceResult, System, resolve_local
from specactor_engine.config import (
    DecoupledConfig,
    DrafterConfig,
    FeatureDrafterConfig,
    ModelConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    RolloutConfig,
    RolloutMode,
    SamplingConfig,
    SpecActorConfig,
    SuffixDrafterConfig,
)
from specactor_engine.drafters import Drafter
from specactor_engine.kernels import int8_linear as int8_kernel
from specactor_engine.model.quantize import int8_supported
from specactor_engine.types import Request

ALL_AT_ONCE = 1 << 16  # rollout.max_batch_size meaning "every sequence in one batch"
WORKER_START_TIMEOUT_S = 600

# Where a variant's drafts come from. "trace": the trace's draft model in process (the n-gram drafter
# when the trace has none); "model": the trace's draft model in process as `specactor` drafts with it (int8
# weights and a compact head where this torch build quantizes), left out when the trace has none;
# "feature": the trained feature-level drafter given with --feature-drafter, left out when none is (int8 weights
# where the engine's int8 kernel runs: half a bf16 draft step's bytes, bench/session52);
# "suffix", "ngram": those config drafters; "oracle": the reference run's own outputs, not a config kind:
# the oracle system hands it to the engine itself (benchmark/oracle.py).
DraftSource = Literal["trace", "model", "feature", "suffix", "ngram", "oracle"]
# "model" drafts over this many tokens (lowest ids, growing with what the target uses): 93% of reasoning-gym
# text's Qwen tokens lie below id 32768 before any growth
CHEAP_DRAFT_VOCAB = 32768


@dataclass(frozen=True)
class EngineVariant:
    """One engine system: what it sets in the rollout config (the rest stays at the config's defaults).

    workers: the trace's draft model, when it has one, runs in a drafter worker process (1 thread; the
    verifier keeps the others) instead of in process.
    """

    name: str
    mode: RolloutMode
    description: str
    drafters: tuple[DraftSource, ...] = ()
    verify_length: Literal["fixed", "dynamic"] = "fixed"
    workers: bool = False
    cpu_kernels: bool = True
    trimming: bool | None = None  # rollout.draft_trimming (policies/draft_trim.py); None: the config's default (on)
    float_feature: bool = False  # the feature drafter drafts in the target's dtype even where int8 runs
    arbitration: bool | None = None  # rollout.draft_arbitration (policies/arbitration.py); None: the config's default

    @property
    def needs_reference(self) -> bool:
        """Drafts from the `ar` run's outputs: `ar` runs first and hands them over."""
        return "oracle" in self.drafters


ENGINE_VARIANTS: tuple[EngineVariant, ...] = (
    EngineVariant("ar", "ar", "The engine without speculation: the speed and identity reference."),
    EngineVariant("ar-torch", "ar", "`ar` with torch's own linear and attention ops (model.cpu_kernels=false): "
                  "what the kernels buy.", cpu_kernels=False),
    EngineVariant("coupled", "coupled", "Draft-then-verify with the trace's draft model (or the n-gram drafter) at "
                  "a fixed k.", ("trace",)),
    EngineVariant("coupled-dynamic", "coupled", "Coupled, with the verify length chosen per round by the cost model "
                  "(0..k; 0 = plain decoding).", ("trace",), "dynamic"),
    EngineVariant("coupled-suffix", "coupled", "The suffix drafter alone (prompt, group siblings, earlier rollouts), "
                  "dynamic verify length: a single-drafter baseline for `specactor`.", ("suffix",), "dynamic"),
    EngineVariant("coupled-ngram", "coupled", "The n-gram drafter alone, dynamic verify length: a single-drafter "
                  "baseline for `specactor` (on traces without a draft model `coupled-dynamic` is the same system).",
                  ("ngram",), "dynamic"),
    EngineVariant("coupled-cheap", "coupled", "The trace's draft model as `specactor` drafts with it in process: "
                  "int8 weights and a compact head over 32k tokens, dynamic verify length (its single-drafter "
                  "baseline).", ("model",), "dynamic"),
    EngineVariant("coupled-cheap-untrimmed", "coupled", "`coupled-cheap` without draft trimming "
                  "(rollout.draft_trimming=false: every drafted position is verified).",
                  ("model",), "dynamic", trimming=False),
    EngineVariant("coupled-feature", "coupled", "The feature-level drafter given with --feature-drafter alone (one "
                  "decoder layer over the target's hidden states, EAGLE-style), dynamic verify length.",
                  ("feature",), "dynamic"),
    EngineVariant("coupled-feature-float", "coupled", "`coupled-feature` drafting in the target's dtype where "
                  "`coupled-feature` drafts on int8 weights: what int8 drafting buys and costs in acceptance.",
                  ("feature",), "dynamic", float_feature=True),
    EngineVariant("coupled-feature-untrimmed", "coupled", "`coupled-feature` without draft trimming "
                  "(rollout.draft_trimming=false: every drafted position is verified).",
                  ("feature",), "dynamic", trimming=False),
    EngineVariant("decoupled", "decoupled", "The trace's draft model in a worker process; the verifier never waits; "
                  "dynamic verify length and dynamic decoupling.", (), "dynamic", workers=True),
    EngineVariant("specactor", "specactor", "Per request, Fastest-of-N over the suffix and n-gram drafters and, when "
                  "the trace has a draft model, that model in process (int8 weights, compact head: `coupled-cheap`'s) "
                  "and in a drafter worker streaming its drafts (dynamic decoupling pauses the worker where it cannot "
                  "pay); the verify length and each row's method chosen together per round. With --feature-drafter "
                  "the feature-level drafter joins them.",
                  ("model", "feature", "suffix", "ngram"), "dynamic", workers=True),
    EngineVariant("specactor-untrimmed", "specactor", "`specactor` without draft trimming "
                  "(rollout.draft_trimming=false: every drafted position is verified).",
                  ("model", "feature", "suffix", "ngram"), "dynamic", workers=True, trimming=False),
    EngineVariant("specactor-arbitrated", "specactor", "`specactor` with draft arbitration "
                  "(rollout.draft_arbitration=true: a row a draft model drafted verifies a suffix draft instead where "
                  "that one is expected to emit more tokens).",
                  ("model", "feature", "suffix", "ngram"), "dynamic", workers=True, arbitration=True),
    EngineVariant("oracle", "coupled", "Coupled mode fed the target's own final outputs: the ceiling at this verify "
                  "length.", ("oracle",)),
    EngineVariant("oracle-dynamic", "coupled", "The oracle with the cost-model verify length: no drafter can beat "
                  "it on this machine, so it bounds every speed goal.", ("oracle",), "dynamic"),
)


def engine_config(variant: EngineVariant, spec: RunSpec) -> SpecActorConfig:
    """The config that runs `variant` on the spec's trace, as `specactor rollout` would be given it.

    Models are named by their local directories, resolved here without downloading (a benchmark
    measures what is there). An oracle's config keeps the default drafters: `drafters=` replaces them.
    """
    target = str(resolve_local(spec.target, spec.dtype))
    fields: dict[str, Any] = {"decoupled": _worker_settings(variant, spec)}
    if not variant.needs_reference:
        fields["drafters"] = [_drafter_config(source, spec, variant.float_feature) for source in variant.drafters
                              if (source != "model" or spec.drafter is not None)
                              and (source != "feature" or spec.feature_drafter is not None)]
    rollout = RolloutConfig(mode=variant.mode, num_draft_tokens=spec.num_draft_tokens,
                            verify_length=variant.verify_length, max_batch_size=spec.max_batch_size or ALL_AT_ONCE,
                            **({} if variant.trimming is None else {"draft_trimming": variant.trimming}),
                            **({} if variant.arbitration is None else {"draft_arbitration": variant.arbitration}),
                            **fields)
    if spec.replicas > 1:  # the run's threads shared among the replicas, no drafter worker beside a 1-thread engine
        rollout = rollout.model_copy(update={"replicas": spec.replicas, "decoupled": DecoupledConfig(),
                                             "replica_threads": max(1, spec.threads // spec.replicas)})
    return SpecActorConfig(model=ModelConfig(target=target, dtype=spec.dtype, cpu_kernels=variant.cpu_kernels),
                           rollout=rollout, threads=spec.threads)


def _drafter_config(source: DraftSource, spec: RunSpec, float_feature: bool = False) -> DrafterConfig:
    """The config drafter behind one draft source of a row (float_feature: the feature drafter in the target's dtype
    where it would draft in int8)."""
    if source == "suffix":
        return SuffixDrafterConfig()
    if source == "model" and spec.drafter is not None:  # drafting that costs little (docs/architecture.md 13)
        cheap = int8_supported()
        return ModelDrafterConfig(model=str(resolve_local(spec.drafter, spec.dtype)),
                                  dtype="float32" if cheap else spec.dtype, quantize="int8" if cheap else "none",
                                  draft_vocab=CHEAP_DRAFT_VOCAB)
    if source == "feature" and spec.feature_drafter is not None:
        cheap = int8_kernel.available() and not float_feature  # torch's own int8 linear loses acceptance (session 34)
        return FeatureDrafterConfig(path=spec.feature_drafter, quantize="int8" if cheap else "none")
    if source == "trace" and spec.drafter is not None:
        return ModelDrafterConfig(model=str(resolve_local(spec.drafter, spec.dtype)), dtype=spec.dtype)
    if source in ("trace", "ngram"):
        return NgramDrafterConfig()
    raise ValueError(f"draft source {source!r} is not a config drafter (the system hands it to the engine)")


def _worker_settings(variant: EngineVariant, spec: RunSpec) -> DecoupledConfig:
    """Drafter workers on the trace's draft model where the row runs them and the trace has one."""
    if not variant.workers or spec.drafter is None:
        return DecoupledConfig()
    return DecoupledConfig(drafter=str(resolve_local(spec.drafter, spec.dtype)), dtype=spec.dtype)


class EngineSystem(System):
    """The engine configured by one `EngineVariant`, built through `Engine.from_config`.

    drafters: in-process drafters that replace the config's (the oracle's lookup drafter).
    """

    def __init__(self, variant: EngineVariant, spec: RunSpec, drafters: Sequence[Drafter] | None = None) -> None:
        from specactor_engine.engine import Engine

        if spec.drafter is None and (variant.mode == "decoupled" or variant.drafters == ("model",)):
            raise RuntimeError(f"{variant.name} needs a draft model (this trace has none)")
        if spec.feature_drafter is None and variant.drafters == ("feature",):
            raise RuntimeError(f"{variant.name} needs a trained feature drafter: --feature-drafter DIR "
                               "(make drafter-feature)")
        self.variant = variant
        config = engine_config(variant, spec)
        if config.rollout.replicas > 1:
            from specactor_engine.replicas.pool import ReplicaPool

            if drafters is not None or variant.mode == "decoupled":
                raise RuntimeError(f"{variant.name}: the benchmark runs neither the oracle's drafts nor drafter "
                                   "workers on replicas (use --replicas 1)")
            self.replicated = True
            self.engine: Any = ReplicaPool.from_config(config)
            return
        self.replicated = False
        self.engine = Engine.from_config(config, drafters=drafters)
        self._wait_for_workers()

    def _wait_for_workers(self) -> None:
        """Workers load their model in the background and rounds run without their drafts until then;
        the benchmark waits, so their start-up is load time, not warm-up or makespan."""
        workers = self.engine.workers
        if workers is not None and not workers.coordinator.wait_ready(WORKER_START_TIMEOUT_S):
            self.engine.close()
            raise RuntimeError("the drafter worker did not start")

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        """The verify-cost profiles (each on the threads its rounds run on: Engine._ensure_length_policy) and the
        KV caches belong to start-up, as vLLM sizes its own there: neither is part of the makespan. The
        verify-length policy forgets the warm-up's acceptance and keeps its cost measurements."""
        if self.replicated:  # each replica sizes its caches and measures its verify costs on its own threads
            self.engine.reserve(requests, sampling)
            self.engine.warm_up(requests[:1], sampling.model_copy(update={"n": 1, "max_new_tokens": 8}))
            return
        self.engine.prepare_length_policy(requests, sampling)
        policy = self.engine.length_policy
        if policy is not None:  # what the warm-up left that the forgetting below keeps (read in the run's .log)
            print(f"after the warm-up: draft models in use {sorted(policy.models_in_use)}, held {sorted(policy.held)}",
                  file=sys.stderr, flush=True)
        # the warm-up's 8 tokens of one row are not the trace's acceptance (a fresh engine starts from the prior)
        self.engine.forget_acceptance()
        self.engine.reserve(requests, sampling)

    def set_history(self, requests: Sequence[Request], history: dict[str, list[list[int]]] | None) -> None:
        from specactor_engine.drafters.suffix import SuffixDrafter, SuffixHistory
        from specactor_engine.tokenize import encode_request

        chat_template = (self.engine.driver if self.replicated else self.engine).chat_template
        for drafter in self.engine.drafters:
            if not isinstance(drafter, SuffixDrafter):
                continue
            drafter.history = SuffixHistory(drafter.history.max_per_prompt)  # the warm-up is not history
            for request in requests if history else ():
                prompt_ids, _ = encode_request(request, self.engine.tokenizer, chat_template)
                for output in history.get(request.request_id, []):
                    drafter.history.add(prompt_ids or [], output)
        if self.replicated:
            self.engine.sync_drafters()  # every replica gets the driver's history

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig, clock: FinishClock) -> Generation:
        result = self.engine.generate(requests, sampling, progress=clock.progress)
        sequences = [SequenceResult(o.request_id, o.sample_index, o.token_ids, o.text, o.finish_reason)
                     for o in result.outputs]
        return Generation(sequences, result.stats.to_dict())

    def external_cpu_s(self) -> float:
        """The drafter workers' (or the replicas') CPU time: their processes work for this system."""
        if self.replicated:
            return self.engine.cpu_s()
        workers = self.engine.workers
        return sum(w.transport.cpu_s() for w in workers.coordinator.workers) if workers is not None else 0.0

    def external_pids(self) -> list[int]:
        """The drafter workers' process ids (none for Ray actors or replicas): a paired run stops them outside this
        system's turns (benchmark/paired.py)."""
        workers = None if self.replicated else self.engine.workers
        if workers is None:
            return []
        processes = [getattr(w.transport, "process", None) for w in workers.coordinator.workers]
        return [p.pid for p in processes if p is not None and p.pid is not None]

    def close(self) -> None:
        self.engine.close()
