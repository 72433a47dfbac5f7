"""The summary `specactor train` prints: the per-step table with the step's time split, and the held-out
evaluation before and after training with the rollout speedup measured on the same prompts."""

from __future__ import annotations

from specactor.cli import _print_train_summary


def _step(step: int, **extra: float) -> dict:
    return {"step": step, "reward/mean": 0.3, "accuracy": 0.1, "rollout/mean_acceptance_length": 1.4,
            "train/loss": 0.01, "time/rollout_s": 7.0, "time/reward_s": 0.1, "time/update_s": 5.0,
            "time/sync_s": 1.0, **extra}


def _evaluation(version: int, reward: float, accuracy: float) -> dict:
    return {"eval/policy_version": version, "eval/reward/mean": reward, "eval/accuracy": accuracy,
            "eval/rollout_s": 4.0, "eval/mean_acceptance_length": 1.5, "eval/ar_rollout_s": 6.0,
            "eval/rollout_speedup": 1.5, "eval/identical": 1.0}


def test_the_summary_shows_steps_and_the_evaluation_before_and_after(capsys):
    result = {"run_dir": "runs/x", "wandb_dir": "runs/x/wandb", "steps": {
        0: {"step": 0, **_evaluation(0, 0.40, 0.12)}, 1: _step(1), 2: _step(2, **_evaluation(2, 0.55, 0.25))}}
    _print_train_summary(result)
    text = capsys.readouterr().out
    assert "update s" in text and "eval s" in text and "held-out evaluation" in text
    assert "held-out reward 0.400 -> 0.550, accuracy 0.12 -> 0.25 (policy v0 -> v2)" in text
    assert "rollout speedup over plain decoding on the held-out prompts (v2): 1.50x (6.0 s -> 4.0 s), outputs " \
           "identical: 100%" in text
    assert "│    0 │" not in text.split("held-out evaluation")[0]  # step 0 (an evaluation only) is no training row


def test_without_an_evaluation_only_the_steps_are_shown(capsys):
    _print_train_summary({"run_dir": "r", "wandb_dir": "w", "steps": {1: _step(1)}})
    text = capsys.readouterr().out
    assert "post-training -> r" in text and "held-out" not in text and "speedup" not in text


def test_a_run_whose_policy_never_speculated_says_so_and_one_that_did_does_not(capsys):
    """Acceptance length 1.00 throughout reads as drafts failing; the summary says the policy chose not to draft."""
    drafters = {"drafter/ngram/version": 0}
    off = {1: _step(1, **{"rollout/mean_verify_length": 0.01}, **drafters),
           2: _step(2, **{"rollout/mean_verify_length": 0.05}, **drafters)}
    _print_train_summary({"run_dir": "r", "wandb_dir": "w", "steps": off})
    text = capsys.readouterr().out
    assert "verify len" in text and "0.05" in text
    assert "speculation stayed off: the verify-length policy verified at most 0.05 draft tokens" in text
    on = {1: _step(1, **{"rollout/mean_verify_length": 0.01}, **drafters),
          2: _step(2, **{"rollout/mean_verify_length": 0.6}, **drafters)}
    _print_train_summary({"run_dir": "r", "wandb_dir": "w", "steps": on})
    assert "speculation stayed off" not in capsys.readouterr().out
    plain = {1: _step(1, **{"rollout/mean_verify_length": 0.0})}  # rollout.mode ar: no drafters, nothing to explain
    _print_train_summary({"run_dir": "r", "wandb_dir": "w", "steps": plain})
    assert "speculation stayed off" not in capsys.readouterr().out
