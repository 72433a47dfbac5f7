"""The drafter acceptance-collapse alarm: a drafter whose acceptance fell sharply after a weight sync."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from tasks.runtime import run_logger

if TYPE_CHECKING:
    from tasks.tracking import Tracker

ACCEPTANCE_FLOOR = 0.05  # below this a drafter was useless already; no collapse alarm
MIN_DRAFTED_FOR_ALARM = 32  # fewer drafted tokens in a step make its acceptance rate too noisy to judge


class DrafterCollapseWarning(UserWarning):
    """A drafter's acceptance collapsed after a weight sync (it is now pure overhead)."""


def acceptance_alarms(previous: dict[str, Any] | None, current: dict[str, Any], ratio: float) -> list[str]:
    """Drafters whose acceptance fell below `ratio` x the previous step's (after a sync)."""
    if not previous:
        return []
    alarms = []
    for key, value in current.items():
        if not (key.startswith("drafter/") and key.endswith("/acceptance_rate")):
            continue
        name = key.split("/")[1]
        before = previous.get(key)
        enough = min(previous.get(f"drafter/{name}/drafted", 0), current.get(f"drafter/{name}/drafted", 0))
        if before is not None and before >= ACCEPTANCE_FLOOR and enough >= MIN_DRAFTED_FOR_ALARM \
                and value < ratio * before:
            alarms.append(f"{name}: acceptance {before:.2f} -> {value:.2f} after the sync")
    return alarms


def raise_alarms(alarms: list[str], tracker: Tracker) -> None:
    """Log, warn (DrafterCollapseWarning) and send a W&B alert for each alarm."""
    for alarm in alarms:
        run_logger().warning("drafter acceptance collapsed: %s", alarm)
        warnings.warn(f"drafter acceptance collapsed: {alarm}", DrafterCollapseWarning, stacklevel=2)
        tracker.alert("drafter acceptance collapsed", alarm)
