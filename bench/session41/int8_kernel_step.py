"""Qwen2.5-Coder-0.5B int8 draft steps at 4 rows, context 300, 32k-token int8 head: PyTorch's dynamic int8 linear
(fbgemm) against the engine's int8 kernel (kernels/int8_linear.py), both through `ModelRunner(model, int8=True)`.

    PYTHONPATH=. .venv/bin/python bench/session41/int8_kernel_step.py [REPEATS]

One token a row and the argmax, the cache set back after each; the two alternate within each repeat; medians of 8
steps after 2 warm ones. Prints the medians per repeat, the int8 linears' share of a step (torch.profiler), and how
far the two runners' last logits lie from the float32 model's.
"""

import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from specactor_engine.kernels import int8_linear as kernel
from specactor_engine.model import quantize
from specactor_engine.model.registry import resolve_model
from specactor_engine.model.runner import ModelRunner, load_hf_model

VOCAB, BATCH, CONTEXT = 32768, 4, 300
FBGEMM = SimpleNamespace(available=lambda: False)  # quantize.py's view of the kernel while the fbgemm runner packs


def prepared(runner: ModelRunner) -> torch.Tensor:
    runner.allocate(BATCH, CONTEXT + 16)
    slots = torch.arange(BATCH)
    prompt = torch.randint(VOCAB, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(1))
    runner.forward(prompt, slots, logits_at="last")
    runner.commit(slots, torch.full((BATCH,), CONTEXT))
    return slots


def step(runner: ModelRunner, slots: torch.Tensor) -> torch.Tensor:
    logits = runner.forward(torch.full((BATCH, 1), 42), slots)
    logits.float().argmax(-1)
    runner.set_lengths(slots, torch.full((BATCH,), CONTEXT))
    return logits


def step_time(runner: ModelRunner, slots: torch.Tensor, steps: int = 10) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step(runner, slots)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def linear_share(runner: ModelRunner, slots: torch.Tensor) -> str:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step(runner, slots)
    rows = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    linear = sum(t for name, t in rows.items() if "linear" in name)
    return f"int8 linears {linear / 5e3:.1f} ms a step ({linear / sum(rows.values()):.0%} of its self CPU time)"


def main() -> None:
    torch.set_num_threads(2)
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    assert kernel.available(), "the int8 kernel needs AVX-512 VNNI"
    path = resolve_model("qwen2.5-coder-0.5b-instruct", dtype="float32", pull=False)
    model = load_hf_model(path, "float32", "cpu")
    head_weight = model.lm_head.weight.detach()[:VOCAB]
    runners, slots = {}, {}
    for name in ("fbgemm", "kernel"):
        quantize.int8_kernel = FBGEMM if name == "fbgemm" else kernel
        runners[name] = ModelRunner(model, int8=True, head=quantize.int8_linear(head_weight))
        slots[name] = prepared(runners[name])  # the first forward packs the linears
    quantize.int8_kernel = kernel
    float_runner = ModelRunner(model, head=torch.nn.Linear(896, VOCAB, bias=False))
    float_runner.head.weight.data.copy_(head_weight)
    results: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            results[name].append(step_time(runner, slots[name]))
    for name, times in results.items():
        print(f"{name}: {', '.join(f'{t * 1e3:.1f}' for t in times)} ms; median {statistics.median(times) * 1e3:.1f}; "
              f"{linear_share(runners[name], slots[name])}")
    exact = step(float_runner, prepared(float_runner)).float()
    for name, runner in runners.items():
        got = step(runner, slots[name]).float()
        print(f"{name}: last logits {float((got - exact).abs().max()):.2f} at most from float32's, argmax agrees on "
              f"{int((got.argmax(-1) == exact.argmax(-1)).sum())} of {BATCH} rows")


if __name__ == "__main__":
    main()
