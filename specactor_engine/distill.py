"""Keep a small-LM drafter aligned with a moving policy by training it on fresh rollouts.

Rollouts are exact samples of the target, so next-token cross-entropy on them is
sequence-level distillation. Used by the pipeline's per-step drafter refresh with a
bounded budget (steps and seconds).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillBudget:
    max_steps: int = 8
    max_seconds: float = 60.0
    batch_size: int = 8
    lr: float = 1e-4
    seed: int = 0


def _batch(sequences: Sequence[tuple[list[int], list[int]]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], attention mask [B, T] and loss mask over output tokens [B, T]."""
    width = max(len(p) + len(o) for p, o in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, output) in enumerate(sequences):
        full = prompt + output
        ids[row, : len(full)] = torch.tensor(full)
        attention[row, : len(full)] = 1
        loss_mask[row, len(prompt) : len(full)] = True
    return ids.to(device), attention.to(device), loss_mask.to(device)


def distill_on_rollouts(model: nn.Module, sequences: Sequence[tuple[list[int], list[int]]],
                        budget: DistillBudget = DistillBudget()) -> dict[str, float]:
    """Train `model` in place on (prompt_ids, output_ids) pairs; returns loss before/after and steps.

    The model is put back in eval mode without gradients afterwards (as drafters run it).
    """
    usable = [(p, o) for p, o in sequences if o]
    if not usable:
        return {"distill_steps": 0.0}
    device = next(model.parameters()).device
    rng = random.Random(budget.seed)
    model.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=budget.lr)
    started, losses = time.perf_counter(), []
    try:
        for _ in range(budget.max_steps):
            if time.perf_counter() - started > budget.max_seconds:
                break
            ids, attention, loss_mask = _batch(rng.sample(usable, min(budget.batch_size, len(usable))), device)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            targets, mask = ids[:, 1:], loss_mask[:, 1:]
            loss = nn.functional.cross_entropy(logits[mask], targets[mask])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        model.eval().requires_grad_(False)
    if not losses:
        return {"distill_steps": 0.0}
    logger.info("distilled drafter for %d steps: loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
    return {"distill_steps": float(len(losses)), "distill_loss_first": losses[0], "distill_loss_last": losses[-1],
            "distill_seconds": time.perf_counter() - started}
