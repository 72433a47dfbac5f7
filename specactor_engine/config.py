"""Typed, frozen, validated configuration and its one loader.

`load_config(path, overrides)` reads a YAML file (or the embedded default), applies dotted
`key=value` overrides and validates the result into a `SpecActorConfig`. Every problem is raised as
a `ConfigError` whose message names the file, the dotted key and what was expected; callers never
see a raw pydantic traceback. Each engine component takes only its own sub-config.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

Dtype = Literal["float32", "bfloat16", "float16", "float64"]
RolloutMode = Literal["ar", "coupled", "decoupled", "specactor"]
AcceptanceRule = Literal["position_keyed", "rejection"]

DEFAULT_CONFIG_RESOURCE = "default_config.yaml"
DEFAULT_CONFIG_LABEL = "<default config>"
_OVERRIDE_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


class ConfigError(ValueError):
    """A config file or override that cannot be loaded; the message is meant for the user."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ModelConfig(_Frozen):
    """The target (policy) model."""

    target: str = Field(min_length=1, description="A registered model name or a local HF model directory.")
    dtype: Dtype = Field("float32", description="Weights and compute dtype.")
    device: str = Field("cpu", description="torch device, e.g. 'cpu' or 'cuda:0'.")
    max_model_len: int = Field(2048, ge=16, description="Context limit in tokens (prompt + output).")
    chat_template: bool = Field(
        True, description="Apply the tokenizer's chat template to 'prompt' and 'messages' inputs."
    )
    cache_dir: str | None = Field(None, description="Model cache directory (None: the user cache dir).")
    cpu_kernels: bool = Field(
        True, description="On CPU, run the target's linear layers through oneDNN with pre-packed weights and its "
        "decode/verify attention through the paged kernel (kernels/); false: torch's own ops (slower; same "
        "tokens up to floating-point near-ties).",
    )


