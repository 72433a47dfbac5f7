"""The `post_training` flow: per step load -> rollout -> score -> update -> sync.

A plain function calling the tasks of tasks/pipeline.py in order. Heavy state lives in the run
directory and in the process-local host (tasks/runtime.py, built by tasks/host.py); tasks exchange
only paths, steps and metric dicts. Resuming: the flow starts at the first step that is not
complete (tasks/run_dir.py). A step is published (checkpoints/LATEST) only after its sync succeeded
and its metrics were written.

Held-out evaluation (`train.eval`): the initial policy is evaluated as step 0 (steps/000000/metrics.json
holds only the evaluation), the policy after the last step within that step (and after every
`train.eval.every`-th step), so `eval/*` keys sit in the metrics of the step whose policy they measure.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from specactor_engine.config import SpecActorConfig
from specactor_engine.files import atomic_write_text
from tasks.alarms import acceptance_alarms, raise_alarms
from tasks.pipeline import evaluate_step, load_prompts, run_rollout, score_rewards, sync_weights, update_policy
from tasks.run_dir import RunDir


@flow(name="post_training")
def post_training(config_path: str | None = None, overrides: Sequence[str] = (), release: bool = True
                  ) -> dict[str, Any]:
    """Run `train.steps` GRPO steps; returns the per-step metrics and where the files are.

    release=False keeps the engine and trainer in this process after the run (tests, notebooks).
    """
    from specactor_engine.config import config_to_yaml, load_config
    from tasks.runtime import drop_host
    from tasks.tracking import Tracker

    config = check_train_config(load_config(config_path, list(overrides)))
    run = RunDir(Path(config.train.run_dir).resolve())
    atomic_write_text(run.root / "config.yaml", config_to_yaml(config))
    root = str(run.root)
    logger = get_run_logger()
    load_prompts(root)
    tracker = Tracker(run.wandb_dir, config.train.wandb.project, config.train.wandb.mode, config.train.wandb.entity,
                      config.model_dump(mode="json"))
    history = {step: run.read_metrics(step) for step in run.completed_steps()}
    first = run.next_step()
    if first > 1:
        logger.info("resuming at step %d (steps 1..%d complete)", first, first - 1)
    evaluation = config.train.eval
    try:
        if evaluation.enabled and first == 1 and 0 not in history:  # the initial policy, before any update
            metrics = {"step": 0, **_timed("eval", evaluate_step, root, 0)}
            run.write_metrics(0, metrics)
            history[0] = metrics
            tracker.log(0, metrics)
            logger.info("evaluation of the initial policy: reward %.3f, accuracy %.2f",
                        metrics["eval/reward/mean"], metrics["eval/accuracy"])
        for step in range(first, config.train.steps + 1):
            metrics = _run_step(root, step)
            if evaluation.enabled and (step == config.train.steps or evaluation.every and step % evaluation.every == 0):
                metrics.update(_timed("eval", evaluate_step, root, step))  # the policy after this step's update
            alarms = acceptance_alarms(history.get(step - 1), metrics, config.train.drafter_sync.collapse_ratio)
            if alarms:
                raise_alarms(alarms, tracker)
                metrics["alarms"] = alarms
            run.write_metrics(step, metrics)
            run.publish(step)
            run.prune_training_states(keep=step)
            if config.train.keep_checkpoints is not None:
                run.prune_checkpoints(step, config.train.keep_checkpoints)
            history[step] = metrics
            tracker.log(step, metrics)
            _artifact(step, metrics)
    finally:
        tracker.finish()
        if release:
            drop_host(root)
    return {"run_dir": root, "wandb_dir": str(run.wandb_dir), "steps": history}


def check_train_config(config: SpecActorConfig) -> SpecActorConfig:
    """Everything that can be checked before any work: the train section and reward names."""
    from tasks.rewards import validate_reward_weights

    if config.train is None:
        raise ValueError("the config has no 'train' section; see configs/train_smollm2.yaml")
    validate_reward_weights(dict(config.train.rewards))
    return config


def _run_step(root: str, step: int) -> dict[str, Any]:
    """The step's tasks in order, with the wall time of each (time/<task>_s) and of the step (time/step_s)."""
    metrics: dict[str, Any] = {"step": step}
    for name, step_task in (("rollout", run_rollout), ("reward", score_rewards), ("update", update_policy),
                            ("sync", sync_weights)):
        metrics.update(_timed(name, step_task, root, step))
    metrics["time/step_s"] = sum(metrics[f"time/{name}_s"] for name in ("rollout", "reward", "update", "sync"))
    return metrics


def _timed(name: str, step_task: Any, root: str, step: int) -> dict[str, Any]:
    """The task's metrics and its wall time as time/<name>_s."""
    started = time.perf_counter()
    metrics = step_task(root, step)
    return {**metrics, f"time/{name}_s": time.perf_counter() - started}


def _artifact(step: int, metrics: dict[str, Any]) -> None:
    rows = [("reward (mean)", "reward/mean", "{:.3f}"), ("accuracy", "accuracy", "{:.3f}"),
            ("rollout makespan (s)", "rollout/makespan_s", "{:.1f}"),
            ("mean acceptance length", "rollout/mean_acceptance_length", "{:.2f}"),
            ("acceptance rate", "rollout/acceptance_rate", "{:.1%}"), ("loss", "train/loss", "{:.4f}")]
    lines = [f"# Step {step}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {label} | {fmt.format(metrics[key])} |" for label, key, fmt in rows if key in metrics]
    create_markdown_artifact(markdown="\n".join(lines), key=f"step-{step}", description=f"post-training step {step}")
