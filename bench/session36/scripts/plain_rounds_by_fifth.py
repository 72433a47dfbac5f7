"""Median 4-row plain (k = 0) round time per fifth of each engine run in a benchmark --out DIR (argv[1]).
The "by fifth" list shows whether a run met the machine's slow state and when."""
import json, sys, glob, statistics, os
for f in sorted(glob.glob(sys.argv[1] + "/runs/*-[0-9].json")):
    r = json.load(open(f)); tl = (r.get("engine_stats") or {}).get("timeline")
    if not tl:  # vllm, hf: no engine timeline
        continue
    ds = [(b["t"] - a["t"]) * 1000 for a, b in zip(tl, tl[1:]) if b["rows"] == 4 and b["k"] == 0]
    n = len(ds); q = max(n // 5, 1)
    parts = [statistics.median(ds[i:i + q]) for i in range(0, n, q)]
    print(os.path.basename(f), f"makespan {r['makespan_s']:.1f}", "median 4-row plain", round(statistics.median(ds), 1),
          "by fifth", [round(p) for p in parts][:6], "rss", round(r["peak_rss_mb"]))
