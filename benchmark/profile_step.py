"""Where one decode step of the engine spends its time: a torch.profiler table by operator.

    python -m benchmark.profile_step --trace A --batch 32 --context 256 --steps 8
    python -m benchmark.profile_step --trace D --batch 4 --width 3   # a verify of 2 drafts a row

Loads the trace's target like the benchmark does, fills every row's KV cache to `--context`
tokens, then profiles `--steps` verify forwards of `--width` tokens a row (1: the `ar` decode step)
plus the seeded sampling at every position, on the benchmark's thread budget. Prints the operators by self CPU time as a
markdown table, and the share of the step in matrix multiplies, attention and everything else.
"""

from __future__ import annotations

import statistics
import time
from typing import Annotated

import torch
import typer

from benchmark.traces import get_trace

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise")
# bmm: the engine's grouped attention for bf16/fp16 (scores and weighted values)
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::softmax", "aten::_softmax",
                 "aten::bmm", "aten::masked_fill", "specactor::paged_decode_attention")
GATHER_OPS = ("aten::index", "aten::index_put", "aten::gather", "aten::copy_", "aten::cat")


def classify(name: str) -> str:
    if name.startswith(MATMUL_OPS):
        return "matmul (linear layers, lm_head)"
    if name.startswith(ATTENTION_OPS):
        return "attention"
    if name.startswith(GATHER_OPS):
        return "KV cache gather/scatter, copies"
    return "other (norms, rotary, activations, sampling, ...)"


@app.command()
def main(trace_name: Annotated[str, typer.Option("--trace", help="Whose target and dtype to profile.")] = "A",
         model: Annotated[str | None, typer.Option("--model", help="A target name or HF dir instead.")] = None,
         dtype: Annotated[str | None, typer.Option("--dtype", help="Override the trace's dtype.")] = None,
         batch: Annotated[int, typer.Option("--batch", min=1)] = 32,
         context: Annotated[int, typer.Option("--context", min=1)] = 256,
         steps: Annotated[int, typer.Option("--steps", min=1)] = 8,
         width: Annotated[int, typer.Option("--width", min=1, help="Tokens a row per forward (1: a decode "
                                                                    "step; k + 1: a verify of k drafts).")] = 1,
         threads: Annotated[int, typer.Option("--threads", min=1)] = 2,
         top: Annotated[int, typer.Option("--top", min=1)] = 15,
         cpu_kernels: Annotated[bool, typer.Option(help="oneDNN packed linears and the paged attention kernel "
                                                        "(model.cpu_kernels); off: torch's own ops.")] = True) -> None:
    """Profile the engine's decode step (or a verify forward of --width tokens a row) on the trace's target."""
    from torch.profiler import ProfilerActivity, profile

    from benchmark.interface import RunSpec, load_target
    from specactor_engine.model.runner import ModelRunner
    from specactor_engine.sampling import SamplingParams, sample_tokens

    torch.set_num_threads(threads)
    trace = get_trace(trace_name)
    target, dtype = model or trace.model.target, dtype or trace.dtype
    loaded, _ = load_target(RunSpec(system="ar", trace=trace, target=target, drafter=None, dtype=dtype,
                                    threads=threads))
    runner = ModelRunner(loaded, packed_linear=cpu_kernels, paged_attention=cpu_kernels)
    runner.allocate(batch, context + (2 * steps + 2) * width)
    slots = torch.arange(batch)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(runner.vocab_size, (batch, context), generator=generator)
    runner.forward(prefix, slots, logits_at="last")
    runner.commit(slots, torch.full((batch,), context))
    params, keys = SamplingParams(1.0, 0, 1.0), torch.arange(batch)

    def step(i: int) -> None:
        tokens = torch.randint(runner.vocab_size, (batch, width), generator=generator)
        logits = runner.forward(tokens, slots)  # [batch, width, V]
        sample_tokens(logits, params, keys, context + i * width + torch.arange(width).expand(batch, width))
        runner.commit(slots, torch.full((batch,), width))

    step(0)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(1, steps + 1):
            step(i)
    wall = []
    for i in range(steps + 1, 2 * steps + 1):  # the same steps without the profiler: what one really costs
        started = time.perf_counter()
        step(i)
        wall.append(time.perf_counter() - started)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for event in events:
        groups[classify(event.key)] = groups.get(classify(event.key), 0.0) + event.self_cpu_time_total
    print(f"{target} ({dtype}), batch {batch}, width {width}, context {context}, {threads} threads: "
          f"{total / steps / 1e3:.1f} ms of operator time per decode step; wall time (forward, sampling and "
          f"the Python around them, unprofiled) median {statistics.median(wall) * 1e3:.1f} ms of {steps}\n")
    print("| group | share |\n|---|---|")
    for name, value in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"| {name} | {value / total:.0%} |")
    print("\n| operator | calls per step | self ms per step | share |\n|---|---|---|---|")
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| `{event.key}` | {event.count / steps:.0f} | {event.self_cpu_time_total / steps / 1e3:.2f} | "
              f"{event.self_cpu_time_total / total:.1%} |")


if __name__ == "__main__":
    app()