class _DrafterBase(_Frozen):
    name: str | None = Field(
        None, min_length=1, description="Unique drafter name in stats (default: kind, or 'model:<basename>')."
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_name(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("name") is None:
            return {**data, "name": cls.default_name(data)}
        return data

    @classmethod
    def default_name(cls, data: Mapping[str, Any]) -> str:
        """Name used when the config does not set one."""
        return str(data.get("kind", cls.model_fields["kind"].default))


class ModelDrafterConfig(_DrafterBase):
    """A small draft LM with its own KV cache; it must share the target's tokenizer."""

    kind: Literal["model"] = "model"
    model: str = Field(min_length=1, description="A registered model name or a local HF model directory.")
    dtype: Dtype | None = Field(None, description="Drafter dtype (None: model.dtype).")
    quantize: Literal["none", "int8"] = Field(
        "none", description="'int8': draft on a copy with per-channel int8 weights (float32 drafters; ~3x cheaper "
        "draft steps on CPU, at some acceptance); output stays exact. Training and syncs use the float weights.")
    draft_vocab: int | None = Field(
        None, ge=16, description="Draft over this many tokens: the lowest ids (byte-level BPE orders them by "
        "frequency) and the special tokens, growing with every token of the prompts and of what the target "
        "commits. None: the full vocabulary (or the drafter's trained draft_vocab.json). Output stays exact.")

    @classmethod
    def default_name(cls, data: Mapping[str, Any]) -> str:
        model = data.get("model")
        return f"model:{Path(model).name}" if isinstance(model, str) and model else "model"


class FeatureDrafterConfig(_DrafterBase):
    """A feature-level drafter (EAGLE-style): one decoder layer over the target's last hidden states and the next
    token's embedding, sharing the target's embedding and LM head. In process only (it reads the target's
    hidden states); build one with `specactor drafter feature`."""

    kind: Literal["feature"] = "feature"
    path: str | None = Field(
        None, min_length=1, description="Directory of a trained feature drafter (feature_drafter.safetensors); "
        "None: an untrained one initialised from the target's last layer (tests, a first distillation).")
    quantize: Literal["none", "int8"] = Field(
        "none", description="'int8': the layer's MLP and output projection in per-channel int8 (float32 and "
        "bfloat16 targets on a CPU): ~60% of a step's weight bytes; output stays exact.")
    draft_vocab: int | None = Field(
        None, ge=16, description="Draft over this many tokens (the lowest ids and the special tokens, growing with "
        "the tokens the target commits); a trained drafter's draft_vocab.json wins. None: the full vocabulary.")
    temperature_scale: float | None = Field(
        None, gt=0.0, le=4.0, description="Draft at the request's temperature times this (lossless: the verifier "
        "decides what is emitted; no effect when greedy). Below 1 sharpens the drafts. None: the value its training "
        "chose on held-out samples (feature_drafter.json `temperature_scale`), else 1.")


class NgramDrafterConfig(_DrafterBase):
    """Prompt-lookup drafter: continues the longest recent n-gram match in prompt + output."""

    kind: Literal["ngram"] = "ngram"
    min_n: int = Field(1, ge=1, description="Shortest n-gram to match.")
    max_n: int = Field(4, ge=1, description="Longest n-gram to match (>= min_n).")

    @model_validator(mode="after")
    def _check_range(self) -> NgramDrafterConfig:
        if self.max_n < self.min_n:
            raise ValueError(f"max_n must be >= min_n (got max_n={self.max_n}, min_n={self.min_n})")
        return self


class SuffixDrafterConfig(_DrafterBase):
    """Suffix-tree drafter over the prompt, the group's samples in flight and earlier rollouts of the prompt."""

    kind: Literal["suffix"] = "suffix"
    max_depth: int = Field(24, ge=2, le=256, description="Longest substring the tree indexes (memory: O(depth x tokens)).")
    min_match: int = Field(2, ge=1, description="Shortest suffix match that may propose a draft.")
    max_history: int = Field(16, ge=0, description="Earlier rollouts kept per prompt.")

    @model_validator(mode="after")
    def _check_match(self) -> SuffixDrafterConfig:
        if self.min_match >= self.max_depth:
            raise ValueError(f"min_match must be < max_depth (got {self.min_match} >= {self.max_depth})")
        return self


# New draft methods: add a config class with its own `kind` literal to this union.
DrafterConfig = Annotated[Union[ModelDrafterConfig, FeatureDrafterConfig, NgramDrafterConfig, SuffixDrafterConfig],
                          Field(discriminator="kind")]


class DecoupledConfig(_Frozen):
    """Decoupled mode: drafter worker processes run ahead of the verifier, streaming drafts."""

    drafter: str | None = Field(None, description="Draft model for the workers: a registered name or a local HF dir.")
    dtype: Dtype | None = Field(None, description="Drafter dtype (None: model.dtype).")
    workers: int = Field(1, ge=1, le=16, description="Drafter worker processes; rows go to the least-loaded one.")
    worker_threads: int = Field(1, ge=1, description="torch threads per worker.")
    verifier_threads: int | None = Field(
        None, ge=1, description="torch threads of the verifier while decoding (None: `threads` minus the workers' "
        "threads, at least 1).")
    max_restarts: int = Field(3, ge=0, description="Restarts of a crashed worker before its rows decode plainly.")
    transport: Literal["local", "ray"] = Field(
        "local", description="'local': worker processes on this machine (pipes); 'ray': Ray actors, on any node of "
        "the Ray cluster at `ray_address` (the drafter's model path must exist on those nodes).")
    ray_address: str | None = Field(
        None, description="With transport 'ray': the cluster to join (e.g. 'auto' or 'ray://head:10001'); None starts "
        "a local Ray instance.")
    dynamic: bool = Field(True, description="Measure, per phase of a rollout, whether running the workers beats "
                          "plain decoding on every thread, and pause them when it does not.")


class RolloutConfig(_Frozen):
    """How the engine decodes: mode, speculation length, acceptance rule and drafters."""

    mode: RolloutMode = Field("specactor", description="'ar': no speculation; 'coupled': draft then verify; "
                              "'decoupled': drafter worker processes stream drafts, the verifier never waits; "
                              "'specactor': Fastest-of-N per request over rollout.drafters (in process) and, when "
                              "rollout.decoupled.drafter is set, the workers' streamed drafts; dynamic verify length.")
    num_draft_tokens: int = Field(4, ge=1, le=16, description="Draft tokens per row per verify round (k; "
                                  "with verify_length 'dynamic', the most it may choose).")
    verify_length: Literal["fixed", "dynamic"] = Field(
        "dynamic", description="'fixed': always num_draft_tokens; 'dynamic': each round picks 0..num_draft_tokens "
        "from a verify-cost profile and live acceptance (0 = plain decoding), so speculation never costs more "
        "than it saves.")
    acceptance: AcceptanceRule = Field(
        "position_keyed",
        description="'position_keyed': seeded Gumbel coupling; 'rejection': classic min(1, p/q) rule.",
    )
    max_batch_size: int = Field(256, ge=1, description="Rows decoded at once.")
    drafters: list[DrafterConfig] = Field(
        default_factory=lambda: [SuffixDrafterConfig(), NgramDrafterConfig()],
        description="Draft methods used by speculative modes."
    )
    selection: Literal["cascade", "fastest_of_n"] = Field(
        "cascade", description="How coupled mode uses several drafters: 'cascade' (in order, each for the rows still "
        "without drafts) or 'fastest_of_n' (per request, the drafter with the most expected tokens per second, "
        "from live acceptance and cost).")
    combine_below: int = Field(
        8, ge=0, description="Combination (Fastest-of-N with several in-process drafters, position-keyed "
        "acceptance): rounds with at most this many rows (the tail, where the verifier has spare capacity) also "
        "verify a second method's draft per row in the same forward and keep the longer accepted one; 0: never.")
    shadow_rows: int = Field(
        4, ge=0, description="Dynamic verify length with model-free drafters (suffix, n-gram) and position-keyed "
        "acceptance: per round, up to this many rows that verify no drafts are drafted anyway and scored against "
        "what they commit (a draft token is accepted iff it equals the committed one), and rows verifying fewer "
        "drafts than their cap are drafted to the cap; this keeps the acceptance statistics and the per-request "
        "method choice fresh without probe rounds at the deepest length. 0: probe rounds instead.")
    draft_trimming: bool = Field(
        True, description="Dynamic verify length on a CPU with packed_verify, in rounds of at most 8 rows (those its "
        "startup profile of packed rounds prices): after drafting, each round verifies only the positions of model and "
        "feature drafts whose chance of being reached and accepted (the drafter's confidence mapped to acceptance rates "
        "learned during the run) pays for their verify time; the rest are cut, and a draft model stops drafting once "
        "every row's deepest draft would be cut. Output is unchanged (a row verifies a prefix of its drafts). On trace "
        "D (4 rows, the feature drafter) `specactor` ran 0.5-6% faster with it in each of three paired repeats "
        "(bench/session49); false: every drafted position is verified.")
    draft_arbitration: bool = Field(
        False, description="With draft trimming and Fastest-of-N (mode specactor, position-keyed acceptance): rows "
        "a draft model drafted are also drafted by the model-free methods that report a confidence (suffix), and each "
        "verifies whichever draft is expected to emit more tokens, by the confidences mapped to acceptance rates as "
        "trimming maps them, an offer's in the context of the model's confidence (policies/arbitration.py). Output is "
        "unchanged. Off by default: on trace D (session 68, before offers were calibrated in context) the swapped rows' "
        "suffix drafts were accepted at ~0.5 and the runs took more rounds than without it.")
    packed_verify: bool = Field(
        True, description="On a CPU, a verify round of at most 32 rows whose rows verify different numbers of drafts "
        "runs their real tokens only, one token per row of the forward, instead of padding every row to the widest "
        "(past the compute ridge a padded token costs what a real one does). The logits are the same either way, up "
        "to the GEMMs' summation order.")
    decoupled: DecoupledConfig = Field(default_factory=DecoupledConfig, description="Settings of mode 'decoupled'.")
    replicas: int = Field(1, ge=1, le=64, description="Rollout engines: 1 is the in-process engine; N > 1 runs N "
                          "engines as Ray actors (replicas.py), each with its own threads and drafters; a call's "
                          "GRPO groups are shared among them and the outputs are the same as with one.")
    replica_threads: int | None = Field(
        None, ge=1, description="torch threads of each replica (None: `threads`, or the machine's cores, divided "
        "among the replicas, at least 1).")
    replica_restarts: int = Field(3, ge=0, description="Restarts of a replica that died or could not load before "
                                  "the rollout fails.")
    ray_address: str | None = Field(
        None, description="With replicas > 1: the Ray cluster to join (e.g. 'auto' or 'ray://head:10001'); None "
        "starts a local Ray instance.")

    @field_validator("drafters")
    @classmethod
    def _unique_names(cls, drafters: list[DrafterConfig]) -> list[DrafterConfig]:
        names = [d.name for d in drafters]
        duplicates = sorted({n for n in names if names.count(n) > 1 and n is not None})
        if duplicates:
            raise ValueError(f"drafter names must be unique (repeated: {', '.join(duplicates)}); set 'name'")
        return drafters

    @model_validator(mode="after")
    def _coupled_needs_drafter(self) -> RolloutConfig:
        if self.mode == "coupled" and not self.drafters:
            raise ValueError(f"mode '{self.mode}' needs at least one drafter in rollout.drafters")
        if self.mode == "specactor":
            if not self.drafters and self.decoupled.drafter is None:
                raise ValueError("mode 'specactor' needs rollout.drafters or rollout.decoupled.drafter (or both)")
            if self.decoupled.drafter is not None and self.acceptance == "rejection":
                raise ValueError("mode 'specactor' with drafter workers streams drafts without their probabilities: "
                                 "set rollout.acceptance to 'position_keyed'")
        if self.mode == "decoupled":
            if self.decoupled.drafter is None:
                raise ValueError("mode 'decoupled' needs rollout.decoupled.drafter (a draft model name or dir)")
            if self.acceptance == "rejection":
                raise ValueError("mode 'decoupled' streams drafts without their probabilities: set "
                                 "rollout.acceptance to 'position_keyed'")
        return self


class SamplingConfig(_Frozen):
    """Per-call sampling parameters (also passed directly to `Engine.generate`)."""

    temperature: float = Field(1.0, ge=0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = off).")
    max_new_tokens: int = Field(256, ge=1, description="Output tokens per sample at most.")
    n: int = Field(1, ge=1, description="Samples per prompt (a GRPO group).")
    seed: int = Field(0, ge=0, description="Keys the position-keyed sampling noise.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (excluded from the text).")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="Token ids that end a sample, in addition to EOS."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    top_logprobs: int = Field(0, ge=0, le=1024, description=(
        "Also return the N most likely tokens and their log-probabilities (temperature-scaled, like `logprobs`) "
        "at every emitted position, as vLLM's logprobs=N; 0 = off. Drafter distillation uses them as soft "
        "targets."))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class DataConfig(_Frozen):
    """Where the training prompts come from (reasoning-gym tasks or a local dataset); tasks/data.py loads it."""

    kind: Literal["reasoning_gym", "jsonl", "parquet", "hf_disk"] = Field(
        "reasoning_gym", description="Prompt source: generated reasoning-gym tasks or a local file/dir.")
    tasks: list[str] = Field(default_factory=lambda: ["chain_sum"], description="reasoning-gym task names.")
    count_per_task: int = Field(64, ge=1, description="reasoning-gym items generated per task.")
    task_config: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "reasoning-gym dataset settings per task (its config's fields: chain_sum {min_terms, max_terms, min_digits, "
        "max_digits, ...}); a task not named keeps reasoning-gym's defaults."))
    path: str | None = Field(None, description="Local JSONL/parquet file or saved HF dataset dir.")
    prompt_column: str = Field("prompt", description="Column with the prompt text or chat messages.")
    answer_column: str = Field("answer", description="Column with the reference answer.")
    id_column: str | None = Field(None, description="Column with row ids (None: generated).")
    task_column: str | None = Field(None, description="Column with each row's task name (None: '').")
    instruction: str | None = Field(
        None, description="Appended (after a blank line) to string prompts of local data; chat prompts are kept.")
    split: str = Field("train", description="The split to read when `path` is a saved HF DatasetDict.")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Share of prompts held out for evaluation.")
    seed: int = Field(0, ge=0, description="Seed for generation, the split and the per-epoch shuffle.")

    @model_validator(mode="after")
    def _path_for_local(self) -> DataConfig:
        if self.kind != "reasoning_gym" and not self.path:
            raise ValueError(f"data.kind '{self.kind}' needs data.path")
        if self.kind == "reasoning_gym" and not self.tasks:
            raise ValueError("data.kind 'reasoning_gym' needs data.tasks (reasoning-gym task names)")
        unknown = sorted(set(self.task_config) - set(self.tasks))
        if unknown:
            raise ValueError(f"data.task_config names tasks not in data.tasks: {unknown} (tasks: {self.tasks})")
        return self


