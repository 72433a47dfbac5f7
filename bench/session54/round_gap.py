"""Where a paired `ar,ar#2` run's gap lies: the per-round difference of the two copies' own-turn seconds (their
rounds are the same rounds: identical outputs), split into rounds where the row count changed (a new row count makes
oneDNN create its primitives, `primitive_first_call.py`) and the rest, and by quarter of the run. Reads each
directory's timelines.json ({system: [[own seconds at the round's end, rows], ...]}, kept from the runs' JSON).

    python bench/session54/round_gap.py bench/session54/place-variants/*/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main(dirs: list[str]) -> None:
    for run_dir in dirs:
        timelines = json.loads((Path(run_dir) / "timelines.json").read_text(encoding="utf-8"))
        (first_name, first), (second_name, second) = sorted(timelines.items())  # `ar` before `ar#2`
        first, second = np.array(first), np.array(second)
        own = np.diff(np.r_[0.0, first[:, 0]]) - np.diff(np.r_[0.0, second[:, 0]])
        rows = first[:, 1]
        changed = np.r_[True, rows[1:] != rows[:-1]]
        quarter = len(own) // 4
        print(f"{run_dir}: {first_name} - {second_name} = {own.sum():+.2f} s; rounds with a new row count "
              f"{own[changed].sum():+.2f} s ({int(changed.sum())} rounds), the others {own[~changed].sum():+.2f} s; "
              f"by quarter {[round(float(own[i * quarter:(i + 1) * quarter].sum()), 2) for i in range(4)]}")


if __name__ == "__main__":
    main(sys.argv[1:])
