"""Per run of one or more benchmark directories: makespan, accept length, rounds, verify / drafting / host seconds,
the rows that verified a suffix draft in place of their model's (draft arbitration, `arbitrated_rows`), and each
method's verified and accepted drafts.

    python bench/session68/split.py /tmp/s68/D-arb [DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

for directory in sys.argv[1:]:
    for path in sorted(Path(directory, "runs").glob("*-[0-9].json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        stats = run.get("engine_stats")
        if not stats or "timeline" not in stats:
            continue
        host = run["makespan_s"] - stats["prefill_s"] - stats["draft_s"] - stats["verify_s"]
        drafted = stats.get("drafted_per_drafter", {})
        accepted = stats.get("accepted_per_drafter", {})
        use = {name.split(":")[0]: f"{accepted.get(name, 0)}/{count}" for name, count in drafted.items()}
        print(f"{Path(directory).name}/{path.stem}: {run['makespan_s']:.1f} s, accept {run['mean_accept_len']:.2f}, "
              f"{stats['verify_rounds']} rounds, verify {stats['verify_s']:.1f} s, drafting {stats['draft_s']:.2f} s, "
              f"host {host:.2f} s, arbitrated rows {stats.get('arbitrated_rows', '-')}, "
              f"trimmed {stats.get('trimmed_tokens', '-')}, accepted/verified {use}")
