"""One rollout replica: an `Engine` in a Ray actor's process, and the drafter state it is sent.

The actor builds its engine from the config it is given (its own threads, drafters and drafter workers)
and answers every load with what it then holds: the target's parameter digest, each drafter's. Results
travel as pickled bytes, unpickled into memory the receiver owns (see decoupled/ray_transport.py for the
zero-copy pitfall this avoids).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from specactor_engine.model.weights import weights_digest

if TYPE_CHECKING:
    from specactor_engine.config import SpecActorConfig
    from specactor_engine.engine import Engine
    from specactor_engine.types import Request


@dataclass
class DrafterPayload:
    """Every drafter's weights (those with weights), non-weight state and version, as held by the driver."""

    weights: dict[str, dict[str, torch.Tensor]]  # drafter name -> its trainable model's parameters
    state_files: dict[str, bytes]  # what the drafters' save_state wrote (e.g. the suffix history), by file name
    versions: dict[str, int]


def drafter_payload(engine: Engine, names: Sequence[str] | None = None, with_state: bool = True) -> DrafterPayload:
    """The payload of `engine`'s drafters (`names`: only those)."""
    drafters = [d for d in engine.drafters if names is None or d.name in names]
    weights = {d.name: {key: value.detach().to("cpu").contiguous() for key, value in model.named_parameters()}
               for d in drafters if (model := d.trainable_model()) is not None}
    files: dict[str, bytes] = {}
    if with_state:
        with tempfile.TemporaryDirectory(prefix="specactor-drafters") as directory:
            for drafter in drafters:
                drafter.save_state(Path(directory))
            files = {str(p.relative_to(directory)): p.read_bytes() for p in Path(directory).rglob("*") if p.is_file()}
    return DrafterPayload(weights, files, {d.name: d.version for d in drafters})


def apply_drafter_payload(engine: Engine, payload: DrafterPayload) -> dict[str, str]:
    """Load a payload into `engine`'s drafters; return their weights' digests."""
    for name, weights in payload.weights.items():
        engine.update_weights(weights.items(), payload.versions[name], component=name)
    if payload.state_files:
        with tempfile.TemporaryDirectory(prefix="specactor-drafters") as directory:
            for name, data in payload.state_files.items():
                (Path(directory) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(directory) / name).write_bytes(data)
            for drafter in engine.drafters:
                if drafter.name in payload.versions:
                    drafter.load_state(Path(directory))
    for drafter in engine.drafters:
        if drafter.name in payload.versions:
            drafter.version = payload.versions[drafter.name]
    return drafter_digests(engine)


def drafter_digests(engine: Engine) -> dict[str, str]:
    """The parameter digest of every drafter with weights."""
    return {d.name: weights_digest(model.named_parameters()) for d in engine.drafters
            if (model := d.trainable_model()) is not None}


def target_digest(engine: Engine) -> str:
    return weights_digest(engine.runner.model.named_parameters())


class ReplicaActor:
    """The body of a replica's Ray actor (wrapped with `ray.remote` by the pool)."""

    def __init__(self, config: SpecActorConfig, policy_version: int) -> None:
        from specactor_engine.engine import Engine

        self.engine = Engine.from_config(config)  # sets this process's torch threads to config.threads
        self.engine.policy_version = policy_version
        self.kept: list[tuple[Any, Any]] = []

    def generate(self, requests: list[Request], sampling: Any, plain: bool) -> bytes:
        """`Engine.generate` (inside `plain_decoding` when `plain`); the RolloutResult pickled."""
        with self.engine.plain_decoding() if plain else contextlib.nullcontext():
            result = self.engine.generate(requests, sampling)
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)

    def reserve(self, requests: list[Request], sampling: Any) -> None:
        self.engine.reserve(requests, sampling)

    def load_target(self, weights: dict[str, torch.Tensor], version: int) -> str:
        """Load the target's weights as policy v<version>; answer with the digest of what it now holds."""
        self.engine.update_weights(weights.items(), version=version)
        return target_digest(self.engine)

    def load_drafters(self, payload: DrafterPayload) -> dict[str, str]:
        return apply_drafter_payload(self.engine, payload)

    def digests(self) -> tuple[str, dict[str, str]]:
        """(target digest, drafter digests) of what this replica holds."""
        return target_digest(self.engine), drafter_digests(self.engine)

    def set_policy_version(self, version: int) -> None:
        self.engine.policy_version = version

    def keep_history(self) -> None:
        """Snapshot the drafters' cross-rollout history (`Engine.history_kept`, across calls)."""
        self.kept = [(d, d.history_snapshot()) for d in self.engine.drafters]

    def restore_history(self) -> None:
        for drafter, snapshot in self.kept:
            if snapshot is not None:
                drafter.restore_history(snapshot)
        self.kept = []

    def pid(self) -> int:
        return os.getpid()

    def cpu_s(self) -> float:
        """CPU seconds this replica's process has used (every thread)."""
        return time.process_time()

    def close(self) -> None:
        self.engine.close()
