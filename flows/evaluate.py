"""The `evaluate` flow: greedy rollouts of the held-out prompts at the run's latest policy, scored."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from specactor_engine.files import atomic_write_text
from tasks.run_dir import RunDir, read_jsonl, write_jsonl


@task(name="evaluate_policy")
def evaluate_policy(run_root: str, limit: int | None) -> dict[str, Any]:
    """Greedy rollout of the eval split with the published policy; reward and accuracy."""
    from specactor_engine.config import load_config
    from specactor_engine.types import Request
    from tasks.host import build_host
    from tasks.metrics import accuracy
    from tasks.rewards import combine_rewards

    run = RunDir(Path(run_root))
    config = load_config(run.root / "config.yaml")
    host = build_host(run_root, config, with_trainer=False)
    rows = read_jsonl(run.data("eval"))[:limit]
    greedy = config.sampling.model_copy(update={"temperature": 0.0, "n": 1})
    outputs = host.engine.generate([Request(str(r["id"]), messages=r["messages"]) for r in rows], greedy).outputs
    columns = {"answer": [r.get("answer") for r in rows], "task": [r.get("task", "") for r in rows],
               "id": [str(r["id"]) for r in rows], "metadata": [r.get("metadata") for r in rows]}
    totals, per_reward = combine_rewards([o.text for o in outputs], columns, dict(config.train.rewards))
    version = host.engine.policy_version
    write_jsonl(run.root / "eval" / f"v{version:06d}.jsonl",
                [{**o.to_json(), "reward": t} for o, t in zip(outputs, totals)])
    return {"eval/policy_version": version, "eval/reward_mean": sum(totals) / max(len(totals), 1),
            "eval/accuracy": accuracy(per_reward), "eval/prompts": len(rows)}


@flow(name="evaluate")
def evaluate(config_path: str | None = None, overrides: Sequence[str] = (), limit: int | None = None
             ) -> dict[str, Any]:
    """Evaluate the latest published policy of the run named by the config (train.run_dir)."""
    from flows.post_training import check_train_config
    from specactor_engine.config import config_to_yaml, load_config
    from tasks.pipeline import load_prompts
    from tasks.runtime import drop_host

    config = check_train_config(load_config(config_path, list(overrides)))
    run = RunDir(Path(config.train.run_dir).resolve())
    if not (run.root / "config.yaml").exists():
        atomic_write_text(run.root / "config.yaml", config_to_yaml(config))
    load_prompts(str(run.root))
    metrics = evaluate_policy(str(run.root), limit)
    drop_host(str(run.root))
    lines = ["# Evaluation", "", "| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in metrics.items()]
    create_markdown_artifact(markdown="\n".join(lines), key="evaluation")
    return metrics
