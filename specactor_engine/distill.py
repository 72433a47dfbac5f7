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


class Distiller:
    """Next-token cross-entropy steps of a draft model on target samples; its state can be saved.

    Used by `distill_on_rollouts` (the pipeline's bounded per-step refresh) and by
    `specactor drafter distill` (a longer, resumable run), so both train the same way.
    """

    def __init__(self, model: nn.Module, lr: float, seed: int = 0) -> None:
        self.model = model
        self.rng = random.Random(seed)
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.steps = 0

    def step(self, usable: Sequence[tuple[list[int], list[int]]], batch_size: int) -> float:
        """One optimizer step on a random batch of (prompt_ids, output_ids); returns the loss."""
        self.model.train().requires_grad_(True)
        ids, attention, loss_mask = _batch(self.rng.sample(list(usable), min(batch_size, len(usable))), self.device)
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        targets, mask = ids[:, 1:], loss_mask[:, 1:]
        loss = nn.functional.cross_entropy(logits[mask], targets[mask])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return loss.item()

    def finish(self) -> None:
        """Back to how drafters run the model: eval mode, no gradients."""
        self.model.eval().requires_grad_(False)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        self.rng.setstate(state["rng"])


def distill_on_rollouts(model: nn.Module, sequences: Sequence[tuple[list[int], list[int]]],
                        budget: DistillBudget = DistillBudget()) -> dict[str, float]:
    """Train `model` in place on (prompt_ids, output_ids) pairs; returns loss before/after and steps.

    The model is put back in eval mode without gradients afterwards (as drafters run it).
    """
    usable = [(p, o) for p, o in sequences if o]
    if not usable:
        return {"distill_steps": 0.0}
    distiller = Distiller(model, budget.lr, budget.seed)
    started, losses = time.perf_counter(), []
    try:
        for _ in range(budget.max_steps):
            if time.perf_counter() - started > budget.max_seconds:
                break
            losses.append(distiller.step(usable, budget.batch_size))
    finally:
        distiller.finish()
    if not losses:
        return {"distill_steps": 0.0}
    logger.info("distilled drafter for %d steps: loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
    return {"distill_steps": float(len(losses)), "distill_loss_first": losses[0], "distill_loss_last": losses[-1],
            "distill_seconds": time.perf_counter() - started}
