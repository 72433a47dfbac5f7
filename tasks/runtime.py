"""Process-local hosts for a run's long-lived objects (the rollout engine, the trainer).

Prefect tasks pass only references (the run directory, step numbers, versions); the
engine and the DeepSpeed trainer stay alive here between steps, keyed by run directory,
for the life of the worker process. A resumed run in a new process rebuilds them from
the last published checkpoint (tasks/host.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specactor_engine.config import SpecActorConfig
    from specactor_engine.replicas import RolloutEngine
    from tasks.trainer import PolicyTrainer
    from tasks.trainer_ranks import RankedTrainer

_HOSTS: dict[str, RunHost] = {}


@dataclass
class RunHost:
    """What one run keeps in memory."""

    config: SpecActorConfig
    engine: RolloutEngine  # one in-process Engine, or a ReplicaPool (rollout.replicas > 1)
    tokenizer: Any  # the engine's Hugging Face tokenizer (saved into each checkpoint)
    trainer: PolicyTrainer | RankedTrainer | None = None  # the same interface, in process or on Ray ranks


def _key(run_root: str | Path) -> str:
    return str(Path(run_root).resolve())


def get_host(run_root: str | Path) -> RunHost | None:
    """The run's host in this process, if one was built."""
    return _HOSTS.get(_key(run_root))


def set_host(run_root: str | Path, host: RunHost) -> RunHost:
    """Keep `host` for the run (replacing any earlier one)."""
    _HOSTS[_key(run_root)] = host
    return host


def drop_host(run_root: str | Path) -> None:
    """Forget a run's objects; the engine's decoupled drafter workers and the trainer's Ray ranks (if any)
    are stopped."""
    host = _HOSTS.pop(_key(run_root), None)
    if host is not None and hasattr(host.engine, "close"):
        host.engine.close()
    if host is not None and hasattr(host.trainer, "close"):
        host.trainer.close()


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow or task run, else the module logger (unit tests of `.fn`)."""
    from prefect import get_run_logger

    try:
        return get_run_logger()
    except Exception:
        return logging.getLogger("specactor.pipeline")
