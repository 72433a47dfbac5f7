"""Resume, crash safety, speculation switch, drafter sync and bad input of the post-training flow."""

from __future__ import annotations

import pytest
import torch

from tests.flows.test_post_training import flow_overrides, prefect_harness, toy_reward, write_toy_dataset  # noqa: F401
from tests.fixtures.tiny_models import save_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("policy"), "llama", seed=0)


@pytest.fixture()
def data(tmp_path):
    return write_toy_dataset(tmp_path / "toy.jsonl")


def run_flow(overrides, **kwargs):
    from flows.post_training import post_training

    return post_training(config_path=None, overrides=overrides, **kwargs)


def test_resume_does_not_recompute_a_completed_step(tmp_path, prefect_harness, toy_reward, policy_dir, data):
    from safetensors.torch import load_file

    from tasks.run_dir import RunDir, read_jsonl
    from tasks.runtime import drop_host, get_host

    run = RunDir(tmp_path / "run")
    run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=1, evaluate=True))
    rollouts_before = run.rollouts(1).read_bytes()
    stamp = run.rollouts(1).stat().st_mtime_ns
    initial_eval = run.metrics(0).read_bytes()
    saved_drafter = load_file(run.checkpoint(1) / "drafters" / "draft.safetensors")
    result = run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=2, evaluate=True), release=False)
    try:
        assert sorted(result["steps"]) == [0, 1, 2]
        assert run.rollouts(1).stat().st_mtime_ns == stamp and run.rollouts(1).read_bytes() == rollouts_before
        assert run.metrics(0).read_bytes() == initial_eval  # the initial policy's evaluation is not redone
        assert run.read_metrics(2)["eval/policy_version"] == 2
        assert run.latest_version() == 2
        # the resumed process started from the distilled drafter of v1, not the original weights
        assert {r["drafter_versions"]["draft"] for r in read_jsonl(run.rollouts(2))} == {1}
        assert not torch.equal(saved_drafter["model.norm.weight"], load_file(policy_dir / "model.safetensors")["model.norm.weight"])
        drafter = next(d for d in get_host(str(run.root)).engine.drafters if d.name == "draft")
        final = load_file(run.checkpoint(2) / "drafters" / "draft.safetensors")
        assert all(torch.equal(p, final[n]) for n, p in drafter.runner.model.named_parameters())
    finally:
        drop_host(str(run.root))


def test_keep_checkpoints_deletes_older_ones_and_the_run_still_resumes(tmp_path, prefect_harness, toy_reward, policy_dir,
                                                                     data):
    """train.keep_checkpoints 1: after each step only the published checkpoint is left, and a later command resumes
    from it."""
    from tasks.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    keep = ["train.keep_checkpoints=1"]
    run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=2) + keep)
    assert sorted(p.name for p in (run.root / "checkpoints").glob("v*")) == ["v000002"] and run.latest_version() == 2
    result = run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=3) + keep)
    assert sorted(result["steps"]) == [1, 2, 3] and run.latest_version() == 3
    assert sorted(p.name for p in (run.root / "checkpoints").glob("v*")) == ["v000003"]


def test_crash_mid_step_keeps_the_last_checkpoint(tmp_path, prefect_harness, toy_reward, policy_dir, data,
                                                 monkeypatch):
    from transformers import AutoModelForCausalLM

    from tasks import trainer as trainer_module
    from tasks.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    calls = {"n": 0}

    real = trainer_module.PolicyTrainer.save_checkpoint

    def crash_on_second(self, directory):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated crash while saving checkpoint v2")
        return real(self, directory)

    monkeypatch.setattr(trainer_module.PolicyTrainer, "save_checkpoint", crash_on_second)
    with pytest.raises(Exception, match="simulated crash"):
        run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=2))
    assert run.latest_version() == 1 and run.next_step() == 2
    AutoModelForCausalLM.from_pretrained(run.checkpoint(1))  # the published checkpoint loads
    monkeypatch.setattr(trainer_module.PolicyTrainer, "save_checkpoint", real)
    result = run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=2))
    assert sorted(result["steps"]) == [1, 2] and run.latest_version() == 2


def test_speculation_switch_keeps_first_step_rollouts_identical(tmp_path, prefect_harness, toy_reward,
                                                                policy_dir, data):
    from tasks.run_dir import RunDir, read_jsonl

    def first_step(name, speculation):
        run = RunDir(tmp_path / name)
        overrides = flow_overrides(policy_dir, data, run.root, toy_reward, steps=1)
        run_flow(overrides + [f"train.speculation={str(speculation).lower()}"])
        return [(r["id"], r["sample"], r["token_ids"]) for r in read_jsonl(run.rollouts(1))]

    assert first_step("spec", True) == first_step("plain", False)


