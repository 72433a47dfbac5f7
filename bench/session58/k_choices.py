"""The verify lengths the engine systems of benchmark runs chose at 4 rows, and what those runs emitted per round.

    python bench/session58/k_choices.py RUN.json [RUN.json ...]

For each run (a `runs/<system>-<i>.json` of `python -m benchmark`): makespan, mean accept length, verify rounds,
verify seconds and ms a round, the rounds at each cap (the chosen verify length) among the 4-row rounds, trimmed
tokens, and the per-width calibration factors (`factors`: observed over profiled round time, per k) at a few points of
the run, which show what the verify-length policy believed each width cost when it chose.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

POINTS = (0.25, 0.5, 0.75, 0.95)  # where in the run's rounds the factors are printed


def describe(path: Path) -> str:
    run = json.loads(path.read_text(encoding="utf-8"))
    stats = run["engine_stats"]
    timeline = stats["timeline"]
    caps = Counter(r["cap"] for r in timeline if r["rows"] == 4)
    lines = [f"{path.parent.parent.name}/{path.stem}: makespan {run['makespan_s']:.1f} s, accept len "
             f"{run['mean_accept_len']:.2f}, {stats['verify_rounds']} rounds, verify {stats['verify_s']:.1f} s "
             f"({1000 * stats['verify_s'] / stats['verify_rounds']:.0f} ms a round), drafting {stats['draft_s']:.1f} s, "
             f"trimmed {stats['trimmed_tokens']}",
             "  4-row rounds at cap k: " + ", ".join(f"k={k}: {n}" for k, n in sorted(caps.items()))]
    for share in POINTS:
        r = timeline[min(int(share * len(timeline)), len(timeline) - 1)]
        factors = ", ".join(f"{f:.2f}" for f in r.get("factors") or [])
        lines.append(f"  at {r['t']:6.1f} s (cap {r['cap']}): factors by k [{factors}]")
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit(__doc__)
    for name in paths:
        print(describe(Path(name)))


if __name__ == "__main__":
    main(sys.argv[1:])
