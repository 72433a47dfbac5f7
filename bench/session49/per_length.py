"""Per verify length, the 4-row rounds of benchmark runs: count, mean seconds, mean tokens emitted and tokens/s.

    python bench/session49/per_length.py RUN.json [RUN.json ...]

RUN.json: a run's result file under a benchmark output's runs/ (not the paired-*.json ones). A timeline entry's `t`
is taken at the end of its round, so round i ran from t[i-1] to t[i] at entry i's `cap` and emitted entry i's tokens
(the first round, which starts at the decode's start, is left out).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def per_length(path: str, rows: int = 4) -> str:
    timeline = json.load(open(path))["engine_stats"]["timeline"]
    rounds: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for before, entry in zip(timeline, timeline[1:]):
        if entry["rows"] == rows:
            rounds[entry["cap"]].append((entry["t"] - before["t"], entry["emitted"]))
    seconds = sum(s for runs in rounds.values() for s, _ in runs)
    tokens = sum(n for runs in rounds.values() for _, n in runs)
    cells = [f"k={k}: {len(r)} rounds, {1e3 * sum(s for s, _ in r) / len(r):.0f} ms, "
             f"{sum(n for _, n in r) / len(r):.1f} tokens, {sum(n for _, n in r) / sum(s for s, _ in r):.0f}/s"
             for k, r in sorted(rounds.items())]
    return f"{path}: {rows}-row rounds {tokens / max(seconds, 1e-9):.1f} tokens/s | " + "; ".join(cells)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for name in sys.argv[1:]:
        print(per_length(name))
