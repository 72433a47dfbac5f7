"""`run.batch_phases`: an engine run's rounds grouped by the rows in its batch (pure, on a made-up timeline)."""

from __future__ import annotations

import pytest

from benchmark.run import batch_phases


def _timeline(rows_and_seconds: list[tuple[int, float]]) -> dict:
    timeline, t = [], 0.0
    for rows, seconds in rows_and_seconds:
        t += seconds
        timeline.append({"t": t, "rows": rows, "emitted": rows, "k": 0})
    return {"timeline": timeline}


def test_rounds_fall_in_quarter_eighth_bands_of_the_largest_batch():
    stats = _timeline([(32, 4.0), (32, 0.3), (25, 0.3), (24, 0.25), (13, 0.2), (12, 0.15), (5, 0.12), (4, 0.1),
                       (1, 0.1)])
    phases = batch_phases(stats)
    assert [p["rows"] for p in phases] == ["25-32", "13-24", "5-12", "1-4"]
    assert [p["rounds"] for p in phases] == [3, 2, 2, 2]
    assert [p["tokens"] for p in phases] == [89, 37, 17, 5]
    assert [p["seconds"] for p in phases] == pytest.approx([4.6, 0.45, 0.27, 0.2])  # the first prefill in the first


def test_a_small_batch_keeps_only_the_bands_that_hold_rows():
    phases = batch_phases(_timeline([(4, 1.0), (3, 0.1), (1, 0.1)]))
    assert [p["rows"] for p in phases] == ["4", "2-3", "1"]  # 4 rows: 3/4 -> 3, 3/8 -> 1, 1/8 -> 0
    assert [p["rounds"] for p in phases] == [1, 1, 1]


def test_systems_without_an_engine_timeline_have_none():
    assert batch_phases(None) is None and batch_phases({"timeline": []}) is None
