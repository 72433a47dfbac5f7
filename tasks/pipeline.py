"""The post-training steps as Prefect tasks: small, typed, passing only references.

Each task takes the run directory (a string) and the step number, reads what it needs
from the run directory or the process-local host (tasks.runtime), writes its outputs
atomically and returns a small dict of metrics.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks.run_dir import RunDir, read_jsonl, write_jsonl
from tasks.runtime import RunHost, get_host, set_host

ACCEPTANCE_FLOOR = 0.05  # below this a drafter was useless already; no collapse alarm
MIN_DRAFTED_FOR_ALARM = 32  # fewer drafted tokens in a step make its acceptance rate too noisy to judge


class DrafterCollapseWarning(UserWarning):
    """A drafter's acceptance collapsed after a weight sync (it is now pure overhead)."""


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except Exception:  # called outside a flow run (unit tests of .fn)
        return logging.getLogger("specactor.pipeline")


def build_host(run_root: str, config: Any, with_trainer: bool = True) -> RunHost:
    """Engine (+ trainer) for a run, both at the last published policy version."""
    from transformers import AutoModelForCausalLM

    from specactor_engine.engine import Engine
    from specactor_engine.model.registry import resolve_model
    from tasks.trainer import PolicyTrainer

    run = RunDir(Path(run_root))
    version = run.latest_version()
    source = run.checkpoint(version) if version else resolve_model(
        config.model.target, dtype=config.model.dtype, cache_dir=config.model.cache_dir)
    engine_config = config.model_copy(update={"model": config.model.model_copy(update={"target": str(source)})})
    if not config.train.speculation:
        engine_config = engine_config.model_copy(
            update={"rollout": config.rollout.model_copy(update={"mode": "ar"})})
    engine = Engine.from_config(engine_config)
    engine.policy_version = version
    host = RunHost(config=config, engine=engine, tokenizer=engine.tokenizer)
    if version:
        load_drafters(host, run.checkpoint(version), version)
    trainer = None
    if with_trainer:
        trainer = PolicyTrainer(AutoModelForCausalLM.from_pretrained(source, dtype="float32"), config.train.optim,
                                temperature=config.sampling.temperature, seed=config.sampling.seed)
    host.trainer = trainer
    return set_host(run_root, host)


def run_config(run_root: str) -> Any:
    """The resolved config the flow wrote into the run directory."""
    host = get_host(run_root)
    if host is not None:
        return host.config
    from specactor_engine.config import load_config

    return load_config(Path(run_root) / "config.yaml")


def host_for(run_root: str) -> RunHost:
    host = get_host(run_root)
    return host if host is not None else build_host(run_root, run_config(run_root))


@task(name="load_prompts", retries=1)
def load_prompts(run_root: str) -> dict[str, Any]:
    """Build the train/eval prompt datasets into the run directory (idempotent)."""
    from tasks.data import load_prompt_dataset, train_eval_split

    run = RunDir(Path(run_root))
    if run.data("train").exists():
        return {"train": str(run.data("train")), "eval": str(run.data("eval"))}
    data_cfg = run_config(run_root).train.data
    dataset = load_prompt_dataset(data_cfg)
    train, evaluation = train_eval_split(dataset, data_cfg.eval_fraction, data_cfg.seed)
    write_jsonl(run.data("eval"), evaluation.to_list())
    write_jsonl(run.data("train"), train.to_list())
    _logger().info("prompts: %d train, %d eval", len(train), len(evaluation))
    return {"train": str(run.data("train")), "eval": str(run.data("eval"))}


def step_requests(run_root: str, step: int) -> list[dict[str, Any]]:
    """The prompt rows of a step (deterministic: the same rows on a resumed run)."""
    import datasets

    from tasks.data import batch_for_step

    rows = read_jsonl(RunDir(Path(run_root)).data("train"))
    train = run_config(run_root).train
    return batch_for_step(datasets.Dataset.from_list(rows), step, train.prompts_per_step, train.data.seed).to_list()


