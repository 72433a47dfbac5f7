"""Run a benchmark plan: every system, every repeat, interleaved and rotated (A B C, B C A, C A B), one subprocess
each.

Writes into the output directory:
    trace.json             the prompts and settings (reproducible from the trace definition)
    runs/<system>-<r>.json one worker result per run (figures, finish times, token ids, texts)
    runs/<system>-<r>.log  the worker's stderr
    results.json           machine, versions, git commit, settings and per-system figures (all repeats)
    results.md             the table: median (min-max) per system
    *.png                  plots (benchmark/plots.py)
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmark.machine import REPO_ROOT, machine_info, wait_for_quiet
from benchmark.metrics import compare_to_reference
from benchmark.paired import check_pairable, run_paired_worker, turn_order
from benchmark.plots import write_plots
from benchmark.report import render_markdown
from benchmark.systems import SYSTEMS, RunSpec, system_unavailable, write_references
from benchmark.traces import Trace, trace_items

logger = logging.getLogger(__name__)

REFERENCE_SYSTEM = "ar"
PER_RUN_FIGURES = ("makespan_s", "tokens_per_s", "output_tokens", "tail_s", "tail_share", "mean_accept_len",
                   "acceptance_rate", "peak_rss_mb", "load_s", "warmup_s", "prepare_s", "loadavg_1m_start", "cpu_share",
                   "others_cpu_share", "mem_read_gbps", "gc_s", "minor_faults", "major_faults")
PAIRED_FIGURES = ("systems", "turns", "external_cpu_s", "gc_s", "page_faults")
MAX_LISTED_MISMATCHES = 50


def parse_system(name: str) -> tuple[str, int | None]:
    """`coupled@2` -> ("coupled", 2): a system at another draft length than the plan's (the best fixed k
    of a baseline is found by running it at several); a plain name -> (name, None). A `#N` suffix names another
    copy of the same system (`ar,ar#2`: the A/A check of the harness) and is dropped here."""
    name, copy, number = name.partition("#")
    if copy and not number.isdigit():
        raise ValueError(f"system {name}#{number}: expected NAME#N with N a number (another copy of NAME)")
    base, at, k = name.partition("@")
    if not at:
        return name, None
    if not k.isdigit() or not 1 <= int(k) <= 16:
        raise ValueError(f"system {name!r}: expected NAME@K with K a draft length in 1..16")
    return base, int(k)


@dataclass(frozen=True)
class BenchPlan:
    """What to run: a trace (with overrides applied), the systems, the models and the budget."""

    trace: Trace
    systems: tuple[str, ...]
    repeats: int
    out: Path
    target: str
    drafter: str | None
    dtype: str
    max_batch_size: int | None = None
    num_draft_tokens: int = 4
    threads: int = 2
    max_load: float | None = None  # wait for a 1-minute load average at most this before starting
    profile: tuple[str, ...] = ()  # systems to run under cProfile (timed region only)
    oracle_passes: int = 1  # see OracleSystem (benchmark/oracle.py)
    slow_systems: tuple[str, ...] = ()  # these run `slow_repeats` times instead of `repeats`
    slow_repeats: int = 1
    feature_drafter: str | None = None  # a trained feature-level drafter's directory
    replicas: int = 1  # engine systems as this many rollout replicas sharing `threads`
    paired: bool = False  # the systems of a repeat take turns round by round in one process (paired.py)

    def repeats_of(self, system: str) -> int:
        return min(self.slow_repeats, self.repeats) if system in self.slow_systems else self.repeats

    def run_order(self) -> tuple[str, ...]:
        """The systems in run order: `ar` first when another system needs its outputs."""
        bases = [parse_system(s)[0] for s in self.systems]
        unknown = [s for s, base in zip(self.systems, bases) if base not in SYSTEMS]
        if unknown:
            raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)} (any of them "
                             "as NAME@K: at draft length K)")
        if not any(SYSTEMS[base].needs_reference for base in bases):
            return tuple(dict.fromkeys(self.systems))
        return tuple(dict.fromkeys((REFERENCE_SYSTEM, *self.systems)))

    def paired_problem(self) -> str | None:
        """Why this plan cannot run paired (None: it can or is not paired); unknown systems raise ValueError."""
        order = self.run_order()
        if not self.paired:
            return None
        return check_pairable(order, [parse_system(s)[0] for s in order], self.replicas)

    def repeat_order(self, repeat: int) -> tuple[str, ...]:
        """The systems in the order repeat `repeat` runs them: `run_order` rotated by `repeat` places, so no system
        always runs first or right after the same one (trace B, session 26: the second run of each pair took ~0.6%
        longer, and `ar` had run first in every repeat); `ar` stays first when another system needs its outputs."""
        order = self.run_order()
        pinned = order[:1] if order and order[0] == REFERENCE_SYSTEM and \
            any(SYSTEMS[parse_system(s)[0]].needs_reference for s in order) else ()
        rest = order[len(pinned):]
        if not rest:
            return order
        shift = repeat % len(rest)
        return (*pinned, *rest[shift:], *rest[:shift])

    def spec(self, system: str, reference: Path | None, history: Path | None = None) -> RunSpec:
        profile = str(self.out / "runs" / f"{system}.prof") if system in self.profile else None
        base, k = parse_system(system)
        return RunSpec(system=base, trace=self.trace, target=self.target, drafter=self.drafter, dtype=self.dtype,
                       max_batch_size=self.max_batch_size, num_draft_tokens=k or self.num_draft_tokens,
                       threads=self.threads, reference_path=str(reference) if reference else None,
                       oracle_passes=self.oracle_passes, profile_path=profile,
                       history_path=str(history) if history else None, feature_drafter=self.feature_drafter,
                       replicas=self.replicas)

    def history_spec(self) -> RunSpec:
        """Trace C's earlier rollout: `ar` on the same prompts with the previous step's seed."""
        assert self.trace.history_seed is not None
        earlier = self.trace.with_overrides(seed=self.trace.history_seed)
        return dataclasses.replace(self.spec(REFERENCE_SYSTEM, None), trace=earlier)


def run_worker(spec: RunSpec, out_json: Path) -> dict[str, Any]:
    """Run one system in a fresh interpreter; its stderr goes to a .log beside the JSON."""
    spec_path = out_json.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec.to_dict(), indent=1), encoding="utf-8")
    env = os.environ | {
        "OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    log_path = out_json.with_suffix(".log")
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.run([sys.executable, "-m", "benchmark.worker", str(spec_path), str(out_json)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{spec.system} failed (exit {proc.returncode}): " + " | ".join(tail))
    return json.loads(out_json.read_text(encoding="utf-8"))


def run_bench(plan: BenchPlan, command: str = "") -> dict[str, Any]:
    """Run the plan and write trace.json, runs/, results.json and results.md; return the results."""
    runs_dir = plan.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    _write_json(plan.out / "trace.json", {"trace": plan.trace.to_dict(), "items": trace_items(plan.trace)})
    load_readings = wait_for_quiet(plan.max_load) if plan.max_load is not None else []
    started = time.time()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in plan.run_order()}
    errors: dict[str, str] = {}
    skipped = {s: why for s in plan.run_order() if (why := system_unavailable(parse_system(s)[0])) is not None}
    for system, why in skipped.items():
        logger.warning("skipping %s: %s", system, why)
    history = run_history(plan, runs_dir) if plan.trace.needs_history else None
    for repeat in range(plan.repeats if plan.paired else 0):
        _run_paired_repeat(plan, repeat, history, runs, errors, skipped)
    for repeat in range(0 if plan.paired else plan.repeats):
        reference: Path | None = None
        for system in plan.repeat_order(repeat):
            if system in errors or system in skipped or repeat >= plan.repeats_of(system):
                continue
            out_json = runs_dir / f"{system}-{repeat}.json"
            try:
                result = run_worker(plan.spec(system, reference, history), out_json)
            except RuntimeError as exc:
                logger.error("%s", exc)
                errors[system] = str(exc)
                continue
            runs[system].append(result)
            logger.info("repeat %d %-8s %7.1f s  %6.1f tok/s  accept len %.2f  load avg %.2f  others' CPU %.0f%%  "
                        "memory %.0f GB/s", repeat, system, result["makespan_s"], result["tokens_per_s"],
                        result["mean_accept_len"], result["loadavg_1m_start"], 100 * (result["others_cpu_share"] or 0),
                        result["mem_read_gbps"])
            if system == REFERENCE_SYSTEM:
                reference = runs_dir / f"{system}-{repeat}.reference.json"
                write_references(reference, plan.trace.seed, result["sequences"])
    results = {
        "command": command,
        "started": started,
        "finished": time.time(),
        "machine": machine_info(plan.threads),
        "load_before_start": load_readings,
        "trace": plan.trace.to_dict(),
        "settings": {"target": plan.target, "drafter": plan.drafter, "dtype": plan.dtype,
                     "max_batch_size": plan.max_batch_size, "num_draft_tokens": plan.num_draft_tokens,
                     "threads": plan.threads, "replicas": plan.replicas, "repeats": plan.repeats,
                     "paired": plan.paired,
                     "oracle_passes": plan.oracle_passes,
                     "repeats_per_system": {s: plan.repeats_of(s) for s in plan.run_order()},
                     "run_order": list(plan.run_order()),
                     "num_sequences": plan.trace.num_sequences},
        "systems": aggregate({s: r for s, r in runs.items() if s not in skipped}, errors),
        "skipped": skipped,
    }
    _write_json(plan.out / "results.json", results)
    (plan.out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    write_plots(plan.out, results)
    return results


def _run_paired_repeat(plan: BenchPlan, repeat: int, history: Path | None, runs: dict[str, list[dict[str, Any]]],
                       errors: dict[str, str], skipped: dict[str, str]) -> None:
    """One repeat of a paired plan (paired.py): every system that has not failed, taking turns in one process;
    each system's figures go to runs/<system>-<repeat>.json as a run of its own would."""
    runs_dir = plan.out / "runs"
    order = turn_order([s for s in plan.run_order() if s not in errors and s not in skipped], repeat)
    if len(order) < 2:
        return
    try:
        results = run_paired_worker([(system, plan.spec(system, None, history)) for system in order],
                                    runs_dir / f"paired-{repeat}.json")
    except RuntimeError as exc:
        logger.error("%s", exc)
        errors.update({system: str(exc) for system in order})
        return
    for system in order:
        result = results[system]
        if "error" in result:
            logger.error("%s failed: %s", system, result["error"])
            errors[system] = result["error"]
            continue
        _write_json(runs_dir / f"{system}-{repeat}.json", result)
        runs[system].append(result)
        logger.info("repeat %d %-8s %7.1f s (own turns: %d)  %6.1f tok/s  accept len %.2f  memory %.0f GB/s", repeat,
                    system, result["makespan_s"], result["paired"]["turns"], result["tokens_per_s"],
                    result["mean_accept_len"], result["mem_read_gbps"])


