"""Exact resume: a run SIGKILLed mid-step and run again with the same command equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.fixtures.state import differing_tensors, flat_tensors
from tests.fixtures.tiny_models import save_tiny_model
from tests.flows.test_post_training import flow_overrides, prefect_harness, toy_reward, write_toy_dataset  # noqa: F401

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# the flow in a child process, with the toy reward the tests register (tests/flows/test_post_training.py)
_CHILD = """
import json, sys
import torch
from tasks.rewards import register_reward
register_reward("distinct_chars")(lambda completions, **_: [len(set(c)) / max(len(c), 1) for c in completions])
torch.set_num_threads(1)
from flows.post_training import post_training
post_training(config_path=None, overrides=json.loads(sys.argv[1]))
"""
# the metrics that must repeat exactly: rewards, the update's figures (not timings, acceptance or drafter figures)
_DETERMINISTIC = ("reward/", "accuracy", "train/", "policy_version")


def _kill_during(overrides: list[str], marker: Path, timeout_s: float = 300) -> None:
    """Run the flow in a child process and SIGKILL it as soon as `marker` exists."""
    from prefect.settings import PREFECT_API_URL

    # not this process's W&B service (WANDB_SERVICE, set by an earlier test's run): a killed child would leave its
    # run registered there, and the resumed run's init in this process would find the id "in use". A user's
    # `specactor train` starts its own service, as the child now does.
    inherited = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env = {**inherited, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PREFECT_API_URL": PREFECT_API_URL.value()}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(overrides)], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    try:
        while not marker.exists():
            if child.poll() is not None:
                raise AssertionError(f"the flow ended (rc {child.returncode}) before {marker} appeared:\n"
                                     + child.stderr.read().decode()[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError(f"{marker} did not appear in {timeout_s} s")
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()


def _weights_at(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(checkpoint / "model.safetensors")


def _rollouts(run) -> dict[int, list[tuple]]:
    from tasks.run_dir import read_jsonl

    return {step: [(r["id"], r["sample"], r["token_ids"], r["logprobs"]) for r in read_jsonl(run.rollouts(step))]
            for step in run.completed_steps()}


def test_a_run_killed_mid_step_and_resumed_equals_an_uninterrupted_run(tmp_path, prefect_harness, toy_reward):
    """float32 ZeRO-0 (the `make run` default), a KL term (its reference must stay the initial policy) and
    speculation with an n-gram and a model drafter; 4 steps of 2 prompts x 4 samples. The run is SIGKILLed as
    soon as step 3's rollouts are on disk, then run again: every step's rollouts (token ids and logprobs), rewards
    and update metrics, the final weights and the optimizer state equal the uninterrupted run's bit for bit."""
    from flows.post_training import post_training
    from tasks.run_dir import RunDir
    from tasks.runtime import drop_host, get_host

    policy = save_tiny_model(tmp_path / "policy", "llama", seed=0)
    data = write_toy_dataset(tmp_path / "toy.jsonl")

    def overrides(run_dir: Path) -> list[str]:
        return flow_overrides(policy, data, run_dir, toy_reward, steps=4) + [
            "train.prompts_per_step=2", "train.optim.zero_stage=0", "train.optim.dtype=float32",
            "train.optim.kl_coef=0.05", "train.optim.lr=3.0e-3"]

    whole, resumed = RunDir(tmp_path / "whole"), RunDir(tmp_path / "resumed")
    _kill_during(overrides(resumed.root), resumed.rollouts(3))
    assert resumed.latest_version() == 2 and resumed.next_step() == 3  # killed within step 3
    try:
        post_training(config_path=None, overrides=overrides(resumed.root), release=False)
        post_training(config_path=None, overrides=overrides(whole.root), release=False)
        assert resumed.completed_steps() == whole.completed_steps() == [1, 2, 3, 4]
        for step in range(1, 5):
            got, want = resumed.read_metrics(step), whole.read_metrics(step)
            assert {k: v for k, v in got.items() if k.startswith(_DETERMINISTIC)} == {
                k: v for k, v in want.items() if k.startswith(_DETERMINISTIC)}, step
            assert resumed.scores(step).read_bytes() == whole.scores(step).read_bytes(), step
        assert whole.read_metrics(4)["train/kl"] > 0
        assert _rollouts(resumed) == _rollouts(whole)
        assert not differing_tensors(_weights_at(resumed.checkpoint(4)), _weights_at(whole.checkpoint(4)))
        trainers = [get_host(str(run.root)).trainer for run in (resumed, whole)]
        assert not differing_tensors(*(dict(t.state_dict_for_sync()) for t in trainers))
        optimizer_states = [flat_tensors(t.engine.optimizer.state_dict()) for t in trainers]
        assert any("exp_avg_sq" in key for key in optimizer_states[0])
        assert not differing_tensors(*optimizer_states)
        assert [p.name for p in resumed.root.glob("checkpoints/v*/trainer")] == ["trainer"]  # the published one's
        assert (resumed.checkpoint(4) / "trainer").is_dir()
    finally:
        drop_host(str(resumed.root))
        drop_host(str(whole.root))


