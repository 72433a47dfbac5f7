"""The post-training steps as Prefect tasks: small, typed, passing only references.

Each task takes the run directory (a string) and the step number, reads what it needs from the
run directory or the process-local host (tasks/host.py), writes its outputs atomically and
returns the step's metrics as a flat name -> value dict (what metrics.json and W&B get).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task

from tasks import drafter_store
from tasks.host import host_for, push_policy, restore_engine, run_config
from tasks.metrics import TailClock, drafter_versions, reward_metrics, rollout_metrics
from tasks.run_dir import RunDir, read_jsonl, write_jsonl
from tasks.runtime import run_logger

Metrics = dict[str, Any]
# the evaluation samples with the run's sampling at this seed offset: the same noise at every evaluation, so the
# before/after comparison is on the same prompts and the same random draws
EVAL_SEED_OFFSET = 1_000_000


@dataclass(frozen=True)
class PromptFiles:
    """The run's prompt datasets (JSONL)."""

    train: str
    eval: str


@task(name="load_prompts", retries=1)
def load_prompts(run_root: str) -> PromptFiles:
    """Build the train/eval prompt datasets into the run directory (idempotent)."""
    from tasks.data import load_prompt_dataset, train_eval_split

    run = RunDir(Path(run_root))
    files = PromptFiles(str(run.data("train")), str(run.data("eval")))
    if run.data("train").exists():
        return files
    data = run_config(run_root).train.data
    train, evaluation = train_eval_split(load_prompt_dataset(data), data.eval_fraction, data.seed)
    write_jsonl(run.data("eval"), evaluation.to_list())
    write_jsonl(run.data("train"), train.to_list())
    run_logger().info("prompts: %d train, %d eval", len(train), len(evaluation))
    return files


@task(name="run_rollout")
def run_rollout(run_root: str, step: int) -> Metrics:
    """Roll out the step's prompts with the engine; write records with policy and drafter versions."""
    from specactor_engine.types import Request

    host, run = host_for(run_root), RunDir(Path(run_root))
    rows = _step_rows(run_root, step)
    requests = [Request(str(row["id"]), messages=row["messages"]) for row in rows]
    sampling = host.config.sampling.model_copy(update={"seed": host.config.sampling.seed + step})
    clock = TailClock()
    result = host.engine.generate(requests, sampling, progress=clock.observe)
    by_id = {str(row["id"]): row for row in rows}
    versions = drafter_versions(host.engine)
    write_jsonl(run.rollouts(step), [
        {**out.to_json(), "step": step, "drafter_versions": versions, "answer": by_id[out.request_id].get("answer"),
         "task": by_id[out.request_id].get("task", ""), "metadata": by_id[out.request_id].get("metadata")}
        for out in result.outputs])
    return rollout_metrics(result.stats, clock, host.engine.policy_version, versions)


def _step_rows(run_root: str, step: int) -> list[dict[str, Any]]:
    """The prompt rows of a step (deterministic: the same rows on a resumed run)."""
    import datasets

    from tasks.data import batch_for_step

    rows = read_jsonl(RunDir(Path(run_root)).data("train"))
    train = run_config(run_root).train
    return batch_for_step(datasets.Dataset.from_list(rows), step, train.prompts_per_step, train.data.seed).to_list()


@task(name="score_rewards", retries=2)
def score_rewards(run_root: str, step: int) -> Metrics:
    """Score every completion with the configured rewards; group-normalised advantages."""
    from tasks.rewards import combine_rewards

    host, run = host_for(run_root), RunDir(Path(run_root))
    records = read_jsonl(run.rollouts(step))
    columns = {"answer": [r["answer"] for r in records], "task": [r["task"] for r in records],
               "id": [r["id"] for r in records], "metadata": [r.get("metadata") for r in records]}
    totals, per_reward = combine_rewards([r["text"] for r in records], columns, dict(host.config.train.rewards))
    advantages = _advantages(host.config.train.advantage, totals, columns["id"])
    write_jsonl(run.scores(step), [
        {"id": r["id"], "sample": r["sample"], "reward": total, "advantage": adv,
         **{f"reward/{name}": values[i] for name, values in per_reward.items()}}
        for i, (r, total, adv) in enumerate(zip(records, totals, advantages))])
    return reward_metrics(totals, per_reward)


def _advantages(estimator: str, totals: list[float], ids: list[str]) -> list[float]:
    """Per-sample advantages from the rewards, grouped by prompt id (a GRPO group)."""
    import torch

    from tasks.grpo import ADVANTAGE_ESTIMATORS

    groups = {rid: i for i, rid in enumerate(dict.fromkeys(ids))}
    return ADVANTAGE_ESTIMATORS[estimator](torch.tensor(totals, dtype=torch.float64),
                                           torch.tensor([groups[rid] for rid in ids])).tolist()