class OptimConfig(_Frozen):
    """Policy update: GRPO loss and the DeepSpeed engine (the settings of tasks/trainer.py's PolicyTrainer)."""

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(
        (0.9, 0.999), strict=False, description="AdamW betas, each in [0, 1) (a YAML list of two numbers).")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO/GRPO ratio clip below (and above, unless clip_eps_high).")
    clip_eps_high: float | None = Field(None, gt=0, description="Upper ratio clip (DAPO clip-higher); None: clip_eps.")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient (0: no reference model).")
    loss_agg: Literal["token_mean", "seq_mean"] = Field(
        "token_mean", description="Loss aggregation: mean over output tokens (DAPO) or over sequences.")
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    old_logprobs: Literal["rollout", "trainer"] = Field("rollout", description=(
        "The importance ratio's denominator: 'rollout', the engine's log-probabilities of the sampled tokens; "
        "'trainer', the trainer's own (detached): each batch gets one update, so the ratio is exactly 1 and the "
        "engine/trainer numerics (a bf16 update against an fp32 engine) clip nothing (as verl recomputes them)."))
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Training dtype: bfloat16/float16 compute over fp32 master weights (docs/training.md; "
        "float16 needs a GPU); auto: bfloat16 where the device computes it natively (a CUDA GPU with bf16, a CPU "
        "with AVX-512 BF16 or AMX), else float32.")
    autocast: Literal["none", "bfloat16", "auto"] = Field("none", description=(
        "With dtype float32: run the forward and backward matrix multiplies in bfloat16 under torch.autocast "
        "(DeepSpeed's torch_autocast), while the weights, the optimizer, the residual stream, the norms, the LM "
        "head and the loss stay float32 (docs/training.md: bf16 arithmetic where it is fast, fp32 where a policy "
        "gradient is sensitive: the log-probabilities). 'none': float32 throughout; 'auto': bfloat16 where the "
        "device computes it natively (a CPU with AVX-512 BF16 or AMX, a CUDA GPU with bf16), else none."))
    attention: Literal["auto", "eager", "sdpa"] = Field("auto", description=(
        "The policy's attention in the update (Hugging Face attn_implementation): 'eager' (matmul, softmax, matmul: "
        "its backward runs as matrix multiplies), 'sdpa' (torch's fused kernel); 'auto': eager on CPU, where the "
        "fused kernel's backward took 0.9 s of a 5.5 s SmolLM2 step against 0.16 s eager (docs/training.md), sdpa "
        "on a GPU. The same attention up to float rounding."))
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward micro batch (at most).")
    shared_prompt: bool = Field(False, description=(
        "Forward a prompt once for the rows of a micro-batch that share it (a GRPO group's samples): its keys and "
        "values are repeated for each row's output and the gradients from every row flow back into the one prompt "
        "pass. The same loss and gradients up to float rounding, fewer tokens computed; a group's outputs are padded "
        "to its longest, so on SmolLM2 with 60-token prompts it measured 0.97x (80-token outputs) to 1.09x "
        "(30-token outputs) on a CPU: off by default; it pays with long prompts and many samples (docs/training.md)."))
    micro_batch_tokens: int | None = Field(None, ge=1, description=(
        "Also cap each micro batch at this many padded tokens (rows x longest row; a longer row goes alone); "
        "null: micro_batch_size alone. Rows are grouped by length either way, so little is padding."))
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; 'auto': nccl with CUDA, gloo on CPU.")
    world_size: int = Field(1, ge=1, description=(
        "DeepSpeed ranks of the update: 1 runs in the flow's process; more run as Ray actors (one GPU each where "
        "there are GPUs), the batch's rows split across them (docs/training.md). Several ranks need ZeRO 1 or 2."))
    threads_per_rank: int | None = Field(None, ge=1, description=(
        "torch threads of each Ray rank (world_size > 1); None: this machine's cores / world_size."))
    ray_address: str | None = Field(None, description=(
        "With world_size > 1: the Ray cluster to run the ranks on (e.g. 'auto'); None starts a local Ray instance."))

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"each beta must be in [0, 1), got {betas}")
        return betas

    @model_validator(mode="after")
    def _check_autocast(self) -> OptimConfig:
        if self.autocast != "none" and self.dtype != "float32":
            raise ValueError(f"autocast {self.autocast} runs over float32 weights: set dtype float32 (got "
                             f"{self.dtype}; dtype bfloat16 already computes everything in bf16)")
        return self

    @model_validator(mode="after")
    def _check_ranks(self) -> OptimConfig:
        if self.world_size > 1 and self.zero_stage not in (1, 2):
            raise ValueError(f"world_size {self.world_size} needs zero_stage 1 or 2 (got {self.zero_stage}): ZeRO-0 "
                             "reports no global gradient norm, ZeRO-3 gathers weights in every forward, which ranks "
                             "with different numbers of micro-batches cannot pair up")
        return self

    @property
    def use_reference(self) -> bool:
        """A frozen copy of the initial policy is kept for the KL term."""
        return self.kl_coef > 0


