"""Startup profile of verify cost, cached per model architecture and machine.

One verify round = a target forward of `rows` x `width` tokens after `context` committed
tokens, plus seeded sampling at every position. Its cost is measured here once for a grid of
batch sizes and widths (1..max_k+1) at two committed contexts (a short one and the rollout's
longest, rounded up to a bucket; cost is linear in context in between) and stored as a
`CostProfile` under `<cache dir>/cost_profiles/<key>.json`; the key covers what the cost depends
on (architecture, dtype, thread count, CPU model, torch version, the grid, the engine's cost-model
version, the CPU kernels' sources where they run), not the weights' values, so a policy update reuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from specactor_engine.kernels import bf16_linear
from specactor_engine.kernels.build import sources_digest
from specactor_engine.model.runner import ModelRunner
from specactor_engine.sampling import SamplingParams, sample_tokens
from specactor_engine.policies.verify_length import CostProfile, CostTable

logger = logging.getLogger(__name__)

# Bump when the forward's cost structure changes (e.g. a new attention kernel): cached profiles measured
# with older code then no longer match and are measured again.
COST_MODEL_VERSION = 5  # 2: bf16/fp16 attention by fp32 batched matmuls; 3: packed linears, paged attention;
# 4: the decoder layers' elementwise ops fused (kernels/decode_ops.py); 5: the paged attention kernel blocked for
# AVX-512 and the Gumbel-max sampling in C++ (a profile from before priced a 4-row width-4 verify ~20 ms over what
# it costs since, and the policy then held trace D at k = 2 where k = 3 emitted ~5% more tokens per second)
PACKED_MAX_ROWS = 8  # packed rounds are measured token by token up to this batch size (draft trimming: few rows)
PROFILE_CONTEXT = 256  # committed tokens per row while profiling (a mid-rollout length)
SHORT_CONTEXT = 128  # the profile's shorter context
CONTEXT_BUCKET = 256  # the longer context is the rollout's longest, rounded up to a multiple of this
BATCH_GRID = (1, 4, 16, 64, 256)
REPEATS = 3  # timed sweeps over every cell after a warm-up sweep; each cell's minimum is kept (least disturbed)


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
                context: int | tuple[int, ...], packed: bool = False) -> str:
    """A digest of everything the verify cost depends on besides the weights' values (and whether packed rounds
    were measured)."""
    facts = {
        "architecture": runner.model.config.to_dict(), "dtype": str(runner.dtype), "device": str(runner.device),
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "torch": torch.__version__,
        "batches": batches, "widths": widths, "context": context, "version": COST_MODEL_VERSION,
        "cpu_kernels": [runner.projections is not None, runner.paged_attention],
    }
    if runner.projections is not None or runner.paged_attention:  # a kernel edit makes its costs stale by itself
        facts["kernel_sources"] = sources_digest()
    if runner.projections is not None and runner.dtype == torch.bfloat16 and bf16_linear.available():
        facts["bf16_kernel"] = bf16_linear.variant()  # same bits, not the same speed
    if packed:  # profiles without packed rounds keep their keys (and caches)
        facts["packed"] = PACKED_MAX_ROWS
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose ops finish before they return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_verify_costs(runner: ModelRunner, batches: tuple[int, ...], widths: tuple[int, ...],
                         context: int = PROFILE_CONTEXT, packed: bool = False) -> CostTable:
    """Time forward + sampling for every (batch, width), and with `packed` every packed round (`CostTable.packed`) of
    the batch sizes up to PACKED_MAX_ROWS on a CPU; leaves the runner's cache to be re-allocated.

    Each cell keeps the least of REPEATS timings taken in separate sweeps over all cells (after a warm-up sweep):
    a disturbance of a few seconds (another process starting, a drafter worker loading) then slows one timing of
    each cell it overlaps rather than every timing of a few cells, and the profile is cached for every later run."""
    runner.allocate(max(batches), context + max(widths))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    generator = torch.Generator().manual_seed(0)
    cells: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # tokens, slots, keys, widths
    plain_cells, packed_cells = [], []  # per batch size: the indices of its cells
    for rows in batches:
        slots, keys = torch.arange(rows), torch.arange(rows, dtype=torch.long)
        plain_cells.append([])
        for width in widths:
            plain_cells[-1].append(len(cells))
            cells.append((torch.randint(runner.vocab_size, (rows, width), generator=generator), slots, keys,
                          torch.full((rows,), width)))
        packed_cells.append([])
        if packed and runner.device.type == "cpu" and 1 < rows <= PACKED_MAX_ROWS:
            for total in range(rows, rows * max(widths) + 1):
                packed_cells[-1].append(len(cells))
                cells.append((torch.randint(runner.vocab_size, (rows, max(widths)), generator=generator), slots, keys,
                              _spread(total, rows)))
    best = [float("inf")] * len(cells)
    for sweep in range(REPEATS + 1):  # the first is a warm-up
        started = time.perf_counter()
        for i, (tokens, slots, keys, row_widths) in enumerate(cells):
            seconds = _timed_round(runner, tokens, slots, keys, row_widths, context, params)
            if sweep:
                best[i] = min(best[i], seconds)
        logger.info("verify-cost profile at context %d: sweep %d of %d (%d rounds) took %.1f s", context, sweep + 1,
                    REPEATS + 1, len(cells), time.perf_counter() - started)
    seconds_table = tuple(tuple(best[i] for i in row) for row in plain_cells)
    # a token more never costs less: the running maximum keeps a timing's noise (a few ms) from pricing a cut
    packed_table = tuple(tuple(np.maximum.accumulate([best[i] for i in row]).tolist()) if row else ()
                         for row in packed_cells)
    runner.set_lengths(torch.arange(max(batches)), torch.zeros(max(batches), dtype=torch.long))
    return CostTable(batches, widths, seconds_table, context, packed_table if any(packed_table) else ())


def _spread(total: int, rows: int) -> torch.Tensor:
    """`total` tokens over `rows` rows as evenly as possible: widths [rows]."""
    return torch.full((rows,), total // rows) + (torch.arange(rows) < total % rows).long()


def _timed_round(runner: ModelRunner, tokens: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                 widths: torch.Tensor, context: int, params: SamplingParams) -> float:
    """One timed verify round: the forward of tokens [R, T] whose rows have `widths` real tokens (packed as the
    verifier packs a ragged block: verifier.py) and the sampling."""
    R, T = tokens.shape
    positions = torch.full((R, 1), context) + torch.arange(T)[None, :]
    runner.set_lengths(slots, torch.full((R,), context))
    synchronize(runner.device)
    started = time.perf_counter()
    if int(widths.sum()) < tokens.numel():
        logits = runner.forward_packed(tokens, slots, widths)
    else:
        logits = runner.forward(tokens, slots, widths)
    sample_tokens(logits, params, keys, positions)
    synchronize(runner.device)  # a GPU's kernels run asynchronously: wait for them before timing
    return time.perf_counter() - started


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block on `count` torch threads (None: as many as now), then restore the count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_or_measure(runner: ModelRunner, max_rows: int, max_k: int, cache_dir: Path | None = None,
                    max_context: int = PROFILE_CONTEXT, packed: bool = False,
                    threads: int | None = None) -> CostProfile:
    """The cached cost profile for this model and machine, measuring (and caching) it if absent; packed: with
    packed rounds (draft trimming prices its cuts with them); threads: the torch threads the rounds it prices run
    on (None: the current count)."""
    with torch_threads(threads):
        return _load_or_measure(runner, max_rows, max_k, cache_dir, max_context, packed)


def _load_or_measure(runner: ModelRunner, max_rows: int, max_k: int, cache_dir: Path | None, max_context: int,
                     packed: bool) -> CostProfile:
    from specactor_engine.model.registry import default_cache_dir

    batches, widths, contexts = profile_batches(max_rows), tuple(range(1, max_k + 2)), profile_contexts(max_context)
    key = profile_key(runner, batches, widths, contexts, packed)
    path = (cache_dir or default_cache_dir()) / "cost_profiles" / f"{key}.json"
    if path.exists():
        try:
            return CostProfile.load(path)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            logger.warning("ignoring unreadable cost profile %s (%s); measuring again", path, exc)
    logger.info("measuring the verify cost once for this model, machine and batch (batches %s x widths %s x contexts "
                "%s, %d sweeps each; minutes on a CPU), to be cached at %s", batches, widths, contexts, REPEATS + 1,
                path)
    started = time.perf_counter()
    profile = CostProfile(tuple(measure_verify_costs(runner, batches, widths, c, packed) for c in contexts))
    profile.save(path)
    logger.info("profiled verify cost for batches %s x widths %s x contexts %s in %.1f s -> %s", batches, widths,
                contexts, time.perf_counter() - started, path)
    return profile
