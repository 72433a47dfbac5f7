"""The paged decode-attention kernel equals its torch reference, reads slots in place, and computes
every query the same way whatever else is in the call (rows, block width)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specactor_engine.kernels import build, paged_attention
from specactor_engine.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}


def random_case(rows: int, width: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
                slots_total: int = 9, cache_len: int = 70):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, width, heads, head_dim, generator=gen).to(dtype)
    key_cache = torch.randn(slots_total, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(slots_total, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(slots_total, generator=gen)[:rows]  # not a contiguous range: no view possible
    start = torch.randint(0, cache_len - width, (rows, 1), generator=gen)  # ragged committed lengths
    positions = start + torch.arange(width)[None, :]
    return q, key_cache, value_cache, slots, positions


def test_the_kernel_builds_on_this_platform():
    """CI runs on Linux x86_64 with g++: a broken build must fail here, not fall back unnoticed."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the kernel is built with g++ on Linux")
    assert paged_attention.kernel_available()


def test_a_lock_left_by_a_killed_build_does_not_hang_later_loads():
    """torch's build lock file survives a builder killed mid-build; without clearing it, every later
    process waited on it forever (seen: a Ray drafter actor stuck until the test timed out)."""
    if not paged_attention.kernel_available():
        pytest.skip("the compiled kernel is not built here")
    build_dir = build.build_directory()
    (build_dir / "lock").touch()  # what a killed builder leaves
    probe = "from specactor_engine.kernels.paged_attention import kernel_available; assert kernel_available()"
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=300, cwd=Path(__file__).parents[2])
    assert not (build_dir / "lock").exists()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width, heads, kv_heads, head_dim, window", [
    (1, 2, 1, 32, 0),  # the tiny test models' shape, one decode token
    (5, 9, 3, 64, 0),  # SmolLM2's heads, a k=4 verify block
    (3, 12, 2, 128, 0),  # Qwen2.5-1.5B's heads
    (4, 4, 4, 16, 7),  # no grouping, a sliding window shorter than the context
    (2, 6, 2, 20, 0),  # a head size that is not a multiple of the vector width
])
def test_kernel_equals_the_reference(dtype, width, heads, kv_heads, head_dim, window):
    q, keys, values, slots, positions = random_case(5, width, heads, kv_heads, head_dim, dtype, seed=width + heads)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, keys, values, slots, positions, scale, window)
    want = paged_decode_attention_reference(q, keys, values, slots, positions, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - want.double()).abs().max() < TOLERANCE[dtype]


def test_reference_is_causal_masked_attention_written_out():
    """The reference itself against softmax(q k^T) v done by hand, one query at a time."""
    q, keys, values, slots, positions = random_case(3, 2, 4, 2, 8, torch.float64, seed=3)
    got = paged_decode_attention_reference(q, keys, values, slots, positions, 0.5)
    for r in range(3):
        for t in range(2):
            for h in range(4):
                p = int(positions[r, t])
                k, v = keys[slots[r], : p + 1, h // 2], values[slots[r], : p + 1, h // 2]
                weights = torch.softmax((k @ q[r, t, h]) * 0.5, dim=0)
                assert torch.allclose(got[r, t, h], weights @ v, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_is_computed_alike_whatever_the_call(dtype):
    """Bit-identical outputs for a query alone, in a verify block, or among other rows: attention
    adds no batch- or block-dependent rounding between plain decoding and speculation."""
    q, keys, values, slots, positions = random_case(4, 5, 6, 2, 32, dtype, seed=11)
    together = paged_decode_attention(q, keys, values, slots, positions, 0.2)
    for r in range(4):
        for t in range(5):
            alone = paged_decode_attention(q[r : r + 1, t : t + 1], keys, values, slots[r : r + 1],
                                           positions[r : r + 1, t : t + 1], 0.2)
            assert torch.equal(alone[0, 0], together[r, t])


def test_kernel_reads_only_each_querys_own_prefix():
    """Entries past a query's position (scratch of rejected drafts) and other slots never matter."""
    q, keys, values, slots, positions = random_case(2, 3, 4, 2, 16, torch.float32, seed=5)
    before = paged_decode_attention(q, keys, values, slots, positions, 0.25)
    scribbled_keys, scribbled_values = keys.clone(), values.clone()
    for r in range(2):
        scribbled_keys[slots[r], int(positions[r, -1]) + 1 :] = 1e4
        scribbled_values[slots[r], int(positions[r, -1]) + 1 :] = -1e4
    others = torch.tensor([s for s in range(keys.shape[0]) if s not in slots.tolist()])
    scribbled_keys[others], scribbled_values[others] = 7.0, 7.0
    after = paged_decode_attention(q, scribbled_keys, scribbled_values, slots, positions, 0.25)
    assert torch.equal(before, after)


def test_bad_shapes_are_refused_with_a_message():
    q, keys, values, slots, positions = random_case(2, 1, 4, 2, 16, torch.float32, seed=1)
    if not paged_attention.kernel_available():
        pytest.skip("the compiled kernel is not built here")
    with pytest.raises(RuntimeError, match="positions outside the cache"):
        paged_decode_attention(q, keys, values, slots, positions + keys.shape[1], 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_decode_attention(q.double(), keys, values, slots, positions, 0.25)
