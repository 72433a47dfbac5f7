"""Pure figures computed from one run's outputs: tail time, identity to `ar`, summaries."""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

TAIL_FRACTION = 0.75  # the tail starts when this share of the sequences has finished


def tail_time(finish_times: Sequence[float], makespan_s: float, num_sequences: int,
              fraction: float = TAIL_FRACTION) -> float:
    """Seconds between the moment `fraction` of the sequences had finished and the makespan.

    finish_times: seconds from submission, one per finished sequence (any order); sequences
    without a time count as finishing at the makespan.
    """
    if num_sequences == 0:
        return 0.0
    times = sorted(finish_times)[:num_sequences]
    times += [makespan_s] * (num_sequences - len(times))
    index = max(math.ceil(fraction * num_sequences) - 1, 0)
    return max(makespan_s - times[index], 0.0)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First position where the token lists differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_to_reference(sequences: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]
                         ) -> tuple[float, list[dict[str, Any]]]:
    """(fraction of sequences token-identical to the reference, the mismatches).

    Sequences are dicts {id, sample, token_ids}, matched by (id, sample); a sequence the
    reference lacks counts as a mismatch at position 0.
    """
    by_key = {(s["id"], s["sample"]): s["token_ids"] for s in reference}
    mismatches = []
    for seq in sequences:
        ref = by_key.get((seq["id"], seq["sample"]))
        position = 0 if ref is None else first_difference(seq["token_ids"], ref)
        if position is not None:
            mismatches.append({"id": seq["id"], "sample": seq["sample"], "first_diff": position,
                               "tokens": len(seq["token_ids"]), "ar_tokens": None if ref is None else len(ref)})
    identical = 1.0 - len(mismatches) / len(sequences) if sequences else 0.0
    return identical, mismatches


def spread(values: Sequence[float | None]) -> dict[str, float] | None:
    """Median, min and max of the non-None values (None when there are none)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}
