"""Qwen2.5-Coder-0.5B draft steps at 4 rows, context 300, over a 32k-token compact head: int8 copy against bf16.

    PYTHONPATH=. .venv/bin/python bench/session40/draft_timing.py [--repeats 3] [--steps 10]

What a model drafter's step costs under each setting the benchmark could draft with (drafters/model.py builds the
same runners): `int8` the fp32 model's fbgemm int8 copy with an int8 head (quantize: int8); `bf16-torch-head` the
bf16 model (its linears packed for the engine's kernel where it runs) with the head through torch's matmul;
`bf16` the same with the head packed like the linears (`float_linear`, what drafting uses now). One forward of one
token a row plus the argmax, cache set back after each; the three alternate within each repeat; medians of the
steps after two warm ones. Prints each setting's median per repeat and the median of those.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from specactor_engine.drafters.draft_head import float_linear
from specactor_engine.kernels import bf16_linear
from specactor_engine.model.quantize import int8_linear, quantize_int8
from specactor_engine.model.registry import resolve_model
from specactor_engine.model.runner import ModelRunner, load_hf_model

VOCAB, BATCH, CONTEXT = 32768, 4, 300


def build(kind: str) -> ModelRunner:
    dtype = "float32" if kind == "int8" else "bfloat16"
    model = load_hf_model(resolve_model("qwen2.5-coder-0.5b-instruct", dtype=dtype, pull=False), dtype, "cpu")
    rows = model.lm_head.weight.detach()[:VOCAB]
    if kind == "int8":
        return ModelRunner(quantize_int8(model), packed_linear=False, head=int8_linear(rows))
    if kind == "bf16-torch-head":
        head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype).requires_grad_(False)
        head.weight.copy_(rows)
        return ModelRunner(model, packed_linear=True, head=head)
    return ModelRunner(model, packed_linear=True, head=float_linear(rows))


def step_times(runner: ModelRunner, steps: int, generator: torch.Generator) -> list[float]:
    runner.allocate(BATCH, CONTEXT + 16)
    slots = torch.arange(BATCH)
    runner.forward(torch.randint(VOCAB, (BATCH, CONTEXT), generator=generator), slots, logits_at="last")
    runner.commit(slots, torch.full((BATCH,), CONTEXT))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        runner.forward(torch.randint(VOCAB, (BATCH, 1), generator=generator), slots).float().argmax(-1)
        times.append(time.perf_counter() - started)
        runner.set_lengths(slots, torch.full((BATCH,), CONTEXT))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)
    kinds = ("int8", "bf16-torch-head", "bf16")
    runners = {kind: build(kind) for kind in kinds}
    generator = torch.Generator().manual_seed(0)
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            results[kind].append(statistics.median(step_times(runners[kind], args.steps, generator)[2:]))
    print(f"bf16 kernel available: {bf16_linear.available()}")
    print("| setting | ms per repeat | median |\n|---|---|---|")
    for kind in kinds:
        print(f"| {kind} | {', '.join(f'{t * 1e3:.1f}' for t in results[kind])} | "
              f"{statistics.median(results[kind]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
