"""Per-repeat table of a paired run: makespan [place in the turn order], rounds, drafting and verify seconds,
accept length; each other system's makespan over the first's.
Usage: python bench/session57/repeats.py DIR SYSTEM..."""
import json
import statistics
import sys
from pathlib import Path

root, systems = Path(sys.argv[1]) / "runs", sys.argv[2:]
repeats = sorted({int(p.stem.rsplit("-", 1)[1]) for p in root.glob(f"{systems[0]}-[0-9]*.json")})
print("| repeat (GB/s) | " + " | ".join(f"`{s}`" for s in systems) + " | " +
      " | ".join(f"`{s}` over `{systems[0]}`" for s in systems[1:]) + " |")
print("|---" * (1 + 2 * len(systems) - 1) + "|")
ratios = {s: [] for s in systems[1:]}
for r in repeats:
    runs = {s: json.loads((root / f"{s}-{r}.json").read_text()) for s in systems}
    order = [name for name, _ in json.loads((root / f"paired-{r}.spec.json").read_text())]  # the turn order
    cells = []
    for s in systems:
        st = runs[s]["engine_stats"]
        place = order.index(s) + 1
        cells.append(f"{runs[s]['makespan_s']:.1f} s [{place}], {st['verify_rounds']} rounds, draft "
                     f"{st['draft_s']:.1f} s, verify {st['verify_s']:.1f} s, accept {st['mean_acceptance_length']:.2f}")
    for s in systems[1:]:
        ratios[s].append(runs[s]["makespan_s"] / runs[systems[0]]["makespan_s"])
    gbps = runs[systems[0]].get("mem_read_gbps") or 0
    print(f"| {r} ({gbps:.0f}) | " + " | ".join(cells) + " | " +
          " | ".join(f"{ratios[s][-1]:.3f}" for s in systems[1:]) + " |")
for s in systems[1:]:
    print(f"`{s}` over `{systems[0]}` (makespans): median {statistics.median(ratios[s]):.3f}, geometric mean "
          f"{statistics.geometric_mean(ratios[s]):.3f}")
