"""The rollout step's per-drafter metrics (what W&B gets), from an engine's stats."""

from __future__ import annotations

import pytest

from specactor_engine.types import EngineStats
from tasks.metrics import drafter_metrics


def test_drafter_metrics_cover_verified_and_shadow_drafts():
    stats = EngineStats(drafted_tokens=40, drafted_per_drafter={"suffix": 30, "ngram": 10},
                        accepted_per_drafter={"suffix": 15, "ngram": 1}, draft_s_per_drafter={"suffix": 0.03},
                        shadow_drafts_per_drafter={"suffix": 4, "ngram": 8},
                        shadow_accepted_per_drafter={"suffix": 6, "ngram": 2})
    metrics = drafter_metrics(stats, {"suffix": 0, "ngram": 0, "decoupled": 3})
    assert metrics["drafter/suffix/acceptance_rate"] == 0.5 and metrics["drafter/ngram/share"] == 0.25
    assert metrics["drafter/suffix/ms_per_drafted_token"] == pytest.approx(1.0)
    assert "drafter/ngram/draft_seconds" not in metrics
    assert metrics["drafter/suffix/shadow_drafts"] == 4 and metrics["drafter/suffix/shadow_accepted_per_draft"] == 1.5
    assert metrics["drafter/ngram/shadow_accepted_per_draft"] == 0.25
    assert metrics["drafter/decoupled/version"] == 3