class DrafterSyncConfig(_Frozen):
    """Refreshing drafters after each policy update, and the acceptance-collapse alarm."""

    distill_steps: int = Field(8, ge=0, description="Distillation steps per sync for model drafters.")
    distill_seconds: float = Field(60.0, gt=0, description="Time budget per sync for distillation.")
    distill_lr: float = Field(1e-4, gt=0, description="Drafter distillation learning rate.")
    distill_batch_size: int = Field(8, ge=1, description="Sequences per distillation step.")
    soft_top_k: int = Field(32, ge=0, description="Train on the new policy's top-k next-token distribution at every "
                            "rollout position, as `specactor drafter distill` does (0: on the sampled tokens only).")
    freeze_embeddings: bool = Field(True, description="Keep model drafters' (tied) embeddings fixed while refreshing.")
    distill_loss: Literal["kl", "coupled"] = Field("kl", description=(
        "With soft_top_k: 'kl' (cross-entropy to the policy's top-k) or 'coupled' (the engine's acceptance "
        "probability, as `drafter distill --loss coupled`)."))
    freeze_layers: int = Field(0, ge=0, description="Keep model drafters' first N blocks fixed while refreshing.")
    collapse_ratio: float = Field(0.5, gt=0, le=1, description="Alarm when acceptance < ratio x previous step.")

    def budget(self) -> Any:
        from specactor_engine.training.distill import DistillBudget

        return DistillBudget(self.distill_steps, self.distill_seconds, self.distill_batch_size, self.distill_lr,
                             freeze_embeddings=self.freeze_embeddings, loss=self.distill_loss,
                             freeze_layers=self.freeze_layers)


