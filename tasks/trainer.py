"""The policy trainer: GRPO updates of a Hugging Face causal LM on a DeepSpeed engine.

`PolicyTrainer(model, optim, temperature=..., seed=...)` owns one DeepSpeed engine, configured by
the validated `OptimConfig` (specactor_engine/config.py: ZeRO stage, dtype, GRPO loss; gloo on CPU,
NCCL on GPU, the same code) and knows nothing about rollouts beyond `RolloutBatch`:
token ids, the engine's logprobs of the emitted tokens and one advantage per sample.
One `step(batch)` is one optimizer update, accumulated over micro-batches so that the loss
is the same as for the whole batch at once (micro-batches group rows of similar length, so
little of a forward is padding; logits are computed at the output positions only;
docs/training.md). Weights leave the trainer as (HF name, tensor)
pairs (`state_dict_for_sync`) or as an atomically written checkpoint: the policy as safetensors (an HF model
directory) and, under `trainer/`, everything the next update depends on (DeepSpeed's engine checkpoint: optimizer
moments and step counts, ZeRO-partitioned per rank; the trainer's RNG streams; the policy version), so a resumed
run continues exactly where the checkpoint was taken (docs/training.md, "Checkpoints and resume").
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import shutil
import socket
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from specactor_engine.config import OptimConfig
from specactor_engine.files import fsync_dir
from tasks.grpo import entropy_from_logits, grpo_loss, token_logprobs_from_logits

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
TRAINER_STATE_DIR = "trainer"  # DeepSpeed's engine checkpoint + per-rank RNG streams + state.json
_ENGINE_TAG = "engine"  # DeepSpeed's checkpoint tag inside TRAINER_STATE_DIR
_STATE_FILE = "state.json"
BACKUP_SUFFIX = ".previous"  # an overwritten checkpoint lives here for the instant of the swap
_SINGLE_PROCESS_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainerConfigError(ValueError):
    """A trainer setting this machine cannot run; the message is meant for the user."""


@dataclass(frozen=True)
class RolloutBatch:
    """What one GRPO update consumes: per sample, its prompt, its output and the rollout's view of it."""

    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    old_logprobs: list[list[float]]  # rollout engine's log softmax(logits / T) of each output token
    advantages: list[float]  # one per sample

    def __post_init__(self) -> None:
        num = len(self.prompt_token_ids)
        if not num:
            raise ValueError("RolloutBatch is empty")
        if not len(self.output_token_ids) == len(self.old_logprobs) == len(self.advantages) == num:
            raise ValueError("RolloutBatch fields must have one entry per sample")
        for index, (prompt, output, logprobs) in enumerate(
                zip(self.prompt_token_ids, self.output_token_ids, self.old_logprobs)):
            if not prompt:
                raise ValueError(f"sample {index}: empty prompt (the first output token needs a context)")
            if len(logprobs) != len(output):
                raise ValueError(f"sample {index}: {len(logprobs)} logprobs for {len(output)} output tokens")

    def __len__(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(output) for output in self.output_token_ids)

    def select(self, rows: Sequence[int]) -> RolloutBatch:
        """The samples at `rows`, as a batch."""
        return RolloutBatch([self.prompt_token_ids[i] for i in rows], [self.output_token_ids[i] for i in rows],
                            [self.old_logprobs[i] for i in rows], [self.advantages[i] for i in rows])

    @classmethod
    def make_dummy(cls, num_samples: int = 4, vocab_size: int = 256, seed: int = 0) -> RolloutBatch:
        """Random prompts/outputs of varied lengths, zero logprobs, advantages of both signs."""
        gen = torch.Generator().manual_seed(seed)
        prompts, outputs = [], []
        for index in range(num_samples):
            prompts.append(torch.randint(vocab_size, (2 + index % 3,), generator=gen).tolist())
            outputs.append(torch.randint(vocab_size, (3 + (index * 2) % 5,), generator=gen).tolist())
        advantages = [(-1.0) ** index * (1 + index) / num_samples for index in range(num_samples)]
        return cls(prompts, outputs, [[0.0] * len(out) for out in outputs], advantages)


