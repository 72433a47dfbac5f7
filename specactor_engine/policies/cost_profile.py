"""Startup profile of verify cost, cached per model architecture and machine.

One verify round = a target forward of `rows` x `width` tokens after `context` committed
tokens, plus seeded sampling at every position. Its cost is measured here once for a grid of
batch sizes and widths (1..max_k+1) at two committed contexts (a short one and the rollout's
longest, rounded up to a bucket; cost is linear in context in between) and stored as a
`CostProfile` under `<cache dir>/cost_profiles/<key>.json`; the key covers what the cost depends
on (architecture, dtype, thread count, CPU model, torch version, the grid, the engine's cost-model
version), not the weights' values, so a policy update reuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from pathlib import Path

import torch

from specactor_engine.model.runner import ModelRunner
from specactor_engine.sampling import SamplingParams, sample_tokens
from specactor_engine.policies.verify_length import CostProfile, CostTable

logger = logging.getLogger(__name__)

# Bump when the forward's cost structure changes (e.g. a new attention kernel): cached profiles measured
# with older code then no longer match and are measured again.
COST_MODEL_VERSION = 4  # 2: bf16/fp16 attention by fp32 batched matmuls; 3: packed linears, paged attention;
# 4: the decoder layers' elementwise ops fused (kernels/decode_ops.py)
PROFILE_CONTEXT = 256  # committed tokens per row while profiling (a mid-rollout length)
SHORT_CONTEXT = 128  # the profile's shorter context
CONTEXT_BUCKET = 256  # the longer context is the rollout's longest, rounded up to a multiple of this
BATCH_GRID = (1, 4, 16, 64, 256)
REPEATS = 2  # timed runs per cell after one warm-up; the minimum is kept (least disturbed)


def profile_batches(max_rows: int) -> tuple[int, ...]:
    """The grid's batch sizes up to `max_rows`, and `max_rows` itself."""
    return tuple(sorted({b for b in BATCH_GRID if b < max_rows} | {max(max_rows, 1)}))


def profile_contexts(max_context: int) -> tuple[int, ...]:
    """The committed contexts to measure for rollouts whose rows reach `max_context` tokens."""
    longest = max(-(-max_context // CONTEXT_BUCKET) * CONTEXT_BUCKET, CONTEXT_BUCKET)
    return (SHORT_CONTEXT, longest)


def cpu_model() -> str:
    """The CPU's model name (part of the profile key; also reported by the benchmark)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def profile_key(runner: ModelRunner, batches: tuple[int, ...], widths: tuple[int, ...],
                context: int | tuple[int, ...]) -> str:
    """A digest of everything the verify cost depends on besides the weights' values."""
    facts = {
        "architecture": runner.model.config.to_dict(), "dtype": str(runner.dtype), "device": str(runner.device),
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "torch": torch.__version__,
        "batches": batches, "widths": widths, "context": context, "version": COST_MODEL_VERSION,
        "cpu_kernels": [runner.projections is not None, runner.paged_attention],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose ops finish before they return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_verify_costs(runner: ModelRunner, batches: tuple[int, ...], widths: tuple[int, ...],
                         context: int = PROFILE_CONTEXT) -> CostTable:
    """Time forward + sampling for every (batch, width); leaves the runner's cache to be re-allocated."""
    runner.allocate(max(batches), context + max(widths))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for rows in batches:
        slots = torch.arange(rows)
        keys = torch.arange(rows, dtype=torch.long)
        row_costs = []
        for width in widths:
            tokens = torch.randint(runner.vocab_size, (rows, width), generator=generator)
            positions = torch.full((rows, 1), context) + torch.arange(width)[None, :]
            timings = []
            for _ in range(REPEATS + 1):  # the first is a warm-up
                runner.set_lengths(slots, torch.full((rows,), context))
                synchronize(runner.device)
                started = time.perf_counter()
                logits = runner.forward(tokens, slots, torch.full((rows,), width))
                sample_tokens(logits, params, keys, positions)
                synchronize(runner.device)  # a GPU's kernels run asynchronously: wait for them before timing
                timings.append(time.perf_counter() - started)
            row_costs.append(min(timings[1:]))
        seconds.append(tuple(row_costs))
    runner.set_lengths(torch.arange(max(batches)), torch.zeros(max(batches), dtype=torch.long))
    return CostTable(batches, widths, tuple(seconds), context)


def load_or_measure(runner: ModelRunner, max_rows: int, max_k: int, cache_dir: Path | None = None,
                    max_context: int = PROFILE_CONTEXT) -> CostProfile:
    """The cached cost profile for this model and machine, measuring (and caching) it if absent."""
    from specactor_engine.model.registry import default_cache_dir

    batches, widths, contexts = profile_batches(max_rows), tuple(range(1, max_k + 2)), profile_contexts(max_context)
    key = profile_key(runner, batches, widths, contexts)
    path = (cache_dir or default_cache_dir()) / "cost_profiles" / f"{key}.json"
    if path.exists():
        try:
            return CostProfile.load(path)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            logger.warning("ignoring unreadable cost profile %s (%s); measuring again", path, exc)
    started = time.perf_counter()
    profile = CostProfile(tuple(measure_verify_costs(runner, batches, widths, c) for c in contexts))
    profile.save(path)
    logger.info("profiled verify cost for batches %s x widths %s x contexts %s in %.1f s -> %s", batches, widths,
                contexts, time.perf_counter() - started, path)
    return profile
