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

from specactor_engine.model.draft_vocab import SubsetHead

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillBudget:
    max_steps: int = 8
    max_seconds: float = 60.0
    batch_size: int = 8
    lr: float = 1e-4
    seed: int = 0
    freeze_embeddings: bool = False
    loss: str = "kl"  # with soft targets: "kl" or "coupled" (see `Distiller`)
    freeze_layers: int = 0


SoftTargets = tuple[torch.Tensor, torch.Tensor]  # per sample: target top-k ids [L, k], log-probs [L, k]

LOSSES = ("kl", "coupled")


def coupled_acceptance_from_topk(probs: torch.Tensor, log_q_top: torch.Tensor, log_q_rest: torch.Tensor
                                 ) -> torch.Tensor:
    """Differentiable P(draft == target token) under shared Gumbel noise, from the target's top-k: [n].

    probs: the target's renormalised top-k probabilities [n, k] (0 for unusable entries);
    log_q_top: the drafter's log-probs of the same tokens [n, k]; log_q_rest: log of the drafter's
    mass outside them [n]. Both choose i with probability 1 / sum_j max(p_j / p_i, q_j / q_i)
    (`scorer.coupled_acceptance`); the target's mass outside its top-k is taken as 0, so the
    drafter's mass there only enters the denominators, as q_rest / q_i.
    """
    log_p = probs.clamp_min(1e-30).log()
    ratio_p = (log_p[:, None, :] - log_p[:, :, None]).exp()  # [n, i, j] = p_j / p_i
    ratio_q = (log_q_top[:, None, :] - log_q_top[:, :, None]).exp()
    rest = (log_q_rest[:, None] - log_q_top).exp()  # [n, i]
    both = 1.0 / (torch.maximum(ratio_p, ratio_q).sum(dim=-1) + rest)
    return torch.where(probs > 0, both, 0.0).sum(dim=-1)


