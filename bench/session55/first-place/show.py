import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/optime-*.json")):
    d = json.load(open(f))
    threads = [t for t in d if t.startswith("paired-")]
    if not threads:
        continue
    print(f)
    ops = sorted({op for t in threads for op in d[t]})
    a, b = threads[0], threads[1]
    for op in ops:
        ca, sa = d[a].get(op, [0, 0]); cb, sb = d[b].get(op, [0, 0])
        print(f"  {op:10s} {a}: {ca:7d} {sa:8.3f}   {b}: {cb:7d} {sb:8.3f}   ratio {sa / max(sb, 1e-9):.3f}")
