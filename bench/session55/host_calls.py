"""Host seconds a replay (`specactor simulate`'s, bare CPU profile) spends in the engine's per-round scheduling,
drafting and bookkeeping calls, timed with perf_counter around each (no profiler), for SYSTEMS over DIR's facts.

    PYTHONPATH=. .venv/bin/python bench/session55/host_calls.py DIR ar,specactor      # DIR holds facts.json
"""
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmark.simulate.cli import _cost_model
from benchmark.simulate.facts import Facts
from benchmark.simulate.replay import calibrate_sampling, replay
from benchmark.simulate.report import measured_forward_s
from specactor_engine import proposer as proposer_mod
from specactor_engine import run as run_mod
from specactor_engine.policies import verify_length

CALLS = [(run_mod.Run, "_schedule"), (run_mod.Run, "_draft_stop"), (run_mod.Run, "_trim"), (run_mod.Run, "_record"),
         (proposer_mod.Proposer, "propose"), (proposer_mod.Proposer, "score_shadows"),
         (proposer_mod.Proposer, "credit"), (verify_length.VerifyLengthPolicy, "observe_round")]
spent: dict[str, float] = defaultdict(float)


def timed(cls, name):
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started
    setattr(cls, name, wrapper)


for cls, name in CALLS:
    timed(cls, name)
run_dir = Path(sys.argv[1])
facts = Facts.load(run_dir / "facts.json")
costs = _cost_model("cpu", facts, None)
measured = measured_forward_s(run_dir)
holds = calibrate_sampling(facts, costs, measured)[0] if measured is not None else False
for system in sys.argv[2].split(","):
    spent.clear()
    r = replay(system, facts, costs, sampling_in_profile=holds)
    calls = "  ".join(f"{name} {spent[name]:.3f}" for _, name in CALLS)
    print(f"{run_dir.name} {system}: makespan {r.makespan_s:.2f} s, rounds {r.rounds}; listed calls "
          f"{sum(spent.values()):.3f} s: {calls}")
