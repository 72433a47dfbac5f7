"""Two systems of one paired repeat, side by side over the same stretches of output: seconds each took to emit
tokens lo..hi (counted over the whole run; every engine system emits the same tokens, so a stretch is the same
text for both), and the first system's draft methods in the rounds of that stretch.

    python bench/session50/by_tokens.py A.json B.json [--step 150]

A.json, B.json: run result files under a benchmark output's runs/ (not the paired-*.json ones). A timeline entry's `t`
is taken at the end of its round; the cumulative tokens are interpolated linearly within a round.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np


def _load(path: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    timeline = json.load(open(path))["engine_stats"]["timeline"]
    ends = np.array([0.0] + [e["t"] for e in timeline])
    tokens = np.concatenate([[0], np.cumsum([e["emitted"] for e in timeline])])
    methods = ["+".join(sorted(e["by_drafter"])) or "plain" for e in timeline]
    return ends, tokens, methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--step", type=int, default=150, help="tokens per stretch")
    args = parser.parse_args()
    a, b = _load(args.first), _load(args.second)
    edges = np.arange(0, min(a[1][-1], b[1][-1]) + 1, args.step)
    print("tokens         first  second  first-second  first's methods (rounds)")
    for lo, hi in zip(edges, edges[1:]):
        took = [float(np.interp(hi, run[1], run[0]) - np.interp(lo, run[1], run[0])) for run in (a, b)]
        rounds = a[2][int(np.searchsorted(a[1], lo)):int(np.searchsorted(a[1], hi))]
        print(f"{int(lo):5d}-{int(hi):5d}  {took[0]:6.2f}  {took[1]:6.2f}  {took[0] - took[1]:+6.2f}  "
              f"{dict(Counter(rounds))}")
    print(f"total seconds: {a[0][-1]:.2f} vs {b[0][-1]:.2f}")


if __name__ == "__main__":
    main()
