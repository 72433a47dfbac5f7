"""tasks/host.py: what a run's local Ray instance is sized for; the policy sync's bit-for-bit check."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specactor_engine.config import load_config
from specactor_engine.model.weights import load_named_weights, weights_digest
from tasks.host import local_ray_cpus, push_policy

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "train_smollm2.yaml"


def test_local_ray_holds_the_replicas_and_the_ranks_together(monkeypatch) -> None:
    """Replicas and ranks reserve their threads for the whole run: on 2 cores, 2 one-thread replicas and 2
    one-thread ranks need 4 logical CPUs, or the ranks wait forever for CPUs the replicas hold."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    both = ["rollout.replicas=2", "train.optim.world_size=2", "train.optim.zero_stage=2"]
    assert local_ray_cpus(load_config(CONFIG, both)) == 4
    assert local_ray_cpus(load_config(CONFIG, both), with_trainer=False) == 2  # `specactor rollout`: no ranks
    assert local_ray_cpus(load_config(CONFIG, [*both, "rollout.replica_threads=2", "train.optim.threads_per_rank=3"])) \
        == 2 * 2 + 2 * 3
    assert local_ray_cpus(load_config(CONFIG, ["rollout.replicas=3"])) == 3  # one thread each, more than the cores
    assert local_ray_cpus(load_config(CONFIG)) == 2  # neither: the cores


class _Engine:
    """The engine's side of a sync: a model held in its own dtype, loaded by `load_named_weights`."""

    def __init__(self, dtype: torch.dtype, broken: bool = False) -> None:
        self.runner = SimpleNamespace(model=nn.Linear(3, 2).to(dtype))
        self.broken = broken

    def update_weights(self, weights, version: int) -> None:
        if not self.broken:
            load_named_weights(self.runner.model, weights)


def _host(engine: _Engine) -> SimpleNamespace:
    torch.manual_seed(0)
    master = {"weight": torch.randn(2, 3) / 3, "bias": torch.randn(2) / 3}  # fp32 master weights
    return SimpleNamespace(engine=engine, trainer=SimpleNamespace(state_dict_for_sync=lambda: iter(master.items())))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_sync_checks_the_engine_against_the_trainer_weights_in_the_engine_dtype(dtype) -> None:
    """A bf16 engine beside fp32 master weights holds them rounded: the check compares with the trainer's weights
    rounded the same way (it refused every sync before), and still catches an engine that did not load them."""
    host = _host(_Engine(dtype))
    metrics = push_policy(host, 1)
    assert metrics["sync/policy_digest"] == weights_digest(host.engine.runner.model.named_parameters())[:16]
    assert host.engine.runner.model.weight.dtype == dtype
    with pytest.raises(RuntimeError, match="differ from the trainer's after sync to v2"):
        push_policy(_host(_Engine(dtype, broken=True)), 2)
