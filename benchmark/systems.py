"""The systems compared by the benchmark: one registry, built from the tables of variants.

Engine systems are rows of `ENGINE_VARIANTS` (benchmark/engine_systems.py), vLLM systems rows of
`VLLM_VARIANTS` (benchmark/vllm_system.py); only what really differs has a class of its own
(`hf`, vLLM's driver process, the oracle's reference plumbing). A new engine configuration is one
row, not a subclass. Every system implements `System` (benchmark/interface.py) and is built from a
`RunSpec`; `NAME@K` (benchmark/run.py) runs a row at draft length K through the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from benchmark.engine_systems import ENGINE_VARIANTS, EngineSystem, EngineVariant
from benchmark.hf_system import HFGenerate
from benchmark.interface import FinishClock, Generation, RunSpec, SequenceResult, System
from benchmark.oracle import OracleDrafter, OracleSystem, load_references, write_references
from benchmark.vllm_system import VLLM_VARIANTS, VLLMSystem, vllm_available

__all__ = ["SYSTEMS", "FinishClock", "Generation", "OracleDrafter", "RunSpec", "SequenceResult", "System",
           "SystemEntry", "build_system", "load_references", "system_unavailable", "write_references"]


def _runs_anywhere() -> str | None:
    return None


@dataclass(frozen=True)
class SystemEntry:
    """What the harness needs of a system before running it: how to build it from a spec, whether
    `ar` must run first (its outputs are the oracle's drafts), and why it cannot run on this machine
    (checked before a plan starts, so a missing vLLM is reported instead of failing the run)."""

    build: Callable[[RunSpec], System]
    needs_reference: bool = False
    unavailable: Callable[[], str | None] = _runs_anywhere


def _engine_entry(variant: EngineVariant) -> SystemEntry:
    """An engine row: the oracle rows need their references plumbed in, every other row is configuration."""
    system = OracleSystem if variant.needs_reference else EngineSystem
    return SystemEntry(partial(system, variant), needs_reference=variant.needs_reference)


SYSTEMS: dict[str, SystemEntry] = {
    "hf": SystemEntry(HFGenerate),
    **{variant.name: _engine_entry(variant) for variant in ENGINE_VARIANTS},
    **{variant.name: SystemEntry(partial(VLLMSystem, variant), unavailable=vllm_available)
       for variant in VLLM_VARIANTS},
}


def build_system(spec: RunSpec) -> System:
    """Build (and load the models of) the spec's system."""
    if spec.system not in SYSTEMS:
        raise ValueError(f"unknown system {spec.system!r}; known: {', '.join(SYSTEMS)}")
    return SYSTEMS[spec.system].build(spec)


def system_unavailable(name: str) -> str | None:
    """Why system `name` cannot run here (None: it can); checked before a plan starts."""
    entry = SYSTEMS.get(name)
    return entry.unavailable() if entry is not None else None