@dataclass(frozen=True)
class _MicroBatch:
    """Right-padded tensors of a micro-batch; O is the longest output."""

    input_ids: torch.Tensor  # [B, L] prompt + output, right-padded
    attention_mask: torch.Tensor  # [B, L]
    logit_positions: torch.Tensor  # [B, O] position whose logits predict output token j
    output_ids: torch.Tensor  # [B, O]
    mask: torch.Tensor  # [B, O] 1 for real output tokens
    old_logprobs: torch.Tensor  # [B, O]
    advantages: torch.Tensor  # [B]


def collate(batch: RolloutBatch, device: torch.device | str = "cpu") -> _MicroBatch:
    """Right-pad prompt + output rows and align output tokens with the logits that predict them."""
    lengths = [len(p) + len(o) for p, o in zip(batch.prompt_token_ids, batch.output_token_ids)]
    width, out_width = max(lengths), max(1, max(len(o) for o in batch.output_token_ids))
    rows = len(batch)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, out_width, dtype=torch.long)
    output_ids = torch.zeros(rows, out_width, dtype=torch.long)
    mask = torch.zeros(rows, out_width)
    old = torch.zeros(rows, out_width)
    for row, (prompt, output, logprobs) in enumerate(
            zip(batch.prompt_token_ids, batch.output_token_ids, batch.old_logprobs)):
        num_out = len(output)
        input_ids[row, :lengths[row]] = torch.tensor(prompt + output)
        attention_mask[row, :lengths[row]] = 1
        positions[row, :num_out] = torch.arange(len(prompt) - 1, len(prompt) - 1 + num_out)
        output_ids[row, :num_out] = torch.tensor(output, dtype=torch.long)
        mask[row, :num_out] = 1
        old[row, :num_out] = torch.tensor(logprobs, dtype=torch.float32)
    tensors = (input_ids, attention_mask, positions, output_ids, mask, old, torch.tensor(batch.advantages))
    return _MicroBatch(*(t.to(device) for t in tensors))


@dataclass(frozen=True)
class _SharedPromptBatch:
    """A micro-batch whose rows share one prompt: the prompt once, the outputs right-padded; O is the longest."""

    prompt_ids: torch.Tensor  # [1, P]
    output_ids: torch.Tensor  # [B, O]
    mask: torch.Tensor  # [B, O] 1 for real output tokens
    old_logprobs: torch.Tensor  # [B, O]
    advantages: torch.Tensor  # [B]


def collate_shared_prompt(batch: RolloutBatch, device: torch.device | str = "cpu") -> _SharedPromptBatch:
    """The rows of `batch` (one prompt) as the prompt once and right-padded outputs."""
    if any(prompt != batch.prompt_token_ids[0] for prompt in batch.prompt_token_ids):
        raise ValueError("collate_shared_prompt: the rows have different prompts")
    out_width = max(1, max(len(o) for o in batch.output_token_ids))
    output_ids = torch.zeros(len(batch), out_width, dtype=torch.long)
    mask, old = torch.zeros(len(batch), out_width), torch.zeros(len(batch), out_width)
    for row, (output, logprobs) in enumerate(zip(batch.output_token_ids, batch.old_logprobs)):
        output_ids[row, :len(output)] = torch.tensor(output, dtype=torch.long)
        mask[row, :len(output)] = 1
        old[row, :len(output)] = torch.tensor(logprobs, dtype=torch.float32)
    tensors = (torch.tensor([batch.prompt_token_ids[0]]), output_ids, mask, old, torch.tensor(batch.advantages))
    return _SharedPromptBatch(*(t.to(device) for t in tensors))