def test_drafter_sync_keeps_acceptance_and_broken_sync_raises_the_alarm(tmp_path, prefect_harness, toy_reward,
                                                                      policy_dir, data, monkeypatch):
    import tasks.alarms
    import tasks.drafter_store

    overrides = flow_overrides(policy_dir, data, tmp_path / "good", toy_reward, steps=2) + [
        "train.optim.lr=1.0e-4", "train.drafter_sync.distill_steps=2", "train.drafter_sync.distill_lr=1.0e-5"]
    steps = run_flow(overrides)["steps"]
    before, after = (steps[s]["drafter/draft/acceptance_rate"] for s in (1, 2))
    assert before > 0.5 and after >= 0.9 * before, (before, after)
    assert "alarms" not in steps[2]

    def broken_refresh(host, records, version):
        for drafter in host.engine.drafters:
            if drafter.trainable_model() is not None:
                with torch.no_grad():
                    for param in drafter.trainable_model().parameters():
                        param.copy_(torch.randn_like(param))
            drafter.version = version
        return {}

    monkeypatch.setattr(tasks.drafter_store, "refresh_drafters", broken_refresh)
    with pytest.warns(tasks.alarms.DrafterCollapseWarning, match="draft: acceptance"):
        broken = run_flow(flow_overrides(policy_dir, data, tmp_path / "broken", toy_reward, steps=2))["steps"]
    assert any(alarm.startswith("draft:") for alarm in broken[2]["alarms"])


def test_decoupled_run_syncs_the_workers_drafter(tmp_path, prefect_harness, toy_reward, policy_dir, data):
    """Mode decoupled: after each update the verifier's copy of the workers' drafter is distilled, saved
    beside the checkpoint and loaded by every worker (digest-checked); a resumed run pushes it again."""
    from safetensors.torch import load_file

    from specactor_engine.model.weights import weights_digest
    from tasks.run_dir import RunDir, read_jsonl
    from tasks.runtime import drop_host, get_host

    run = RunDir(tmp_path / "run")
    decoupled = ["rollout.mode=decoupled", f"rollout.decoupled.drafter={policy_dir}", "rollout.decoupled.dynamic=false"]
    first = run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=1) + decoupled)["steps"][1]
    assert first["drafter/decoupled/synced_workers"] == 1.0 and first["drafter/decoupled/distill_steps"] > 0
    saved = load_file(run.checkpoint(1) / "drafters" / "decoupled.safetensors")
    initial = load_file(policy_dir / "model.safetensors")
    assert not torch.equal(saved["model.norm.weight"], initial["model.norm.weight"])  # distilled, not the original

    resumed = run_flow(flow_overrides(policy_dir, data, run.root, toy_reward, steps=2) + decoupled, release=False)
    try:
        assert sorted(resumed["steps"]) == [1, 2]
        assert {r["drafter_versions"]["decoupled"] for r in read_jsonl(run.rollouts(2))} == {1}
        engine = get_host(str(run.root)).engine
        final = load_file(run.checkpoint(2) / "drafters" / "decoupled.safetensors")
        copy = dict(engine.worker_drafter.model.named_parameters())
        assert all(torch.equal(copy[name], tensor) for name, tensor in final.items())
        assert [w.weights.digest for w in engine.coordinator.workers] == [weights_digest(copy.items())]
    finally:
        drop_host(str(run.root))


def test_bad_input_fails_before_any_work(tmp_path, policy_dir):
    from flows.post_training import check_train_config
    from specactor_engine.config import ConfigError, DataConfig, load_config
    from tasks.data import DataError, load_prompt_dataset

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "2+2", "answer": "4"}\n')
    with pytest.raises(DataError, match="prompt"):
        load_prompt_dataset(DataConfig(kind="jsonl", path=str(bad)))
    with pytest.raises(ValueError, match="unknown reward"):
        check_train_config(load_config(None, [f"model.target={policy_dir}", "train.rewards={nope: 1.0}"]))
    with pytest.raises(ConfigError, match="float16"):
        load_config(None, ["train.optim.dtype=float16"])


def test_evaluate_flow_scores_the_published_policy(tmp_path, prefect_harness, toy_reward, policy_dir, data):
    from flows.evaluate import evaluate

    overrides = flow_overrides(policy_dir, data, tmp_path / "run", toy_reward, steps=1)
    run_flow(overrides)
    metrics = evaluate(config_path=None, overrides=overrides)
    assert metrics["eval/policy_version"] == 1 and metrics["eval/prompts"] == 4
    assert 0.0 <= metrics["eval/reward_mean"] <= 1.0
    assert (tmp_path / "run" / "eval" / "v000001.jsonl").exists()