def run_history(plan: BenchPlan, runs_dir: Path) -> Path:
    """Roll out the trace's earlier step once (untimed, `ar`); its outputs per request, for history drafters."""
    path = runs_dir / "history.json"
    if not path.exists():
        result = run_worker(plan.history_spec(), runs_dir / "history-ar.json")
        outputs: dict[str, list[list[int]]] = {}
        for seq in result["sequences"]:
            outputs.setdefault(seq["id"], []).append(seq["token_ids"])
        _write_json(path, outputs)
        logger.info("earlier rollout for the history drafters: %d sequences in %.1f s", len(result["sequences"]),
                    result["makespan_s"])
    return path


def aggregate(runs: dict[str, list[dict[str, Any]]], errors: dict[str, str]) -> dict[str, Any]:
    """Per system: every per-run figure as a list (one per repeat) and identity to `ar` repeat 0."""
    reference = runs.get(REFERENCE_SYSTEM, [None])[0] if runs.get(REFERENCE_SYSTEM) else None
    summary: dict[str, Any] = {}
    for system, results in runs.items():
        entry: dict[str, Any] = {"repeats": len(results)}
        for figure in PER_RUN_FIGURES:  # None where a run predates the figure (--report-only on older runs)
            entry[figure] = [r.get(figure) for r in results]
        entry["identical_to_ar"], entry["mismatches"] = _identity(results, reference)
        entry["time_split"] = [time_split(r.get("engine_stats")) for r in results]
        entry["batch_phases"] = [batch_phases(r.get("engine_stats")) for r in results]
        entry["drafter_use"] = [drafter_use(r.get("engine_stats")) for r in results]
        entry["finish_reasons"] = _finish_reasons(results[0]) if results else {}
        if any("paired" in r for r in results):  # what each paired run's own turns held (paired.py)
            entry["paired"] = [{key: value for key, value in (r.get("paired") or {}).items()
                                if key in PAIRED_FIGURES} for r in results]
        if results and (results[0].get("engine_stats") or {}).get("vllm_version"):
            entry["vllm_version"] = results[0]["engine_stats"]["vllm_version"]
        if system in errors:
            entry["error"] = errors[system]
        summary[system] = entry
    return summary


