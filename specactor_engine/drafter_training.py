"""Train a draft model from a target: `specactor drafter distill` (resumable, saves an HF model).

Training data are exact samples of the target, so next-token cross-entropy on them is
sequence-level distillation (`distill.Distiller`, the same steps as the pipeline's per-step
refresh). They come either from rollout records that carry `prompt_token_ids` and `token_ids`
(the pipeline's `steps/*/rollouts.jsonl`), or from a prompt file, rolled out with the target
first. The drafter starts from a model (`--init`) or from the target's first N layers with the
target's final norm and head (`--init-layers N`: a policy-derived drafter).

The output directory holds the drafter as a Hugging Face model (`model.safetensors`, config,
tokenizer) and `trainer_state.pt`; a run that finds them resumes where they left off.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from specactor_engine.distill import Distiller

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


class DistillDataError(ValueError):
    """The data file is neither rollout records nor prompts (message names file and line)."""


@dataclass(frozen=True)
class DistillSettings:
    steps: int = 200
    batch_size: int = 8
    lr: float = 3e-4
    save_every: int = 50
    max_seconds: float | None = None
    seed: int = 0


def truncated_copy(target: nn.Module, num_layers: int) -> nn.Module:
    """A drafter made of the target's embeddings, first `num_layers` blocks, final norm and head."""
    total = target.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"--init-layers must be between 1 and {total - 1} (the target has {total} layers)")
    draft = copy.deepcopy(target)
    draft.model.layers = nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    return draft


def read_rollout_records(path: Path) -> list[tuple[list[int], list[int]]] | None:
    """(prompt_ids, output_ids) pairs if every line is a rollout record; None if the file holds prompts."""
    pairs: list[tuple[list[int], list[int]]] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DistillDataError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise DistillDataError(f"{path}:{number}: expected a JSON object")
        if "token_ids" not in record:
            if pairs:
                raise DistillDataError(f"{path}:{number}: a prompt line among rollout records (no 'token_ids')")
            return None
        if "prompt_token_ids" not in record:
            raise DistillDataError(f"{path}:{number}: a rollout record needs 'prompt_token_ids' as well as "
                                   "'token_ids' (the pipeline's steps/*/rollouts.jsonl have both)")
        pairs.append((list(record["prompt_token_ids"]), list(record["token_ids"])))
    if not pairs:
        raise DistillDataError(f"{path}: no records")
    return pairs


def distill(model: nn.Module, tokenizer: Any, pairs: list[tuple[list[int], list[int]]], out: Path,
            settings: DistillSettings, on_step: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Train `model` on `pairs`, saving to `out` every `save_every` steps and at the end; resumes from `out`.

    on_step(step, loss) is called after every step (progress bars).
    """
    usable = [(p, o) for p, o in pairs if o]
    if not usable:
        raise DistillDataError("no sample with output tokens to train on")
    distiller = Distiller(model, settings.lr, settings.seed)
    state_path = out / STATE_FILE
    if state_path.exists():
        distiller.load_state_dict(torch.load(state_path, weights_only=False))
        logger.info("resuming %s at step %d", out, distiller.steps)
    started, losses = time.perf_counter(), []
    try:
        while distiller.steps < settings.steps:
            if settings.max_seconds is not None and time.perf_counter() - started > settings.max_seconds:
                logger.info("time budget reached at step %d", distiller.steps)
                break
            losses.append(distiller.step(usable, settings.batch_size))
            if on_step is not None:
                on_step(distiller.steps, losses[-1])
            if distiller.steps % settings.save_every == 0:
                save(model, tokenizer, distiller, out)
    finally:
        distiller.finish()
    save(model, tokenizer, distiller, out)
    return {"steps": distiller.steps, "trained_steps": len(losses), "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "seconds": time.perf_counter() - started, "out": str(out)}


def save(model: nn.Module, tokenizer: Any, distiller: Distiller, out: Path) -> None:
    """The model as an HF directory, then the trainer state (written last: it marks a complete save)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(distiller.state_dict(), tmp)
    tmp.replace(out / STATE_FILE)
