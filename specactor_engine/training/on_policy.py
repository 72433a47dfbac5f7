"""On-policy distillation data: the drafter's own samples, labelled with the target's top-k.

A drafter trained only on target samples drafts positions 2..k from prefixes its own earlier
drafts wrote, which it never saw in training. Sampling the drafter itself on the training prompts
and labelling every position with the target's next-token distribution (one teacher-forced pass)
trains it on exactly those states (on-policy distillation, as in DistillSpec). The drafter is
several times cheaper to sample than the target, so within a fixed time budget the training pool
also grows faster than target sampling alone would allow, which is what a drafter that overfits a
few hundred target samples needs.

Each round is cached in the output directory (`student_round{r}.pt`), so a resumed run reuses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from specactor_engine.training.distill import SoftTargets
from specactor_engine.training.teacher import teacher_topk
from specactor_engine.types import Request

logger = logging.getLogger(__name__)

Pair = tuple[list[int], list[int]]  # (prompt_ids, output_ids)


@dataclass(frozen=True)
class StudentRounds:
    """When and how much the drafter samples itself during `drafter distill`."""

    rounds: int = 0  # collections spread evenly over the run; 0 turns on-policy data off
    samples: int = 2  # per prompt and round
    max_new_tokens: int = 256
    top_k: int = 32  # the target's top-k kept per position (as for the target's own samples)
    seed: int = 0

    def due(self, collected: int, progress: float) -> bool:
        """Round `collected` (0-based) is due once training progress (0..1) reaches (collected + 1) / (rounds + 1)."""
        return collected < self.rounds and progress >= (collected + 1) / (self.rounds + 1)


def prompts_of(pairs: Sequence[Pair]) -> list[Request]:
    """One tokenized request per distinct prompt of `pairs`, in first-seen order."""
    seen: dict[tuple[int, ...], Request] = {}
    for prompt, _ in pairs:
        key = tuple(prompt)
        if key not in seen:
            seen[key] = Request(request_id=f"p{len(seen)}", prompt_token_ids=list(prompt))
    return list(seen.values())


class StudentSampler:
    """Collects round r: the drafter's samples on `prompts` and the target's top-k at each of their positions."""

    def __init__(self, student: nn.Module, target: nn.Module, tokenizer: Any, prompts: Sequence[Request],
                 rounds: StudentRounds, out: Path, autocast: torch.dtype | None = None,
                 max_batch_size: int = 256) -> None:
        self.student, self.target, self.tokenizer = student, target, tokenizer
        self.prompts, self.rounds, self.out = list(prompts), rounds, out
        self.autocast, self.max_batch_size = autocast, max_batch_size

    def path(self, round_index: int) -> Path:
        return self.out / f"student_round{round_index}.pt"

    def collect(self, round_index: int, on_batch: Callable[[int], None] | None = None
                ) -> tuple[list[Pair], list[SoftTargets]]:
        """Round `round_index`'s pairs and soft targets (from the cache when a resumed run already made them)."""
        from specactor_engine.config import RolloutConfig, SamplingConfig
        from specactor_engine.engine import Engine

        path = self.path(round_index)
        if path.exists():
            cached = torch.load(path, weights_only=True)
            return [(list(p), list(o)) for p, o in cached["pairs"]], list(cached["soft"])
        self.student.eval().requires_grad_(False)
        # a new seed per round: the same prompts give new samples
        sampling = SamplingConfig(temperature=1.0, n=self.rounds.samples, max_new_tokens=self.rounds.max_new_tokens,
                                  seed=self.rounds.seed + 1 + round_index)
        engine = Engine(self.student, self.tokenizer, RolloutConfig(mode="ar", max_batch_size=self.max_batch_size))
        result = engine.generate(self.prompts, sampling)
        pairs = [(list(o.prompt_token_ids), list(o.token_ids)) for o in result.outputs if not o.error and o.token_ids]
        soft = teacher_topk(self.target, pairs, self.rounds.top_k, on_batch=on_batch, autocast=self.autocast)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"pairs": pairs, "soft": soft}, tmp)
        tmp.replace(path)
        logger.info("student round %d: %d samples, %d tokens", round_index, len(pairs), sum(len(o) for _, o in pairs))
        return pairs, soft