class WandbConfig(_Frozen):
    project: str = Field("specactor", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user).")
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="W&B mode.")


class EvalConfig(_Frozen):
    """The held-out evaluation inside `specactor train` (flows/post_training.py, tasks/pipeline.py evaluate_step)."""

    enabled: bool = Field(True, description="Evaluate the initial policy (step 0) and the policy after the last step "
                          "on the eval split (train.data.eval_fraction), at the run's sampling with a fixed seed.")
    every: int = Field(0, ge=0, description="Also evaluate after every N-th step (0: before and after only).")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate at most this many eval prompts (null: all).")
    compare_ar: bool = Field(True, description="Roll the evaluation out with plain decoding too (same weights and "
                             "noise): the rollout speedup measured on the same prompts, outputs checked identical.")


class TrainConfig(_Frozen):
    """The post-training loop (flows/post_training.py)."""

    run_dir: str = Field("runs/default", description="Run directory: rollouts, metrics, checkpoints, W&B files.")
    keep_checkpoints: int | None = Field(None, ge=1, description=(
        "Published checkpoints to keep: after each step the ones older than the newest N are deleted (a run "
        "resumes from the newest; each holds the policy's weights and drafters). None keeps every one."))
    steps: int = Field(4, ge=1, description="GRPO steps.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per step (each rolled out sampling.n times).")
    speculation: bool = Field(True, description="False: roll out with rollout.mode 'ar'.")
    advantage: Literal["grpo", "dr_grpo"] = Field("grpo", description="Advantage estimator.")
    rewards: dict[str, float] = Field(
        default_factory=lambda: {"reasoning_gym": 1.0}, description="Reward name -> weight.")
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    drafter_sync: DrafterSyncConfig = Field(default_factory=DrafterSyncConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @field_validator("optim")
    @classmethod
    def _cpu_dtype(cls, optim: OptimConfig) -> OptimConfig:
        if optim.dtype == "float16":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("float16 training needs a GPU; on CPU use bfloat16 or float32 (train.optim.dtype)")
        return optim


class SpecActorConfig(_Frozen):
    """The whole configuration: target model, rollout engine, sampling, threads."""

    model: ModelConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (None: torch default).")
    train: TrainConfig | None = Field(None, description="Post-training loop (only `specactor train` uses it).")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> SpecActorConfig:
    """Load YAML `path` (None: the embedded default), apply `key=value` overrides, validate."""
    source = DEFAULT_CONFIG_LABEL if path is None else str(path)
    raw = _read_yaml(path, source)
    applied: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text, source)
        _set_dotted(raw, key.split("."), value, source, text)
        applied[key] = text
    try:
        return SpecActorConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_format_config_issue(source, err, applied) for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def config_to_yaml(cfg: SpecActorConfig) -> str:
    """The resolved config as YAML (loads back to an equal config)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def default_config_text() -> str:
    """The embedded default config YAML (package data)."""
    return resources.files("specactor_engine").joinpath(DEFAULT_CONFIG_RESOURCE).read_text(encoding="utf-8")


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML's safe loader reads it, except that floats follow YAML 1.2: `1e-5` and `3E+2` are numbers
    (YAML 1.1, PyYAML's default, needs a dot and a signed exponent, so `lr: 1e-5` was the string '1e-5')."""


