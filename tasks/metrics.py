"""What a step reports (to metrics.json, W&B and the Prefect artifact), computed from the engine's
stats and the rewards: pure functions of their inputs, plus the rollout's tail clock."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specactor_engine.engine import Engine
    from specactor_engine.types import EngineStats

TAIL_SHARE = 0.75  # the rollout's tail starts when this share of its sequences has finished
CORRECTNESS_REWARDS = ("reasoning_gym", "math_verify")  # the first one configured gives the accuracy


class TailClock:
    """Time at which 75% of the sequences had finished (from the engine's progress callback)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.tail_start: float | None = None

    def observe(self, finished: int, total: int) -> None:
        """The engine's progress callback: `finished` of `total` sequences are done."""
        if self.tail_start is None and finished >= TAIL_SHARE * total:
            self.tail_start = time.perf_counter() - self.started

    def tail_seconds(self, makespan: float) -> float:
        """Seconds from the tail's start to the end of a rollout of `makespan` seconds."""
        return max(makespan - self.tail_start, 0.0) if self.tail_start is not None else 0.0


def drafter_versions(engine: Engine) -> dict[str, int]:
    """The weights' version of every draft method (in-process drafters and the decoupled workers)."""
    versions = {d.name: d.version for d in engine.drafters}
    if engine.worker_drafter is not None:
        versions[engine.worker_drafter.name] = engine.worker_drafter.version
    return versions


def rollout_metrics(stats: EngineStats, clock: TailClock, policy_version: int,
                    versions: dict[str, int]) -> dict[str, Any]:
    """Makespan, tail, throughput and acceptance of a rollout, per drafter and per draft position."""
    metrics = {
        "rollout/makespan_s": stats.total_s, "rollout/tail_s": clock.tail_seconds(stats.total_s),
        "rollout/tokens_per_s": stats.tokens_per_s, "rollout/output_tokens": stats.output_tokens,
        "rollout/mean_acceptance_length": stats.mean_acceptance_length,
        "rollout/acceptance_rate": stats.acceptance_rate, "policy_version": policy_version,
    }
    return metrics | drafter_metrics(stats, versions) | speculation_metrics(stats)


def drafter_metrics(stats: EngineStats, drafter_versions: dict[str, int]) -> dict[str, float]:
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


def speculation_metrics(stats: EngineStats) -> dict[str, float]:
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


def reward_metrics(totals: list[float], per_reward: dict[str, list[float | None]]) -> dict[str, float]:
    """Mean and spread of the combined reward, the mean of each reward, and the accuracy."""
    import torch

    rewards = torch.tensor(totals)
    metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0}
    for name, values in per_reward.items():
        scored = [v for v in values if v is not None]
        metrics[f"reward/{name}"] = sum(scored) / len(scored) if scored else 0.0
    metrics["accuracy"] = accuracy(per_reward)
    return metrics


def accuracy(per_reward: dict[str, list[float | None]]) -> float:
    """Share of completions a correctness reward scored 1.0 (reasoning_gym or math_verify)."""
    for name in CORRECTNESS_REWARDS:
        if name in per_reward:
            scored = [v for v in per_reward[name] if v is not None]
            return sum(v >= 1.0 for v in scored) / len(scored) if scored else 0.0
    return 0.0
