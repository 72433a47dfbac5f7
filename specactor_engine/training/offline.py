"""Train a draft model from a target: `specactor drafter distill` (resumable, saves an HF model).

Training data are samples of the target, so next-token cross-entropy on them is
sequence-level distillation (`distill.Distiller`, the same steps as the pipeline's per-step
refresh). They come either from rollout records that carry `prompt_token_ids` and `token_ids`
(the pipeline's `steps/*/rollouts.jsonl`), or from a prompt file, rolled out with the target
first (in bf16 with `--bf16-autocast`; the rollout's own top-k log-probs become the soft targets). The drafter starts from a model (`--init`) or from the target's first N layers with the
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
from typing import Any, Callable, Sequence

import torch
from torch import nn

from specactor_engine.training.distill import Distiller, SoftTargets, pad_batch
from specactor_engine.drafters.draft_vocab import SubsetHead, save_draft_vocab
from specactor_engine.training.on_policy import StudentSampler

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


class DistillDataError(ValueError):
    """The data file is neither rollout records nor prompts (message names file and line)."""


TEACHER_FILE = "teacher_topk.pt"


@dataclass(frozen=True)
class DistillSettings:
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


@torch.no_grad()
def teacher_topk(target: nn.Module, pairs: Sequence[tuple[list[int], list[int]]], k: int, batch_size: int = 8,
                 on_batch: Callable[[int], None] | None = None,
                 autocast: torch.dtype | None = None) -> list[SoftTargets]:
    """The target's top-k next-token (ids int32 [L, k], log-probs fp16 [L, k]) at each output position.

    One teacher-forced forward per batch; on_batch(samples_done) reports progress.
    """
    target.eval()
    device = next(target.parameters()).device
    out: list[SoftTargets] = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        ids, attention, where = pad_batch(chunk, device)
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            hidden = target.model(input_ids=ids, attention_mask=attention).last_hidden_state
            for row in range(len(chunk)):
                log_p = target.lm_head(hidden[row][where[row]]).float().log_softmax(dim=-1)
                values, indices = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
                out.append((indices.to(torch.int32).cpu(), values.to(torch.float16).cpu()))
        if on_batch is not None:
            on_batch(start + len(chunk))
    return out


def load_or_compute_teacher(out: Path, target: nn.Module, pairs: Sequence[tuple[list[int], list[int]]], k: int,
                            on_batch: Callable[[int], None] | None = None,
                            autocast: torch.dtype | None = None) -> list[SoftTargets]:
    """Soft targets for `pairs`, cached in out/teacher_topk.pt so a resumed run does not recompute them."""
    path = out / TEACHER_FILE
    if path.exists():
        cached = torch.load(path, weights_only=True)
        if len(cached) == len(pairs) and all(len(t[0]) == len(o) for t, (_, o) in zip(cached, pairs)):
            return cached
        logger.warning("%s does not match the samples; recomputing", path)
    soft = teacher_topk(target, pairs, k, on_batch=on_batch, autocast=autocast)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(soft, path)
    return soft


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


def read_record_top_logprobs(path: Path, k: int) -> list[SoftTargets] | None:
    """Soft targets carried by rollout records: each record's `top_logprobs` (rollouts made with
    `sampling.top_logprobs` >= k) cut to the top k, as `teacher_topk` returns them; None unless every
    record has them for every output token (then the teacher pass is needed)."""
    soft: list[SoftTargets] = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        if not raw.strip():
            continue
        record = json.loads(raw)
        top = record.get("top_logprobs")
        if not isinstance(top, list) or len(top) != len(record["token_ids"]) or any(len(row) < k for row in top):
            return None
        table = torch.tensor([pair for row in top for pair in row[:k]], dtype=torch.float64).view(len(top), k, 2)
        soft.append((table[..., 0].to(torch.int32), table[..., 1].to(torch.float16)))
    return soft or None


def distill(model: nn.Module, tokenizer: Any, pairs: list[tuple[list[int], list[int]]], out: Path,
            settings: DistillSettings, on_step: Callable[[int, float], None] | None = None,
            soft: Sequence[SoftTargets] | None = None, student: StudentSampler | None = None) -> dict[str, Any]:
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
    return {"steps": distiller.steps, "trained_steps": len(losses), "student_rounds": collected,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "seconds": time.perf_counter() - started, "out": str(out)}


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
