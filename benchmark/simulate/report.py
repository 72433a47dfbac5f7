"""Validation (predicted against measured makespans) and projection tables of the simulator."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmark.simulate.costs import CostModel
from benchmark.simulate.facts import Facts
from benchmark.simulate.replay import Replayed, calibrate_sampling, replay, sources_of, variant

VALIDATED = ("ar", "coupled", "coupled-feature", "specactor", "oracle-dynamic")
# public GPU results a projection is read beside (labelled as theirs, not reproduced here)
PUBLISHED = (
    "SpecActor paper (arXiv 2511.16193 v3, as summarised in the project brief): 2.0-2.4x mean rollout speedup "
    "(up to 2.7x) over common post-training baselines, 1.1-2.6x over vanilla speculative rollout",
    "SGLang PR #22520 (the SpecActor authors' table): 1.81-1.91x at batch 1-16 and 1.21x at batch 64, 70B verifier "
    "with a 1B drafter",
    "NeMo-RL's EAGLE-3 speculative rollouts: 1.8x generation",
)


@dataclass
class ValidationRow:
    system: str
    measured_s: float
    predicted_s: float
    error: float  # (predicted - measured) / measured
    replayed: Replayed  # the median replay
    replays: list[float]  # every replay's makespan, ascending
    by_number: list[float] = field(default_factory=list)  # the same in replay order: replay i of every system drew
    # the same disturbance stream (`Disturbance.restart`), so systems compare replay by replay

    def line(self) -> str:
        return (f"{self.system:<16} measured {self.measured_s:7.1f} s  predicted {self.predicted_s:7.1f} s  "
                f"error {self.error * 100:+6.1f}%  (accept len {self.replayed.mean_accept_len:.2f}, "
                f"rounds {self.replayed.rounds}, replays {min(self.replays):.1f}-{max(self.replays):.1f} s)")


def measured_makespans(run_dir: Path) -> dict[str, float]:
    """Median makespan of every system in the directory's results.json (errors left out)."""
    path = run_dir / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a benchmark result ({exc})") from None
    return {name: statistics.median(entry["makespan_s"]) for name, entry in results.get("systems", {}).items()
            if entry.get("makespan_s") and "error" not in entry}


def own_outputs(run_dir: Path, system: str, facts: Facts) -> list[list[int]]:
    """The system's first run's outputs in the facts' sequence order (they differ from `ar`'s only at bf16
    near-ties, and for the oracle wherever its references did)."""
    path = run_dir / "runs" / f"{system}-0.json"
    sequences = json.loads(path.read_text(encoding="utf-8"))["sequences"]
    by_id = {(s["id"], s["sample"]): s["token_ids"] for s in sequences}
    return [by_id[(s.id, s.sample)] for s in facts.sequences]


def replayable(system: str, facts: Facts) -> bool:
    try:
        v = variant(system)
    except ValueError:
        return False
    return v.mode == "ar" or bool(sources_of(system, facts))


def measured_forward_s(run_dir: Path, system: str = "ar") -> float | None:
    """The forward seconds (engine `verify_s`) of the system's first run, if the directory has one."""
    path = run_dir / "runs" / f"{system}-0.json"
    if not path.exists():
        return None
    return float(json.loads(path.read_text(encoding="utf-8"))["engine_stats"]["verify_s"])


