"""Qwen2.5-Coder-0.5B int8 draft steps at 4 rows, context 300, 32k-token int8 head: an int8 copy against the fused runner.

    PYTHONPATH=. .venv/bin/python bench/session40/int8_step.py [REPEATS]

`copy`: the int8 copy of the model (`quantize_int8`: torch's dynamic int8 Linear for every projection, q, k, v, gate
and up apart), how drafting ran before a096eb4; `fused`: `ModelRunner(model, int8=True)`, the float model's own
modules with q/k/v and gate/up fused into one int8 GEMM each (model/quantize.py `Int8PackedLinear`) and the fused
layer ops that come with fused projections. One token a row and the argmax, the cache set back after each; the two
alternate within each repeat; medians of 8 steps after 2 warm ones. Prints both runners' step bytes (the draft-cost
prior), the medians per repeat, and how far the two runners' last logits lie apart (int8 rounding cascades).
"""

import statistics
import sys
import time

import torch

from specactor_engine.model.quantize import int8_linear, quantize_int8
from specactor_engine.model.registry import resolve_model
from specactor_engine.model.runner import ModelRunner, load_hf_model

VOCAB, BATCH, CONTEXT = 32768, 4, 300


def step_time(runner: ModelRunner, steps: int = 10) -> tuple[float, torch.Tensor]:
    runner.allocate(BATCH, CONTEXT + 16)
    slots = torch.arange(BATCH)
    prompt = torch.randint(VOCAB, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(1))
    runner.forward(prompt, slots, logits_at="last")
    runner.commit(slots, torch.full((BATCH,), CONTEXT))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = runner.forward(torch.full((BATCH, 1), 42), slots)
        logits.float().argmax(-1)
        times.append(time.perf_counter() - started)
        runner.set_lengths(slots, torch.full((BATCH,), CONTEXT))
    return statistics.median(times[2:]), logits


def main() -> None:
    torch.set_num_threads(2)
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    path = resolve_model("qwen2.5-coder-0.5b-instruct", dtype="float32", pull=False)
    model = load_hf_model(path, "float32", "cpu")
    head = int8_linear(model.lm_head.weight.detach()[:VOCAB])
    runners = {"copy": ModelRunner(quantize_int8(model), packed_linear=False, head=head),
               "fused": ModelRunner(model, int8=True, head=head)}
    print({name: f"{runner.step_bytes() / 1e6:.1f} MB" for name, runner in runners.items()})
    results: dict[str, list[float]] = {name: [] for name in runners}
    last: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, runner in runners.items():
            seconds, last[name] = step_time(runner)
            results[name].append(seconds)
    for name, times in results.items():
        print(f"{name}: {', '.join(f'{t * 1e3:.1f}' for t in times)} ms; median {statistics.median(times) * 1e3:.1f}")
    copy, fused = last["copy"].float(), last["fused"].float()
    print(f"last logits: max difference {float((copy - fused).abs().max()):.2f}, "
          f"argmax agrees on {int((copy.argmax(-1) == fused.argmax(-1)).sum())} of {copy.shape[0]} rows")


if __name__ == "__main__":
    main()
