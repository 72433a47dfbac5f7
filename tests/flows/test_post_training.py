"""The post-training flow end to end on a tiny model, under a real Prefect test harness,
with DeepSpeed (ZeRO-2) updates and W&B offline logging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.rewards import REWARDS, register_reward
from tests.fixtures.tiny_models import save_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def toy_reward():
    """A reward with variance inside every group for a random model: share of distinct characters."""
    if "distinct_chars" not in REWARDS:
        @register_reward("distinct_chars")
        def distinct_chars(completions, **_):
            return [len(set(c)) / max(len(c), 1) for c in completions]
    return "distinct_chars"


def write_toy_dataset(path: Path, count: int = 16) -> Path:
    rows = [{"prompt": f"say {chr(97 + i % 4)}", "answer": chr(97 + i % 4)} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def flow_overrides(model_dir: Path, data: Path, run_dir: Path, reward: str, steps: int = 2,
                   evaluate: bool = False) -> list[str]:
    """The tiny flow's settings; evaluate: the held-out evaluation before and after (off: fewer rollouts)."""
    return [
        # fixed verify length: the acceptance figures these tests compare need every round to draft
        f"model.target={model_dir}", "model.max_model_len=64", "rollout.mode=coupled", "rollout.verify_length=fixed",
        "rollout.drafters=[{kind: ngram}, {kind: model, model: " + str(model_dir) + ", name: draft}]",
        "sampling.max_new_tokens=8", "sampling.n=4", "sampling.temperature=1.0",
        f"train.run_dir={run_dir}", f"train.steps={steps}", "train.prompts_per_step=4",
        "train.rewards={" + reward + ": 1.0}", "train.data.kind=jsonl", f"train.data.path={data}",
        "train.data.eval_fraction=0.25", "train.optim.lr=1.0e-3", "train.optim.zero_stage=2",
        "train.optim.micro_batch_size=8", "train.drafter_sync.distill_steps=2", f"train.eval.enabled={evaluate}",
    ]


def test_two_steps_update_sync_and_log(tmp_path, prefect_harness, toy_reward):
    from safetensors.torch import load_file

    from flows.post_training import post_training
    from specactor_engine.model.weights import model_digest
    from tasks.run_dir import RunDir, read_jsonl
    from tasks.runtime import drop_host, get_host

    model_dir = save_tiny_model(tmp_path / "policy", "llama", seed=0)
    data = write_toy_dataset(tmp_path / "toy.jsonl")
    run_dir = tmp_path / "run"
    result = post_training(config_path=None, overrides=flow_overrides(model_dir, data, run_dir, toy_reward,
                                                                      evaluate=True), release=False)
    run = RunDir(run_dir)
    try:
        assert sorted(result["steps"]) == [0, 1, 2] and run.latest_version() == 2
        # the held-out evaluation: the initial policy as step 0, the final one within the last step, each also
        # rolled out by plain decoding on the same prompts and noise, with identical outputs
        evaluations = {step: run.read_metrics(step) for step in (0, 1, 2)}
        assert evaluations[0]["eval/policy_version"] == 0 and evaluations[2]["eval/policy_version"] == 2
        assert "eval/reward/mean" not in evaluations[1] and "train/loss" not in evaluations[0]
        for step in (0, 2):
            metrics = evaluations[step]
            assert metrics["eval/prompts"] == 4 and metrics["eval/samples"] == 16
            assert metrics["eval/identical"] == 1.0 and metrics["eval/rollout_speedup"] > 0
            assert 0 <= metrics["eval/accuracy"] <= 1 and "eval/reward/mean" in metrics
            assert len(read_jsonl(run.step_dir(step) / "eval.jsonl")) == 16
        assert evaluations[2]["time/step_s"] == pytest.approx(sum(evaluations[2][f"time/{name}_s"] for name in
                                                                  ("rollout", "reward", "update", "sync")))
        # every trainable parameter changed in the first update
        initial = load_file(model_dir / "model.safetensors")
        updated = load_file(run.checkpoint(1) / "model.safetensors")
        unchanged = [name for name, tensor in initial.items() if torch.equal(tensor, updated[name])]
        assert not unchanged, unchanged
        # rollouts carry the policy version that produced them
        assert {r["policy_version"] for r in read_jsonl(run.rollouts(1))} == {0}
        assert {r["policy_version"] for r in read_jsonl(run.rollouts(2))} == {1}
        assert all("draft" in r["drafter_versions"] for r in read_jsonl(run.rollouts(2)))
        # after the last sync the engine holds the trainer's weights bit for bit ...
        host = get_host(str(run.root))
        assert model_digest(host.engine.runner.model) == model_digest(host.trainer.module)
        # ... and its logprobs match the trainer's recomputation
        check_logprobs_match(host)
        # W&B offline run holds the step metrics
        history = wandb_history(run.wandb_dir)
        assert [row["step"] for row in history] == [0, 1, 2]
        assert "eval/reward/mean" in history[0] and "eval/reward/mean" in history[-1]
        summary = history[-1]
        for key in ("time/rollout_s", "time/reward_s", "time/update_s", "time/sync_s", "time/step_s", "reward/mean", "reward/std", "accuracy", "train/loss", "train/kl", "train/grad_norm", "train/lr",
                    "rollout/makespan_s", "rollout/tail_s", "rollout/tokens_per_s", "rollout/mean_acceptance_length",
                    "drafter/draft/acceptance_rate", "policy_version", "rollout/mean_verify_length",
                    "rollout/draft_supply", "rollout/accept_rate_pos1", "drafter/draft/ms_per_drafted_token"):
            assert key in summary, key
    finally:
        drop_host(str(run.root))