def pad_batch(sequences: Sequence[tuple[list[int], list[int]]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], attention mask [B, T], and [B, T] True where the position predicts an output token."""
    width = max(len(p) + len(o) for p, o in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    predicts_output = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, output) in enumerate(sequences):
        full = prompt + output
        ids[row, : len(full)] = torch.tensor(full)
        attention[row, : len(full)] = 1
        predicts_output[row, len(prompt) - 1 : len(full) - 1] = True
    return ids.to(device), attention.to(device), predicts_output.to(device)


class Distiller:
    """Distillation steps of a draft model on target samples; its state can be saved.

    With soft targets (the target's top-k log-probs at every output position) the loss is
    the cross-entropy to the target's renormalised top-k distribution (`loss="kl"`), which
    carries far more signal per sample than the sampled token; `loss="coupled"` instead
    maximises the engine's own acceptance probability (the Gumbel-coupling closed form,
    `coupled_acceptance_from_topk`) with `kl_weight` x the cross-entropy kept as a regulariser.
    Without soft targets it is next-token cross-entropy on the samples (sequence-level distillation). A drafter with a `SubsetHead` is trained over
    its sub-vocabulary only (positions whose target token lies outside are skipped).

    Used by `distill_on_rollouts` (the pipeline's bounded per-step refresh) and by
    `specactor drafter distill` (a longer, resumable run), so both train the same way.
    """

    def __init__(self, model: nn.Module, lr: float, seed: int = 0, freeze_embeddings: bool = False,
                 autocast: torch.dtype | None = None, loss: str = "kl", kl_weight: float = 0.1,
                 freeze_layers: int = 0) -> None:
        if loss not in LOSSES:
            raise ValueError(f"unknown distillation loss {loss!r}; expected one of {', '.join(LOSSES)}")
        self.model = model
        self.loss, self.kl_weight = loss, kl_weight
        self.autocast = autocast  # e.g. bfloat16 matmuls with fp32 weights and optimizer (about 2x on AVX-512 BF16)
        self.rng = random.Random(seed)
        self.device = next(model.parameters()).device
        self.freeze_embeddings = freeze_embeddings
        self.freeze_layers = freeze_layers  # the first N blocks stay as they are (no backward through them)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.steps = 0
        head = model.lm_head
        vocab = head.weight.shape[0]
        if isinstance(head, SubsetHead):
            self._column = torch.full((vocab,), -1, dtype=torch.long, device=self.device)
            self._column[head.token_ids] = torch.arange(len(head.token_ids), device=self.device)
        else:
            self._column = torch.arange(vocab, device=self.device)

    def _log_probs(self, ids: torch.Tensor, attention: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """Draft log-probs over the head's vocabulary at the `where` positions: [n, N]."""
        hidden = self.model.model(input_ids=ids, attention_mask=attention).last_hidden_state[where]
        head = self.model.lm_head
        logits = head.subset_logits(hidden) if isinstance(head, SubsetHead) else head(hidden)
        return logits.float().log_softmax(dim=-1)

    def step(self, usable: Sequence[tuple[list[int], list[int]]], batch_size: int,
             soft: Sequence[SoftTargets] | None = None) -> float:
        """One optimizer step on a random batch of (prompt_ids, output_ids); returns the loss.

        soft: per sample of `usable`, the target's top-k (ids, log-probs) at its output positions.
        """
        self.model.train().requires_grad_(True)
        if self.freeze_embeddings:
            self.model.get_input_embeddings().requires_grad_(False)
        for layer in self.model.model.layers[: self.freeze_layers]:
            layer.requires_grad_(False)
        picked = self.rng.sample(range(len(usable)), min(batch_size, len(usable)))
        ids, attention, where = pad_batch([usable[i] for i in picked], self.device)
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            log_q = self._log_probs(ids, attention, where)
        log_q = log_q.float()
        if soft is None:
            columns = self._column[ids[:, 1:][where[:, :-1]]]
            inside = columns >= 0
            loss = -log_q[inside].gather(1, columns[inside, None]).mean()
        else:
            top_ids = torch.cat([soft[i][0] for i in picked]).to(self.device).long()
            probs = torch.cat([soft[i][1] for i in picked]).to(self.device).float().exp()
            columns = self._column[top_ids]
            probs = probs * (columns >= 0)
            probs = probs / probs.sum(dim=1, keepdim=True).clamp(min=1e-12)
            log_q_top = log_q.gather(1, columns.clamp(min=0))
            loss = -(probs * log_q_top).sum(dim=1).mean()
            if self.loss == "coupled":
                # Entries outside the sub-vocabulary (column -1) have p = 0 after the mask above and q ~ 0;
                # top-k ids are distinct, so the rest mass is 1 - sum q_top. The floor of -40 keeps every
                # ratio q_j / q_i below e^80, finite in fp32 (so are the gradients).
                log_q_top = torch.where(columns >= 0, log_q_top, -40.0).clamp_min(-40.0)
                q_rest = (1.0 - log_q_top.exp().sum(dim=1)).clamp_min(1e-12)
                alpha = coupled_acceptance_from_topk(probs, log_q_top, q_rest.log())
                loss = -alpha.mean() + self.kl_weight * loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return loss.item()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

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
                        budget: DistillBudget = DistillBudget(),
                        soft: Sequence[SoftTargets] | None = None) -> dict[str, float]:
    """Train `model` in place on (prompt_ids, output_ids) pairs; returns loss before/after and steps.

    soft: per pair, the target's top-k next-token log-probs at its output positions (`teacher_topk`);
    without them the loss is cross-entropy on the sampled tokens. The model is put back in eval mode
    without gradients afterwards (as drafters run it).
    """
    keep = [i for i, (_, o) in enumerate(sequences) if o]
    usable = [sequences[i] for i in keep]
    soft_usable = [soft[i] for i in keep] if soft is not None else None
    if not usable:
        return {"distill_steps": 0.0}
    distiller = Distiller(model, budget.lr, budget.seed, freeze_embeddings=budget.freeze_embeddings,
                          loss=budget.loss if soft_usable is not None else "kl", freeze_layers=budget.freeze_layers)
    started, losses = time.perf_counter(), []
    try:
        for _ in range(budget.max_steps):
            if time.perf_counter() - started > budget.max_seconds:
                break
            losses.append(distiller.step(usable, budget.batch_size, soft_usable))
    finally:
        distiller.finish()
    if not losses:
        return {"distill_steps": 0.0}
    logger.info("distilled drafter for %d steps: loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
    return {"distill_steps": float(len(losses)), "distill_loss_first": losses[0], "distill_loss_last": losses[-1],
            "distill_seconds": time.perf_counter() - started}
