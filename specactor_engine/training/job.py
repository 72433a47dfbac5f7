"""One `specactor drafter distill` run as a library call: from its options to a saved, resumable drafter.

In order: check the options; load the target and the drafter (resumed from the output directory, a
given model, or the target's first N layers with its final norm and head: a policy-derived drafter);
get the training pairs (`samples`) and the target's top-k on them (`teacher`); give a new drafter a
head over the tokens the data use most (`model.draft_vocab`); then train (`offline.distill`), with
the drafter's own samples at on-policy rounds (`on_policy`) if asked. The time budget covers the whole
run, sampling and the teacher pass included, since that is the wall-clock time a user budgets.

The CLI only parses options into a `DistillJob`, shows what the `Reporter` is told, and turns the
errors raised here (`DistillJobError`, `samples.DistillDataError`, other `ValueError`s) into messages.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from specactor_engine.config import Dtype
from specactor_engine.model.draft_vocab import SubsetHead, choose_draft_vocab, install_subset_head
from specactor_engine.training.distill import SoftTargets
from specactor_engine.training.offline import STATE_FILE, DistillResult, DistillSettings, distill
from specactor_engine.training.on_policy import StudentRounds, StudentSampler, prompts_of
from specactor_engine.training.report import LogReporter, Reporter
from specactor_engine.training.samples import target_pairs
from specactor_engine.training.teacher import Pair, load_or_compute_teacher


class DistillJobError(ValueError):
    """Options that do not make a run (the message names the options as the CLI spells them)."""


@dataclass(frozen=True)
class DistillJob:
    """The options of a drafter-distillation run: those of `specactor drafter distill`, one to one."""

    target: str  # a registered model name or a local HF directory
    data: Path  # rollout records (prompt_token_ids + token_ids) or a prompt file to roll out with the target
    out: Path  # the drafter's HF directory; a run that finds a trainer state there resumes it
    init: str | None = None  # the drafter to start from (name or HF directory) ...
    init_layers: int | None = None  # ... or the target's first N layers (exactly one, unless resuming)
    dtype: Dtype = "float32"
    cache_dir: Path | None = None
    steps: int = 200  # optimizer steps in total (a resumed run counts on)
    batch_size: int = 8
    lr: float = 3e-4
    save_every: int = 50
    max_minutes: float | None = None  # for the whole run, counted from after loading the models
    samples: int = 4  # target samples per prompt when `data` holds prompts
    max_new_tokens: int = 256
    seed: int = 0
    soft_top_k: int = 32  # train on the target's top-k per position; 0: on the sampled tokens only
    draft_vocab: int = 16384  # a head over this many of the data's most used tokens; 0: the full vocabulary
    freeze_embeddings: bool = True
    bf16_autocast: bool = True  # sampling, teacher pass and steps in bfloat16 (fp32 weights only)
    lr_decay: bool = True
    student_rounds: int = 0  # on-policy rounds spread over the run (needs soft_top_k)
    student_samples: int = 2
    loss: Literal["kl", "coupled"] = "kl"
    kl_weight: float = 0.1
    freeze_layers: int = 0

    @property
    def resumes(self) -> bool:
        """A trainer state in `out` means an earlier run to carry on (its drafter, data and caches)."""
        return (self.out / STATE_FILE).exists()

    @property
    def autocast(self) -> torch.dtype | None:
        """bfloat16 autocast speeds up fp32 weights only; other dtypes run as they are."""
        return torch.bfloat16 if self.bf16_autocast and self.dtype == "float32" else None

    def check(self) -> None:
        """Refuse option combinations that cannot make a run, before any model is loaded."""
        if (self.init is None) == (self.init_layers is None) and not self.resumes:
            raise DistillJobError("give exactly one of --init and --init-layers (or --out of a run to resume)")
        if self.init_layers is not None and self.freeze_layers >= self.init_layers:
            raise DistillJobError(f"--freeze-layers {self.freeze_layers} leaves nothing to train in a "
                                  f"{self.init_layers}-layer drafter")
        if self.loss == "coupled" and not self.soft_top_k:
            raise DistillJobError("--loss coupled needs --soft-top-k > 0: the acceptance probability is computed "
                                  "from the target's top-k")
        if self.student_rounds and not self.soft_top_k:
            raise DistillJobError("--student-rounds needs --soft-top-k > 0: the drafter's own samples are labelled "
                                  "by the target's top-k")

    def settings(self, max_seconds: float | None) -> DistillSettings:
        """The trainer's settings, with what is left of the time budget once the data are ready."""
        return DistillSettings(steps=self.steps, batch_size=self.batch_size, lr=self.lr, save_every=self.save_every,
                               seed=self.seed, max_seconds=max_seconds, freeze_embeddings=self.freeze_embeddings,
                               autocast=self.autocast, lr_decay=self.lr_decay, loss=self.loss,
                               kl_weight=self.kl_weight, freeze_layers=self.freeze_layers)


