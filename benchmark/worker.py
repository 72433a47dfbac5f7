"""Run one system once, in this process, and write its figures as JSON.

    python -m benchmark.worker SPEC.json OUT.json

One process per run keeps peak RSS per system clean and the thread budget exact. Order:
load the models (load_s), a short warm-up generate (warmup_s; history drafters forget it, and
on a trace with history they load the earlier rollout instead), then the timed rollout of the
whole trace (makespan: from submitting the requests to the last token). Systems that need
untimed work on the trace itself (the oracle's extra passes) do it in between (prepare_s).
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from benchmark.machine import GcTimer, busy_cpu_s, log_engine_progress, read_bandwidth_gbps
from benchmark.metrics import tail_time
from benchmark.systems import FinishClock, Generation, RunSpec, build_system
from benchmark.traces import build_requests, sampling_config

WARMUP_NEW_TOKENS = 8
T = TypeVar("T")


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_once(spec: RunSpec) -> dict[str, Any]:
    """Load, warm up and time one system on the spec's trace: the run's figures and outputs."""
    torch.set_num_threads(spec.threads)
    requests, sampling = build_requests(spec.trace), sampling_config(spec.trace)
    loadavg_start = os.getloadavg()[0]
    system, load_s = _timed(build_system, spec)
    warmup = sampling.model_copy(update={"n": 1, "max_new_tokens": WARMUP_NEW_TOKENS})
    _, warmup_s = _timed(system.generate, requests[:1], warmup, FinishClock())
    history = json.loads(Path(spec.history_path).read_text(encoding="utf-8")) if spec.history_path else None
    system.set_history(requests, history)
    _, prepare_s = _timed(system.prepare, requests, sampling)
    gc.collect()
    bandwidth_start = read_bandwidth_gbps()  # the machine's state as the timed run starts (machine.py)
    clock = FinishClock()
    profiler = cProfile.Profile() if spec.profile_path else None
    if profiler is not None:
        profiler.enable()
    busy_before, own_before = busy_cpu_s(), time.process_time() + system.external_cpu_s()
    gc_timer = GcTimer()  # the interpreter's garbage collections during the timed run: part of its makespan
    gc.callbacks.append(gc_timer)
    faults_before = _page_faults()
    start = clock.start()
    try:
        generation = system.generate(requests, sampling, clock)
    finally:
        makespan_s = time.perf_counter() - start
        gc.callbacks.remove(gc_timer)
        faults = [after - before for after, before in zip(_page_faults(), faults_before)]
    contention = _cpu_shares(busy_before, own_before, makespan_s, spec.threads, system.external_cpu_s())
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(spec.profile_path)
    bandwidth_end = read_bandwidth_gbps()
    system.close()
    # a system that runs in a child process (vLLM) reports that process's peak
    peak = max(peak_rss_mb(), getattr(system, "peak_rss_mb", 0.0))
    return _figures(spec, generation, clock, makespan_s) | contention | {
        "load_s": load_s, "warmup_s": warmup_s, "prepare_s": prepare_s, "peak_rss_mb": peak,
        "loadavg_1m_start": loadavg_start, "loadavg_1m_end": os.getloadavg()[0], "threads": torch.get_num_threads(),
        "mem_read_gbps": (bandwidth_start + bandwidth_end) / 2,
        "mem_read_gbps_start_end": [bandwidth_start, bandwidth_end],
        "gc_s": gc_timer.seconds, "gc_collections": {str(g): n for g, n in sorted(gc_timer.collections.items())},
        "minor_faults": faults[0], "major_faults": faults[1],
    }


def _page_faults() -> tuple[int, int]:
    """This process's (minor, major) page faults so far: first touches of fresh memory (a KV cache, new buffers)
    during the timed run are part of its makespan, and paired runs showed them differing by system (session 54)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_majflt


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started


def _cpu_shares(busy_before: float | None, own_before: float, makespan_s: float, threads: int,
                external_s: float = 0.0) -> dict[str, float | None]:
    """How much CPU the timed run got, and how much other processes took meanwhile.

    cpu_share: this process's CPU time / (threads x makespan) (1.0 = every thread busy throughout);
    others_cpu_share: other processes' CPU time / (all CPUs x makespan) (0 = a quiet machine).
    """
    own_s = time.process_time() + external_s - own_before
    busy_after = busy_cpu_s()
    others = None
    if busy_before is not None and busy_after is not None and makespan_s > 0:
        others = max(busy_after - busy_before - own_s, 0.0) / ((os.cpu_count() or 1) * makespan_s)
    return {"cpu_s": own_s, "cpu_share": own_s / (threads * makespan_s) if makespan_s else None,
            "others_cpu_share": others}


def _figures(spec: RunSpec, generation: Generation, clock: FinishClock, makespan_s: float) -> dict[str, Any]:
    sequences = generation.sequences
    output_tokens = sum(len(s.token_ids) for s in sequences)
    tail_s = tail_time(clock.times, makespan_s, len(sequences))
    stats = generation.engine_stats
    speculative = stats is not None and stats.get("drafted_tokens", 0) > 0
    return {
        "system": spec.system,
        "num_sequences": len(sequences),
        "makespan_s": makespan_s,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / makespan_s if makespan_s else 0.0,
        "finish_times_s": sorted(clock.times),
        "tail_s": tail_s,
        "tail_share": tail_s / makespan_s if makespan_s else 0.0,
        # one token per target forward without speculation
        "mean_accept_len": stats["mean_acceptance_length"] if speculative else 1.0,
        "acceptance_rate": stats["acceptance_rate"] if speculative else None,
        "engine_stats": stats,
        "sequences": [{"id": s.request_id, "sample": s.sample_index, "token_ids": s.token_ids, "text": s.text,
                       "finish_reason": s.finish_reason} for s in sequences],
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    log_engine_progress()
    if len(args) != 2:
        raise SystemExit("usage: python -m benchmark.worker SPEC.json OUT.json")
    spec = RunSpec.from_dict(json.loads(Path(args[0]).read_text(encoding="utf-8")))
    result = run_once(spec)
    Path(args[1]).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
