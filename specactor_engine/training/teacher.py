"""The target as teacher: its top-k next-token distribution at every output position of a sample.

These soft targets carry far more signal per sample than the sampled token, so every drafter trainer
wants them: the offline trainer (`offline`, `job`), the on-policy rounds (`on_policy`) and the pipeline's
per-step refresh. They live here, apart from the trainers, so that none of those imports another for them.
A run caches them in its output directory (`TEACHER_FILE`), so a resumed run does not recompute them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from specactor_engine.training.distill import SoftTargets, pad_batch

logger = logging.getLogger(__name__)

TEACHER_FILE = "teacher_topk.pt"

Pair = tuple[list[int], list[int]]  # (prompt_ids, output_ids)


@torch.no_grad()
def teacher_topk(target: nn.Module, pairs: Sequence[Pair], k: int, batch_size: int = 8,
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


def save_teacher(out: Path, soft: Sequence[SoftTargets]) -> None:
    """Cache `soft` in out/teacher_topk.pt (also for soft targets that came with the samples)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save(list(soft), out / TEACHER_FILE)


def load_or_compute_teacher(out: Path, target: nn.Module, pairs: Sequence[Pair], k: int,
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
    save_teacher(out, soft)
    return soft