def check_logprobs_match(host) -> None:
    from specactor_engine.config import SamplingConfig
    from specactor_engine.types import Request
    from tasks.trainer import RolloutBatch

    requests = [Request(f"p{i}", prompt=f"say {c}") for i, c in enumerate("abcd")]
    outputs = host.engine.generate(requests, SamplingConfig(temperature=1.0, max_new_tokens=8, n=2, seed=3)).outputs
    batch = RolloutBatch(prompt_token_ids=[o.prompt_token_ids for o in outputs],
                         output_token_ids=[o.token_ids for o in outputs],
                         old_logprobs=[o.logprobs for o in outputs], advantages=[0.0] * len(outputs))
    for engine_lp, trainer_lp in zip([o.logprobs for o in outputs], host.trainer.logprobs(batch)):
        assert torch.allclose(torch.tensor(engine_lp), torch.tensor(trainer_lp), atol=1e-4)


def wandb_history(wandb_dir: Path) -> list[dict]:
    from tests.flows.wandb_reader import read_history

    files = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {wandb_dir}"
    return read_history(files[-1])


def test_a_feature_drafter_is_refreshed_against_each_new_policy_and_saved(tmp_path, prefect_harness, toy_reward):
    """The feature-level drafter in the pipeline: after each policy update the drafter sync trains it against the
    new policy's own features (a few bounded steps), and its weights are saved beside every checkpoint."""
    from safetensors.torch import load_file

    from flows.post_training import post_training
    from tasks.run_dir import RunDir
    from tasks.runtime import drop_host

    model_dir = save_tiny_model(tmp_path / "policy", "llama", seed=0)
    data = write_toy_dataset(tmp_path / "toy.jsonl")
    run_dir = tmp_path / "run"
    overrides = [o for o in flow_overrides(model_dir, data, run_dir, toy_reward) if not o.startswith("rollout.drafters")]
    post_training(config_path=None, overrides=[*overrides, "rollout.drafters=[{kind: feature, name: feature}]"],
                  release=False)
    run = RunDir(run_dir)
    try:
        first = load_file(run.checkpoint(1) / "drafters" / "feature.safetensors")
        second = load_file(run.checkpoint(2) / "drafters" / "feature.safetensors")
        assert "fc.weight" in first and any(not torch.equal(first[n], second[n]) for n in first)
        summary = wandb_history(run.wandb_dir)[-1]
        assert summary["drafter/feature/feature_distill_steps"] == 2.0
        assert "drafter/feature/acceptance_rate" in summary
    finally:
        drop_host(str(run.root))
