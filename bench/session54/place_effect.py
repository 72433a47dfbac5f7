"""The first place's effect in every committed paired run: for each repeat, each system's log makespan centred on
the repeat's mean, less that system's mean over the repeats; the first-placed system's residual, averaged over a
run's repeats, in percent. Positive: the system in the first place ran slower than it did elsewhere.

    python bench/session54/place_effect.py
"""

from __future__ import annotations

import collections
import glob
import json
import math
import statistics as st


def place_effect(path: str) -> tuple[str, int, int, float] | None:
    data = json.load(open(path, encoding="utf-8"))
    systems = data.get("systems", {})
    names = [n for n, s in systems.items() if isinstance(s, dict) and s.get("paired")]
    if len(names) < 2:
        return None
    repeats = min(len(systems[n]["makespan_s"]) for n in names)
    logs = {n: [math.log(systems[n]["makespan_s"][r]) for r in range(repeats)] for n in names}
    centred = []
    for r in range(repeats):
        first = systems[names[0]]["paired"][r]["systems"][0]
        mean = st.mean(logs[n][r] for n in names)
        centred.append((first, {n: logs[n][r] - mean for n in names}))
    own = {n: st.mean(c[n] for _, c in centred) for n in names}
    residual = st.mean(c[first] - own[first] for first, c in centred)
    return data["trace"]["name"], len(names), repeats, 100 * residual


def main() -> None:
    by_trace = collections.defaultdict(list)
    for path in sorted(glob.glob("bench/session*/*/results.json")):
        found = place_effect(path)
        if found is None:
            continue
        trace, systems, repeats, effect = found
        print(f"{path:70s} {trace} systems={systems} repeats={repeats} first place {effect:+.2f}%")
        if repeats >= 3:
            by_trace[trace].append(effect)
    for trace, effects in sorted(by_trace.items()):
        print(f"trace {trace}: {len(effects)} runs, mean {st.mean(effects):+.2f}%, median {st.median(effects):+.2f}%")


if __name__ == "__main__":
    main()
