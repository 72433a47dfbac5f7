"""PNG plots of one benchmark run (docs/benchmarking.md "Output"), drawn from results.json and runs/*.json.

    makespan.png      makespan per system: median bar, min-max whiskers
    throughput.png    sequences finished over wall time (every system: the tail shows as a
                      flat end) and output tokens/s over wall time (engine systems)
    acceptance.png    tokens per row per verify (acceptance length) and draft width k over
                      rollout progress (share of the run's output tokens emitted so far)
    drafter_mix.png   share of verified rows drafted by each drafter over rollout progress

The per-round figures come from the engine's `EngineStats.timeline` of each system's first
repeat; systems without one (hf, vllm) appear only where their finish times suffice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after the backend choice

from benchmark.metrics import spread  # noqa: E402

PROGRESS_BINS = 20


def load_first_runs(out: Path, systems: list[str]) -> dict[str, dict[str, Any]]:
    """Each system's first repeat (runs/<system>-0.json) that exists."""
    found = {}
    for system in systems:
        path = out / "runs" / f"{system}-0.json"
        if path.exists():
            found[system] = json.loads(path.read_text(encoding="utf-8"))
    return found


def plot_makespan(results: dict[str, Any], path: Path) -> None:
    names, medians, lows, highs = [], [], [], []
    for name, entry in results["systems"].items():
        stats = spread(entry["makespan_s"])
        if stats is None:
            continue
        names.append(name)
        medians.append(stats["median"])
        lows.append(stats["median"] - stats["min"])
        highs.append(stats["max"] - stats["median"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, medians, yerr=[lows, highs], capsize=4, color="tab:blue")
    for x, value in enumerate(medians):
        ax.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_ylabel("makespan (s)")
    ax.set_title(_title(results, "makespan (median, min-max)"))
    _save(fig, path)


def _tokens_per_s_over_time(timeline: list[dict[str, Any]], makespan: float) -> tuple[list[float], list[float]]:
    width = max(makespan / PROGRESS_BINS, 1e-9)
    bins = [0.0] * PROGRESS_BINS
    for entry in timeline:
        bins[min(int(entry["t"] / width), PROGRESS_BINS - 1)] += entry["emitted"]
    return [width * (i + 0.5) for i in range(PROGRESS_BINS)], [b / width for b in bins]


def plot_throughput(results: dict[str, Any], runs: dict[str, dict[str, Any]], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, run in runs.items():
        times = sorted(run["finish_times_s"])
        left.step([0.0, *times], range(len(times) + 1), where="post", label=name)
        timeline = (run.get("engine_stats") or {}).get("timeline")
        if timeline:
            xs, ys = _tokens_per_s_over_time(timeline, run["makespan_s"])
            right.plot(xs, ys, marker=".", label=name)
    left.set_xlabel("wall time (s)")
    left.set_ylabel("sequences finished")
    right.set_xlabel("wall time (s)")
    right.set_ylabel("output tokens/s (engine systems)")
    _legends(left, right)
    fig.suptitle(_title(results, "progress over wall time (first repeat)"))
    _save(fig, path)


def _by_progress(timeline: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split the rounds into PROGRESS_BINS groups by the share of output tokens emitted so far."""
    total = sum(e["emitted"] for e in timeline) or 1
    groups: list[list[dict[str, Any]]] = [[] for _ in range(PROGRESS_BINS)]
    done = 0
    for entry in timeline:
        groups[min(int(PROGRESS_BINS * done / total), PROGRESS_BINS - 1)].append(entry)
        done += entry["emitted"]
    return groups


def _speculative(runs: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {name: run["engine_stats"]["timeline"] for name, run in runs.items()
            if (run.get("engine_stats") or {}).get("timeline")
            and (run["engine_stats"].get("drafted_tokens") or run["engine_stats"].get("shadow_drafts"))}


def plot_acceptance(results: dict[str, Any], runs: dict[str, dict[str, Any]], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    xs = [(i + 0.5) / PROGRESS_BINS for i in range(PROGRESS_BINS)]
    for name, timeline in _speculative(runs).items():
        groups = _by_progress(timeline)
        accept = [sum(e["emitted"] for e in g) / max(sum(e["rows"] for e in g), 1) if g else None for g in groups]
        width = [sum(e.get("cap", e["k"]) for e in g) / len(g) if g else None for g in groups]
        left.plot(xs, accept, marker=".", label=name)
        right.plot(xs, width, marker=".", label=name)
    left.set_xlabel("rollout progress (share of output tokens)")
    left.set_ylabel("tokens per row per verify")
    right.set_xlabel("rollout progress (share of output tokens)")
    right.set_ylabel("chosen verify length (drafts per row)")
    _legends(left, right)
    fig.suptitle(_title(results, "acceptance and verify length over progress (first repeat)"))
    _save(fig, path)


def plot_drafter_mix(results: dict[str, Any], runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Per speculative system: each method's share of verified rows (top), its accepted tokens per
    row it drafted for (middle; dashed: per shadow draft, scored against the commits) and its drafting
    cost per draft, verified or shadow (bottom; in-process drafters only), over rollout progress."""
    speculative = _speculative(runs)
    columns = max(len(speculative), 1)
    fig, axes = plt.subplots(3, columns, figsize=(5.5 * columns, 10.0), squeeze=False, sharex=True)
    xs = [(i + 0.5) / PROGRESS_BINS for i in range(PROGRESS_BINS)]
    for column, (name, timeline) in enumerate(speculative.items()):
        share_ax, accept_ax, cost_ax = axes[0][column], axes[1][column], axes[2][column]
        groups = _by_progress(timeline)
        drafters = sorted({d for e in timeline for d in e["by_drafter"]})
        shares = {d: [] for d in [*drafters, "(no draft)"]}
        for group in groups:
            rows = sum(e["rows"] for e in group) or 1
            for drafter in drafters:
                shares[drafter].append(sum(e["by_drafter"].get(drafter, 0) for e in group) / rows)
            shares["(no draft)"].append(1 - sum(shares[d][-1] for d in drafters) if group else 0.0)
        share_ax.stackplot(xs, *shares.values(), labels=list(shares))
        share_ax.set_title(name)
        share_ax.set_ylabel("share of verified rows")
        share_ax.set_ylim(0, 1)
        share_ax.legend(fontsize=8, loc="lower left")
        for drafter in drafters:
            drafted = [sum(e["by_drafter"].get(drafter, 0) for e in g) for g in groups]
            accepted = [sum(e.get("accepted_by_drafter", {}).get(drafter, 0) for e in g) for g in groups]
            accept_ax.plot(xs, [a / d if d else None for a, d in zip(accepted, drafted)], marker=".", label=drafter)
        for drafter in sorted({d for e in timeline for d in e.get("shadow_by_drafter", {})}):
            scored = [[e.get("shadow_by_drafter", {}).get(drafter, [0, 0]) for e in g] for g in groups]
            drafts = [sum(s[0] for s in group) for group in scored]
            accepted = [sum(s[1] for s in group) for group in scored]
            accept_ax.plot(xs, [a / d if d else None for a, d in zip(accepted, drafts)], marker=".", linestyle="--",
                           label=f"{drafter} (shadow)")
        # cost per draft, verified or shadow (a shadow is counted when scored, a few rounds after it was drafted)
        for drafter in sorted({d for e in timeline for d in e.get("draft_s_by_drafter", {})}):
            spent = [sum(e.get("draft_s_by_drafter", {}).get(drafter, 0.0) for e in g) for g in groups]
            drafts = [sum(e["by_drafter"].get(drafter, 0) + e.get("shadow_by_drafter", {}).get(drafter, [0])[0]
                          for e in g) for g in groups]
            if any(spent):
                cost_ax.plot(xs, [1e3 * s / d if d else None for s, d in zip(spent, drafts)], marker=".",
                             label=drafter)
        accept_ax.set_ylabel("accepted tokens per draft")
        accept_ax.legend(fontsize=8)
        cost_ax.set_xlabel("rollout progress (share of output tokens)")
        cost_ax.set_ylabel("drafting ms per draft")
        if cost_ax.lines:
            cost_ax.legend(fontsize=8)
    if not speculative:
        axes[0][0].text(0.5, 0.5, "no speculative engine system in this run", ha="center", va="center")
    fig.suptitle(_title(results, "drafter mix, each drafter's acceptance and cost over progress (first repeat)"))
    _save(fig, path)


def write_plots(out: Path, results: dict[str, Any]) -> list[Path]:
    """Draw every plot of this run into `out`; returns the files written."""
    runs = load_first_runs(out, list(results["systems"]))
    paths = [out / name for name in ("makespan.png", "throughput.png", "acceptance.png", "drafter_mix.png")]
    plot_makespan(results, paths[0])
    plot_throughput(results, runs, paths[1])
    plot_acceptance(results, runs, paths[2])
    plot_drafter_mix(results, runs, paths[3])
    return paths


def _legends(*axes: Any) -> None:
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # an empty legend only warns
            ax.legend(fontsize=8)


def _title(results: dict[str, Any], what: str) -> str:
    trace = results["trace"]
    return f"trace {trace['name']} ({results['settings']['num_sequences']} sequences): {what}"


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
