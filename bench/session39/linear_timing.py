"""Qwen2.5-Coder-1.5B bf16 forwards at 4 rows, context 300: oneDNN's packed linears against the engine's bf16 kernel.

    PYTHONPATH=. .venv/bin/python bench/session39/linear_timing.py [--repeats 3] [--steps 5]

Loads trace D's target as the benchmark does, fills 4 rows to 300 tokens, then alternates the two backends
(every PackedLinear re-packed at each switch) and times forwards of widths 1-5 a row with the seeded sampling of
every position (what a decode step and a verify of 0-4 drafts cost); the cache is set back to 300 after each
forward. Prints per backend the median per repeat, and the ratio of the medians. Also reports the process's
AnonHugePages (the kernel's packed weights ask for 2 MB pages).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmark.interface import RunSpec, load_target
from benchmark.traces import get_trace
from specactor_engine.kernels import bf16_linear
from specactor_engine.model import packed_linear
from specactor_engine.model.runner import ModelRunner
from specactor_engine.sampling import SamplingParams, sample_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--widths", default="1,2,3,4,5")
    args = parser.parse_args()
    torch.set_num_threads(2)
    trace = get_trace("D")
    model, _ = load_target(RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=None,
                                   dtype=trace.dtype, threads=2))
    runner = ModelRunner(model, packed_linear=True, paged_attention=True)
    batch, context = 4, 300
    runner.allocate(batch, context + 16)
    slots = torch.arange(batch)
    generator = torch.Generator().manual_seed(0)
    runner.forward(torch.randint(runner.vocab_size, (batch, context), generator=generator), slots, logits_at="last")
    runner.commit(slots, torch.full((batch,), context))
    params, keys = SamplingParams(1.0, 0, 1.0), torch.arange(batch)
    linears = [value for layer in runner.projections or [] for value in vars(layer).values()
               if isinstance(value, packed_linear.PackedLinear)]
    linears += [value for value in vars(runner).values() if isinstance(value, packed_linear.PackedLinear)]
    kernel_available = bf16_linear.available()

    def use(kernel: bool) -> None:
        packed_linear.bf16_linear.available = (lambda: kernel_available) if kernel else (lambda: False)
        for linear in linears:
            linear._key, linear._weight = None, None
        gc.collect()

    def forward(width: int) -> float:
        started = time.perf_counter()
        tokens = torch.randint(runner.vocab_size, (batch, width), generator=generator)
        logits = runner.forward(tokens, slots)
        sample_tokens(logits, params, keys, context + torch.arange(width).expand(batch, width))
        elapsed = time.perf_counter() - started
        runner.set_lengths(slots, torch.full((batch,), context))
        return elapsed

    widths = [int(w) for w in args.widths.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for name in ("onednn", "kernel"):
            use(name == "kernel")
            forward(1)  # packs
            for width in widths:
                forward(width)
                results.setdefault((name, width), []).append(
                    statistics.median(forward(width) for _ in range(args.steps)))
    print(f"kernel available: {kernel_available}; {len(linears)} packed linears; "
          f"AnonHugePages {open('/proc/meminfo').read().split('AnonHugePages:')[1].split()[0]} kB")
    print("| width (tokens) | oneDNN ms per repeat | kernel ms per repeat | oneDNN / kernel |\n|---|---|---|---|")
    for width in widths:
        a, b = results[("onednn", width)], results[("kernel", width)]
        print(f"| {width} ({batch * width}) | {', '.join(f'{t * 1e3:.1f}' for t in a)} | "
              f"{', '.join(f'{t * 1e3:.1f}' for t in b)} | {statistics.median(a) / statistics.median(b):.2f}x |")


if __name__ == "__main__":
    main()
