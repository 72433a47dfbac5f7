"""Gumbel-max sampling over Qwen2.5-Coder-1.5B's own logits: 4 of trace D's `ar` outputs fed back (positions 40-87 of
each, 192 rows of 151,936 logits), the C++ kernel against the TorchInductor-compiled reference, bit for bit first.

    PYTHONPATH=. .venv/bin/python bench/session34/gumbel_timing.py RUNS_DIR

RUNS_DIR: a trace D benchmark's runs/ directory (its ar-0.reference.json holds the outputs).
"""

import json
import sys
import time
from pathlib import Path

import torch

from benchmark.interface import RunSpec, load_target
from benchmark.traces import get_trace
from specactor_engine import counter_hash
from specactor_engine.kernels import gumbel_argmax as kernel
from specactor_engine.model.runner import ModelRunner


def median_ms(fn, n=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[n // 2] * 1e3


torch.set_num_threads(2)
trace = get_trace("D")
model, _ = load_target(RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=None, dtype=trace.dtype,
                               threads=2))
runner = ModelRunner(model)
runner.allocate(4, 128)
sequences = json.loads((Path(sys.argv[1]) / "ar-0.reference.json").read_text())["sequences"]
longest = sorted(sequences, key=lambda s: -len(s["token_ids"]))[:4]
logits = runner.forward(torch.tensor([s["token_ids"][:100] for s in longest]), torch.arange(4))[:, 40:88]
vocab = logits.shape[-1]
as_bf16 = logits.reshape(-1, vocab).contiguous()
as_float = as_bf16.float()
keys = torch.randint(0, 2**32, (as_float.shape[0],), generator=torch.Generator().manual_seed(0))
hashes = counter_hash.token_hash(vocab, torch.device("cpu"))
top = as_float.max(-1, keepdim=True).values
share = (as_float > top - 16.7).float().mean(-1).median()
print(f"share of each row's logits within 16.7 of its best: median {share:.4f}")
assert torch.equal(torch.ops.specactor.gumbel_argmax(as_bf16, keys, hashes),
                   kernel.gumbel_argmax_reference(as_float, keys, hashes))
compiled = median_ms(lambda: kernel._compiled()(as_float, keys, hashes))
cpp_float = median_ms(lambda: torch.ops.specactor.gumbel_argmax(as_float, keys, hashes))
cpp_bf16 = median_ms(lambda: torch.ops.specactor.gumbel_argmax(as_bf16, keys, hashes))
print(f"{as_float.shape[0]} rows: compiled reference {compiled:.2f} ms, C++ float32 {cpp_float:.2f} ms, "
      f"C++ bfloat16 {cpp_bf16:.2f} ms")