def _shared_prompt_logits(model: nn.Module, micro: _SharedPromptBatch) -> torch.Tensor:
    """Logits [B, O, V] that predict the output tokens: the prompt's last position (output 0) from one pass over
    the prompt, then every row's outputs 0..O-2 (outputs 1..O-1) over the prompt's keys and values repeated per
    row. Autograd sums the rows' gradients into the one prompt pass. Outputs are right-padded and attention is
    causal, so no real token attends to padding and no mask is needed."""
    rows, width = micro.output_ids.shape
    first = model(input_ids=micro.prompt_ids, use_cache=True, logits_to_keep=1)  # [1, 1, V] predicts output 0
    logits = first.logits.expand(rows, 1, -1)
    if width == 1:
        return logits
    cache = first.past_key_values
    cache.batch_repeat_interleave(rows)  # [1, H, P, D] -> [B, H, P, D] per layer (a differentiable copy)
    rest = model(input_ids=micro.output_ids[:, :-1], past_key_values=cache, use_cache=True).logits  # [B, O-1, V]
    return torch.cat([logits, rest], dim=1)


def output_logprobs(model: nn.Module, micro: _MicroBatch | _SharedPromptBatch, temperature: float,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, O] of the output tokens under `model` (and their entropies [B, O] if asked). The head runs
    at the O positions that predict output tokens only (HF `logits_to_keep`), not at the prompt's; a
    `_SharedPromptBatch` computes its prompt once (`_shared_prompt_logits`)."""
    if isinstance(micro, _SharedPromptBatch):
        picked = _shared_prompt_logits(model, micro)
    else:
        picked = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False,
                       logits_to_keep=micro.logit_positions).logits  # [B, O, V]
    logprobs = token_logprobs_from_logits(picked, micro.output_ids, temperature)
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        return logprobs, entropy_from_logits(picked, temperature)


def set_attention(model: nn.Module, attention: str, cuda: bool | None = None) -> str:
    """Switch `model` (an HF causal LM) to the configured attention; 'auto': eager on CPU, sdpa with CUDA (the
    fused kernel's CPU backward is slow at these shapes: OptimConfig.attention). Returns what it set."""
    if attention == "auto":
        attention = "sdpa" if (torch.cuda.is_available() if cuda is None else cuda) else "eager"
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attention)
    return attention


def keep_head_float32(model: nn.Module) -> None:
    """Run `model`'s LM head outside autocast, in float32: the logits a policy gradient differentiates through
    log_softmax need fp32's resolution (bf16 rounds a logit of 20 to a multiple of 0.125). The module and its
    state dict are unchanged (the weight stays shared with a tied embedding); only its forward is replaced."""
    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float())

    head.forward = forward


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted by length (longest first, stable), cut every `max_rows` rows
    and, with `max_tokens`, before a row would make rows x longest exceed it (a row longer than that goes
    alone). Each micro-batch lists its rows in the batch's order. A padded forward costs its longest row per
    row, so grouping by length cuts the padding (rollouts of a group range from a few tokens to the limit)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    parts: list[list[int]] = []
    for i in order:  # longest first: a part's first row is its longest
        part = parts[-1] if parts else None
        if part is not None and len(part) < max_rows and (
                max_tokens is None or (len(part) + 1) * lengths[part[0]] <= max_tokens):
            part.append(i)
        else:
            parts.append([i])
    return [sorted(part) for part in parts]


