"""Process-local hosts for a run's long-lived objects (the rollout engine, the trainer).

Prefect tasks pass only references (the run directory, step numbers, versions); the
engine and the DeepSpeed trainer stay alive here between steps, keyed by run directory,
for the life of the worker process. A resumed run in a new process rebuilds them from
the last published checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HOSTS: dict[str, "RunHost"] = {}


@dataclass
class RunHost:
    """What one run keeps in memory."""

    config: Any  # SpecActorConfig
    engine: Any  # specactor_engine.engine.Engine
    trainer: Any = None  # tasks.trainer.PolicyTrainer
    tokenizer: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


def _key(run_root: str | Path) -> str:
    return str(Path(run_root).resolve())


def get_host(run_root: str | Path) -> RunHost | None:
    return _HOSTS.get(_key(run_root))


def set_host(run_root: str | Path, host: RunHost) -> RunHost:
    _HOSTS[_key(run_root)] = host
    return host


def drop_host(run_root: str | Path) -> None:
    """Forget a run's objects; the engine's decoupled drafter workers (if any) are stopped."""
    host = _HOSTS.pop(_key(run_root), None)
    if host is not None and hasattr(host.engine, "close"):
        host.engine.close()
