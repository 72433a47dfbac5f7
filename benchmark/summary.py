"""One markdown table over several benchmark runs (for bench/README.md and the project README).

    python -m benchmark.summary bench/A bench/B bench/B-greedy bench/A-greedy

Each argument is an output directory of `specactor bench`; rows are its systems with medians over
repeats, the ratio to `ar` in that run, acceptance, identity to `ar` and the CPU other processes
took during the timed runs (the contamination check).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmark.metrics import spread


def _median(values: list[float | None]) -> float | None:
    stats = spread(values)
    return None if stats is None else stats["median"]


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summary_rows(out: Path) -> list[str]:
    results: dict[str, Any] = json.loads((out / "results.json").read_text(encoding="utf-8"))
    trace, systems = results["trace"], results["systems"]
    label = f"{trace['name']}{' greedy' if trace['temperature'] == 0 else ''} ({results['settings']['num_sequences']} seq)"
    reference = _median(systems.get("ar", {}).get("tokens_per_s", []))
    rows = []
    for name, entry in systems.items():
        tps = _median(entry["tokens_per_s"])
        ratio = f"{tps / reference:.2f}x" if tps and reference else "-"
        others = _median(entry.get("others_cpu_share", []))
        note = entry.get("error", "")
        rows.append(f"| {label} | `{name}` | {entry['repeats']} | {_fmt(_median(entry['makespan_s']), '.1f')} | "
                    f"{_fmt(tps, '.1f')} | {ratio} | {_fmt(_median(entry['mean_accept_len']), '.2f')} | "
                    f"{_fmt(_median(entry['identical_to_ar']), '.2f')} | "
                    f"{'-' if others is None else f'{100 * others:.0f}%'} | {note[:60]} |")
    rows += [f"| {label} | `{name}` | 0 | - | - | - | - | - | - | not run: {why[:60]} |"
             for name, why in (results.get("skipped") or {}).items()]
    return rows


def render(outs: list[Path]) -> str:
    lines = ["| trace | system | runs | makespan s | tokens/s | vs ar | accept len | identical to ar | others' CPU | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for out in outs:
        lines += summary_rows(out)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m benchmark.summary BENCH_DIR [BENCH_DIR ...]")
    missing = [a for a in args if not (Path(a) / "results.json").exists()]
    if missing:
        raise SystemExit(f"no results.json in: {', '.join(missing)}")
    sys.stdout.write(render([Path(a) for a in args]))


if __name__ == "__main__":
    main()
