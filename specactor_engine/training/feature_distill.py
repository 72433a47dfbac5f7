"""Train a feature-level drafter (model/feature_draft.py) on its target's own samples.

The target is the teacher twice over: its features f_j (final hidden state, normalised) are both the
drafter's input one position later and what it should predict, and its next-token distribution
softmax(head(f_j)) is what the drafter's head(g_j) should match. Per position (EAGLE's objective):

    loss = CE(softmax(head(f_j)) || softmax(head(g_j)))  +  feature_weight * SmoothL1(g_j, f_j)

over the draft vocabulary's head rows (the head stays the target's, frozen). Inputs are teacher-forced
with the target's features, jittered by uniform noise (`noise`), since at draft time the drafter reads
its own, imperfect, predictions from the second draft on. With `passes` > 1 (EAGLE-3's training-time
test) it is also trained on those: pass p runs every position as the p-th draft step of a round runs it,
on the drafter's own predicted features of the p - 1 positions before (`FeatureDraftModel.forward_unrolled`),
with the same loss against the same targets. On its 64 held-out samples, drafter v3 (one pass) was
accepted 0.848 / 0.663 / 0.535 of the time at draft steps 1 / 2 / 3 (shared-noise rule, T = 1), v4 (v3 and
300 steps of three passes) 0.844 / 0.743 / 0.683: the steps v3 was never trained for are where it lost.

The target's features of every sample are computed once (`target_features`, one forward per batch) and,
in a training run (`run_feature_distill`), cached in the output directory in fp16 so a resumed run does
not recompute them (nor, when samples were appended to the data file, those it had).
`distill_features` is the bounded refresh the post-training flow runs after a policy update: the new
policy's features on the step's rollouts, a few steps.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.training.teacher import Pair

logger = logging.getLogger(__name__)

FEATURES_FILE = "target_features.pt"
STATE_FILE = "feature_trainer_state.pt"


@torch.no_grad()
def target_features(target: nn.Module, pairs: Sequence[Pair], batch_size: int = 4,
                    on_batch: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """The target's normalised final hidden states at every position of each prompt + output: fp16 [L, d] each."""
    target.eval()
    device = next(target.parameters()).device
    out: list[torch.Tensor] = []
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))  # little padding
    by_index: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, attention = _pad([pairs[i][0] + pairs[i][1] for i in chunk], device)
        hidden = target.model(input_ids=ids, attention_mask=attention).last_hidden_state
        for row, index in enumerate(chunk):
            by_index[index] = hidden[row, : int(attention[row].sum())].to(torch.float16).cpu()
        if on_batch is not None:
            on_batch(start + len(chunk))
    out = [by_index[i] for i in range(len(pairs))]
    return out


