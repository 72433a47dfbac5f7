"""Starting the drafter workers of decoupled speculation, and what the engine holds of them.

The engine (and the benchmark's systems) get one `DrafterWorkers` value: the coordinator that
reaches the worker processes, how many torch threads the verifier keeps while they draft, and the
verifier's copy of the workers' draft model for the pipeline's drafter sync (sync.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from specactor_engine.config import DecoupledConfig, ModelConfig
from specactor_engine.decoupled.coordinator import DecoupledCoordinator
from specactor_engine.decoupled.sync import WorkerDrafterSync
from specactor_engine.decoupled.transport import LocalWorker, Transport, WorkerSpec


@dataclass
class DrafterWorkers:
    """Running drafter workers as the verifier sees them.

    verifier_threads: torch threads of the verifier while the workers draft (None: leave as is);
    sync: the verifier's copy of the workers' model, None where the workers were not started from a
    model directory (tests hand in a coordinator of their own).
    """

    coordinator: DecoupledCoordinator
    verifier_threads: int | None = None
    sync: WorkerDrafterSync | None = None

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self.coordinator.close()


def start_workers(settings: DecoupledConfig, model: ModelConfig, tokenizer: Any, vocab_size: int,
                  threads: int | None = None) -> DrafterWorkers:
    """Start `settings.workers` drafter workers running `settings.drafter`.

    threads: the machine's torch threads to share between the verifier and the workers (None: torch's
    current count). The workers load their model in the background; rounds run without their drafts
    until they are ready (the verifier never waits).
    """
    from transformers import AutoTokenizer

    from specactor_engine.drafters.model import check_same_tokenizer
    from specactor_engine.model.registry import resolve_model

    if settings.drafter is None:
        raise ValueError("drafter workers need rollout.decoupled.drafter (a draft model name or dir)")
    dtype = settings.dtype or model.dtype
    path = resolve_model(settings.drafter, dtype=dtype, cache_dir=model.cache_dir)
    check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(path), settings.drafter)
    spec = WorkerSpec(str(path), dtype, settings.worker_threads, vocab_size)
    total = threads or torch.get_num_threads()
    verifier_threads = settings.verifier_threads or max(total - settings.workers * settings.worker_threads, 1)
    make_transport: Callable[[int], Transport] = lambda index: LocalWorker(spec)  # noqa: E731
    if settings.transport == "ray":
        from specactor_engine.decoupled.ray_transport import RayWorker, ensure_ray

        ensure_ray(settings.ray_address, num_cpus=total)
        make_transport = lambda index: RayWorker(spec)  # noqa: E731
    coordinator = DecoupledCoordinator(make_transport, settings.workers, max_restarts=settings.max_restarts)
    return DrafterWorkers(coordinator, verifier_threads, WorkerDrafterSync(coordinator, spec.model_path, spec.dtype))
