"""tasks/host.py: what a run's local Ray instance is sized for."""

from __future__ import annotations

from pathlib import Path

from specactor_engine.config import load_config
from tasks.host import local_ray_cpus

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
