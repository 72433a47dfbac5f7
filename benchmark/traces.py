"""Rollout traces of docs/benchmarking.md: which prompts, how many samples, how long, how sampled.

A trace is a frozen value; `with_overrides` derives a variant (a subset of prompts for the
batch-1 figures, greedy instead of temperature 1, another model pair) and `build_requests`
turns it into engine requests deterministically (reasoning-gym seeds, chat messages).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specactor_engine.config import SamplingConfig
from specactor_engine.types import Request


@dataclass(frozen=True)
class TaskPrompts:
    """`count` reasoning-gym items of `task` generated with dataset seed `seed`."""

    task: str
    count: int
    seed: int = 0


@dataclass(frozen=True)
class ModelPair:
    """Target model and its draft model (None: the model-free n-gram drafter)."""

    target: str
    drafter: str | None = None


MODEL_PAIRS = {
    "qwen-pair": ModelPair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    "smollm2": ModelPair("smollm2-135m-instruct", None),
    # SmolLM2 drafting for itself: every system, drafter workers included, runs on a fresh clone (smoke runs;
    # a draft step costs a target step, so this pair says nothing about speed)
    "smollm2-self": ModelPair("smollm2-135m-instruct", "smollm2-135m-instruct"),
}


@dataclass(frozen=True)
class Trace:
    """One workload: prompts x samples, stopping and sampling rules, default models."""

    name: str
    description: str
    prompts: tuple[TaskPrompts, ...]
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    model: ModelPair
    dtype: str
    top_p: float = 1.0
    seed: int = 0  # keys the sampling noise (hf: the torch seed)
    num_prompts: int | None = None  # a subset: the first N prompts, tasks taken in turn
    history_seed: int | None = None  # trace C: the seed of the earlier rollout its history drafters know
    max_batch_size: int | None = None  # rows decoded at once (continuous batching; vLLM max_num_seqs); None: all

    @property
    def needs_history(self) -> bool:
        return self.history_seed is not None

    @property
    def total_prompts(self) -> int:
        available = sum(p.count for p in self.prompts)
        return available if self.num_prompts is None else min(self.num_prompts, available)

    @property
    def num_sequences(self) -> int:
        return self.total_prompts * self.samples_per_prompt

    def with_overrides(self, **changes: Any) -> "Trace":
        """A copy with the non-None `changes` applied (unknown names raise TypeError)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        fields = dict(data)
        fields["prompts"] = tuple(TaskPrompts(**p) for p in fields["prompts"])
        fields["model"] = ModelPair(**fields["model"])
        return cls(**fields)


_TRACE_A_PROMPTS = (TaskPrompts("chain_sum", 4), TaskPrompts("basic_arithmetic", 4))
_TRACE_B_PROMPTS = (TaskPrompts("gsm_symbolic", 8), TaskPrompts("chain_sum", 8))

TRACES: dict[str, Trace] = {
    "A": Trace("A", "GRPO math on the real Qwen pair", _TRACE_A_PROMPTS, samples_per_prompt=4, max_new_tokens=256,
               temperature=1.0, model=MODEL_PAIRS["qwen-pair"], dtype="bfloat16"),
    "B": Trace("B", "long tail on SmolLM2", _TRACE_B_PROMPTS, samples_per_prompt=8, max_new_tokens=512,
               temperature=1.0, model=MODEL_PAIRS["smollm2"], dtype="float32"),
    # the next step of B: the same prompts, new samples (seed 1); history drafters know B's rollout (seed 0)
    "C": Trace("C", "B's prompts at the next step, with B's rollout as history", _TRACE_B_PROMPTS,
               samples_per_prompt=8, max_new_tokens=512, temperature=1.0, model=MODEL_PAIRS["smollm2"],
               dtype="float32", seed=1, history_seed=0),
    "G": Trace("G", "greedy on the real Qwen pair in fp32", _TRACE_A_PROMPTS, samples_per_prompt=1,
               max_new_tokens=256, temperature=0.0, model=MODEL_PAIRS["qwen-pair"], dtype="float32"),
    # the per-worker regime of a 2-core CPU: a few rows at a time sit under its compute ridge (~10 tokens per
    # forward) as 64-128 rows per GPU sit under an H100's (~300); docs/benchmarking.md section 2
    "D": Trace("D", "per-worker regime: A's first 4 prompts, at most 4 rows at a time", _TRACE_A_PROMPTS,
               samples_per_prompt=4, max_new_tokens=256, temperature=1.0, model=MODEL_PAIRS["qwen-pair"],
               dtype="bfloat16", num_prompts=4, max_batch_size=4),
    "quick": Trace("quick", "small SmolLM2 trace for smoke runs (SmolLM2 drafting for itself)",
                   (TaskPrompts("chain_sum", 2), TaskPrompts("basic_arithmetic", 2)), samples_per_prompt=4,
                   max_new_tokens=128, temperature=1.0, model=MODEL_PAIRS["smollm2-self"], dtype="float32"),
}


def get_trace(name: str) -> Trace:
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    return TRACES[name]


def trace_items(trace: Trace) -> list[dict[str, Any]]:
    """The trace's reasoning-gym items {id, question, answer, task}, tasks taken in turn.

    Interleaving keeps a prefix (`num_prompts`) balanced across tasks.
    """
    from tasks.prompts import reasoning_gym_items

    groups = [reasoning_gym_items(p.task, p.count, p.seed) for p in trace.prompts]
    depth = max(len(g) for g in groups)
    items = [g[i] for i in range(depth) for g in groups if i < len(g)]
    return items[: trace.total_prompts]


def build_requests(trace: Trace) -> list[Request]:
    """One chat request per prompt (docs/benchmarking.md instruction); samples come from `sampling.n`."""
    from tasks.prompts import build_prompt

    return [Request(request_id=item["id"], messages=build_prompt(item["question"])) for item in trace_items(trace)]


def sampling_config(trace: Trace) -> SamplingConfig:
    """Sampling shared by every system: EOS ends a sequence, no stop strings."""
    return SamplingConfig(temperature=trace.temperature, top_p=trace.top_p, top_k=0,
                          max_new_tokens=trace.max_new_tokens, n=trace.samples_per_prompt, seed=trace.seed)
