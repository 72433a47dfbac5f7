"""One replay (`specactor simulate`'s, bare CPU profile) of a system from a run directory with facts.json: its rounds
by the batch's rows, with their time, tokens per second, mean k and draft methods.

    PYTHONPATH=. .venv/bin/python bench/session53/replay_tl.py DIR SYSTEM [REPLAY_NUMBER [STATS.json]]
"""
import sys, json, collections
from pathlib import Path
from benchmark.simulate.cli import _cost_model
from benchmark.simulate.facts import Facts
from benchmark.simulate.replay import replay, calibrate_sampling
from benchmark.simulate.report import measured_forward_s

run_dir, system = Path(sys.argv[1]), sys.argv[2]
facts = Facts.load(run_dir / "facts.json")
costs = _cost_model("cpu", facts, None)
holds, _ = calibrate_sampling(facts, costs, measured_forward_s(run_dir))
r = replay(system, facts, costs, sampling_in_profile=holds, number=int(sys.argv[3]) if len(sys.argv) > 3 else 0)
tl = r.stats["timeline"]
print(system, "makespan %.2f rounds %d accept %.3f" % (r.makespan_s, r.rounds, r.mean_accept_len))
b = collections.defaultdict(lambda: [0, 0.0, 0, 0, 0, collections.Counter()])
prev = 0.0
for e in tl:
    dt = e["t"] - prev; prev = e["t"]
    rows = e["rows"]
    key = 32 if rows >= 24 else 20 if rows >= 17 else 14 if rows >= 12 else 8 if rows >= 6 else 3
    x = b[key]; x[0] += 1; x[1] += dt; x[2] += e["k"]; x[3] += e["emitted"]; x[4] += e["drafted"]
    x[5]["+".join(sorted(e["by_drafter"])) or "plain"] += 1
for key in sorted(b, reverse=True):
    x = b[key]
    print(f"rows~{key:2d} rounds {x[0]:4d} time {x[1]:6.2f} tok/s {x[3]/x[1]:6.1f} mean k {x[2]/x[0]:.2f} emitted {x[3]} drafted {x[4]} {dict(x[5])}")
if len(sys.argv) > 4:
    json.dump(r.stats, open(sys.argv[4], "w"))