def shared_prompt_batches(prompts: list[list[int]], output_lengths: list[int], max_rows: int,
                          max_tokens: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch when rows that share a prompt share its forward: rows grouped by prompt,
    then within a prompt `micro_batches` of their outputs (`max_tokens` counts the prompt once and each row's
    output). Groups in order of first appearance; each micro-batch lists its rows in the batch's order."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(row)
    parts: list[list[int]] = []
    for prompt, rows in by_prompt.items():
        budget = None if max_tokens is None else max(1, max_tokens - len(prompt))
        for part in micro_batches([output_lengths[r] for r in rows], max_rows, budget):
            parts.append([rows[i] for i in part])
    return parts


def native_bf16(cuda_available: bool | None = None) -> bool:
    """The device computes bf16 natively: a CUDA GPU that supports it, or a CPU oneDNN runs bf16 on (AVX-512
    BF16 or AMX; an AVX2-only CPU emulates it, slower than fp32)."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if cuda:
        return bool(torch.cuda.is_bf16_supported())
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(cfg: OptimConfig, bf16_native: bool | None = None) -> OptimConfig:
    """`cfg` with dtype and autocast 'auto' made concrete: bfloat16 where the device computes it natively (else
    float32 and no autocast)."""
    if cfg.dtype != "auto" and cfg.autocast != "auto":
        return cfg
    native = native_bf16() if bf16_native is None else bf16_native
    update: dict[str, str] = {}
    if cfg.dtype == "auto":
        update["dtype"] = "bfloat16" if native else "float32"
    if cfg.autocast == "auto":
        update["autocast"] = "bfloat16" if native else "none"
    return cfg.model_copy(update=update)


def check_device_support(cfg: OptimConfig, cuda_available: bool | None = None) -> None:
    """Refuse settings this machine cannot run, before any work (fp16 needs a GPU)."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if cfg.dtype == "float16" and not cuda:
        raise TrainerConfigError(
            "train.optim.dtype: 'float16' cannot run on CPU: DeepSpeed's fp16 training (loss scaling, fused "
            "fp16 optimizer) needs a GPU. Use dtype 'bfloat16' or 'float32' on CPU.")
    if cfg.backend == "nccl" and not cuda:
        raise TrainerConfigError("train.optim.backend: 'nccl' needs CUDA; use 'auto' or 'gloo' on CPU.")


def resolve_backend(backend: str) -> str:
    """'auto' -> 'nccl' with CUDA, 'gloo' otherwise."""
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str) -> None:
    """Join (or create) the process group; a lone process becomes rank 0 of 1. Safe to call repeatedly."""
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed resolves its accelerator
    for name, value in _SINGLE_PROCESS_ENV.items():
        os.environ.setdefault(name, value)
    lone = os.environ["WORLD_SIZE"] == "1"
    if "MASTER_PORT" not in os.environ and not lone:
        os.environ["MASTER_PORT"] = str(_free_port())
    import deepspeed

    if on_cpu:  # otherwise init JIT-compiles this op (~70 s on 2 cores), for a single process too
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if lone and not torch.distributed.is_initialized():
        # a group of one needs no rendezvous: an in-memory store instead of a TCP port (a free port picked, closed
        # and bound again can be taken in between: seen as EADDRINUSE with Ray starting beside it); DeepSpeed keeps
        # a group that is already initialised
        torch.distributed.init_process_group(resolve_backend(backend), store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=resolve_backend(backend))  # no-op once initialised


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_config(cfg: OptimConfig) -> dict[str, Any]:
    """The DeepSpeed config for `cfg`: the client owns the accumulation boundary (one step per batch)."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # backward() accumulates, each step() is one update
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "torch_autocast": {"enabled": cfg.autocast != "none", "dtype": "bfloat16"},
        "fp16": {"enabled": cfg.dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class PolicyTrainer:
    """GRPO updates of `model` (an HF causal LM) on a DeepSpeed engine.

    The trainer takes ownership of `model`: it is cast to `cfg.dtype` and wrapped (under ZeRO-3,
    partitioned) in place. `temperature` is the rollout's sampling temperature (logprobs use
    logits / T, as the engine's do; 0: greedy, T=1); `seed` seeds torch's global RNG and the trainer's own
    RNG streams (torch, numpy, python: what an update draws from, swapped in for its duration and checkpointed).
    `reference` is the frozen policy of the KL term (default: a copy of `model`; a resumed run passes the
    initial policy). Every rank of a multi-process group must make the same calls.
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig, *, temperature: float, seed: int,
                 reference: nn.Module | None = None) -> None:
        cfg = resolve_dtype(cfg)
        check_device_support(cfg)
        self.cfg = cfg
        logger.info("policy update in %s%s, ZeRO-%d, micro-batches of %d rows", cfg.dtype,
                    f" with {cfg.autocast} autocast" if cfg.autocast != "none" else "", cfg.zero_stage,
                    cfg.micro_batch_size)
        self.temperature = temperature
        self.version = 0  # updates the weights hold: +1 per step, restored by load_checkpoint
        self._rng = seeded_rng_state(seed)
        torch.manual_seed(seed)
        init_distributed(cfg.backend)
        import deepspeed

        model = model.to(_DTYPES[cfg.dtype]).train()
        logger.info("policy attention in the update: %s", set_attention(model, cfg.attention))
        self.reference = None
        if cfg.use_reference:
            source = model if reference is None else reference.to(_DTYPES[cfg.dtype])
            self.reference = copy.deepcopy(source).eval().requires_grad_(False)
            set_attention(self.reference, cfg.attention)  # a resumed run's reference is loaded, not copied
        if cfg.autocast != "none":  # after the reference's copy: the replaced forward reads this model's head
            keep_head_float32(model)
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel per step over all parameters (CPU and CUDA), same update as the loop
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                      fused=True)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg))
        if self.reference is not None:
            self.reference.to(self.engine.device)

    @property
    def module(self) -> nn.Module:
        """The wrapped HF model (under ZeRO-3 its parameters are partitioned)."""
        return self.engine.module

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer update on `batch`; returns loss, pg_loss, kl, clip_fraction, grad_norm, lr, tokens, ..."""
        with self._own_rng():
            sums = self.backward(batch)
            grad_norm = self._local_grad_norm()
            self.engine.step()
        self.version += 1
        engine_norm = self.engine.get_global_grad_norm()
        grad_norm = float(engine_norm) if engine_norm is not None else grad_norm
        counts = self._sum_over_ranks({"tokens": float(batch.num_output_tokens), "sequences": float(len(batch))})
        return {**sums, "grad_norm": grad_norm, "lr": float(self.engine.get_lr()[0]), **counts}

    def backward(self, batch: RolloutBatch) -> dict[str, float]:
        """The first half of `step`: the batch's loss backpropagated over its micro-batches, the gradients left
        for the update (`deepspeed.utils.safe_get_full_grad` reads them in between); returns the loss metrics.
        With several ranks `batch` is this rank's rows: the mean is over every rank's tokens (or sequences) and
        the metrics are summed over ranks, so the update and metrics are those of the whole batch on one rank."""
        total = self._sum_over_ranks({"count": float(self._aggregation_count(batch))})["count"]
        if total == 0:
            raise ValueError("RolloutBatch has no output tokens to train on")
        ranks = torch.distributed.get_world_size()  # DeepSpeed averages the ranks' gradients: undo the 1 / ranks
        self.engine.train()
        sums: dict[str, float] = {}
        for _, part in self._micro_batches(batch):
            weight = self._aggregation_count(part) / total  # micro-batch mean -> its share of the batch mean
            loss, metrics = self._micro_loss(self._collate(part))
            self.engine.backward(loss * (weight * ranks), scale_wrt_gas=False)
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + weight * value
        return self._sum_over_ranks(sums)

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """`values` summed over the ranks (every rank passes the same names)."""
        if torch.distributed.get_world_size() == 1:
            return values
        names = sorted(values)
        summed = torch.tensor([values[name] for name in names], dtype=torch.float64, device=self.engine.device)
        torch.distributed.all_reduce(summed)
        return dict(zip(names, summed.tolist()))

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> list[list[float]]:
        """Logprobs of every output token under the current weights (temperature-scaled like the engine)."""
        self.engine.eval()
        rows: list[list[float]] = [[] for _ in range(len(batch))]
        for indices, part in self._micro_batches(batch):
            logprobs, _ = output_logprobs(self.engine, self._collate(part), self.temperature)
            for index, row, out in zip(indices, logprobs.tolist(), part.output_token_ids):
                rows[index] = row[:len(out)]
        return rows

    @property
    def low_precision(self) -> bool:
        """The module computes in bf16/fp16 over DeepSpeed's fp32 master weights (which are the policy)."""
        return self.cfg.dtype != "float32"

    def state_dict_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights as (HF parameter name, CPU tensor) pairs, gathered one at a time under ZeRO-3. In
        bf16/fp16 the fp32 master weights: the policy the optimizer updates, of which the module holds a
        rounded copy to compute with, so rollouts, checkpoints and a resumed run see the weights the update
        produced (docs/training.md)."""
        for name, param in self.module.named_parameters():
            if self.low_precision and param.requires_grad:
                yield name, self._master(name, param).detach().to("cpu", copy=True)
                continue
            with self._gathered([param]):
                yield name, param.detach().to("cpu", copy=True)

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write the policy (`model.safetensors` + config.json) and the training state (`trainer/`, with the
        trainer's `version`) to `directory` atomically; return the directory.

        Every rank writes its part into one staging sibling, which is fsynced and then renamed into place:
        a crash at any point leaves the previous checkpoint (at this or any other path) complete and loadable.
        """
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = directory.with_name(_agreed(f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"))
        state = dict(self.state_dict_for_sync())  # every rank takes part in the ZeRO-3 gathers
        rank = torch.distributed.get_rank()
        try:
            if rank == 0:
                self.module.save_pretrained(staging, state_dict=state)
            self._save_training_state(staging / TRAINER_STATE_DIR)
            torch.distributed.barrier()
            if rank == 0:
                _fsync_tree(staging)
                _replace_dir(staging, directory)
        finally:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
        torch.distributed.barrier()
        logger.info("saved checkpoint %s", directory)
        return directory

    def _save_training_state(self, directory: Path) -> None:
        """DeepSpeed's engine checkpoint (optimizer, any LR scheduler, step counts; ZeRO: each rank its
        partition), this rank's RNG streams and, from rank 0, what the state belongs to."""
        self.engine.save_checkpoint(str(directory), tag=_ENGINE_TAG)
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.save(self._rng, directory / f"rng_rank{rank}.pt")
        if rank == 0:
            (directory / _STATE_FILE).write_text(json.dumps(
                {"version": self.version, "world_size": world_size, "zero_stage": self.cfg.zero_stage,
                 "dtype": self.cfg.dtype}, indent=2) + "\n")

    @torch.no_grad()
    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what `save_checkpoint` wrote: the policy's weights (exactly: in bf16/fp16 the fp32 master
        weights too) and, where `trainer/` is there and was written by the same world size, ZeRO stage and
        dtype, the optimizer and engine state and the RNG streams. Learning rate, betas and weight decay
        are the config's (a resumed run may change them). A weights-only checkpoint restarts the optimizer."""
        directory = checkpoint_dir(directory)
        saved = self._compatible_state(directory / TRAINER_STATE_DIR)
        if saved is not None:
            self.engine.load_checkpoint(str(directory / TRAINER_STATE_DIR), tag=_ENGINE_TAG)
            rank = torch.distributed.get_rank()
            self._rng = torch.load(directory / TRAINER_STATE_DIR / f"rng_rank{rank}.pt", weights_only=False)
            self.version = int(saved["version"])
        self._load_weights(directory)
        for group in self.engine.optimizer.param_groups:
            group.update(lr=self.cfg.lr, betas=self.cfg.betas, weight_decay=self.cfg.weight_decay)

    def _compatible_state(self, directory: Path) -> dict[str, Any] | None:
        """state.json of the training state at `directory`, if it is there and this trainer can load it."""
        if not (directory / _STATE_FILE).is_file():
            logger.warning("%s holds no training state: the optimizer starts afresh", directory.parent)
            return None
        saved = json.loads((directory / _STATE_FILE).read_text())
        here = {"world_size": torch.distributed.get_world_size(), "zero_stage": self.cfg.zero_stage,
                "dtype": self.cfg.dtype}
        changed = {key: (saved[key], value) for key, value in here.items() if saved[key] != value}
        if changed:
            logger.warning("%s: training state written with other settings %s (saved, now): loading the "
                           "weights only, the optimizer starts afresh", directory.parent, changed)
            return None
        return saved

    def _load_weights(self, directory: Path) -> None:
        """The policy's weights from `model.safetensors` into the module and the optimizer's master copy."""
        tensors = load_file(str(directory / WEIGHTS_NAME))
        pairs = _match_parameters(self.module, tensors)
        with self._gathered([param for param, _ in pairs], modifier_rank=0):
            for param, tensor in pairs:
                param.copy_(tensor.to(param.dtype))
        if hasattr(self.engine.optimizer, "refresh_fp32_params"):
            self.engine.optimizer.refresh_fp32_params()  # ZeRO/bf16 keep their own fp32 master weights
        if self.low_precision:  # ... which the module's rounded copy only approximates: set them exactly
            from deepspeed.utils import safe_set_full_fp32_param

            for param, tensor in pairs:
                if not param.requires_grad:
                    continue
                exact = tensor.to(self.engine.device, torch.float32)
                if hasattr(param, "_hp_mapping") or hasattr(param, "ds_id"):  # ZeRO 1-3
                    safe_set_full_fp32_param(param, exact)
                else:
                    self._master("", param).copy_(exact)

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        """Run with the trainer's RNG streams in place of the process's, and keep where they got to."""
        outer = rng_state()
        set_rng_state(self._rng)
        try:
            yield
        finally:
            self._rng = rng_state()
            set_rng_state(outer)

    def _master(self, name: str, param: nn.Parameter) -> torch.Tensor:
        """The fp32 master weight of a bf16/fp16 parameter: ZeRO 1-3's (gathered: every rank takes part under
        ZeRO-3) or, without ZeRO, the mixed-precision optimizer's copy (fp16_groups -> fp32_groups)."""
        from deepspeed.utils import safe_get_full_fp32_param

        master = safe_get_full_fp32_param(param)
        if master is not None:
            return master
        optimizer = self.engine.optimizer
        for low_group, fp32_group in zip(getattr(optimizer, "fp16_groups", ()), getattr(optimizer, "fp32_groups", ())):
            for low, fp32 in zip(low_group, fp32_group):
                if low is param:
                    return fp32
        raise RuntimeError(f"{name or 'a parameter'}: DeepSpeed's {type(optimizer).__name__} holds no fp32 master "
                           "weight for it")

    def _micro_batches(self, batch: RolloutBatch) -> Iterator[tuple[list[int], RolloutBatch]]:
        """(row indices, rows) of each micro-batch: with `shared_prompt`, rows of one prompt
        (`shared_prompt_batches`), else rows of similar length (`micro_batches`)."""
        if self.cfg.shared_prompt:
            parts = shared_prompt_batches(batch.prompt_token_ids, [len(o) for o in batch.output_token_ids],
                                          self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)
        else:
            lengths = [len(p) + len(o) for p, o in zip(batch.prompt_token_ids, batch.output_token_ids)]
            parts = micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)
        for rows in parts:
            yield rows, batch.select(rows)

    def _collate(self, part: RolloutBatch) -> _MicroBatch | _SharedPromptBatch:
        if self.cfg.shared_prompt:
            return collate_shared_prompt(part, self.engine.device)
        return collate(part, self.engine.device)

    def _micro_loss(self, micro: _MicroBatch | _SharedPromptBatch) -> tuple[torch.Tensor, dict[str, float]]:
        new_logprobs, entropy = output_logprobs(self.engine, micro, self.temperature, with_entropy=True)
        ref_logprobs = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logprobs, _ = output_logprobs(self.reference, micro, self.temperature)
        # 'trainer': this batch's single update starts from the weights that rolled it out, so the trainer's own
        # log-probabilities are the old ones up to numerics (docs/training.md)
        old = micro.old_logprobs if self.cfg.old_logprobs == "rollout" else new_logprobs.detach()
        loss, metrics = grpo_loss(new_logprobs, old, micro.advantages, micro.mask,
                                  clip_eps=self.cfg.clip_eps, clip_eps_high=self.cfg.clip_eps_high,
                                  ref_logprobs=ref_logprobs, kl_coef=self.cfg.kl_coef, loss_agg=self.cfg.loss_agg,
                                  entropy=entropy)
        with torch.no_grad():  # how far the trainer's log-probabilities are from the engine's (numerics, or staleness)
            gap = (new_logprobs.detach() - micro.old_logprobs).abs() * micro.mask
            metrics["rollout_logprob_gap"] = float(gap.sum() / micro.mask.sum().clamp_min(1))
        return loss, metrics

    def _aggregation_count(self, batch: RolloutBatch) -> int:
        """What the loss mean divides by: output tokens (token_mean) or sequences with any (seq_mean)."""
        if self.cfg.loss_agg == "seq_mean":
            return sum(1 for output in batch.output_token_ids if output)
        return batch.num_output_tokens

    def _local_grad_norm(self) -> float:
        """Gradient norm from `.grad` (ZeRO-0 keeps full grads there and does not report its norm)."""
        if self.cfg.zero_stage > 0:
            return float("nan")
        norms = [torch.linalg.vector_norm(p.grad.float()) for p in self.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def _gathered(self, params: list[nn.Parameter], modifier_rank: int | None = None):
        if self.cfg.zero_stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def checkpoint_dir(directory: str | Path) -> Path:
    """`directory`, or its backup if a crash interrupted the swap that replaces it."""
    directory = Path(directory)
    backup = directory.with_name(directory.name + BACKUP_SUFFIX)
    if not directory.exists() and backup.exists():
        logger.warning("checkpoint %s is missing; using the previous one at %s", directory, backup)
        return backup
    if not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"no checkpoint at {directory} (expected {WEIGHTS_NAME})")
    return directory


