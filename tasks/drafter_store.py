"""Drafter weights across policy versions: refreshed on each step's rollouts, saved beside each
checkpoint, loaded again on resume.

The drafters with weights are those whose `trainable_model()` is not None (model drafters), plus,
in decoupled mode, the verifier's copy of the drafter workers' model (`engine.worker_drafter`),
which the workers load from the file saved beside the checkpoint. With rollout replicas, these are the
pool's driver drafters: refreshed once there, then loaded by every replica (`push_replica_drafters`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from specactor_engine.engine import Engine
    from tasks.runtime import RunHost

DRAFTERS_DIR = "drafters"


def drafter_file(checkpoint: Path, name: str) -> Path:
    """Where the weights of drafter `name` are saved beside checkpoint `checkpoint`."""
    return checkpoint / DRAFTERS_DIR / f"{name.replace('/', '_').replace(':', '_')}.safetensors"


def trainable_models(engine: Engine) -> list[tuple[str, nn.Module]]:
    """(name, module) of every drafter with weights: in-process drafters first, then the workers' copy."""
    models = [(d.name, model) for d in engine.drafters if (model := d.trainable_model()) is not None]
    if engine.worker_drafter is not None:
        models.append((engine.worker_drafter.name, engine.worker_drafter.model))
    return models


def refresh_drafters(host: RunHost, records: list[dict[str, Any]], version: int) -> dict[str, float]:
    """Drafters with weights: distil on the step's rollouts (bounded); every in-process drafter: bump its version.
    Feature-level drafters train against the new policy's own features (training/feature_distill.py), the
    others on its top-k distributions (training/distill.py)."""
    from specactor_engine.training.distill import distill_on_rollouts

    sync = host.config.train.drafter_sync
    sequences = [(r["prompt_token_ids"], r["token_ids"]) for r in records if r["token_ids"]]
    metrics = _refresh_feature_drafters(host, sequences)
    feature = {d.name for d in host.engine.drafters if d.needs_target}
    models = [(name, model) for name, model in trainable_models(host.engine) if name not in feature]
    soft = None
    if sync.soft_top_k and sequences and models:
        from specactor_engine.training.teacher import teacher_topk

        started = time.perf_counter()  # the engine holds the new policy already: its distributions on the rollouts
        soft = teacher_topk(host.engine.runner.model, sequences, sync.soft_top_k)
        metrics["sync/teacher_seconds"] = time.perf_counter() - started
    for name, model in models:
        result = distill_on_rollouts(model, sequences, sync.budget(), soft)
        metrics.update({f"drafter/{name}/{key}": value for key, value in result.items()})
    for drafter in host.engine.drafters:
        if drafter.name not in feature and drafter.trainable_model() is not None:
            drafter.weights_changed()
        drafter.version = version
    return metrics


def _refresh_feature_drafters(host: RunHost, sequences: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """Each feature-level drafter: a bounded distillation against the updated policy's features on the rollouts."""
    from specactor_engine.drafters.feature import FeatureDrafter
    from specactor_engine.training.feature_distill import FeatureDistillBudget, distill_features

    budget = host.config.train.drafter_sync.budget()
    metrics: dict[str, float] = {}
    for drafter in host.engine.drafters:
        if not isinstance(drafter, FeatureDrafter) or drafter.model is None or not sequences:
            continue
        result = distill_features(drafter.model, host.engine.runner.model, sequences,
                                  FeatureDistillBudget(max_steps=budget.max_steps, max_seconds=budget.max_seconds,
                                                       batch_size=budget.batch_size, lr=budget.lr, seed=budget.seed,
                                                       passes=drafter.model.trained_passes),
                                  vocab_ids=drafter.head_token_ids())
        drafter.weights_changed()
        metrics.update({f"drafter/{drafter.name}/{key}": value for key, value in result.items()})
    return metrics


def save_drafters(host: RunHost, checkpoint: Path) -> None:
    """Every drafter's non-weight state and the weights of those with weights, next to the policy checkpoint."""
    from safetensors.torch import save_file

    for drafter in host.engine.drafters:
        drafter.save_state(checkpoint / DRAFTERS_DIR)  # e.g. the suffix drafter's rollout history
    for name, model in trainable_models(host.engine):
        path = drafter_file(checkpoint, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({key: value.contiguous() for key, value in model.named_parameters()}, path)


def push_worker_drafter(host: RunHost, checkpoint: Path, version: int) -> dict[str, float]:
    """Decoupled: the workers load the refreshed drafter saved beside checkpoint v<version>."""
    workers = host.engine.worker_drafter
    if workers is None:
        return {}
    return workers.push(drafter_file(checkpoint, workers.name), version)


def push_replica_drafters(host: RunHost) -> dict[str, float]:
    """Rollout replicas: every replica loads the driver's drafters (refreshed there once, so all are the same)."""
    from specactor_engine.replicas.pool import ReplicaPool

    return host.engine.sync_drafters() if isinstance(host.engine, ReplicaPool) else {}


def load_drafters(host: RunHost, checkpoint: Path, version: int) -> None:
    """Load the drafter weights and state saved beside checkpoint v<version>, where they exist."""
    from safetensors.torch import load_file

    for drafter in host.engine.drafters:
        path = drafter_file(checkpoint, drafter.name)
        if path.exists():
            host.engine.update_weights(load_file(path).items(), version=version, component=drafter.name)
        drafter.load_state(checkpoint / DRAFTERS_DIR)
        drafter.version = version
    workers = host.engine.worker_drafter
    if workers is not None and drafter_file(checkpoint, workers.name).exists():
        workers.load_file(drafter_file(checkpoint, workers.name))
        workers.push(drafter_file(checkpoint, workers.name), version)
    push_replica_drafters(host)


def load_initial_drafters(host: RunHost) -> None:
    """Put every drafter with weights back to the model its config names (policy v0)."""
    from safetensors.torch import load_file

    from specactor_engine.model.registry import resolve_model

    model = host.config.model
    from specactor_engine.drafters.feature import FeatureDrafter

    for drafter, spec in zip(host.engine.drafters, host.config.rollout.drafters):
        if isinstance(drafter, FeatureDrafter):
            drafter.reset_weights()  # from its path, or fresh from the target
        elif drafter.trainable_model() is not None:
            path = resolve_model(spec.model, spec.dtype or model.dtype, model.cache_dir)
            host.engine.update_weights(load_file(Path(path) / "model.safetensors").items(), 0, drafter.name)
        drafter.version = 0
    workers = host.engine.worker_drafter
    if workers is not None:
        workers.load_file(workers.initial_weights())
        workers.push(workers.initial_weights(), 0)
    push_replica_drafters(host)