_Loader.yaml_implicit_resolvers = {key: list(value) for key, value in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"""),
    list("-+0123456789"))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str, source: str = "--set") -> tuple[str, Any]:
    """Split `a.b.0.c=value` into the dotted key and the YAML-parsed value."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not _OVERRIDE_KEY.fullmatch(key):
        raise ConfigError(
            f"{source}: bad override '{text}': expected KEY=VALUE with a dotted KEY, "
            "e.g. rollout.num_draft_tokens=4"
        )
    try:
        return key, _load_yaml(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: bad override '{text}': value is not valid YAML ({exc})") from None


def _read_yaml(path: str | Path | None, source: str) -> dict[str, Any]:
    try:
        text = default_config_text() if path is None else Path(path).read_text(encoding="utf-8")
        data = _load_yaml(text)
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"{source}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read config file ({exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _set_dotted(node: Any, keys: list[str], value: Any, source: str, text: str) -> None:
    """Set `value` at `keys` inside nested dicts/lists, creating missing containers."""
    head, rest = keys[0], keys[1:]
    if isinstance(node, list):
        if not head.isdigit() or int(head) > len(node):
            raise ConfigError(f"{source}: bad override '{text}': '{head}' is not an index 0..{len(node)} of a list")
        if int(head) == len(node):
            node.append({} if rest else None)
        slot: Any = int(head)
    elif isinstance(node, dict):
        if rest and head not in node:
            node[head] = [] if rest[0].isdigit() else {}
        slot = head
    else:
        raise ConfigError(f"{source}: bad override '{text}': cannot set '{head}' inside a {type(node).__name__}")
    if rest:
        if node[slot] is None:
            node[slot] = [] if rest[0].isdigit() else {}
        _set_dotted(node[slot], rest, value, source, text)
    else:
        node[slot] = value


def _format_config_issue(source: str, err: ErrorDetails, applied: Mapping[str, str]) -> str:
    parts, owner = _clean_loc(err["loc"], SpecActorConfig)
    key = ".".join(str(p) for p in parts)
    if err["type"] == "extra_forbidden":
        message = f"{source}: unknown key '{key}'{_suggest(parts, owner)}"
    else:
        message = f"{source}: {key or '<top level>'}: {describe_error(err)}"
    origin = next((t for k, t in applied.items() if _is_prefix(k, key) or _is_prefix(key, k)), None)
    return f"{message} [from --set {origin}]" if origin else message


def _is_prefix(prefix: str, key: str) -> bool:
    return bool(prefix) and (key == prefix or key.startswith(prefix + "."))


def _suggest(parts: list[str | int], owner: type[BaseModel] | None) -> str:
    if owner is None or not parts:
        return ""
    matches = difflib.get_close_matches(str(parts[-1]), list(owner.model_fields), n=3, cutoff=0.6)
    prefix = "".join(f"{p}." for p in parts[:-1])
    if matches:
        return " (did you mean " + " or ".join(f"'{prefix}{m}'" for m in matches) + "?)"
    return f" (known keys: {', '.join(owner.model_fields)})"


def _clean_loc(loc: tuple[str | int, ...], root: type[BaseModel]) -> tuple[list[str | int], type[BaseModel] | None]:
    """Drop discriminator tags from a pydantic error location; also return the model owning its last key."""
    parts: list[str | int] = []
    annotation: Any = root
    owner: type[BaseModel] | None = None
    for item in loc:
        tags = _union_tags(annotation)
        if item in tags:
            annotation = tags[item]
            continue
        parts.append(item)
        owner = annotation if _is_model(annotation) else None
        if owner is not None and item in owner.model_fields:
            annotation = owner.model_fields[item].annotation
        elif isinstance(item, int) and typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        else:
            annotation = None
    return parts, owner


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _union_tags(annotation: Any) -> dict[Any, type[BaseModel]]:
    """Map each `kind` literal of a discriminated union to its member model."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return {}
    tags: dict[Any, type[BaseModel]] = {}
    for member in typing.get_args(annotation):
        if _is_model(member) and "kind" in member.model_fields:
            for tag in typing.get_args(member.model_fields["kind"].annotation):
                tags[tag] = member
    return tags


_EXPECTATIONS = {
    "missing": "required key is missing",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}


def describe_error(err: ErrorDetails) -> str:
    """What one pydantic error expected, in words, with the offending value."""
    kind, ctx = err["type"], err.get("ctx", {})
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        limit = next(iter(ctx.values()))
        text = f"must be {op} {limit}"
    elif kind == "literal_error":
        text = f"must be one of {ctx['expected']}"
    elif kind in ("too_short", "string_too_short"):
        text = "must not be empty"
    elif kind == "union_tag_invalid":
        return f"{ctx['discriminator']} must be one of {ctx['expected_tags']} (got '{ctx['tag']}')"
    elif kind == "union_tag_not_found":
        return f"missing {ctx['discriminator']}"
    elif kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    else:
        text = _EXPECTATIONS.get(kind, err["msg"])
    return text if kind == "missing" else f"{text} (got {_short_repr(err['input'])})"


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