def time_split(stats: dict[str, Any] | None) -> dict[str, float] | None:
    """An engine run's wall time by phase (None for systems without engine stats)."""
    if not stats or "timeline" not in stats:
        return None
    timeline = stats["timeline"]
    rows = sum(e["rows"] for e in timeline) or 1
    split = {key: stats[key] for key in ("total_s", "prefill_s", "draft_s", "verify_s")}
    split["host_s"] = max(stats["total_s"] - stats["prefill_s"] - stats["draft_s"] - stats["verify_s"], 0.0)
    split["rounds"] = len(timeline)
    split["mean_k"] = sum(e["k"] * e["rows"] for e in timeline) / rows
    decoupled = stats.get("decoupled") or {}
    split["worker_busy_s"] = decoupled.get("worker_busy_s")
    split["arm_rounds"] = stats.get("arm_rounds") or {}
    return split


def batch_phases(stats: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """An engine run's rounds grouped by the rows they ran: above 3/4 of the run's largest batch, above 3/8, above
    1/8, and the rest. Per group: the rows it spans ("25-32"), its rounds, their seconds (each round's from the end
    of the one before, so the first group's include the first prefill) and the tokens they emitted (a row's first
    token comes from its prefill, in no round's count). It shows where a run spends its time as its batch drains:
    on trace A (32 rows, 256 tokens) `ar`'s rows that run to the limit end together and it never runs under 5 rows,
    while `specactor`'s finish out of step and it ends with rounds at 1-4 rows (bench/session45)."""
    if not stats or not stats.get("timeline"):
        return None
    timeline = stats["timeline"]
    peak = max(entry["rows"] for entry in timeline)
    edges = [peak, 3 * peak // 4, 3 * peak // 8, peak // 8, 0]
    bands = [(low + 1, high) for high, low in zip(edges, edges[1:]) if high > low]  # rows low..high, largest first
    phases = [{"rows": f"{low}-{high}" if high > low else str(high), "rounds": 0, "seconds": 0.0, "tokens": 0}
              for low, high in bands]
    previous = 0.0
    for entry in timeline:
        phase = phases[next(i for i, (low, high) in enumerate(bands) if low <= entry["rows"] <= high)]
        phase["rounds"] += 1
        phase["seconds"] += entry["t"] - previous
        phase["tokens"] += entry["emitted"]
        previous = entry["t"]
    return phases


def drafter_use(stats: dict[str, Any] | None) -> dict[str, dict[str, float]] | None:
    """Per draft method of an engine run: tokens it drafted that were verified and how many were accepted,
    shadow drafts scored against the commits (shadow.py) and their accepted tokens, in-process drafting s."""
    if not stats or "timeline" not in stats:
        return None
    fields = {"verified_tokens": "drafted_per_drafter", "accepted_tokens": "accepted_per_drafter",
              "shadow_drafts": "shadow_drafts_per_drafter", "shadow_accepted": "shadow_accepted_per_drafter",
              "draft_s": "draft_s_per_drafter"}
    use: dict[str, dict[str, float]] = {}
    for figure, key in fields.items():
        for method, value in (stats.get(key) or {}).items():
            use.setdefault(method, dict.fromkeys(fields, 0))[figure] = value
    return use


def rerender(out: Path) -> dict[str, Any]:
    """Rebuild results.json, results.md and the plots of `out` from its runs/ (after a report change;
    no system is run). Systems keep their recorded errors; the machine and command stay as recorded."""
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs: dict[str, list[dict[str, Any]]] = {}
    for system, entry in results["systems"].items():
        found = [out / "runs" / f"{system}-{i}.json" for i in range(entry["repeats"])]
        missing = [str(path) for path in found if not path.exists()]
        if missing:
            raise FileNotFoundError(f"{out}: runs of {system!r} are missing: {', '.join(missing)}")
        runs[system] = [json.loads(path.read_text(encoding="utf-8")) for path in found]
    errors = {system: entry["error"] for system, entry in results["systems"].items() if entry.get("error")}
    results["systems"] = aggregate(runs, errors)
    _write_json(out / "results.json", results)
    (out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    write_plots(out, results)
    return results


def _identity(results: list[dict[str, Any]], reference: dict[str, Any] | None) -> tuple[list[float], list[Any]]:
    """identical_to_ar per repeat, and the first repeat's mismatches (None without an `ar` run)."""
    if reference is None:
        return [], []
    fractions, listed = [], None
    for result in results:
        fraction, mismatches = compare_to_reference(result["sequences"], reference["sequences"])
        fractions.append(fraction)
        if listed is None:
            listed = mismatches[:MAX_LISTED_MISMATCHES]
    return fractions, listed or []


def _finish_reasons(result: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in result["sequences"]:
        counts[seq["finish_reason"]] = counts.get(seq["finish_reason"], 0) + 1
    return counts


def _write_json(path: Path, data: Any) -> None:
    # default=str: reasoning-gym metadata holds Fractions and the like
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
