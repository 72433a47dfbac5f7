"""The post-training flow with two rollout replicas (Ray actors on a local Ray instance): every sync leaves both
replicas holding the trainer's weights and the driver's drafters (recorded in the step's metrics), and the
rollouts are the records one in-process engine writes on the same run."""

from __future__ import annotations

import pytest

from tests.engine.test_replicas import local_ray  # noqa: F401 - fixture
from tests.fixtures.tiny_models import save_tiny_model
from tests.flows.test_post_training import flow_overrides, prefect_harness, toy_reward, write_toy_dataset  # noqa: F401

pytestmark = pytest.mark.slow
pytest.importorskip("ray")


def run_flow(tmp_path, name: str, model_dir, data, reward: str, replicas: int, evaluate: bool):
    from flows.post_training import post_training

    run_dir = tmp_path / name
    overrides = flow_overrides(model_dir, data, run_dir, reward, evaluate=evaluate) + [
        f"rollout.replicas={replicas}", "rollout.replica_threads=1"]
    post_training(config_path=None, overrides=overrides, release=False)
    return run_dir


def test_two_replicas_sync_every_step_and_roll_out_as_one_engine(tmp_path, local_ray, prefect_harness,  # noqa: F811
                                                                 toy_reward):  # noqa: F811
    from specactor_engine.model.weights import model_digest, weights_digest
    from specactor_engine.replicas.pool import ReplicaPool
    from tasks.run_dir import RunDir, read_jsonl
    from tasks.runtime import drop_host, get_host

    model_dir = save_tiny_model(tmp_path / "policy", "llama", seed=0)
    data = write_toy_dataset(tmp_path / "toy.jsonl")
    pooled = RunDir(run_flow(tmp_path, "pooled", model_dir, data, toy_reward, replicas=2, evaluate=True))
    try:
        host = get_host(str(pooled.root))
        assert isinstance(host.engine, ReplicaPool) and len(host.engine.replicas) == 2
        for step in (1, 2):
            metrics = pooled.read_metrics(step)
            assert metrics["sync/replicas"] == 2 and metrics["sync/replica_digests_equal"] == 1.0
            assert metrics["sync/replica_drafters_equal"] == 1.0 and metrics["policy_version_after"] == step
        assert pooled.read_metrics(2)["eval/identical"] == 1.0  # plain decoding on the replicas: the same outputs
        driver = weights_digest(host.engine.runner.model.named_parameters())
        assert host.engine.replica_digests() == [driver, driver]  # asked now, after the last sync
        assert model_digest(host.engine.runner.model) == model_digest(host.trainer.module)
    finally:
        drop_host(str(pooled.root))
    single = RunDir(run_flow(tmp_path, "single", model_dir, data, toy_reward, replicas=1, evaluate=False))
    drop_host(str(single.root))
    for step in (1, 2):
        assert read_jsonl(pooled.rollouts(step)) == read_jsonl(single.rollouts(step)), f"step {step}"
