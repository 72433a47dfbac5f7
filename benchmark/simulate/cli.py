"""`specactor simulate`: replay a benchmark run under a cost model (benchmark/simulate/__init__.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Optional

import typer

from benchmark.simulate.costs import GPUS, CostModel, Disturbance, profile_costs, roofline_costs, table_costs
from benchmark.simulate.facts import FACTS_FILE, Facts, gather
from benchmark.simulate.report import (VALIDATED, measured_makespans, project, projection_markdown, replayable,
                                       rows_json, validate)
from benchmark.simulate.replay import sources_of, variant

COST_HELP = ("cpu: the engine's profile on the machine that gathered the facts (validation); roofline:h100 or "
             "roofline:h200: a GPU from its datasheet; table:PATH: a verify-cost table from `make gpu-check` "
             "(e.g. bench/gpu/h200-2026-11-26/run1-tests-tables/cost_qwen2.5-1.5b.json) with roofline drafting.")


def _cost_model(spec: str, facts: Facts, overhead_ms: float | None) -> CostModel:
    kind, _, arg = spec.partition(":")
    if kind == "cpu":
        return profile_costs(facts)
    gpu = GPUS.get(arg if kind == "roofline" else "h100")
    if gpu is None:
        raise typer.BadParameter(f"unknown GPU {arg!r}; known: {', '.join(GPUS)}", param_hint="--cost")
    if overhead_ms is not None:
        gpu = dataclasses.replace(gpu, overhead_s=overhead_ms / 1e3)
    if kind == "roofline":
        return roofline_costs(facts, gpu)
    if kind == "table":
        path = Path(arg)
        if not path.is_file():
            raise typer.BadParameter(f"{path}: no such cost table", param_hint="--cost")
        return table_costs(facts, path, gpu)
    raise typer.BadParameter(f"{spec!r}: expected cpu, roofline:GPU or table:PATH", param_hint="--cost")


def _disturbance(width_factors: str | None, jitter: float, spells: str | None, seed: int) -> Disturbance | None:
    """--width-factors, --jitter, --spells as a `Disturbance` (None: none asked)."""
    if width_factors is None and not jitter and spells is None:
        return None
    try:
        factors = tuple(float(f) for f in width_factors.split(",") if f.strip()) if width_factors else ()
    except ValueError:
        raise typer.BadParameter(f"{width_factors!r}: expected comma-separated numbers, e.g. 1.7,1.5,1.2",
                                 param_hint="--width-factors") from None
    every, rounds, scale = 0, 0, 1.0
    if spells is not None:
        parts = spells.split(",")
        try:
            if len(parts) != 3:
                raise ValueError
            every, rounds, scale = int(parts[0]), int(parts[1]), float(parts[2])
        except ValueError:
            raise typer.BadParameter(f"{spells!r}: expected EVERY,ROUNDS,SCALE, e.g. 150,10,2",
                                     param_hint="--spells") from None
    try:
        return Disturbance(factors, jitter, every, rounds, scale, seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--width-factors/--spells") from None


def _systems(option: str | None, run_dir: Path) -> list[str]:
    if option:
        names = [s.strip() for s in option.split(",") if s.strip()]
        for name in names:
            variant(name)  # an unknown name fails here, with the known ones listed
        return names
    measured = measured_makespans(run_dir) if (run_dir / "results.json").exists() else {}
    return [s for s in measured if s in VALIDATED] or list(VALIDATED)


def _sources(systems: list[str]) -> list[str]:
    out: list[str] = []
    for system in systems:
        for source in sources_of(system):
            if source not in out:
                out.append(source)
    return out


def simulate(
    run_dir: Path = typer.Option(..., "--from", help="A benchmark output directory (results.json, runs/).",
                                 metavar="DIR"),
    validate_: bool = typer.Option(False, "--validate", help="Replay each measured system under the CPU profile and "
                                   "print measured, predicted and relative error, then `max error: X%`."),
    systems: Optional[str] = typer.Option(None, help="Comma-separated systems (default: the directory's ar, "
                                          "coupled, coupled-feature, specactor and oracle-dynamic)."),
    cost: str = typer.Option("cpu", help=COST_HELP),
    batch: Optional[str] = typer.Option(None, help="Comma-separated rows per worker to project at (e.g. "
                                        "1,2,4,8,16): each system's speedup against `ar` at each."),
    host_scale: float = typer.Option(1.0, min=0.0, help="Weight of the engine's host work as timed here (1: as "
                                     "measured on this CPU; 0: a free host, the device alone)."),
    replays: int = typer.Option(3, min=1, help="Replays per system in --validate; the prediction is their median."),
    overhead_ms: Optional[float] = typer.Option(None, min=0.0, help="A GPU forward's fixed cost in ms (launches, "
                                                "host): roofline forwards and draft steps, and table drafting "
                                                "(default 2.0, costs.Gpu)."),
    gather_facts: bool = typer.Option(False, "--gather", help="Gather the acceptance facts again (loads the "
                                      "models; done anyway when DIR has no facts.json)."),
    out: Optional[Path] = typer.Option(None, help="Write simulate.json / projection.md here (default: DIR)."),
    width_factors: Optional[str] = typer.Option(None, help="Charge each verify width this factor of the profile, "
                                                "unseen by the policy (comma-separated, width 1 first; the last "
                                                "carries on), e.g. 1.7,1.5,1.2,1.0,0.95: trace D in a slow memory "
                                                "state (docs/simulate.md 3.1)."),
    jitter: float = typer.Option(0.0, min=0.0, help="Spread of each verify round's charge: a lognormal factor "
                                 "with this sigma (0.15: +-15%)."),
    spells: Optional[str] = typer.Option(None, help="EVERY,ROUNDS,SCALE: every EVERY-th verify starts ROUNDS "
                                         "verifies charged SCALE x (slow spells), e.g. 150,10,2."),
    seed: int = typer.Option(0, help="Seed of the jitter (replay i of each system draws the same stream)."),
) -> None:
    """Replay a recorded benchmark run under a cost model: acceptance facts from its outputs, the engine's
    own loop and policies on a simulated clock (docs/simulate.md)."""
    disturbance = _disturbance(width_factors, jitter, spells, seed)  # a malformed option fails before any work
    if not (run_dir / "runs").is_dir():
        typer.echo(f"error: --from {run_dir}: no runs/ folder here (expected the --out folder of `python -m "
                   "benchmark` or `specactor bench`)", err=True)
        raise typer.Exit(2)
    names = _systems(systems, run_dir)
    facts_path = run_dir / FACTS_FILE
    if gather_facts or not facts_path.exists():
        sources = _sources(names)
        typer.echo(f"gathering acceptance facts of {', '.join(sources) or 'no drafter'} over {run_dir}'s `ar` outputs")
        try:
            facts = gather(run_dir, sources, progress=typer.echo)
        except FileNotFoundError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        facts.save(facts_path)
        typer.echo(f"wrote {facts_path}")
    else:
        try:
            facts = Facts.load(facts_path)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    missing = [s for s in names if not replayable(s, facts)]
    if missing:
        typer.echo(f"note: no facts for {', '.join(missing)}'s draft sources (run with --gather); left out")
    names = [s for s in names if s not in missing]
    costs = _cost_model(cost, facts, overhead_ms)
    costs.disturbance = disturbance
    if costs.disturbance is not None:
        costs.notes.append(f"disturbed: {costs.disturbance}")
    target_dir = out or run_dir
    target_dir.mkdir(parents=True, exist_ok=True)
    header = {"from": str(run_dir), "cost": costs.name, "notes": costs.notes, "host_scale": host_scale}
    if not validate_ and not batch:
        typer.echo("nothing asked: add --validate and/or --batch (see --help)")
        return
    if validate_:
        rows = validate(run_dir, facts, costs, names, replays=replays,
                        progress=lambda line: typer.echo(line) if line.startswith("`ar`") else None)
        if not rows:
            typer.echo(f"error: {run_dir} has no measured system the facts can replay ({', '.join(names)})", err=True)
            raise typer.Exit(2)
        for row in rows:
            typer.echo(row.line())
        worst = max(abs(r.error) for r in rows)
        typer.echo(f"max error: {worst * 100:.1f}%")
        _write_json(target_dir / "simulate-validate.json", {**header, "validation": rows_json(rows), "max_error": worst})
    if batch:
        try:
            batches = [int(b) for b in batch.split(",") if b.strip()]
        except ValueError:
            raise typer.BadParameter(f"{batch!r}: expected comma-separated integers", param_hint="--batch") from None
        projected = project(facts, costs, batches, names, host_scale, progress=lambda _: None)
        text = projection_markdown(projected, costs, facts, host_scale)
        typer.echo(text)
        overhead = f"-overhead{overhead_ms:g}ms" if overhead_ms is not None and cost != "cpu" else ""
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{cost.rsplit('/', 1)[-1]}{overhead}-host{host_scale:g}").strip("-")
        (target_dir / f"projection-{slug}.md").write_text(text, encoding="utf-8")
        _write_json(target_dir / f"projection-{slug}.json", {**header, "projection": projected})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


__all__ = ["simulate"]