@task(name="run_rollout")
def run_rollout(run_root: str, step: int) -> dict[str, Any]:
    """Roll out the step's prompts with the engine; write records with policy and drafter versions."""
    from specactor_engine.types import Request

    host, run = host_for(run_root), RunDir(Path(run_root))
    rows = step_requests(run_root, step)
    requests = [Request(str(row["id"]), messages=row["messages"]) for row in rows]
    sampling = host.config.sampling.model_copy(update={"seed": host.config.sampling.seed + step})
    clock = _TailClock()
    result = host.engine.generate(requests, sampling, progress=clock.observe)
    by_id = {str(row["id"]): row for row in rows}
    drafter_versions = {d.name: d.version for d in host.engine.drafters}
    if host.engine.worker_drafter is not None:
        drafter_versions[host.engine.worker_drafter.name] = host.engine.worker_drafter.version
    records = [{**out.to_json(), "step": step,
                "drafter_versions": drafter_versions, "answer": by_id[out.request_id].get("answer"),
                "task": by_id[out.request_id].get("task", "")} for out in result.outputs]
    write_jsonl(run.rollouts(step), records)
    stats = result.stats
    metrics = {
        "rollout/makespan_s": stats.total_s, "rollout/tail_s": clock.tail_seconds(stats.total_s),
        "rollout/tokens_per_s": stats.tokens_per_s, "rollout/output_tokens": stats.output_tokens,
        "rollout/mean_acceptance_length": stats.mean_acceptance_length,
        "rollout/acceptance_rate": stats.acceptance_rate, "policy_version": host.engine.policy_version,
    }
    return metrics | drafter_metrics(stats, drafter_versions) | speculation_metrics(stats)


def drafter_metrics(stats: Any, drafter_versions: dict[str, int]) -> dict[str, float]:
    """Per draft method: share, acceptance and cost of its verified drafts, its shadow drafts (scored
    against the commits, shadow.py) and its weights' version."""
    metrics: dict[str, float] = {}
    for name, drafted in stats.drafted_per_drafter.items():
        metrics[f"drafter/{name}/acceptance_rate"] = stats.accepted_per_drafter.get(name, 0) / max(drafted, 1)
        metrics[f"drafter/{name}/share"] = drafted / max(stats.drafted_tokens, 1)
        metrics[f"drafter/{name}/drafted"] = drafted
        if name in stats.draft_s_per_drafter:  # in-process drafters (workers draft off the critical path); the
            # seconds include the method's shadow drafts
            metrics[f"drafter/{name}/draft_seconds"] = stats.draft_s_per_drafter[name]
            metrics[f"drafter/{name}/ms_per_drafted_token"] = 1e3 * stats.draft_s_per_drafter[name] / max(drafted, 1)
    for name, shadows in stats.shadow_drafts_per_drafter.items():  # drafts scored against the commits (shadow.py)
        metrics[f"drafter/{name}/shadow_drafts"] = shadows
        metrics[f"drafter/{name}/shadow_accepted_per_draft"] = stats.shadow_accepted_per_drafter.get(name, 0) / shadows
    for name, version in drafter_versions.items():
        metrics[f"drafter/{name}/version"] = version
    return metrics


def speculation_metrics(stats: Any) -> dict[str, float]:
    """Per-position acceptance, the chosen verify length, and the decoupled workers' busy share."""
    metrics: dict[str, float] = {}
    for j, (drafted, accepted) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position), start=1):
        if drafted:
            metrics[f"rollout/accept_rate_pos{j}"] = accepted / drafted
    rows = sum(e["rows"] for e in stats.timeline)
    if rows:
        offered = sum(e["cap"] * e["rows"] for e in stats.timeline)
        metrics["rollout/mean_verify_length"] = offered / rows
        # supply: share of the chosen verify slots that had a draft ready
        metrics["rollout/draft_supply"] = sum(e["drafted"] for e in stats.timeline) / max(offered, 1)
    if stats.decoupled and stats.total_s:
        busy = stats.decoupled.get("worker_busy_s", 0.0)
        metrics["rollout/worker_busy_share"] = busy / stats.total_s
        metrics["rollout/worker_idle_s"] = max(stats.total_s - busy, 0.0)
    for arm, rounds in stats.arm_rounds.items():
        metrics[f"rollout/rounds_{arm}"] = rounds
    return metrics


