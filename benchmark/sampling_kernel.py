"""Seeded sampling with and without the fused Gumbel-max kernel, side by side on one shape.

    python -m benchmark.sampling_kernel --rows 32 --width 5 --vocab 151936 --repeats 7

Times `sample_tokens` (fused for vocabularies >= FUSED_MIN_VOCAB) against the materialised-noise
path (warp, [R, T, V] Gumbel noise, add, argmax) on random logits, alternating the two, checks that
they pick the same tokens, and prints the median milliseconds of each and their ratio.
"""

from __future__ import annotations

import statistics
import time
from typing import Annotated

import torch
import typer

from specactor_engine.sampling import STREAM_TARGET, SamplingParams, gumbel_noise, sample_tokens, warp_logits

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def materialised(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The pre-kernel path: [R, T] token ids."""
    scores = warp_logits(logits, params)
    return (scores + gumbel_noise(keys, positions, logits.shape[-1], STREAM_TARGET).to(scores.dtype)).argmax(-1)


@app.command()
def main(rows: Annotated[int, typer.Option(min=1)] = 32, width: Annotated[int, typer.Option(min=1)] = 5,
         vocab: Annotated[int, typer.Option(min=2)] = 151936, repeats: Annotated[int, typer.Option(min=1)] = 7,
         threads: Annotated[int, typer.Option(min=1)] = 2) -> None:
    torch.set_num_threads(threads)
    params = SamplingParams(1.0, 0, 1.0)
    logits = torch.randn(rows, width, vocab)
    keys, positions = torch.randint(0, 2**32, (rows,)), torch.randint(0, 4000, (rows, width))
    sample_tokens(logits, params, keys, positions, STREAM_TARGET)  # compile (or load the cached kernel)
    before, after = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        expected = materialised(logits, params, keys, positions)
        before.append(time.perf_counter() - started)
        started = time.perf_counter()
        got = sample_tokens(logits, params, keys, positions, STREAM_TARGET)
        after.append(time.perf_counter() - started)
        if not torch.equal(got, expected):
            raise SystemExit(f"the two paths picked different tokens on [{rows}, {width}, {vocab}]")
    slow, fast = statistics.median(before), statistics.median(after)
    print(f"[{rows}, {width}, {vocab}] materialised {1e3 * slow:.1f} ms, sample_tokens {1e3 * fast:.1f} ms, "
          f"{slow / fast:.2f}x (medians of {repeats}, {threads} threads, identical tokens)")


if __name__ == "__main__":
    app()
