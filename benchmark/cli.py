"""The `bench` command: run systems side by side on a trace and write results.json / results.md.

    python -m benchmark --trace A --systems hf,ar,coupled,specactor,oracle --repeats 3 --out bench/A

`bench` is also importable for registering as `specactor bench`.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from benchmark.traces import MODEL_PAIRS, TRACES, ModelPair, get_trace

USER_ERROR_EXIT_CODE = 2

app = typer.Typer(name="bench", add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=USER_ERROR_EXIT_CODE)


def parse_model(text: str | None, default: ModelPair) -> ModelPair:
    """`qwen-pair`, `smollm2`, `TARGET` or `TARGET:DRAFTER` (names or local dirs); None: the trace's pair."""
    if text is None:
        return default
    if text in MODEL_PAIRS:
        return MODEL_PAIRS[text]
    target, _, drafter = text.partition(":")
    if not target:
        _fail(f"--model {text!r}: expected a pair name ({', '.join(MODEL_PAIRS)}) or TARGET[:DRAFTER]")
    return ModelPair(target, drafter or None)


def command_line() -> str:
    """How this process was started, for the results (`python -m benchmark ...` or `specactor bench ...`)."""
    program = Path(sys.argv[0]).name
    return " ".join(["python -m benchmark" if program == "__main__.py" else program, shlex.join(sys.argv[1:])])


@app.command()
def bench(
    out: Annotated[Path, typer.Option("--out", help="Output directory (results.json, results.md, runs/).")],
    trace_name: Annotated[str, typer.Option("--trace", help=f"One of {', '.join(TRACES)}.")] = "quick",
    systems: Annotated[str, typer.Option(
        "--systems", help="Comma-separated systems; NAME@K runs one at draft length K instead of --num-draft-tokens "
        "(e.g. coupled@1,coupled@2,coupled for the best fixed k).")] = "hf,ar,coupled,specactor,oracle",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs per system, interleaved.")] = 1,
    model: Annotated[str | None, typer.Option("--model", help=f"{' | '.join(MODEL_PAIRS)} | TARGET[:DRAFTER].")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Override the trace's dtype.")] = None,
    max_batch: Annotated[int | None, typer.Option("--max-batch", "--batch-size", min=1,
                                                  help="Rows decoded at once (1: one sequence at a time; default: the trace's, "
                                                  "e.g. 4 for D, else all at once).")] = None,
    prompts: Annotated[int | None, typer.Option("--prompts", min=1, help="Use only the first N prompts.")] = None,
    samples: Annotated[int | None, typer.Option("--samples", min=1, help="Samples per prompt.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", min=1)] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", min=0.0, help="0 = greedy.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", min=0, help="Sampling seed.")] = None,
    history_seed: Annotated[int | None, typer.Option(
        "--history-seed", min=0, help="Roll the trace out once first (untimed, `ar`) with this seed, as the earlier "
        "step history drafters know (trace C sets 0).")] = None,
    num_draft_tokens: Annotated[int, typer.Option("--num-draft-tokens", "-k", min=1, max=16)] = 4,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch threads per system (all of them).")] = 2,
    replicas: Annotated[int, typer.Option(
        "--replicas", min=1, help="Run the engine systems as N rollout replicas (Ray actors, rollout.replicas) "
        "sharing --threads: --replicas 2 --threads 2 is two 1-thread engines (docs/distributed.md).")] = 1,
    wait_load: Annotated[float | None, typer.Option(
        "--wait-load", help="First wait (up to 10 min) for a 1-minute load average at most this.")] = None,
    profile: Annotated[str, typer.Option("--profile", help="Comma-separated systems to cProfile.")] = "",
    slow_systems: Annotated[str, typer.Option(
        "--slow-systems", help="Comma-separated systems that run only --slow-repeats times.")] = "",
    slow_repeats: Annotated[int, typer.Option("--slow-repeats", min=1, help="Runs of each slow system.")] = 1,
    oracle_passes: Annotated[int, typer.Option(
        "--oracle-passes", min=1, help="Oracle runs; all but the last are untimed and refresh its drafts.")] = 2,
    feature_drafter: Annotated[Path | None, typer.Option(
        "--feature-drafter", help="A trained feature-level drafter of the target (`make drafter-feature`): "
        "`coupled-feature` drafts with it alone, and `specactor` adds it to its methods.")] = None,
    paired: Annotated[bool, typer.Option(
        "--paired", help="Load every system into one process per repeat and let them take turns round by round, so "
        "each meets the same memory state; a system's makespan is the sum of its own turns (engine systems only; "
        "docs/benchmarking.md).")] = False,
    report_only: Annotated[bool, typer.Option(
        "--report-only", help="Run nothing: rebuild results.json, results.md and the plots of --out from its runs/ "
        "(after a change to the report).")] = False,
) -> None:
    """Run systems side by side on one trace (docs/benchmarking.md) and write the results.

    A system's first run on a machine measures its verify-cost profile before timing (minutes on a CPU: 170 s at
    4 rows, 523 s at 128 for Qwen 1.5B on 2 cores); it is cached under the cache dir and left out of makespans."""
    from benchmark.run import BenchPlan, rerender, run_bench

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if report_only:
        if not (out / "results.json").exists():
            _fail(f"--report-only: {out / 'results.json'} does not exist (run the benchmark into --out first)")
        try:
            rerender(out)
        except FileNotFoundError as exc:
            _fail(str(exc))
        typer.echo((out / "results.md").read_text(encoding="utf-8"))
        return
    try:
        trace = get_trace(trace_name)
    except ValueError as exc:
        _fail(str(exc))
    pair = parse_model(model, trace.model)
    trace = trace.with_overrides(num_prompts=prompts, samples_per_prompt=samples, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed, model=pair, dtype=dtype,
                                 history_seed=history_seed, max_batch_size=max_batch)
    if trace.history_seed is not None and trace.history_seed == trace.seed:
        _fail(f"--history-seed {trace.history_seed} equals the trace's seed: the earlier rollout would be the "
              "same samples")
    plan = BenchPlan(trace=trace, systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
                     repeats=repeats, out=out, target=pair.target, drafter=pair.drafter, dtype=trace.dtype,
                     max_batch_size=trace.max_batch_size, num_draft_tokens=num_draft_tokens, threads=threads,
                     max_load=wait_load, profile=tuple(s for s in profile.split(",") if s),
                     oracle_passes=oracle_passes, slow_systems=tuple(s for s in slow_systems.split(",") if s),
                     slow_repeats=slow_repeats, feature_drafter=str(feature_drafter) if feature_drafter else None,
                     replicas=replicas, paired=paired)
    try:
        problem = plan.paired_problem()
    except ValueError as exc:
        _fail(str(exc))
    if problem is not None:
        _fail(problem)
    count = len(plan.run_order())
    if paired and repeats % count:
        typer.echo(f"warning: {repeats} paired repeats of {count} systems do not give each system the first place "
                   "equally often; on traces B and C that place cost up to ~5% (docs/benchmarking.md): run a multiple "
                   f"of {count}", err=True)
    results = run_bench(plan, command=command_line())
    typer.echo((out / "results.md").read_text(encoding="utf-8"))
    if any(entry.get("error") for entry in results["systems"].values()):
        raise typer.Exit(code=1)