class _TailClock:
    """Time at which 75% of the sequences had finished (from the engine's progress callback)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.tail_start: float | None = None

    def observe(self, finished: int, total: int) -> None:
        if self.tail_start is None and finished >= 0.75 * total:
            self.tail_start = time.perf_counter() - self.started

    def tail_seconds(self, makespan: float) -> float:
        return max(makespan - self.tail_start, 0.0) if self.tail_start is not None else 0.0


@task(name="score_rewards", retries=2)
def score_rewards(run_root: str, step: int) -> dict[str, Any]:
    """Score every completion with the configured rewards; group-normalised advantages."""
    import torch

    from tasks.grpo import ADVANTAGE_ESTIMATORS
    from tasks.rewards import combine_rewards

    host, run = host_for(run_root), RunDir(Path(run_root))
    records = read_jsonl(run.rollouts(step))
    columns = {"answer": [r["answer"] for r in records], "task": [r["task"] for r in records],
               "id": [r["id"] for r in records]}
    totals, per_reward = combine_rewards([r["text"] for r in records], columns, dict(host.config.train.rewards))
    groups = {rid: i for i, rid in enumerate(dict.fromkeys(columns["id"]))}
    estimator = ADVANTAGE_ESTIMATORS[host.config.train.advantage]
    advantages = estimator(torch.tensor(totals, dtype=torch.float64),
                           torch.tensor([groups[rid] for rid in columns["id"]])).tolist()
    write_jsonl(run.scores(step), [
        {"id": r["id"], "sample": r["sample"], "reward": total, "advantage": adv,
         **{f"reward/{name}": values[i] for name, values in per_reward.items()}}
        for i, (r, total, adv) in enumerate(zip(records, totals, advantages))])
    rewards = torch.tensor(totals)
    metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0}
    for name, values in per_reward.items():
        scored = [v for v in values if v is not None]
        metrics[f"reward/{name}"] = sum(scored) / len(scored) if scored else 0.0
    metrics["accuracy"] = _accuracy(per_reward)
    return metrics


def _accuracy(per_reward: dict[str, list[float | None]]) -> float:
    """Share of completions a correctness reward scored 1.0 (reasoning_gym or math_verify)."""
    for name in ("reasoning_gym", "math_verify"):
        if name in per_reward:
            scored = [v for v in per_reward[name] if v is not None]
            return sum(v >= 1.0 for v in scored) / len(scored) if scored else 0.0
    return 0.0


@task(name="update_policy")
def update_policy(run_root: str, step: int) -> dict[str, Any]:
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
    metrics = host.trainer.step(batch)
    host.trainer.save_checkpoint(run.checkpoint(step))
    host.tokenizer.save_pretrained(run.checkpoint(step))  # a checkpoint is a complete HF model directory
    (run.checkpoint(step) / "COMPLETE").write_text("ok\n")
    return {f"train/{key}": float(value) for key, value in metrics.items()}


@task(name="sync_weights")
def sync_weights(run_root: str, step: int) -> dict[str, Any]:
    """Push policy v<step> into the engine, verify it bit for bit, refresh every drafter and
    save the drafters' weights beside checkpoint v<step>.

    On any failure the engine and its drafters are restored to the previous version, so the
    previous consistent (checkpoint, engine, drafters) triple stays in place.
    """
    from specactor_engine.model.weights import weights_digest

    host, run = host_for(run_root), RunDir(Path(run_root))
    previous = host.engine.policy_version
    try:
        host.engine.update_weights(host.trainer.state_dict_for_sync(), version=step)
        engine_digest = weights_digest(host.engine.runner.model.named_parameters())
        if engine_digest != weights_digest(host.trainer.state_dict_for_sync()):
            raise RuntimeError(f"weights in the engine differ from the trainer's after sync to v{step}")
        metrics = refresh_drafters(host, read_jsonl(run.rollouts(step)), step)
        save_drafters(host, run.checkpoint(step))
        metrics |= push_worker_drafter(host, run.checkpoint(step), step)
    except Exception:
        _restore_engine(host, run, previous)
        raise
    return {"sync/policy_digest": engine_digest[:16], "policy_version_after": step, **metrics}


def refresh_drafters(host: RunHost, records: list[dict[str, Any]], version: int) -> dict[str, float]:
    """Model drafters: distil on the step's rollouts (bounded); others: bump their version."""
    from specactor_engine.training.distill import distill_on_rollouts

    metrics: dict[str, float] = {}
    sync = host.config.train.drafter_sync
    sequences = [(r["prompt_token_ids"], r["token_ids"]) for r in records if r["token_ids"]]
    workers = host.engine.worker_drafter  # decoupled: the verifier's copy of the workers' model
    models = [d.runner.model for d in host.engine.drafters if hasattr(d, "runner")]
    soft = None
    if sync.soft_top_k and sequences and (models or workers is not None):
        from specactor_engine.training.offline import teacher_topk

        # the engine holds the new policy already: its distributions on the step's rollouts
        started = time.perf_counter()
        soft = teacher_topk(host.engine.runner.model, sequences, sync.soft_top_k)
        metrics["sync/teacher_seconds"] = time.perf_counter() - started
    for drafter in host.engine.drafters:
        if hasattr(drafter, "runner"):
            result = distill_on_rollouts(drafter.runner.model, sequences, sync.budget(), soft)
            metrics.update({f"drafter/{drafter.name}/{k}": v for k, v in result.items()})
        drafter.version = version
    if workers is not None:
        result = distill_on_rollouts(workers.model, sequences, sync.budget(), soft)
        metrics.update({f"drafter/{workers.name}/{k}": v for k, v in result.items()})
    return metrics


