"""The offline drafter trainer: distillation steps on the target's samples, saved and resumable.

Training data are samples of the target, so next-token cross-entropy on them is sequence-level
distillation (`distill.Distiller`, the same steps as the pipeline's per-step refresh); with the
target's top-k (`teacher`) it is distillation to the target's distribution. `distill` runs the steps
under a step and time budget with a warm-up and decaying learning rate, adds the drafter's own samples
at the on-policy rounds (`on_policy`), and saves the drafter as a Hugging Face model with the trainer
state beside it, so a run that finds them resumes where it left off. `job` builds a whole
`specactor drafter distill` run around it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from specactor_engine.model.draft_vocab import SubsetHead, save_draft_vocab
from specactor_engine.training.distill import Distiller, SoftTargets
from specactor_engine.training.on_policy import StudentSampler
from specactor_engine.training.samples import DistillDataError
from specactor_engine.training.teacher import Pair

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True)
class DistillSettings:
    """How long and how `distill` trains (the optimizer, the schedule, what stays frozen)."""

    steps: int = 200
    batch_size: int = 8
    lr: float = 3e-4
    save_every: int = 50
    max_seconds: float | None = None
    seed: int = 0
    freeze_embeddings: bool = False
    autocast: torch.dtype | None = None  # mixed precision for the forward/backward (weights stay in their dtype)
    lr_decay: bool = False  # warm up, then decay linearly to `lr_floor` x lr over the run's horizon
    warmup_steps: int = 10
    lr_floor: float = 0.1
    loss: str = "kl"  # with soft targets: "kl" or "coupled" (`distill.Distiller`)
    kl_weight: float = 0.1
    freeze_layers: int = 0  # keep the drafter's first N blocks fixed (faster steps, less over-fitting)


def scheduled_lr(settings: DistillSettings, step: int, elapsed_s: float) -> float:
    """The learning rate for optimizer step `step` (0-based) after `elapsed_s` seconds of training.

    With a time budget the horizon is whichever comes first, the last step or the budget's end, so a
    time-limited run still ends at the low rate (where most of the final loss is gained).
    """
    if not settings.lr_decay:
        return settings.lr
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = step / max(settings.steps, 1)
    if settings.max_seconds:
        progress = max(progress, elapsed_s / settings.max_seconds)
    return settings.lr * max(1.0 - (1.0 - settings.lr_floor) * min(progress, 1.0), settings.lr_floor)


@dataclass(frozen=True)
class DistillResult:
    """What a `distill` run did: its step count (resumed runs count on) and the loss it went through."""

    steps: int  # optimizer steps in total, earlier runs included
    trained_steps: int  # steps this run took
    student_rounds: int  # on-policy rounds collected (or reloaded) by this run
    loss_first: float | None  # None when this run took no step
    loss_last: float | None
    seconds: float
    out: Path


def distill(model: nn.Module, tokenizer: Any, pairs: list[Pair], out: Path,
            settings: DistillSettings, on_step: Callable[[int, float], None] | None = None,
            soft: Sequence[SoftTargets] | None = None, student: StudentSampler | None = None) -> DistillResult:
    """Train `model` on `pairs`, saving to `out` every `save_every` steps and at the end; resumes from `out`.

    soft: the target's top-k per output position of each pair (`teacher_topk`), or None for
    hard labels. on_step(step, loss) is called after every step (progress bars).
    student: adds the drafter's own samples, labelled by the target, to the pool at the rounds it
    schedules over the run's progress (on-policy distillation; needs `soft`).
    """
    keep = [i for i, (_, o) in enumerate(pairs) if o]
    usable = [pairs[i] for i in keep]
    if not usable:
        raise DistillDataError("no sample with output tokens to train on")
    soft_usable = [soft[i] for i in keep] if soft is not None else None
    if student is not None and soft_usable is None:
        raise ValueError("on-policy rounds need soft targets (the drafter's own samples carry no labels)")
    distiller = Distiller(model, settings.lr, settings.seed, freeze_embeddings=settings.freeze_embeddings,
                          autocast=settings.autocast, loss=settings.loss, kl_weight=settings.kl_weight,
                          freeze_layers=settings.freeze_layers)
    state_path = out / STATE_FILE
    if state_path.exists():
        distiller.load_state_dict(torch.load(state_path, weights_only=False))
        logger.info("resuming %s at step %d", out, distiller.steps)
    started, losses, collected = time.perf_counter(), [], 0
    try:
        while distiller.steps < settings.steps:
            elapsed = time.perf_counter() - started
            if settings.max_seconds is not None and elapsed > settings.max_seconds:
                logger.info("time budget reached at step %d", distiller.steps)
                break
            progress = max(distiller.steps / settings.steps,
                           elapsed / settings.max_seconds if settings.max_seconds else 0.0)
            if student is not None and soft_usable is not None and student.rounds.due(collected, progress):
                distiller.finish()  # sampled as drafters run it: eval mode, no gradients
                more, more_soft = student.collect(collected)
                usable.extend(more)
                soft_usable.extend(more_soft)
                collected += 1
                continue
            distiller.set_lr(scheduled_lr(settings, distiller.steps, time.perf_counter() - started))
            losses.append(distiller.step(usable, settings.batch_size, soft_usable))
            if on_step is not None:
                on_step(distiller.steps, losses[-1])
            if distiller.steps % settings.save_every == 0:
                save(model, tokenizer, distiller, out)
    finally:
        distiller.finish()
    save(model, tokenizer, distiller, out)
    return DistillResult(steps=distiller.steps, trained_steps=len(losses), student_rounds=collected,
                         loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
                         seconds=time.perf_counter() - started, out=out)


def save(model: nn.Module, tokenizer: Any, distiller: Distiller, out: Path) -> None:
    """The model as an HF directory, then the trainer state (written last: it marks a complete save)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if isinstance(model.lm_head, SubsetHead):
        save_draft_vocab(out, model.lm_head.token_ids)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(distiller.state_dict(), tmp)
    tmp.replace(out / STATE_FILE)
