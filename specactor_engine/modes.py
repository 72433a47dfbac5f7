"""The rollout modes as data: which draft sources each one uses.

The engine and its round read a `Mode` instead of comparing mode names, so adding a mode is one
row of `MODES` (see docs/architecture.md for what each mode is for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specactor_engine.config import DecoupledConfig, RolloutMode

WorkerUse = Literal["never", "optional", "required"]


@dataclass(frozen=True)
class Mode:
    """What one rollout mode drafts with.

    speculative: drafts at all (otherwise every round is plain decoding, k = 0);
    in_process: uses the in-process drafters (drafters/) of the engine;
    workers: drafter worker processes streaming drafts (decoupled/): never, when configured, or always;
    fastest_of_n: picks one draft method per request (policies/selector.py) instead of the configured
    selection.
    """

    name: RolloutMode
    speculative: bool
    in_process: bool
    workers: WorkerUse
    fastest_of_n: bool

    def starts_workers(self, settings: DecoupledConfig) -> bool:
        """Whether a config with these decoupled settings runs drafter workers in this mode."""
        return self.workers == "required" or (self.workers == "optional" and settings.drafter is not None)


MODES: dict[str, Mode] = {
    "ar": Mode("ar", speculative=False, in_process=False, workers="never", fastest_of_n=False),
    "coupled": Mode("coupled", speculative=True, in_process=True, workers="never", fastest_of_n=False),
    "decoupled": Mode("decoupled", speculative=True, in_process=False, workers="required", fastest_of_n=False),
    "specactor": Mode("specactor", speculative=True, in_process=True, workers="optional", fastest_of_n=True),
}