def _pad(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and attention mask [B, T]."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(list(seq))
        attention[row, : len(seq)] = 1
    return ids.to(device), attention.to(device)


@dataclass(frozen=True)
class FeatureDistillBudget:
    max_steps: int = 8
    max_seconds: float = 60.0
    batch_size: int = 4
    lr: float = 3e-4
    seed: int = 0
    feature_weight: float = 1.0
    noise: float = 0.1
    passes: int = 1  # draft steps trained per position (FeatureDistiller)
    autocast: torch.dtype | None = None  # the steps' matmuls in this dtype (FeatureDistiller)


class FeatureDistiller:
    """Optimizer steps of a feature drafter against its target (module docstring); its state can be saved."""

    def __init__(self, model: FeatureDraftModel, target: nn.Module, lr: float, vocab_ids: torch.Tensor | None = None,
                 seed: int = 0, feature_weight: float = 1.0, noise: float = 0.1, passes: int = 1,
                 autocast: torch.dtype | None = None) -> None:
        """passes: the draft steps each position is trained for (`FeatureDraftModel.forward_unrolled`): 1 trains on
        the target's features only; p > 1 adds the steps that read the drafter's own predictions, each with the
        same loss (a pass costs about as much as the first).
        autocast: run a training step's forward and backward under torch.autocast in this dtype (bfloat16: 1.5-2x
        faster steps on a CPU with AVX-512 BF16); the weights, the optimizer, the teacher's distribution
        and the softmaxes stay in the model's dtype. Evaluation (`loss` called directly) is not autocast."""
        if passes < 1:
            raise ValueError(f"passes must be at least 1, got {passes}")
        self.passes = passes
        self.model = model
        self.embed = target.get_input_embeddings()
        weight = target.lm_head.weight.detach()
        self.vocab_ids = vocab_ids  # the head's token ids (None: the whole vocabulary)
        self.head_rows = weight if vocab_ids is None else weight[vocab_ids.to(weight.device)]  # [N, d], frozen
        self.feature_weight, self.noise = feature_weight, noise
        self.autocast = autocast
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters()], lr=lr)
        self.steps = 0

    def loss(self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor,
             noise: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """ids [B, T], the target's features [B, T, d], valid [B, T] -> (loss, its parts)."""
        dtype = self.head_rows.dtype
        features = features.to(dtype)
        prev = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)  # f_{j-1}
        if noise and self.noise:
            prev = prev + (torch.rand(prev.shape, generator=self.generator, dtype=torch.float32).to(dtype) - 0.5) \
                * (2 * self.noise)
        with torch.no_grad():
            embeds = self.embed(ids)
        if self.passes == 1:
            outputs = [self.model(embeds, prev)]
        else:
            outputs = self.model.forward_unrolled(embeds, prev, self.passes)
        total, parts = 0.0, {}
        for p, g in enumerate(outputs, start=1):
            at = valid.clone()
            at[:, : p - 1] = False  # pass p needs p - 1 earlier positions
            with torch.no_grad(), torch.autocast(features.device.type, enabled=False):  # exact targets
                teacher = (features[at] @ self.head_rows.T).float().softmax(dim=-1)  # [n, N]
            log_q = (g[at] @ self.head_rows.T).float().log_softmax(dim=-1)
            ce = -(teacher * log_q).sum(dim=-1).mean()
            reg = F.smooth_l1_loss(g[at].float(), features[at].float())
            agree = (log_q.argmax(dim=-1) == teacher.argmax(dim=-1)).float().mean()
            total = total + ce + self.feature_weight * reg
            suffix = "" if p == 1 else f"_{p}"
            parts.update({f"ce{suffix}": ce.item(), f"feature{suffix}": reg.item(), f"top1{suffix}": agree.item()})
        return total, parts

    def batch(self, pairs: Sequence[Pair], features: Sequence[torch.Tensor], batch_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A random batch: ids [B, T], features [B, T, d], valid [B, T] (real positions)."""
        picked = self.rng.sample(range(len(pairs)), min(batch_size, len(pairs)))
        device = self.head_rows.device
        ids, attention = _pad([pairs[i][0] + pairs[i][1] for i in picked], device)
        width, d = ids.shape[1], features[picked[0]].shape[1]
        feats = torch.zeros(len(picked), width, d, dtype=self.head_rows.dtype, device=device)
        for row, i in enumerate(picked):
            feats[row, : len(features[i])] = features[i].to(device, feats.dtype)
        return ids, feats, attention.bool()

    def step(self, pairs: Sequence[Pair], features: Sequence[torch.Tensor], batch_size: int) -> dict[str, float]:
        """One optimizer step on a random batch; returns the loss and its parts."""
        self.model.train().requires_grad_(True)
        ids, feats, valid = self.batch(pairs, features, batch_size)
        autocast = self.autocast is not None
        with torch.autocast(feats.device.type, dtype=self.autocast or torch.bfloat16, enabled=autocast):
            loss, parts = self.loss(ids, feats, valid)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return {"loss": loss.item(), **parts}

    def finish(self) -> None:
        self.model.eval().requires_grad_(False)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps, "rng": self.rng.getstate(),
                "generator": self.generator.get_state()}

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def load_state_dict(self, state: dict) -> None:
        """Resume a saved trainer at this trainer's learning rate (the optimizer's saved state would bring back the
        earlier run's: a resumed run at a lower rate, to anneal a drafter trained at a constant one, kept the old)."""
        lr = self.lr
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.steps = state["steps"]
        self.rng.setstate(state["rng"])
        self.generator.set_state(state["generator"])


def distill_features(model: FeatureDraftModel, target: nn.Module, pairs: Sequence[Pair],
                     budget: FeatureDistillBudget = FeatureDistillBudget(),
                     vocab_ids: torch.Tensor | None = None) -> dict[str, float]:
    """The bounded refresh after a policy update: the target's features on `pairs`, then at most
    budget.max_steps steps within budget.max_seconds (the features' forward counted). Returns metrics."""
    usable = [p for p in pairs if p[1]]
    if not usable:
        return {"feature_distill_steps": 0.0}
    started = time.perf_counter()
    features = target_features(target, usable, budget.batch_size)
    distiller = FeatureDistiller(model, target, budget.lr, vocab_ids, budget.seed, budget.feature_weight, budget.noise,
                                 budget.passes, budget.autocast)
    history: list[dict[str, float]] = []
    try:
        for _ in range(budget.max_steps):
            if time.perf_counter() - started > budget.max_seconds:
                break
            history.append(distiller.step(usable, features, budget.batch_size))
    finally:
        distiller.finish()
    if not history:
        return {"feature_distill_steps": 0.0}
    logger.info("distilled feature drafter for %d steps: loss %.3f -> %.3f", len(history), history[0]["loss"],
                history[-1]["loss"])
    return {"feature_distill_steps": float(len(history)), "feature_distill_loss_first": history[0]["loss"],
            "feature_distill_loss_last": history[-1]["loss"], "feature_distill_top1_last": history[-1]["top1"],
            "feature_distill_seconds": time.perf_counter() - started}


def load_or_compute_features(out: Path, target: nn.Module | Callable[[], nn.Module], pairs: Sequence[Pair],
                             batch_size: int = 4, on_batch: Callable[[int], None] | None = None
                             ) -> list[torch.Tensor]:
    """`target_features` of `pairs`, cached in out/target_features.pt. A cache that matches the first samples
    serves them (data appended to a run's file: only the new samples are computed); one that does not match
    them is recomputed. A sample matches when its cached features have its length.
    target: the model, or a function that loads it (called only when the cache does not serve them all)."""
    path = out / FEATURES_FILE
    cached: list[torch.Tensor] = []
    if path.exists():
        cached = torch.load(path, weights_only=True)
        if len(cached) > len(pairs) or any(len(f) != len(p) + len(o) for f, (p, o) in zip(cached, pairs)):
            logger.warning("%s does not match the samples; recomputing", path)
            cached = []
        elif len(cached) == len(pairs):
            return cached
        else:
            logger.info("%s serves the first %d of %d samples; computing the rest", path, len(cached), len(pairs))
    served = len(cached)
    model = target if isinstance(target, nn.Module) else target()
    report = None if on_batch is None else (lambda done: on_batch(served + done))
    features = cached + target_features(model, pairs[served:], batch_size, report)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(features, path)
    return features
