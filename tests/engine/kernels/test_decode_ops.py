"""The decoder layer's fused elementwise ops equal their torch references (bit for bit where the contract says
so), compute every token alike whatever else is in the call, and leave the runner's forward what it was."""

from __future__ import annotations

import pytest
import torch

from specactor_engine.kernels import decode_ops
from specactor_engine.kernels.build import extension_available
from specactor_engine.model.runner import ModelRunner, fusable_layers
from tests.fixtures.tiny_models import make_tiny_model

DTYPES = [torch.float64, torch.float32, torch.bfloat16]
# the norm sums in its own order and SiLU's exp is glibc's: float rounding apart (the norm runs in float32
# for every dtype, as transformers' RMSNorm does)
TOLERANCE = {torch.float64: 2e-6, torch.float32: 2e-6, torch.bfloat16: 0.0}


@pytest.fixture(autouse=True)
def _compiled_kernels():
    if not extension_available():
        pytest.skip("the C++ kernels are not built here (test_paged_attention checks that they build)")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.double().abs().max().clamp(min=1.0)
    assert ((got.double() - want.double()).abs().max() / scale) <= TOLERANCE[dtype]


def qkv_case(dtype: torch.dtype, rows: int = 3, width: int = 5, heads: int = 6, kv_heads: int = 2, head_dim: int = 20,
             slots_total: int = 7, cache_len: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, width, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, width, head_dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    cache = torch.randn(slots_total, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(slots_total, generator=gen)[:rows]
    positions = torch.randint(0, cache_len - width, (rows, 1), generator=gen) + torch.arange(width)[None, :]
    return qkv, cos, sin, cache, slots, positions, heads


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_silu_mul_equal_their_references(dtype):
    gen = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(3, 5, 200, generator=gen).to(dtype) * 4 for _ in range(2))
    weight = (1 + torch.randn(200, generator=gen) * 0.3).to(dtype)
    _close(decode_ops.rms_norm(x, weight, 1e-6), decode_ops.rms_norm_reference(x, weight, 1e-6), dtype)
    total, normed = decode_ops.add_rms_norm(x, delta, weight, 1e-5)
    want_total, want_normed = decode_ops.add_rms_norm_reference(x, delta, weight, 1e-5)
    assert torch.equal(total, want_total)  # the residual add rounds exactly as torch's
    _close(normed, want_normed, dtype)
    gate_up = torch.randn(3, 5, 2 * 90, generator=gen).to(dtype) * 5  # 90: a tail past the 16-lane loop
    _close(decode_ops.silu_mul(gate_up), decode_ops.silu_mul_reference(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_the_kv_write_equal_the_reference_bit_for_bit(dtype):
    qkv, cos, sin, cache, slots, positions, heads = qkv_case(dtype)
    keys, values = cache.clone(), cache.clone() + 1
    want_keys, want_values = keys.clone(), values.clone()
    q = decode_ops.rotary_write_kv(qkv, cos, sin, keys, values, slots, positions, heads)
    want_q = decode_ops.rotary_write_kv_reference(qkv, cos, sin, want_keys, want_values, slots, positions, heads)
    assert torch.equal(q, want_q)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)  # written there, and nowhere else
    assert not torch.equal(keys, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_token_is_computed_alike_whatever_the_call(dtype):
    """A token alone gives the bits it gives inside a verify block among other rows: the fused ops add no
    batch- or block-dependent rounding between plain decoding and speculation (and parallel tasks over many
    tokens compute each one the same way as one task)."""
    gen = torch.Generator().manual_seed(2)
    x, delta = (torch.randn(40, 5, 96, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(96, generator=gen).to(dtype)
    gate_up = torch.randn(40, 5, 2 * 3000, generator=gen).to(dtype)
    together = (decode_ops.rms_norm(x, weight, 1e-6), *decode_ops.add_rms_norm(x, delta, weight, 1e-6),
                decode_ops.silu_mul(gate_up))
    for r, t in [(0, 0), (7, 3), (39, 4)]:
        alone = (decode_ops.rms_norm(x[r:r + 1, t:t + 1], weight, 1e-6),
                 *decode_ops.add_rms_norm(x[r:r + 1, t:t + 1], delta[r:r + 1, t:t + 1], weight, 1e-6),
                 decode_ops.silu_mul(gate_up[r:r + 1, t:t + 1]))
        for one, many in zip(alone, together):
            assert torch.equal(one[0, 0], many[r, t])
    qkv, cos, sin, cache, slots, positions, heads = qkv_case(dtype, rows=4, width=5)
    together_q = decode_ops.rotary_write_kv(qkv, cos, sin, cache.clone(), cache.clone(), slots, positions, heads)
    alone_q = decode_ops.rotary_write_kv(qkv[2:3, 1:2], cos[2:3, 1:2], sin[2:3, 1:2], cache.clone(), cache.clone(),
                                         slots[2:3], positions[2:3, 1:2], heads)
    assert torch.equal(alone_q[0, 0], together_q[2, 1])


def test_without_the_kernels_the_references_serve(monkeypatch):
    monkeypatch.setattr(decode_ops, "extension_available", lambda: False)
    gate_up = torch.randn(2, 3, 64)
    assert torch.equal(decode_ops.silu_mul(gate_up), decode_ops.silu_mul_reference(gate_up))


def test_bad_arguments_are_refused_with_a_message():
    qkv, cos, sin, cache, slots, positions, heads = qkv_case(torch.float32)
    with pytest.raises(RuntimeError, match="positions outside the cache"):
        decode_ops.rotary_write_kv(qkv, cos, sin, cache, cache.clone(), slots, positions + cache.shape[1], heads)
    with pytest.raises(RuntimeError, match=r"qkv's last dim must be \(H \+ 2 H_kv\) D"):
        decode_ops.rotary_write_kv(qkv, cos, sin, cache, cache.clone(), slots, positions, heads + 1)
    with pytest.raises(RuntimeError, match="x \\[..., d\\] and weight \\[d\\] expected"):
        decode_ops.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_runner_forward_is_the_same_with_the_fused_ops(family):
    """The runner's fused path (norms, rotary + KV write, SiLU-mul in the C++ ops) against its torch-op path, on a
    tiny fp32 model of each family: prefill, then a decode step and a verify block over the cache it wrote."""
    model = make_tiny_model(family, seed=3, num_layers=3)
    assert fusable_layers(model)
    fused, plain = ModelRunner(model), ModelRunner(model)
    plain._fused = False  # the torch-op path (what model.cpu_kernels: false or an unusual layer runs)
    gen = torch.Generator().manual_seed(4)
    slots = torch.tensor([2, 0])
    prompt, block = torch.randint(0, 250, (2, 20), generator=gen), torch.randint(0, 250, (2, 4), generator=gen)
    outputs = []
    for runner in (fused, plain):
        runner.allocate(3, 40)
        first = runner.forward(prompt, slots)
        runner.commit(slots, torch.tensor([20, 20]))
        step = runner.forward(block[:, :1], slots)
        verify = runner.forward(block, slots)
        outputs.append((first, step, verify, runner.cache.keys[1][slots, :24].clone()))
    assert fused._fused and not plain._fused
    for got, want in zip(*outputs):  # each path's logits (up to ~10) are 1-4e-5 from a float64 run of the model
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)
    assert torch.equal(outputs[0][1][:, 0], outputs[0][2][:, 0])  # decode and verify agree bit for bit


def test_layers_of_another_activation_keep_the_models_modules():
    model = make_tiny_model("llama", seed=0)
    model.config.hidden_act = "gelu"
    assert not fusable_layers(model)
