"""kernels/int8_linear: the drafting linears' int8 kernel equals its torch reference, a row's result does not depend
on the other rows of the call, and model/quantize.py serves int8 drafting with it (PyTorch's dynamic int8 linear
where it does not run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specactor_engine.kernels import int8_linear
from specactor_engine.model import quantize
from specactor_engine.model.quantize import Int8PackedLinear, int8_supported

pytestmark = pytest.mark.skipif(not int8_linear.available(), reason="the int8 kernel serves CPUs with AVX-512 VNNI")


def weights(n: int, k: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=generator), (torch.randn(n, generator=generator) if bias else None)


@pytest.mark.parametrize("rows, k, n, bias", [
    (1, 64, 40, False),    # one row; N not a multiple of the 32-column group
    (5, 70, 96, True),     # K not a multiple of 4 (padded); a tile of 5 rows, with a bias
    (13, 256, 33, False),  # tiles of 7 and 6; one column in the last group
    (130, 36, 64, True),   # three blocks of rows (64, 64, 2), each in tiles
])
def test_the_kernel_equals_its_reference(rows, k, n, bias):
    weight, b = weights(n, k, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 3
    got = int8_linear.Int8Linear(weight, b)(x)
    want = int8_linear.int8_linear_reference(x, weight, b)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # the same integer accumulation and scales; the kernel may fuse the scaling's multiply and the bias add
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5 * float(want.abs().max()))
    exact = x.double() @ weight.double().T + (b.double() if b is not None else 0)
    # per-row and per-column symmetric int8: each product off by at most half a step of either factor
    bound = (x.abs().amax(1, keepdim=True).double() / 127) * weight.double().abs().sum(1) + \
        x.double().abs().sum(1, keepdim=True) * (weight.abs().amax(1).double() / 127)
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_a_rows_result_is_the_same_alone_and_among_any_rows():
    """Each row is quantized by its own scale and accumulated in exact integers: its tile, its block of rows and its
    place in them change with the row count, its bits must not."""
    weight, b = weights(100, 96, bias=True, seed=2)
    linear = int8_linear.Int8Linear(weight, b)
    x = torch.randn(140, 96, generator=torch.Generator().manual_seed(3))
    full = linear(x)
    for rows in (1, 2, 3, 4, 7, 9, 13, 17, 65, 130):
        assert torch.equal(linear(x[-rows:]), full[-rows:]), rows


def test_zero_rows_leading_dimensions_and_an_empty_input():
    weight, b = weights(48, 32, bias=True)
    linear = int8_linear.Int8Linear(weight, b)
    x = torch.randn(2, 3, 32)
    x[0, 1] = 0.0
    y = linear(x)
    assert torch.equal(y, linear(x.reshape(6, 32)).reshape(2, 3, 48))
    assert torch.equal(y[0, 1], b)  # a row of zeros: scale 0, the bias alone
    assert linear(torch.empty(0, 32)).shape == (0, 48)
    assert torch.equal(linear(x.double()), y)  # computed in float32 whatever the input's float type


def test_bad_inputs_are_refused_with_what_was_expected():
    weight, _ = weights(48, 32, bias=False)
    linear = int8_linear.Int8Linear(weight)
    with pytest.raises(ValueError, match=r"expected inputs of 32 features, got shape \(2, 31\)"):
        linear(torch.randn(2, 31))
    with pytest.raises(RuntimeError, match="x has 28 columns and the packed weight 32"):
        torch.ops.specactor.int8_linear(torch.randn(2, 28), linear.packed, linear.scale, linear.colsum, None, 48)
    with pytest.raises(RuntimeError, match="expected a 2-D int8 CPU weight"):
        torch.ops.specactor.int8_linear_pack(weight)
    with pytest.raises(RuntimeError, match="float32 scales and int32 column sums"):
        torch.ops.specactor.int8_linear(torch.randn(2, 32), linear.packed, linear.scale[:5], linear.colsum, None, 48)


def test_int8_drafting_runs_on_the_kernel_and_on_pytorchs_linear_where_it_does_not(monkeypatch):
    """quantize.int8_linear (compact heads, the fused projections of `Int8PackedLinear`) and quantize_int8 (a model
    copy) use the kernel where it runs; without it, PyTorch's dynamic int8 linear, which quantizes activations per
    call rather than per row: the two agree to int8's precision."""
    torch.manual_seed(0)
    parts = [torch.nn.Linear(64, n, bias=bias) for n, bias in ((64, True), (32, False))]
    x = torch.randn(4, 64)
    assert isinstance(quantize.int8_linear(parts[0].weight, parts[0].bias), int8_linear.Int8Linear)
    copy = quantize.quantize_int8(torch.nn.Sequential(*parts[:1]))
    assert isinstance(copy[0], int8_linear.Int8Linear) and isinstance(parts[0], torch.nn.Linear)
    fused = Int8PackedLinear(parts)
    with_kernel = fused(x)
    if not int8_supported():
        return
    monkeypatch.setattr(quantize, "int8_kernel", SimpleNamespace(available=lambda: False))
    without = quantize.int8_linear(parts[0].weight, parts[0].bias)
    assert not isinstance(without, int8_linear.Int8Linear)
    exact = torch.cat([p(x) for p in parts], dim=-1).detach()
    fallback = Int8PackedLinear(parts)(x)
    for got in (with_kernel, fallback):
        assert float((got - exact).norm() / exact.norm()) < 0.02


def test_the_kernel_linear_is_refused_where_the_kernel_does_not_run(monkeypatch):
    monkeypatch.setattr(int8_linear, "available", lambda: False)
    with pytest.raises(RuntimeError, match="AVX-512 VNNI"):
        int8_linear.Int8Linear(torch.randn(8, 8))
