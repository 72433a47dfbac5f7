"""One `specactor drafter feature` run as a library call: a feature-level drafter trained on its target.

In order: load the target; get the training pairs (`samples.target_pairs`: rollout records, or a
prompt file rolled out with the target, kept in the output directory); hold out every tenth pair; pick
the draft vocabulary (the tokens the data use most, plus the special tokens); compute the target's
features once (cached in the output directory); train within the step and time budgets, saving every
`save_every` steps so a run that finds its state in `out` resumes; report the held-out top-1 agreement
(the drafter's greedy token against the target's) at the first draft position, and the held-out chance
that each of the first `SCORED_STEPS` draft steps is accepted at a few drafting temperature scales
(`held_out_acceptance`); the drafter keeps the scale that makes the most accepted tokens
(feature_drafter.json `temperature_scale`, what the engine's feature drafter drafts at unless told).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from specactor_engine.config import Dtype
from specactor_engine.model.draft_vocab import choose_draft_vocab, load_draft_vocab, save_draft_vocab
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.training.feature_distill import STATE_FILE, FeatureDistiller, load_or_compute_features
from specactor_engine.training.job import load_target, special_ids
from specactor_engine.training.report import LogReporter, Reporter
from specactor_engine.training.samples import target_pairs
from specactor_engine.training.scorer import coupled_acceptance
from specactor_engine.training.teacher import Pair

REPORT_FILE = "feature_report.json"
SCORED_STEPS = 3  # draft steps scored on the held-out pairs
TEMPERATURE_SCALES = (0.6, 0.7, 0.8, 0.9, 1.0)  # drafting temperature scales tried on them


@dataclass(frozen=True)
class FeatureJob:
    """The options of `specactor drafter feature`, one to one."""

    target: str
    data: Path
    out: Path
    dtype: Dtype = "float32"
    cache_dir: Path | None = None
    steps: int = 300
    batch_size: int = 4
    lr: float = 3e-4
    save_every: int = 25
    max_minutes: float | None = None  # the whole run, sampling and the features' pass included
    samples: int = 2
    max_new_tokens: int = 256
    seed: int = 0
    draft_vocab: int = 32768  # 0: the full vocabulary
    feature_weight: float = 1.0
    noise: float = 0.1
    passes: int = 1  # draft steps trained per position (training-time test: FeatureDraftModel.forward_unrolled)
    # the target's dtype for the features' pass (None: `dtype`): the drafter then reads, while training, features
    # as a target served in it computes them; bfloat16 also runs the pass faster on a CPU with bf16 units
    feature_dtype: Dtype | None = None
    bf16_autocast: bool = True  # training steps' matmuls in bfloat16 (fp32 weights only; FeatureDistiller)

    @property
    def autocast(self) -> torch.dtype | None:
        """bfloat16 autocast speeds up fp32 weights only; other dtypes train as they are."""
        return torch.bfloat16 if self.bf16_autocast and self.dtype == "float32" else None


@dataclass(frozen=True)
class FeatureResult:
    steps: int
    trained_steps: int
    seconds: float
    loss_first: float | None
    loss_last: float | None
    held_out_top1: float | None  # drafter's greedy token == target's, held-out pairs, first draft position
    # chance of acceptance of draft steps 1..SCORED_STEPS at T = 1, held out, per drafting temperature scale
    held_out_acceptance: dict[float, list[float]] | None = None
    temperature_scale: float = 1.0  # the scale kept (the most accepted tokens per round)


def run_feature_distill(job: FeatureJob, reporter: Reporter | None = None) -> FeatureResult:
    """Run `job` to its step count or its time budget; the drafter is saved in `job.out`."""
    reporter = reporter or LogReporter()
    started = time.monotonic()
    target, tokenizer = load_target(job)
    pairs = [p for p in target_pairs(job.data, job.out, target, tokenizer, samples=job.samples,
                                     max_new_tokens=job.max_new_tokens, seed=job.seed, soft_top_k=0,
                                     reporter=reporter) if p[1]]
    if len(pairs) < 2:
        raise ValueError(f"--data {job.data}: {len(pairs)} usable samples; need at least 2 (one held out)")
    train, held = [p for i, p in enumerate(pairs) if i % 10], [p for i, p in enumerate(pairs) if not i % 10]
    vocab = _draft_vocab(job, target, tokenizer, train, reporter)
    with reporter.phase("target features", len(pairs)) as progress:
        features = load_or_compute_features(job.out, lambda: _feature_target(job, target), pairs,
                                            on_batch=lambda done: progress(done))
    train_f = [f for i, f in enumerate(features) if i % 10]
    held_f = [f for i, f in enumerate(features) if not i % 10]
    model, distiller = _model_and_trainer(job, target, vocab, reporter)
    resumed_at = distiller.steps
    history: list[dict[str, float]] = []
    with reporter.phase("training", job.steps) as progress:
        progress(distiller.steps)
        while distiller.steps < job.steps:
            if job.max_minutes is not None and time.monotonic() - started > job.max_minutes * 60:
                reporter.note(f"time budget of {job.max_minutes} min reached at step {distiller.steps}")
                break
            history.append(distiller.step(train, train_f, job.batch_size))
            progress(distiller.steps, history[-1]["loss"])
            if distiller.steps % job.save_every == 0:
                _save(job, model, distiller)
    distiller.finish()
    top1 = held_out_top1(distiller, held, held_f)
    with reporter.phase("held-out acceptance", len(held)) as progress:
        acceptance = held_out_acceptance(distiller, target, held, held_f, on_pair=progress)
    scale = best_temperature_scale(acceptance)
    _save(job, model, distiller, {"held_out_top1": top1, "train_pairs": len(train), "held_out_pairs": len(held),
                                  "draft_vocab": len(vocab) if vocab is not None else None,
                                  "held_out_acceptance": {str(s): a for s, a in acceptance.items()},
                                  "temperature_scale": scale})
    return FeatureResult(distiller.steps, distiller.steps - resumed_at, time.monotonic() - started,
                         history[0]["loss"] if history else None, history[-1]["loss"] if history else None, top1,
                         acceptance, scale)


def _feature_target(job: FeatureJob, target: nn.Module) -> nn.Module:
    """The target that computes the features: the training one, or a copy in `feature_dtype`."""
    if job.feature_dtype is None or job.feature_dtype == job.dtype:
        return target
    return load_target(dataclasses.replace(job, dtype=job.feature_dtype))[0]


def held_out_top1(distiller: FeatureDistiller, pairs: list[Pair], features: list[torch.Tensor]) -> float | None:
    """The share of held-out output positions where the drafter's greedy token is the target's (no noise)."""
    agree, total = 0.0, 0
    with torch.no_grad():
        for i in range(len(pairs)):
            ids, feats, valid = distiller.batch([pairs[i]], [features[i]], 1)
            output = torch.zeros_like(valid)
            output[0, len(pairs[i][0]) - 1 : valid.shape[1] - 1] = True  # positions that predict an output token
            _, parts = distiller.loss(ids, feats, valid & output, noise=False)
            n = int((valid & output).sum())
            agree, total = agree + parts["top1"] * n, total + n
    return agree / total if total else None


@torch.no_grad()
def held_out_acceptance(distiller: FeatureDistiller, target: nn.Module, pairs: list[Pair], features: list[torch.Tensor],
                        scales: tuple[float, ...] = TEMPERATURE_SCALES, steps: int = SCORED_STEPS,
                        on_pair: Callable[[int], None] | None = None, candidates: int = 64
                        ) -> dict[float, list[float]]:
    """The chance that draft step 1..`steps` is accepted under the engine's shared-noise rule at T = 1
    (`scorer.coupled_acceptance`), over the held-out output positions, drafting at T x scale for each scale:
    {scale: [a_1, ..., a_steps]}. Step p at position j is `forward_unrolled`'s pass p (the drafter reading its own
    predicted features for p - 1 positions), on the target's tokens: a_p is the chance given the steps before were
    accepted. The target's distribution is over its whole vocabulary, the drafter's over its head's tokens.
    candidates: tokens of each side summed over (`coupled_acceptance`: a lower bound, tight for an LM's peaked
    distributions, loose for flat ones)."""
    full = target.lm_head.weight
    head, ids = distiller.head_rows, distiller.vocab_ids
    sums = {scale: [0.0] * steps for scale in scales}
    counts = [0] * steps
    for done, ((prompt, output), f) in enumerate(zip(pairs, features), start=1):
        tokens = torch.tensor([prompt + output], device=full.device)
        f = f[None].to(full.device, full.dtype)
        prev = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)
        passes = distiller.model.forward_unrolled(distiller.embed(tokens), prev, steps)
        lo, hi = len(prompt) - 1, tokens.shape[1] - 1  # positions that predict an output token
        p = (f[0, lo:hi] @ full.T).double().softmax(dim=-1)  # [n, V]
        if ids is not None:  # the tokens the head cannot draft, as one: a draft never picks them
            inside = p[:, ids]
            p = torch.cat([inside, (1.0 - inside.sum(dim=-1, keepdim=True)).clamp_min(0.0)], dim=-1)
        for step, g in enumerate(passes):
            start = max(lo, step)  # step p needs p - 1 positions before it
            logits = (g[0, start:hi] @ head.T).double()
            for scale in scales:
                q = (logits / scale).softmax(dim=-1)
                if ids is not None:
                    q = torch.cat([q, q.new_zeros(len(q), 1)], dim=-1)
                sums[scale][step] += float(coupled_acceptance(p[start - lo :], q, candidates).sum())
            counts[step] += len(logits)
        if on_pair is not None:
            on_pair(done)
    return {scale: [s / c if c else 0.0 for s, c in zip(sums[scale], counts)] for scale in scales}


def best_temperature_scale(acceptance: dict[float, list[float]]) -> float:
    """The scale whose steps make the most accepted tokens in a round drafting them all (a_1 + a_1 a_2 + ...);
    1 on a tie or with nothing scored."""
    def accepted(rates: list[float]) -> float:
        total, chain = 0.0, 1.0
        for rate in rates:
            chain *= rate
            total += chain
        return total

    best = 1.0
    for scale, rates in acceptance.items():
        if accepted(rates) > accepted(acceptance.get(best, [])) + 1e-9:
            best = scale
    return best


def _draft_vocab(job: FeatureJob, target: nn.Module, tokenizer: Any, pairs: list[Pair],
                 reporter: Reporter) -> torch.Tensor | None:
    """The head's tokens: kept from a resumed run, else the job's size of most used tokens (None: all)."""
    saved = load_draft_vocab(job.out)
    if saved is not None:
        return saved
    vocab = target.lm_head.weight.shape[0]
    if not job.draft_vocab or job.draft_vocab >= vocab:
        return None
    always = [t for t in special_ids(tokenizer) if t < vocab]
    ids = choose_draft_vocab([], [p + o for p, o in pairs], job.draft_vocab, vocab, always=always)
    save_draft_vocab(job.out, ids)
    reporter.note(f"draft head over {len(ids)} of {vocab} tokens")
    return ids


def _model_and_trainer(job: FeatureJob, target: nn.Module, vocab: torch.Tensor | None,
                       reporter: Reporter) -> tuple[FeatureDraftModel, FeatureDistiller]:
    """A fresh drafter (the target's last layer), or the one in `out` with its trainer state."""
    state_path = job.out / STATE_FILE
    resuming = state_path.exists()
    model = FeatureDraftModel.load(job.out, target) if resuming else FeatureDraftModel(target)
    distiller = FeatureDistiller(model, target, job.lr, vocab, job.seed, job.feature_weight, job.noise, job.passes,
                                 job.autocast)
    if resuming:
        state = torch.load(state_path, weights_only=False)
        saved_lr = state["optimizer"]["param_groups"][0]["lr"]
        distiller.load_state_dict(state)
        change = f", learning rate {saved_lr:g} -> {job.lr:g}" if saved_lr != job.lr else ""
        reporter.note(f"resuming the feature drafter in {job.out} at step {distiller.steps}{change}")
    return model, distiller


def _save(job: FeatureJob, model: FeatureDraftModel, distiller: FeatureDistiller,
          report: dict[str, Any] | None = None) -> None:
    """Weights first, then the trainer state: a state on disk always has its weights."""
    model.save(job.out, extra={"steps": distiller.steps, "passes": job.passes,
                               "bf16_autocast": job.autocast is not None, **(report or {})})
    torch.save(distiller.state_dict(), job.out / STATE_FILE)
    if report is not None:
        (job.out / REPORT_FILE).write_text(json.dumps({"steps": distiller.steps, **report}, indent=1) + "\n",
                                           encoding="utf-8")
