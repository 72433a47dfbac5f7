"""The target's samples a drafter trains on: read from rollout records, or made by rolling out prompts.

Rollout records (the pipeline's `steps/*/rollouts.jsonl`, or `specactor rollout` output) carry
`prompt_token_ids` and `token_ids`; those made with `sampling.top_logprobs` >= k also carry the
target's top-k log-probs, which then serve as the soft targets with no teacher pass. A prompt file is
rolled out with the target first; the samples (`TARGET_SAMPLES_FILE`) and the rollout's own top-k
(`teacher.TEACHER_FILE`) are kept in the output directory, so a resumed run trains on the same data.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specactor_engine.training.distill import SoftTargets
from specactor_engine.training.report import Reporter
from specactor_engine.training.teacher import TEACHER_FILE, Pair, save_teacher

TARGET_SAMPLES_FILE = "target_samples.jsonl"


class DistillDataError(ValueError):
    """The data file is neither rollout records nor prompts (message names file and line)."""


def read_rollout_records(path: Path) -> list[Pair] | None:
    """(prompt_ids, output_ids) pairs if every line is a rollout record; None if the file holds prompts."""
    pairs: list[Pair] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):  # not splitlines: U+2028
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DistillDataError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise DistillDataError(f"{path}:{number}: expected a JSON object")
        if "token_ids" not in record:
            if pairs:
                raise DistillDataError(f"{path}:{number}: a prompt line among rollout records (no 'token_ids')")
            return None
        if "prompt_token_ids" not in record:
            raise DistillDataError(f"{path}:{number}: a rollout record needs 'prompt_token_ids' as well as "
                                   "'token_ids' (the pipeline's steps/*/rollouts.jsonl have both)")
        pairs.append((list(record["prompt_token_ids"]), list(record["token_ids"])))
    if not pairs:
        raise DistillDataError(f"{path}: no records")
    return pairs


def read_record_top_logprobs(path: Path, k: int) -> list[SoftTargets] | None:
    """Soft targets carried by rollout records: each record's `top_logprobs` (rollouts made with
    `sampling.top_logprobs` >= k) cut to the top k, as `teacher_topk` returns them; None unless every
    record has them for every output token (then the teacher pass is needed)."""
    soft: list[SoftTargets] = []
    for raw in path.read_text(encoding="utf-8").split("\n"):  # not splitlines: U+2028 sits unescaped in JSON
        if not raw.strip():
            continue
        record = json.loads(raw)
        top = record.get("top_logprobs")
        if not isinstance(top, list) or len(top) != len(record["token_ids"]) or any(len(row) < k for row in top):
            return None
        table = torch.tensor([pair for row in top for pair in row[:k]], dtype=torch.float64).view(len(top), k, 2)
        soft.append((table[..., 0].to(torch.int32), table[..., 1].to(torch.float16)))
    return soft or None


def target_pairs(data: Path, out: Path, target: nn.Module, tokenizer: Any, *, samples: int, max_new_tokens: int,
                 seed: int, soft_top_k: int, reporter: Reporter,
                 sample_dtype: torch.dtype | None = None) -> list[Pair]:
    """Training pairs from rollout records, or from rolling out a prompt file (kept in out/ for resumes).

    A rollout of prompts also keeps the target's top-`soft_top_k` log-probs at every sampled position
    (the engine computes them anyway) as the soft-target cache, so no separate teacher pass is needed.
    sample_dtype: roll out with a copy of the target in this dtype (bfloat16 samples about 1.4x faster
    on CPU; the samples are then those of the bf16-rounded target).
    """
    if not data.exists():
        raise DistillDataError(f"--data {data}: no such file")
    cached = out / TARGET_SAMPLES_FILE
    source = cached if cached.exists() else data
    pairs = read_rollout_records(source)
    if pairs is not None:
        if soft_top_k and source == data:
            _keep_records_soft_targets(data, out, soft_top_k, reporter)
        return pairs
    sampler = target if sample_dtype is None else copy.deepcopy(target).to(sample_dtype)
    return _roll_out_prompts(data, out, sampler, tokenizer, samples=samples, max_new_tokens=max_new_tokens,
                             seed=seed, soft_top_k=soft_top_k, reporter=reporter)


def _keep_records_soft_targets(data: Path, out: Path, k: int, reporter: Reporter) -> None:
    """Records rolled out with sampling.top_logprobs >= k carry their own soft targets: cache them
    (unless a cache is there already) so the teacher pass finds them."""
    carried = read_record_top_logprobs(data, k)
    if carried is not None and not (out / TEACHER_FILE).exists():
        save_teacher(out, carried)
        reporter.note(f"soft targets: the records' own top-{k} log-probs")


def _roll_out_prompts(data: Path, out: Path, sampler: nn.Module, tokenizer: Any, *, samples: int,
                      max_new_tokens: int, seed: int, soft_top_k: int, reporter: Reporter) -> list[Pair]:
    """Sample the prompt file with the target and keep the samples (and their top-k) in `out`."""
    from specactor_engine.config import RolloutConfig, SamplingConfig
    from specactor_engine.engine import Engine
    from specactor_engine.io import read_requests

    requests = read_requests(data)
    engine = Engine(sampler, tokenizer, RolloutConfig(mode="ar", max_batch_size=128))
    sampling = SamplingConfig(temperature=1.0, n=samples, max_new_tokens=max_new_tokens, seed=seed,
                              top_logprobs=soft_top_k)
    with reporter.phase("target samples", len(requests) * samples) as progress:
        result = engine.generate(requests, sampling, progress=lambda done, total: progress(done))
    kept = [o for o in result.outputs if not o.error]
    out.mkdir(parents=True, exist_ok=True)
    if soft_top_k:  # written first: a cache without its samples is recomputed, never mismatched
        save_teacher(out, [(o.top_logprobs[0], o.top_logprobs[1].to(torch.float16)) for o in kept])
    records = [{"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids} for o in kept]
    (out / TARGET_SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return [(r["prompt_token_ids"], r["token_ids"]) for r in records]
