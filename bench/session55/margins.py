"""One replay (`specactor simulate`'s, bare CPU profile) of `specactor` over DIR's facts: the speculation margin of
every choice the verify-length policy made (its best speculative rate over plain decoding's), their distribution,
how many rounds chose, held and drafted, and the replay's makespan.

    PYTHONPATH=. .venv/bin/python bench/session55/margins.py DIR [SYSTEM]      # DIR holds facts.json
"""
import sys
from pathlib import Path

import numpy as np

from benchmark.simulate.cli import _cost_model
from benchmark.simulate.facts import Facts
from benchmark.simulate.replay import calibrate_sampling, replay
from benchmark.simulate.report import measured_forward_s
from specactor_engine.policies.verify_length import VerifyLengthPolicy

run_dir = Path(sys.argv[1])
system = sys.argv[2] if len(sys.argv) > 2 else "specactor"
facts = Facts.load(run_dir / "facts.json")
costs = _cost_model("cpu", facts, None)
measured = measured_forward_s(run_dir)  # None where DIR holds the facts alone (bf16 forwards: sampling is host work)
holds = calibrate_sampling(facts, costs, measured)[0] if measured is not None else False
margins, ks = [], []
choose = VerifyLengthPolicy.choose


def recording(self, *args, **kwargs):
    k = choose(self, *args, **kwargs)
    margins.append(self.speculation_margin)
    ks.append(k)
    return k


VerifyLengthPolicy.choose = recording
r = replay(system, facts, costs, sampling_in_profile=holds)
m = np.array(margins)
print(f"{run_dir} {system}: makespan {r.makespan_s:.2f} s, rounds {r.rounds}, choices {len(m)}, "
      f"drafting choices {sum(k > 0 for k in ks)}")
print("margin percentiles 10/25/50/75/90:", np.percentile(m, [10, 25, 50, 75, 90]).round(3))
for lo, hi in ((0, 0.7), (0.7, 0.8), (0.8, 0.85), (0.85, 0.9), (0.9, 0.95), (0.95, 9)):
    print(f"  [{lo}, {hi}): {int(((m >= lo) & (m < hi)).sum())}")