def rng_state() -> dict[str, Any]:
    """The process's RNG states: torch (CPU and every CUDA device), numpy's global, python's."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back RNG states taken by `rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seeded_rng_state(seed: int) -> dict[str, Any]:
    """RNG states seeded with `seed` (torch, numpy, python), leaving the process's own as they were."""
    outer = rng_state()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    seeded = rng_state()
    set_rng_state(outer)
    return seeded


def _agreed(value: str) -> str:
    """Rank 0's `value` on every rank (a name all ranks must use)."""
    if torch.distributed.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _match_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Pair each parameter with its tensor (tied parameters may be stored under any of their names)."""
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        params[id(param)] = param
    unknown = set(tensors) - {name for names in names_of.values() for name in names}
    if unknown:
        raise KeyError(f"checkpoint has weights the model does not: {sorted(unknown)[:5]}")
    pairs = []
    for key, names in names_of.items():
        stored = next((name for name in names if name in tensors), None)
        if stored is None:
            raise KeyError(f"checkpoint lacks weight {names[0]!r}")
        shape = getattr(params[key], "ds_shape", params[key].shape)  # ZeRO-3 params are empty until gathered
        if tuple(tensors[stored].shape) != tuple(shape):
            raise ValueError(f"weight {stored!r}: shape {tuple(tensors[stored].shape)} != {tuple(shape)}")
        pairs.append((params[key], tensors[stored]))
    return pairs


def _fsync_tree(directory: Path) -> None:
    """Flush every file under `directory` and every directory in it to disk."""
    for path in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):  # files and subdirectories first
        if path.is_dir():
            fsync_dir(path)
            continue
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    fsync_dir(directory)


def _replace_dir(staging: Path, directory: Path) -> None:
    """Rename `staging` to `directory`; an existing `directory` is moved aside first, then deleted."""
    backup = directory.with_name(directory.name + BACKUP_SUFFIX)
    if directory.exists():
        shutil.rmtree(backup, ignore_errors=True)  # left by an earlier swap that completed
        os.rename(directory, backup)
    os.rename(staging, directory)
    fsync_dir(directory.parent)
    shutil.rmtree(backup, ignore_errors=True)
