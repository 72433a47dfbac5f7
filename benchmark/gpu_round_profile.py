"""Where an `ar` round's time goes on a GPU: plain decoding in float32 and bfloat16, alternated, then profiled.

    python3 -m benchmark.gpu_round_profile --out OUT [--arch qwen2.5-1.5b] [--rows 4] [--runs 2]

Session 21's check left a puzzle (bench/gpu/h200-2026-11-26-s21): an `ar` round cost 30.9 ms in bf16 and
17.9 ms in fp32 at 4 rows, while the cost table's forward + sampling was 18-20 ms in both, and the bf16 runs
had gone first. Here the two dtypes alternate (fp32, bf16, fp32, bf16, ...), each run after its own warm-up,
so an order or warm-up effect shows as a difference between a dtype's runs; and every run's cProfile says which host
functions its time sits in (the first run against the later ones).

Writes:
    rounds.json                 per run: dtype, seconds, rounds, ms per round
    profile_<dtype>_run<i>.txt  each run's top functions by own time and by cumulative time
Random weights with the published shapes (benchmark/gpu_check.py); `--device cpu --arch tiny` for the test.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path
from typing import Any

import torch

from benchmark.gpu_check import _NoTokenizer, _sampling, _timed, _write, environment, random_model


def _engine(model: torch.nn.Module, rows: int, max_len: int):
    from specactor_engine.config import DecoupledConfig, RolloutConfig
    from specactor_engine.engine import Engine

    config = RolloutConfig(mode="ar", max_batch_size=rows, decoupled=DecoupledConfig(drafter=None))
    return Engine(model, _NoTokenizer(model.config.vocab_size), config, max_model_len=max_len)


def _requests(vocab: int, prompts: int) -> list:
    from specactor_engine.types import Request

    gen = torch.Generator().manual_seed(0)
    return [Request(f"p{i}", prompt_token_ids=torch.randint(vocab, (64,), generator=gen).tolist())
            for i in range(prompts)]


def measure(arch: str, device: str, rows: int, runs: int, max_new_tokens: int, dtypes: tuple[str, ...],
            top: int = 30) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`runs` alternations of every dtype, each run timed and under cProfile (its overhead is a few percent
    of a host-bound round: 7.2-7.6 s profiled vs 6.0-8.2 s unprofiled for 255 rounds on an H200)."""
    models = {name: random_model(arch, getattr(torch, name), device, seed=1) for name in dtypes}
    engines = {name: _engine(model, rows, 64 + max_new_tokens + 2) for name, model in models.items()}
    requests = _requests(models[dtypes[0]].config.vocab_size, rows)  # one batch of `rows` GRPO groups of 1
    params = _sampling(max_new_tokens, 1)
    for engine in engines.values():
        engine.generate(requests[:1], _sampling(8, 1))  # warm-up (kernel selection, allocator)
    timings, profiles = [], {}
    for index in range(runs):
        for name, engine in engines.items():
            profiler = cProfile.Profile()
            profiler.enable()
            result, seconds = _timed(device, lambda: engine.generate(requests, params))
            profiler.disable()
            rounds = result.stats.verify_rounds
            timings.append({"run": index, "dtype": name, "seconds": seconds, "rounds": rounds,
                            "ms_per_round": round(1e3 * seconds / max(rounds, 1), 2)})
            print(f"  run {index} {name}: {seconds:.2f} s, {rounds} rounds, "
                  f"{timings[-1]['ms_per_round']} ms per round", flush=True)
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text).strip_dirs()
            stats.sort_stats("tottime").print_stats(top)
            stats.sort_stats("cumulative").print_stats(top)
            profiles[f"{name}_run{index}"] = text.getvalue()
    return timings, profiles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for rounds.json and the profiles")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; 'cpu' for the test)")
    parser.add_argument("--arch", default="qwen2.5-1.5b", help="architecture (benchmark/gpu_check.py)")
    parser.add_argument("--rows", type=int, default=4, help="rows decoded at once (one batch)")
    parser.add_argument("--runs", type=int, default=2, help="timed alternations of the dtypes")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, in run order")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-round-profile: torch sees no CUDA device here; nothing to measure.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    facts = environment(args.device)
    _write(args.out, "environment.json", facts)
    print(f"gpu-round-profile on {facts.get('name', args.device)}: {args.arch}, {args.rows} rows", flush=True)
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    timings, profiles = measure(args.arch, args.device, args.rows, args.runs, args.max_new_tokens, dtypes)
    _write(args.out, "rounds.json", {"arch": args.arch, "rows": args.rows, "max_new_tokens": args.max_new_tokens,
                                     "runs": timings})
    for name, text in profiles.items():
        (args.out / f"profile_{name}.txt").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