def validate(run_dir: Path, facts: Facts, costs: CostModel, systems: Sequence[str] | None = None,
             progress: Callable[[str], None] = print, replays: int = 3) -> list[ValidationRow]:
    """Replay every measured engine system of the directory (or `systems`) under `costs`, `replays` times:
    the prediction is their median (a replay's policy reacts to its own host timings, as a run's does, so
    replays of one system differ by a few percent)."""
    measured = measured_makespans(run_dir)
    names = [s for s in (systems or measured) if s in measured and replayable(s, facts)]
    rows = []
    forward = measured_forward_s(run_dir)
    holds = False
    if forward is not None:
        holds, why = calibrate_sampling(facts, costs, forward)
        progress(why)
    for name in names:
        progress(f"replaying {name} ...")
        # an oracle drafts the reference outputs, and where its own outputs part from them (bf16 near-ties) its
        # drafts stop matching: it is replayed emitting its own outputs. A drafter system drafts from the
        # prefix it committed, and its facts along `ar`'s outputs stand for its own (a near-tie of the target
        # moves the outputs, not how well a drafter follows them)
        truth = own_outputs(run_dir, name, facts) if variant(name).needs_reference else None
        in_order = [replay(name, facts, costs, truth=truth, sampling_in_profile=holds, number=i)
                    for i in range(max(replays, 1))]
        results = sorted(in_order, key=lambda r: r.makespan_s)
        if not all(r.identical for r in results):
            raise RuntimeError(f"{name}: the replay emitted other tokens than the run (a replay bug)")
        result = results[len(results) // 2]
        rows.append(ValidationRow(name, measured[name], result.makespan_s,
                                  (result.makespan_s - measured[name]) / measured[name], result,
                                  [r.makespan_s for r in results], [r.makespan_s for r in in_order]))
    return rows


def project(facts: Facts, costs: CostModel, batches: Sequence[int], systems: Sequence[str], host_scale: float,
            progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Makespan of each system at each per-worker batch size; speedups against `ar` at the same batch.
    Batches above the trace's sequence count replay its sequences tiled (Facts.tiled) to 2x the batch, so the
    batch stays full until the tail."""
    rows = []
    for batch in batches:
        base = None
        for system in ("ar", *[s for s in systems if s != "ar"]):
            if not replayable(system, facts):
                continue
            progress(f"batch {batch}: replaying {system} ...")
            times = max(1, -(-2 * batch // len(facts.sequences))) if batch > len(facts.sequences) // 2 else 1
            result = replay(system, facts.tiled(times), costs, max_batch_size=batch, host_scale=host_scale,
                            compact_vocab=True)
            base = result.makespan_s if system == "ar" else base
            rows.append({"batch": batch, "system": system, "makespan_s": round(result.makespan_s, 4),
                         "speedup": round(base / result.makespan_s, 3) if base else None,
                         "accept_len": round(result.mean_accept_len, 3), "rounds": result.rounds,
                         "modelled_s": round(result.modelled_s, 4), "host_s": round(result.host_s, 4)})
    return rows


def projection_markdown(rows: list[dict[str, Any]], costs: CostModel, facts: Facts, host_scale: float) -> str:
    systems = list(dict.fromkeys(r["system"] for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    cell = {(r["batch"], r["system"]): r for r in rows}
    lines = [f"Projection (not a measurement): trace {facts.trace['name']}'s recorded acceptance, replayed under "
             f"{costs.name}; host work x {host_scale:g}.", "",
             "| rows per worker | " + " | ".join(f"`{s}`" for s in systems) + " |",
             "|---|" + "---|" * len(systems)]
    for b in batches:
        parts = []
        for s in systems:
            r = cell.get((b, s))
            parts.append("-" if r is None else f"{r['speedup']:.2f}x ({r['makespan_s']:.2f} s, {r['accept_len']:.2f})")
        lines.append(f"| {b} | " + " | ".join(parts) + " |")
    lines += ["", "Cells: speedup against `ar` at the same batch (makespan, tokens per row per target forward).",
              *[f"- {note}" for note in costs.notes], "", "Published GPU results to read it beside:",
              *[f"- {p}" for p in PUBLISHED]]
    return "\n".join(lines) + "\n"


def rows_json(rows: list[ValidationRow]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        replayed = asdict(r.replayed)
        replayed.pop("stats", None)
        out.append({"system": r.system, "measured_s": r.measured_s, "predicted_s": r.predicted_s, "error": r.error,
                    "replays_s": r.replays, "replays_by_number_s": r.by_number, **{k: v for k, v in replayed.items() if k != "system"}})
    return out