def push_worker_drafter(host: RunHost, checkpoint: Path, version: int) -> dict[str, float]:
    """Decoupled: the workers load the refreshed drafter saved beside checkpoint v<version>."""
    workers = host.engine.worker_drafter
    if workers is None:
        return {}
    return workers.push(_drafter_file(checkpoint, workers.name), version)


def _drafter_file(checkpoint: Path, name: str) -> Path:
    return checkpoint / "drafters" / f"{name.replace('/', '_').replace(':', '_')}.safetensors"


def save_drafters(host: RunHost, checkpoint: Path) -> None:
    """Weights of every model drafter next to the policy checkpoint (a resumed run reloads them)."""
    from safetensors.torch import save_file

    for drafter in host.engine.drafters:
        drafter.save_state(checkpoint / "drafters")  # e.g. the suffix drafter's rollout history
        if hasattr(drafter, "runner"):
            path = _drafter_file(checkpoint, drafter.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            state = {k: v.contiguous() for k, v in drafter.runner.model.named_parameters()}
            save_file(state, path)
    workers = host.engine.worker_drafter
    if workers is not None:
        path = _drafter_file(checkpoint, workers.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in workers.model.named_parameters()}, path)


def load_drafters(host: RunHost, checkpoint: Path, version: int) -> None:
    """Load saved drafter weights of checkpoint v<version>, where they exist."""
    from safetensors.torch import load_file

    for drafter in host.engine.drafters:
        path = _drafter_file(checkpoint, drafter.name)
        if path.exists():
            host.engine.update_weights(load_file(path).items(), version=version, component=drafter.name)
        drafter.load_state(checkpoint / "drafters")
        drafter.version = version
    workers = host.engine.worker_drafter
    if workers is not None and _drafter_file(checkpoint, workers.name).exists():
        workers.load_file(_drafter_file(checkpoint, workers.name))
        workers.push(_drafter_file(checkpoint, workers.name), version)


def _restore_engine(host: RunHost, run: RunDir, version: int) -> None:
    """Reload the engine's target and drafters from checkpoint v<version> (v0: the initial models)."""
    from safetensors.torch import load_file

    from specactor_engine.model.registry import resolve_model

    model = host.config.model
    source = run.checkpoint(version) if version else resolve_model(model.target, model.dtype, model.cache_dir)
    weights = load_file(Path(source) / "model.safetensors")
    host.engine.update_weights(weights.items(), version=version)
    if version:
        load_drafters(host, run.checkpoint(version), version)
    else:
        for drafter, spec in zip(host.engine.drafters, host.config.rollout.drafters):
            if hasattr(drafter, "runner"):
                path = resolve_model(spec.model, spec.dtype or model.dtype, model.cache_dir)
                host.engine.update_weights(load_file(Path(path) / "model.safetensors").items(), 0, drafter.name)
            drafter.version = 0
        workers = host.engine.worker_drafter
        if workers is not None:
            workers.load_file(workers.initial_weights())
            workers.push(workers.initial_weights(), 0)
    _logger().error("sync to the new policy failed; the engine and drafters are back at v%d", version)


def acceptance_alarms(previous: dict[str, Any] | None, current: dict[str, Any], ratio: float) -> list[str]:
    """Drafters whose acceptance fell below `ratio` x the previous step's (after a sync)."""
    if not previous:
        return []
    alarms = []
    for key, value in current.items():
        if not (key.startswith("drafter/") and key.endswith("/acceptance_rate")):
            continue
        name = key.split("/")[1]
        before = previous.get(key)
        enough = min(previous.get(f"drafter/{name}/drafted", 0), current.get(f"drafter/{name}/drafted", 0))
        if before is not None and before >= ACCEPTANCE_FLOOR and enough >= MIN_DRAFTED_FOR_ALARM \
                and value < ratio * before:
            alarms.append(f"{name}: acceptance {before:.2f} -> {value:.2f} after the sync")
    return alarms
