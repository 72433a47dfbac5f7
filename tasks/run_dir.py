"""The run directory: every artifact of a post-training run, written atomically.

Layout (step numbers are 1-based; policy version v is the policy after v updates):

    <run>/config.yaml                    the resolved config
    <run>/data/train.jsonl, eval.jsonl   prompt datasets (engine JSONL + answer columns)
    <run>/steps/000001/rollouts.jsonl    rollout records of step 1 (policy version 0)
    <run>/steps/000001/scores.jsonl      rewards per record
    <run>/steps/000001/metrics.json      written last: its presence marks the step complete
    <run>/checkpoints/v000001/           model.safetensors + config.json + tokenizer (+ COMPLETE), drafters/,
                                         trainer/ (the training state; kept for the published version only)
    <run>/checkpoints/LATEST             the published version (atomic rename)
    <run>/wandb/                         W&B offline files

A step is complete only when its metrics file exists and the checkpoint it published is
LATEST, so a crash anywhere mid-step resumes at that step with the previous pair intact.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from specactor_engine.files import atomic_write_text


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """One JSON object per line, written atomically."""
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (blank lines skipped). Lines end at \\n only: `str.splitlines` also
    breaks at U+2028, U+0085 and others, which JSON leaves unescaped inside strings (a model's text has them)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line.strip()]


@dataclass(frozen=True)
class RunDir:
    """Paths of one run; all methods are cheap and side-effect free except the writers."""

    root: Path

    def step_dir(self, step: int) -> Path:
        return self.root / "steps" / f"{step:06d}"

    def rollouts(self, step: int) -> Path:
        return self.step_dir(step) / "rollouts.jsonl"

    def scores(self, step: int) -> Path:
        return self.step_dir(step) / "scores.jsonl"

    def metrics(self, step: int) -> Path:
        return self.step_dir(step) / "metrics.json"

    def checkpoint(self, version: int) -> Path:
        return self.root / "checkpoints" / f"v{version:06d}"

    @property
    def latest_file(self) -> Path:
        return self.root / "checkpoints" / "LATEST"

    @property
    def wandb_dir(self) -> Path:
        return self.root / "wandb"

    def data(self, split: str) -> Path:
        return self.root / "data" / f"{split}.jsonl"

    def latest_version(self) -> int:
        """The published policy version (0 = the initial model, nothing published yet)."""
        return int(self.latest_file.read_text().strip()) if self.latest_file.exists() else 0

    def publish(self, version: int) -> None:
        """Make checkpoint `version` the current one (atomic)."""
        if not (self.checkpoint(version) / "COMPLETE").exists():
            raise FileNotFoundError(f"checkpoint v{version} is not complete: {self.checkpoint(version)}")
        atomic_write_text(self.latest_file, f"{version}\n")

    def prune_training_states(self, keep: int) -> None:
        """Delete the training state (optimizer moments: twice the weights) of every checkpoint but v<keep>:
        a run resumes from the published version only; the older checkpoints keep their weights."""
        from tasks.trainer import TRAINER_STATE_DIR

        for state in (self.root / "checkpoints").glob(f"v*/{TRAINER_STATE_DIR}"):
            if state.parent != self.checkpoint(keep):
                shutil.rmtree(state, ignore_errors=True)

    def prune_checkpoints(self, latest: int, keep: int) -> list[int]:
        """Delete the checkpoints older than the newest `keep` up to v<latest> (the published one); return the
        versions deleted. Versions after `latest` (staged by a step that has not been published) stay."""
        root = self.root / "checkpoints"
        if not root.exists():
            return []
        versions = [int(p.name[1:]) for p in root.iterdir() if p.is_dir() and p.name[:1] == "v" and p.name[1:].isdigit()]
        old = sorted(v for v in versions if v <= latest - keep)
        for version in old:
            shutil.rmtree(self.checkpoint(version), ignore_errors=True)
        return old

    def completed_steps(self) -> list[int]:
        """Steps whose metrics were written and whose checkpoint is published."""
        latest = self.latest_version()
        steps_root = self.root / "steps"
        if not steps_root.exists():
            return []
        done = sorted(int(p.name) for p in steps_root.iterdir() if p.name.isdigit() and (p / "metrics.json").exists())
        return [s for s in done if s <= latest]

    def next_step(self) -> int:
        """The first step to run (1 for a new run); resuming never recomputes a completed step."""
        done = self.completed_steps()
        return done[-1] + 1 if done else 1

    def write_metrics(self, step: int, metrics: dict[str, Any]) -> Path:
        return atomic_write_text(self.metrics(step), json.dumps(metrics, indent=2, sort_keys=True))

    def read_metrics(self, step: int) -> dict[str, Any]:
        return json.loads(self.metrics(step).read_text())
