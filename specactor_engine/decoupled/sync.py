"""The verifier side's copy of the drafter workers' model, for the pipeline's drafter sync.

After a policy update the pipeline refreshes every drafter. The workers' draft model lives in
other processes (or machines), so the pipeline distils this copy on the step's rollouts (the same
bounded refresh as an in-process model drafter), saves it beside the checkpoint, and `push`es the
file: every worker loads it in place and answers with the digest of what it now holds, which
must equal this copy's. A worker that restarts later loads the same file before drafting again.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch import nn

from specactor_engine.decoupled.coordinator import DecoupledCoordinator


class WorkerDrafterSync:
    """`model` (loaded on first use) mirrors what the workers run; `version` is the last pushed."""

    name = "decoupled"  # the drafts' source name in engine stats, metrics and checkpoints/vN/drafters/

    def __init__(self, coordinator: DecoupledCoordinator, model_path: str, dtype: str) -> None:
        self.coordinator = coordinator
        self.model_path = model_path
        self.dtype = dtype
        self.version = 0
        self._model: nn.Module | None = None

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            from specactor_engine.model.runner import load_hf_model

            self._model = load_hf_model(self.model_path, self.dtype)
        return self._model

    def initial_weights(self) -> Path:
        """The draft model's own weights file (what the workers start from)."""
        return Path(self.model_path) / "model.safetensors"

    def load_file(self, path: Path) -> None:
        """Weights from a safetensors file into the copy (not yet the workers: see `push`)."""
        from safetensors.torch import load_file

        from specactor_engine.model.weights import load_named_weights

        load_named_weights(self.model, load_file(path).items())

    def push(self, path: Path, version: int, timeout_s: float = 300.0) -> dict[str, float]:
        """Make every live worker load `path` (which holds this copy's weights) and check its digest.

        Raises RuntimeError naming the workers that failed, timed out, or hold different weights.
        """
        from specactor_engine.model.weights import weights_digest

        expected = weights_digest(self.model.named_parameters())
        started = time.perf_counter()
        answers = self.coordinator.load_weights(str(path), version, timeout_s)
        live = sum(1 for w in self.coordinator.workers if w.ready or w.transport.alive())
        problems = [f"worker answered: {a.error}" for a in answers if a.error]
        problems += [f"worker holds digest {a.digest[:12]}, expected {expected[:12]}" for a in answers
                     if not a.error and a.digest != expected]
        if len(answers) < live:
            problems.append(f"{live - len(answers)} of {live} workers did not answer within {timeout_s:.0f} s")
        if problems:
            raise RuntimeError(f"drafter workers not synced to v{version} from {path}: " + "; ".join(problems))
        self.version = version
        return {f"drafter/{self.name}/push_s": time.perf_counter() - started,
                f"drafter/{self.name}/synced_workers": float(len(answers))}
