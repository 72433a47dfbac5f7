"""End-to-end post-training step time: the same `specactor train` run with speculative rollouts (the config's
`rollout.mode`) and with plain decoding (`rollout.mode=ar`), side by side.

    python -m benchmark.e2e                                   # the `make run` config, 5 steps each way
    python -m benchmark.e2e --config C --steps 5 --repeats 2 --out bench/e2e

Each run is a fresh `specactor train` process in its own run directory under --runs (checkpoints included, so
not beside the results; the evaluation is switched off: only the steps are timed); the modes alternate (speculative, ar, speculative, ...) so that a drift of the
shared machine falls on both. Reported per mode: the median over the runs' steps of the step time and of its
parts (rollout, reward, update, sync; steps/NNNNNN/metrics.json), the rollouts' acceptance length, and the
ratio of the medians. Written as e2e.json and e2e.md. Speed lives here, not in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmark.machine import REPO_ROOT, busy_cpu_s, machine_info

DEFAULT_CONFIG = "configs/train_smollm2.yaml"
PARTS = ("step", "rollout", "reward", "update", "sync")


def train_command(config: str, run_dir: Path, steps: int, mode: str | None, extra: list[str]) -> list[str]:
    """The `specactor train` command of one run (mode None: the config's rollout.mode)."""
    script = Path(sys.executable).with_name("specactor")  # the venv's console script
    command = [str(script) if script.exists() else "specactor", "train", "--config", config,
               "--set", f"train.run_dir={run_dir}", "--set", f"train.steps={steps}",
               "--set", "train.eval.enabled=false"]
    if mode is not None:
        command += ["--set", f"rollout.mode={mode}"]
    for override in extra:
        command += ["--set", override]
    return command


def step_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics of a finished run's steps 1..N (step 0 holds only an evaluation)."""
    files = sorted((run_dir / "steps").glob("[0-9]*/metrics.json"))
    steps = [json.loads(path.read_text()) for path in files]
    return [m for m in steps if m.get("step", 0) > 0]


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps of each part's seconds, the acceptance length and the step count."""
    summary: dict[str, Any] = {"steps": len(steps)}
    for part in PARTS:
        values = [m[f"time/{part}_s"] for m in steps if f"time/{part}_s" in m]
        summary[f"{part}_s"] = statistics.median(values) if values else None
    lengths = [m["rollout/mean_acceptance_length"] for m in steps if "rollout/mean_acceptance_length" in m]
    summary["accept_len"] = statistics.median(lengths) if lengths else None
    rewards = [m["reward/mean"] for m in steps if "reward/mean" in m]
    summary["reward_mean"] = statistics.mean(rewards) if rewards else None
    return summary


def report(results: dict[str, Any]) -> str:
    """The markdown table of the two modes and their ratio."""
    modes = results["modes"]
    spec, plain = modes["speculative"], modes["ar"]
    others = results.get("others_cpu_share")
    lines = [f"# End-to-end step time: `{results['config']}`", "",
             f"- {results['runs_per_mode']} run(s) per mode x {results['steps']} steps, medians over all steps"
             + (f"; others' CPU {others:.0%}" if others is not None else ""),
             f"- command: `{results['command']}`", "",
             "| rollouts | step s | rollout s | reward s | update s | sync s | accept len |",
             "|---|---|---|---|---|---|---|"]
    for label, summary in ((f"speculative (`{results['speculative_mode']}`)", spec), ("plain decoding (`ar`)", plain)):
        cells = [f"{summary[f'{part}_s']:.1f}" if summary[f"{part}_s"] is not None else "-" for part in PARTS]
        accept = f"{summary['accept_len']:.2f}" if summary["accept_len"] is not None else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {accept} |")
    lines += ["", f"Step time, `ar` / speculative: **{results['step_speedup']:.2f}x**; rollout time: "
              f"**{results['rollout_speedup']:.2f}x**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a train config (default: the `make run` one)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (alternating)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="an extra config override for both modes, e.g. --set sampling.max_new_tokens=64")
    parser.add_argument("--out", type=Path, default=Path("bench/e2e"), help="results (e2e.json, e2e.md, logs)")
    parser.add_argument("--runs", type=Path, default=Path("runs/e2e"), help="the runs' directories (checkpoints)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from specactor_engine.config import load_config

    speculative_mode = load_config(args.config, args.overrides).rollout.mode
    steps: dict[str, list[dict[str, Any]]] = {"speculative": [], "ar": []}
    busy_before, wall_before = busy_cpu_s(), time.perf_counter()
    for repeat in range(args.repeats):
        for label, mode in (("speculative", None), ("ar", "ar")):
            run_dir = args.runs / f"{label}-{repeat}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            command = train_command(args.config, run_dir, args.steps, mode, args.overrides)
            print(f"[{label} {repeat + 1}/{args.repeats}] {' '.join(command[1:])}", flush=True)
            with (args.out / f"{label}-{repeat}.log").open("w") as log:
                done = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise SystemExit(f"{label} run {repeat} failed (exit {done.returncode}); see "
                                 f"{args.out / f'{label}-{repeat}.log'}")
            ran = step_metrics(run_dir)
            steps[label] += ran
            print(f"  step s {[round(m['time/step_s'], 1) for m in ran]}", flush=True)
    wall = time.perf_counter() - wall_before
    others = None
    if busy_before is not None:  # the runs' own processes are children: their CPU is all but the others'
        children = os.times()
        own = children.children_user + children.children_system
        capacity = wall * (os.cpu_count() or 1)
        busy = busy_cpu_s() - busy_before  # type: ignore[operator]
        others = max(0.0, min(1.0, (busy - own) / capacity)) if capacity else None
    modes = {label: summarize(ran) for label, ran in steps.items()}
    results = {
        "config": args.config, "steps": args.steps, "runs_per_mode": args.repeats, "overrides": args.overrides,
        "speculative_mode": speculative_mode, "modes": modes,
        "step_speedup": modes["ar"]["step_s"] / modes["speculative"]["step_s"],
        "rollout_speedup": modes["ar"]["rollout_s"] / modes["speculative"]["rollout_s"],
        # the runs use torch's default threads: every core
        "others_cpu_share": others, "machine": machine_info(os.cpu_count() or 1),
        "command": "python -m benchmark.e2e " + " ".join(argv if argv is not None else sys.argv[1:]),
        "per_step": steps,
    }
    (args.out / "e2e.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    text = report(results)
    (args.out / "e2e.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
