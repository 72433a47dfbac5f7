"""Per run of one or more benchmark directories: makespan, accept length, verify / drafting / host seconds, the
drafting seconds and rows of each drafter, and the 4-row rounds at each cap (the chosen verify length).

    python bench/session61/split.py bench/session61/D-paired [DIR ...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

for directory in sys.argv[1:]:
    for path in sorted(Path(directory, "runs").glob("*-[0-9].json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        stats = run.get("engine_stats")
        if not stats or "timeline" not in stats:
            continue
        draft_s, rows = Counter(), Counter()
        for entry in stats["timeline"]:
            for name, seconds in entry.get("draft_s_by_drafter", {}).items():
                draft_s[name.split(":")[0]] += seconds
            for name, count in entry.get("by_drafter", {}).items():
                rows[name.split(":")[0]] += count
        caps = Counter(e["cap"] for e in stats["timeline"] if e["rows"] == 4)
        host = run["makespan_s"] - stats["prefill_s"] - stats["draft_s"] - stats["verify_s"]
        print(f"{Path(directory).name}/{path.stem}: {run['makespan_s']:.1f} s, accept {run['mean_accept_len']:.2f}, "
              f"{stats['verify_rounds']} rounds, verify {stats['verify_s']:.1f} s, drafting {stats['draft_s']:.2f} s, "
              f"prefill {stats['prefill_s']:.2f} s, host {host:.2f} s; drafting s "
              f"{ {k: round(v, 2) for k, v in draft_s.items()} }, rows {dict(rows)}, 4-row caps {dict(sorted(caps.items()))}")
