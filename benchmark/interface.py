"""What every benchmarked system shares: the run spec it is built from, the interface it implements
and the result it returns.

A system is built from a `RunSpec` (this loads its models: load time is measured by the caller and
kept out of the makespan) and then generates a trace's requests. Every system emits the same thing,
a `Generation`, and marks each sequence's finish on a `FinishClock`, so tail time, identity to `ar`
and tokens/s are computed the same way for all (docs/benchmarking.md).
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmark.traces import Trace
from specactor_engine.config import SamplingConfig
from specactor_engine.types import Request


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to run one system once (JSON round-trip for the subprocess)."""

    system: str
    trace: Trace
    target: str  # registry name or local HF dir
    drafter: str | None  # draft model (name or dir); None: the n-gram drafter
    dtype: str
    max_batch_size: int | None = None  # None: all sequences at once
    num_draft_tokens: int = 4
    threads: int = 2
    reference_path: str | None = None  # `ar` outputs, for the oracle drafter
    oracle_passes: int = 1  # >1: untimed oracle runs that replace the references with their own outputs
    profile_path: str | None = None  # write a cProfile of the timed run here
    history_path: str | None = None  # trace C: the earlier rollout's outputs, {request_id: [token_ids, ...]}
    feature_drafter: str | None = None  # a trained feature-level drafter's directory (`make drafter-feature`)
    replicas: int = 1  # >1: engine systems run as that many rollout replicas (Ray actors), threads shared among them

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "trace": self.trace.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSpec":
        return cls(**{**data, "trace": Trace.from_dict(data["trace"])})


@dataclass
class SequenceResult:
    """One generated sample, as every system reports it."""

    request_id: str
    sample_index: int
    token_ids: list[int]  # up to and including the stop token, like the engine
    text: str
    finish_reason: str


@dataclass
class Generation:
    sequences: list[SequenceResult]
    engine_stats: dict[str, Any] | None = None  # EngineStats.to_dict() for engine systems


@dataclass
class FinishClock:
    """Seconds from `start()` at which each sequence finished (in finishing order)."""

    started: float = 0.0
    times: list[float] = field(default_factory=list)

    def start(self) -> float:
        self.started = time.perf_counter()
        self.times = []
        return self.started

    def mark(self, count: int = 1) -> None:
        now = time.perf_counter() - self.started
        self.times.extend([now] * count)

    def progress(self, finished: int, total: int) -> None:
        """`Engine.generate` progress callback: (finished sequences, total)."""
        if finished > len(self.times):
            self.mark(finished - len(self.times))


class System(ABC):
    """A way to roll out a trace; the constructor loads the models."""

    @abstractmethod
    def generate(self, requests: Sequence[Request], sampling: SamplingConfig, clock: FinishClock) -> Generation:
        """Roll out `sampling.n` samples of every request; mark each finish on `clock`."""

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        """Untimed work on the trace itself before the timed run (default: none)."""

    def set_history(self, requests: Sequence[Request], history: dict[str, list[list[int]]] | None) -> None:
        """Before the timed run: history drafters forget the warm-up and, with `history`
        ({request_id: earlier outputs}), know the earlier rollout of each prompt (default: nothing)."""

    def close(self) -> None:
        """Release what the system holds outside this process (default: nothing)."""

    def external_cpu_s(self) -> float:
        """CPU seconds used so far by processes this system drives (counted as its own, not others')."""
        return 0.0

    def external_pids(self) -> list[int]:
        """Ids of the processes this system drives on this machine (default: none)."""
        return []


def resolve_local(name: str, dtype: str) -> Path:
    """The local directory of a model name or dir; never downloads (a benchmark measures, it does not fetch)."""
    from specactor_engine.model.registry import resolve_model

    return resolve_model(name, dtype, pull=False)


def load_target(spec: RunSpec) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of the spec's target in its dtype, for what runs it outside the engine; never downloads."""
    from transformers import AutoTokenizer

    from specactor_engine.model.runner import load_hf_model

    path = resolve_local(spec.target, spec.dtype)
    return load_hf_model(path, spec.dtype), AutoTokenizer.from_pretrained(path)
