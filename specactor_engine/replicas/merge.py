"""One call's statistics from the replicas' per-chunk `EngineStats`: the shape `Engine.generate` returns.

Counters, seconds and per-drafter / per-position figures add up (prefill_s, draft_s and verify_s are then
compute seconds summed over replicas, not wall time); `total_s` is the pool's wall time; the timeline's
entries keep their replica and are shifted to seconds since the pool's call began; `replicas` keeps each
replica's own split (busy seconds, prefill / draft / verify seconds, sequences, tokens, chunks, restarts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from specactor_engine.types import EngineStats

_NOT_ADDED = {"mode", "total_s", "timeline", "replicas"}


@dataclass(frozen=True)
class ChunkStats:
    """The stats of one chunk's `generate` on replica `replica`, begun `offset_s` after the pool's call."""

    replica: int
    offset_s: float
    stats: EngineStats


def merge_stats(parts: Sequence[ChunkStats], mode: str, total_s: float, restarts: Sequence[int]) -> EngineStats:
    """Sum the chunks' counters; keep the timeline (with each entry's replica) and a per-replica split."""
    merged = EngineStats(mode=mode, total_s=total_s)
    for part in parts:
        for field in dataclasses.fields(EngineStats):
            if field.name not in _NOT_ADDED:
                setattr(merged, field.name, _add(getattr(merged, field.name), getattr(part.stats, field.name)))
        merged.timeline.extend({**entry, "t": entry["t"] + part.offset_s, "replica": part.replica}
                               for entry in part.stats.timeline)
    merged.timeline.sort(key=lambda entry: entry["t"])
    merged.replicas = [_replica_split(i, [p.stats for p in parts if p.replica == i], count)
                       for i, count in enumerate(restarts)]
    return merged


def _add(total: Any, value: Any) -> Any:
    """Numbers add, lists add position by position (the longer one's tail kept), dicts add by key."""
    if isinstance(total, dict):
        return {key: _add(total.get(key, 0), value.get(key, 0)) for key in {**total, **value}}
    if isinstance(total, list):
        longer, shorter = (total, value) if len(total) >= len(value) else (value, total)
        return [a + (shorter[i] if i < len(shorter) else 0) for i, a in enumerate(longer)]
    return total + value


def _replica_split(replica: int, stats: list[EngineStats], restarts: int) -> dict[str, float]:
    return {"replica": replica, "chunks": len(stats), "busy_s": sum(s.total_s for s in stats),
            "prefill_s": sum(s.prefill_s for s in stats), "draft_s": sum(s.draft_s for s in stats),
            "verify_s": sum(s.verify_s for s in stats), "sequences": sum(s.num_sequences for s in stats),
            "output_tokens": sum(s.output_tokens for s in stats), "restarts": restarts}
