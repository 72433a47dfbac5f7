"""Paged decode attention over 28 layers' caches (Qwen2.5-1.5B's shape: 12 heads, 2 KV heads, head size 128, bf16),
4 rows at context 300, each layer's cache its own tensor so it is cold by the time its turn comes, as in a forward.

    PYTHONPATH=. .venv/bin/python bench/session34/attention_timing.py

Prints the median of 12 passes per block width (1: a decode step; 3, 4: verifies of 2 and 3 drafts a row). Session 34
ran it against the kernel before 37f123e (a git worktree at c4bf19d with its own TORCH_EXTENSIONS_DIR) and after.
"""

import time

import torch

from specactor_engine.kernels.paged_attention import kernel_available, paged_decode_attention

torch.set_num_threads(2)
assert kernel_available(), "the C++ kernel did not build"
SLOTS, CACHE_LEN, KV_HEADS, HEAD, HEADS, LAYERS = 4, 1024, 2, 128, 12, 28
shape = (SLOTS, CACHE_LEN, KV_HEADS, HEAD)
layers = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS)]
for rows, width, context in [(4, 1, 300), (4, 3, 300), (4, 4, 300)]:
    q = torch.randn(rows, width, HEADS, HEAD).bfloat16()
    slots = torch.arange(rows)
    positions = (context + torch.arange(width)[None, :].expand(rows, width)).contiguous()
    times = []
    for _ in range(12):
        started = time.perf_counter()
        for keys, values in layers:
            paged_decode_attention(q, keys, values, slots, positions, HEAD**-0.5, 0)
        times.append(time.perf_counter() - started)
    times.sort()
    print(f"rows {rows}, width {width}, context {context}: {LAYERS} layers {times[len(times) // 2] * 1e3:.2f} ms")