@task(name="update_policy")
def update_policy(run_root: str, step: int) -> Metrics:
    """One GRPO update on the step's rollouts; stages checkpoint v<step> (not yet published)."""
    from tasks.trainer import RolloutBatch

    host, run = host_for(run_root), RunDir(Path(run_root))
    records, scores = read_jsonl(run.rollouts(step)), read_jsonl(run.scores(step))
    usable = [(r, s) for r, s in zip(records, scores) if r["token_ids"] and r["finish_reason"] != "error"]
    batch = RolloutBatch(
        prompt_token_ids=[r["prompt_token_ids"] for r, _ in usable],
        output_token_ids=[r["token_ids"] for r, _ in usable],
        old_logprobs=[r["logprobs"] for r, _ in usable],
        advantages=[s["advantage"] for _, s in usable],
    )
    if host.trainer.version != step - 1:  # e.g. a host kept after a failed step: its update is not v<step - 1>'s
        raise RuntimeError(f"the trainer holds policy v{host.trainer.version}, step {step} updates v{step - 1}")
    metrics = host.trainer.step(batch)
    host.trainer.save_checkpoint(run.checkpoint(step))
    host.tokenizer.save_pretrained(run.checkpoint(step))  # a checkpoint is a complete HF model directory
    (run.checkpoint(step) / "COMPLETE").write_text("ok\n")
    return {f"train/{key}": float(value) for key, value in metrics.items()}


@task(name="sync_weights")
def sync_weights(run_root: str, step: int) -> Metrics:
    """Push policy v<step> into the engine (every rollout replica), verify it bit for bit, refresh every drafter,
    save the drafters' weights beside checkpoint v<step> and hand every replica the refreshed drafters.

    All or nothing: on any failure the engine and its drafters are restored to the previous version,
    so the previous consistent (checkpoint, engine, drafters) triple stays in place.
    """
    host, run = host_for(run_root), RunDir(Path(run_root))
    previous = host.engine.policy_version
    try:
        metrics = push_policy(host, step)
        metrics |= drafter_store.refresh_drafters(host, read_jsonl(run.rollouts(step)), step)
        drafter_store.save_drafters(host, run.checkpoint(step))
        metrics |= drafter_store.push_worker_drafter(host, run.checkpoint(step), step)
        metrics |= drafter_store.push_replica_drafters(host)
    except Exception:
        restore_engine(host, run, previous)
        run_logger().error("sync to the new policy failed; the engine and drafters are back at v%d", previous)
        raise
    return {"policy_version_after": step, **metrics}


@task(name="evaluate_step")
def evaluate_step(run_root: str, step: int) -> Metrics:
    """Roll out the held-out prompts (`train.eval`) with the engine's current policy at the run's sampling (a
    fixed seed) and score them: `eval/reward/mean`, `eval/accuracy`. With `train.eval.compare_ar`, the same
    rollout again with plain decoding (same weights, same noise): the rollout speedup measured on the same
    prompts, and whether the outputs are identical (they must be). Evaluation rollouts leave the drafters'
    cross-rollout history as it was. Writes steps/NNNNNN/eval.jsonl."""
    from specactor_engine.types import Request
    from tasks.rewards import combine_rewards

    host, run = host_for(run_root), RunDir(Path(run_root))
    settings = host.config.train.eval
    rows = read_jsonl(run.data("eval"))[: settings.max_prompts]
    if not rows:
        raise ValueError("train.eval: the eval split is empty; raise train.data.eval_fraction or set "
                         "train.eval.enabled=false")
    requests = [Request(str(row["id"]), messages=row["messages"]) for row in rows]
    sampling = host.config.sampling.model_copy(update={"seed": host.config.sampling.seed + EVAL_SEED_OFFSET})
    host.engine.reserve(requests, sampling)  # caches and the verify length's cost profile: not in the timings
    with host.engine.history_kept():  # an evaluation's rollouts must not draft the next evaluation's
        # one-time work (the sampler's compile, first-call dispatch) lands in a short untimed warm-up, not in
        # whichever of the two timed rollouts runs first
        host.engine.generate(requests[:1], sampling.model_copy(update={"n": 1, "max_new_tokens": 4}))
        result = host.engine.generate(requests, sampling)
    outputs, by_id = result.outputs, {str(row["id"]): row for row in rows}
    columns = {"answer": [by_id[o.request_id].get("answer") for o in outputs],
               "task": [by_id[o.request_id].get("task", "") for o in outputs], "id": [o.request_id for o in outputs],
               "metadata": [by_id[o.request_id].get("metadata") for o in outputs]}
    totals, per_reward = combine_rewards([o.text for o in outputs], columns, dict(host.config.train.rewards))
    metrics: Metrics = {f"eval/{key}": value for key, value in reward_metrics(totals, per_reward).items()}
    metrics |= {"eval/policy_version": host.engine.policy_version, "eval/prompts": len(rows),
                "eval/samples": len(outputs), "eval/rollout_s": result.stats.total_s,
                "eval/mean_acceptance_length": result.stats.mean_acceptance_length}
    if settings.compare_ar and host.engine.speculative:
        with host.engine.plain_decoding():
            plain = host.engine.generate(requests, sampling)
        same = sum(a.token_ids == b.token_ids for a, b in zip(outputs, plain.outputs))
        metrics |= {"eval/ar_rollout_s": plain.stats.total_s,
                    "eval/rollout_speedup": plain.stats.total_s / max(result.stats.total_s, 1e-9),
                    "eval/identical": same / len(outputs)}
        if same != len(outputs):
            run_logger().warning("evaluation at v%d: %d of %d outputs differ from plain decoding's",
                                 host.engine.policy_version, len(outputs) - same, len(outputs))
    write_jsonl(run.step_dir(step) / "eval.jsonl",
                [{**out.to_json(), "reward": total} for out, total in zip(outputs, totals)])
    return metrics