def _die_at_the_update(rank) -> None:
    """In a training rank's process: SIGKILL itself when its optimizer step begins (mid-update)."""
    rank.trainer.engine.step = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)


def test_a_training_rank_killed_mid_step_is_redone_on_resume(tmp_path, prefect_harness, toy_reward):
    """train.optim.world_size=2 (Ray actors, ZeRO-2): rank 1 is SIGKILLed within step 2's update. The flow
    fails, v2 is not published; the same command again redoes step 2, which equals an uninterrupted run's."""
    import ray

    from flows.post_training import post_training
    from specactor_engine.decoupled.ray_transport import ensure_ray
    from tasks.run_dir import RunDir
    from tasks.runtime import drop_host, get_host
    from tasks.trainer_ranks import TrainerRankError

    ray_dir = tempfile.mkdtemp(prefix="ray-")  # a short path: Ray's sockets live there
    ensure_ray(num_cpus=2, temp_dir=ray_dir)
    policy = save_tiny_model(tmp_path / "policy", "llama", seed=0)
    data = write_toy_dataset(tmp_path / "toy.jsonl")

    def overrides(run_dir: Path, steps: int = 2) -> list[str]:
        return flow_overrides(policy, data, run_dir, toy_reward, steps=steps) + [
            "train.prompts_per_step=2", "train.optim.world_size=2", "train.optim.threads_per_rank=1"]

    whole, resumed = RunDir(tmp_path / "whole"), RunDir(tmp_path / "resumed")
    try:
        post_training(config_path=None, overrides=overrides(resumed.root, steps=1), release=False)
        ranks = get_host(str(resumed.root)).trainer._ranks
        ray.get(ranks[1].__ray_call__.remote(_die_at_the_update))
        with pytest.raises(TrainerRankError, match="in step"):
            post_training(config_path=None, overrides=overrides(resumed.root))  # releases the host and its ranks
        assert resumed.latest_version() == 1 and resumed.next_step() == 2 and not resumed.metrics(2).exists()
        post_training(config_path=None, overrides=overrides(resumed.root))
        post_training(config_path=None, overrides=overrides(whole.root))
        for step in (1, 2):
            got, want = resumed.read_metrics(step), whole.read_metrics(step)
            assert {k: v for k, v in got.items() if k.startswith(_DETERMINISTIC)} == {
                k: v for k, v in want.items() if k.startswith(_DETERMINISTIC)}, step
        assert _rollouts(resumed) == _rollouts(whole)
        assert not differing_tensors(_weights_at(resumed.checkpoint(2)), _weights_at(whole.checkpoint(2)))
    finally:
        drop_host(str(resumed.root))
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