def run_distill(job: DistillJob, reporter: Reporter | None = None) -> DistillResult:
    """Run `job` to the end (or its time budget) and save the drafter in `job.out`."""
    reporter = reporter or LogReporter()
    job.check()
    target, tokenizer = load_target(job)
    model = _load_drafter(job, target, tokenizer, reporter)
    started = time.monotonic()
    pairs = target_pairs(job.data, job.out, target, tokenizer, samples=job.samples,
                         max_new_tokens=job.max_new_tokens, seed=job.seed, soft_top_k=job.soft_top_k,
                         reporter=reporter, sample_dtype=job.autocast)
    soft = _soft_targets(job, target, pairs, reporter)
    _install_draft_head(job, model, tokenizer, pairs, soft, reporter)
    settings = job.settings(_seconds_left(job, started))
    student = None
    if job.student_rounds:
        rounds = StudentRounds(job.student_rounds, job.student_samples, job.max_new_tokens, job.soft_top_k, job.seed)
        student = StudentSampler(model, target, tokenizer, prompts_of(pairs), rounds, job.out, job.autocast)
    with reporter.phase("distilling", job.steps) as progress:
        return distill(model, tokenizer, pairs, job.out, settings, soft=soft, student=student,
                       on_step=lambda step, loss: progress(step, loss))


def _seconds_left(job: DistillJob, started: float) -> float | None:
    """What is left of `job.max_minutes` for training steps; the data took the time since `started`."""
    if job.max_minutes is None:
        return None
    return max(job.max_minutes * 60 - (time.monotonic() - started), 0.0)


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


def special_ids(tokenizer: Any) -> list[int]:
    """Token ids a drafter head must always cover (end of sequence and the other special tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def load_target(job: Any) -> tuple[nn.Module, Any]:
    """The target model in the training dtype, and its tokenizer (the drafter's too)."""
    from transformers import AutoTokenizer

    from specactor_engine.model.registry import resolve_model
    from specactor_engine.model.runner import load_hf_model

    path = resolve_model(job.target, dtype=job.dtype, cache_dir=job.cache_dir)
    return load_hf_model(path, job.dtype), AutoTokenizer.from_pretrained(path)


def _load_drafter(job: DistillJob, target: nn.Module, tokenizer: Any, reporter: Reporter) -> nn.Module:
    """The drafter to train: resumed from `out`, loaded from `init` (same tokenizer), or cut from the target."""
    from transformers import AutoTokenizer

    from specactor_engine.drafters.model import check_same_tokenizer
    from specactor_engine.model.registry import resolve_model
    from specactor_engine.model.runner import load_hf_model

    if job.resumes:
        reporter.note(f"resuming the drafter in {job.out}")
        return load_hf_model(job.out, job.dtype)
    if job.init is not None:
        path = resolve_model(job.init, dtype=job.dtype, cache_dir=job.cache_dir)
        check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(path), job.init)
        return load_hf_model(path, job.dtype)
    return truncated_copy(target, int(job.init_layers or 0))


def _soft_targets(job: DistillJob, target: nn.Module, pairs: list[Pair],
                  reporter: Reporter) -> list[SoftTargets] | None:
    """The target's top-k on `pairs` (cached in `out`), or None when training on the sampled tokens."""
    if job.soft_top_k <= 0:
        return None
    with reporter.phase("target top-k", len(pairs)) as progress:
        return load_or_compute_teacher(job.out, target, pairs, job.soft_top_k, autocast=job.autocast,
                                       on_batch=lambda done: progress(done))


def _install_draft_head(job: DistillJob, model: nn.Module, tokenizer: Any, pairs: list[Pair],
                        soft: list[SoftTargets] | None, reporter: Reporter) -> None:
    """Give a new drafter a head over the `job.draft_vocab` tokens with most target mass in the data.

    Drafting then costs a fraction of the full head; output stays exact (the verifier decides). A resumed
    drafter keeps the head it was saved with, so the choice is made once.
    """
    vocab = model.lm_head.weight.shape[0]
    if not job.draft_vocab or job.draft_vocab >= vocab or isinstance(model.lm_head, SubsetHead):
        return
    if soft is not None:
        masses = [(ids, values.float().exp()) for ids, values in soft]
    else:
        masses = [(torch.tensor(o), torch.ones(len(o))) for _, o in pairs]
    ids = choose_draft_vocab(masses, [p for p, _ in pairs], job.draft_vocab, vocab, always=special_ids(tokenizer))
    install_subset_head(model, ids)
    reporter.note(f"draft head over {len(ids)} of {vocab} tokens")
