"""One replay (`specactor simulate`'s, bare CPU profile) of a system under cProfile: calls and cumulative seconds of
the verify-length policy's and the proposer's per-round work.

    PYTHONPATH=. .venv/bin/python bench/session53/prof_choose.py DIR SYSTEM      # DIR holds facts.json
"""
import sys, cProfile, pstats, io
from pathlib import Path
from benchmark.simulate.cli import _cost_model
from benchmark.simulate.facts import Facts
from benchmark.simulate.replay import replay, calibrate_sampling
from benchmark.simulate.report import measured_forward_s
run_dir = Path(sys.argv[1]); system = sys.argv[2]
facts = Facts.load(run_dir / "facts.json"); costs = _cost_model("cpu", facts, None)
holds, _ = calibrate_sampling(facts, costs, measured_forward_s(run_dir))
pr = cProfile.Profile(); pr.enable(); r = replay(system, facts, costs, sampling_in_profile=holds); pr.disable()
st = pstats.Stats(pr)
for (f, l, fn), (cc, nc, tt, ct, _) in st.stats.items():
    if fn in ("choose", "_schedule", "catch_up_estimate_s", "method_options", "_shadow_idle_rows", "score_shadows", "propose") and "specactor_engine" in f:
        print(f"{f.split('specactor_engine/')[-1]}:{fn} n={nc} cum={ct:.3f}")
print("makespan %.2f rounds %d" % (r.makespan_s, r.rounds))
