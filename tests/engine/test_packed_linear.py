"""oneDNN pre-packed linears: equal to the modules they replace, and never stale after a weight update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specactor_engine.model.runner import ModelRunner
from specactor_engine.model.packed_linear import PackedLinear, packing_supported
from specactor_engine.model.weights import load_named_weights
from tests.fixtures.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32, torch.device("cpu")),
                                reason="this torch has no oneDNN")


def linears(dtype: torch.dtype, bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(48, n, bias=bias).to(dtype) for n in (32, 16, 16)]


BF16_PACKING = packing_supported(torch.bfloat16, torch.device("cpu"))


def test_bf16_packing_is_offered_exactly_where_onednn_can_reorder_bf16_weights():
    """On a CPU without native bf16 (AVX2-only) oneDNN refuses the bf16 reorder: the runner must then keep
    torch's linears instead of failing at the first forward."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(16, 8, dtype=torch.bfloat16), 128)
        reorders = True
    except RuntimeError:
        reorders = False
    assert BF16_PACKING == reorders
    runner = ModelRunner(make_tiny_model(dtype=torch.bfloat16), packed_linear=True)
    runner.allocate(1, 8)
    logits = runner.forward(torch.tensor([[1, 2, 3]]), torch.tensor([0]), logits_at="last")
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("dtype, tolerance", [
    (torch.float32, 1e-5),
    pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        not BF16_PACKING, reason="this CPU has no native bf16 (oneDNN's bf16 reorder needs AVX-512 or AVX-NE-CONVERT)")),
])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projection_equals_each_module(dtype, tolerance, bias):
    modules = linears(dtype, bias)
    fused = PackedLinear(modules)
    x = torch.randn(3, 5, 48).to(dtype)  # [R, T, K]
    for got, module in zip(fused.split(fused(x)), modules):
        want = F.linear(x, module.weight, module.bias)
        assert got.shape == want.shape
        assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16_PACKING, reason="this CPU has no native bf16")),
])
def test_a_rows_output_does_not_depend_on_how_many_rows_share_the_call(dtype):
    """A plain step of one row and a verify of several must compute a row alike (speculation invariance): oneDNN
    takes other kernels for 1-2 rows, which on the AMD EPYC summed a 1536 -> 4096 projection's single row
    differently (and streamed its weights ~30% slower); PackedLinear pads such inputs to MIN_ROWS."""
    torch.manual_seed(0)
    packed = PackedLinear([nn.Linear(1536, 4096).to(dtype)])
    x = torch.randn(2, 3, 1536).to(dtype)  # [R, T, K]: 6 rows
    full = packed(x)
    assert packed(x[:1, :1]).shape == (1, 1, 4096)
    for rows in (1, 2, 3, 5):
        flat = x.reshape(6, 1536)[:rows]
        assert torch.equal(packed(flat), full.reshape(6, 4096)[:rows]), rows


def test_an_in_place_weight_update_is_picked_up():
    """A weight sync copies into the parameters: the packed copy must follow (it is keyed by the
    parameters' version counters), not keep serving the old policy."""
    modules = linears(torch.float32, bias=True)
    fused = PackedLinear(modules)
    x = torch.randn(4, 48)
    before = fused(x)
    new = [(f"{i}.weight", torch.randn_like(m.weight)) for i, m in enumerate(modules)]
    load_named_weights(nn.ModuleList(modules), new)
    after = fused(x)
    assert not torch.allclose(after, before)
    want = torch.cat([F.linear(x, m.weight, m.bias) for m in modules], dim=-1)
    assert torch.allclose(after, want, atol=1e-5)
    with torch.no_grad():
        modules[2].bias.add_(1.0)  # a bias alone changing counts too
    assert torch.allclose(fused(x)[:, 48:], want[:, 48:] + 1.0, atol=1e-5)
    modules[0].weight = nn.Parameter(torch.randn_like(modules[0].weight))  # a parameter replaced, not written into
    assert torch.allclose(fused(x)[:, :32], F.linear(x, modules[0].weight, modules[0].bias), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_runner_logits_match_the_unpacked_modules(family):
    model = make_tiny_model(family, seed=3)
    tokens = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    packed = ModelRunner(model, num_slots=2, max_len=16)
    plain = ModelRunner(model, num_slots=2, max_len=16, packed_linear=False)
    assert packed.projections is not None and plain.projections is None
    got, want = packed.forward(tokens, torch.arange(2)), plain.forward(tokens, torch.arange(2))
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_float64_keeps_the_models_own_modules():
    """oneDNN has no float64 GEMM: exactness tests in fp64 run the Hugging Face modules."""
    model = make_tiny_model("llama", seed=1, dtype=torch.float64)
    assert ModelRunner(model, num_slots=1, max_len=8).projections is None
