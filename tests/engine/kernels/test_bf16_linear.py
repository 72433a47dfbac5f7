"""kernels/bf16_linear: the packed linears' bf16 kernel equals its torch reference bit for bit in both of its
variants (VDPBF16PS, fp32 FMAs), denormals included, and a row's bits do not depend on the other rows of the call
(what keeps a verify block and a decode step identical)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specactor_engine.kernels import bf16_linear
from specactor_engine.model.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not bf16_linear.available(),
                                reason="the bf16 kernel serves CPUs with AVX-512 BF16 and no AMX")


def weights(n: int, k: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    return weight, (torch.randn(n, generator=generator).bfloat16() if bias else None)


@pytest.mark.parametrize("kernel", bf16_linear.VARIANTS)
@pytest.mark.parametrize("rows, k, n, bias", [
    (1, 64, 40, False),    # one row; N not a multiple of the 32-column group
    (5, 64, 96, True),     # a tile of 5 rows, with a bias
    (12, 192, 70, False),  # one tile of 12 (24 accumulators)
    (16, 128, 64, True),   # two tiles of 8
    (13, 256, 33, False),  # tiles of 7 and 6; one column in the last group
    (20, 32, 32, True),    # two tiles of 10
    (25, 96, 64, True),    # three tiles (9, 8, 8)
])
def test_the_kernel_equals_its_reference_bit_for_bit(rows, k, n, bias, kernel):
    weight, b = weights(n, k, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = bf16_linear.linear(x, bf16_linear.pack(weight), b, n, kernel)
    want = bf16_linear.bf16_linear_reference(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, want)
    exact = x.double() @ weight.double().T + (b.double() if b is not None else 0)
    assert (got.double() - exact).abs().max() <= 2**-7 * exact.abs().max()  # within bf16's rounding of the result


@pytest.mark.parametrize("kernel", bf16_linear.VARIANTS)
def test_a_rows_bits_are_the_same_alone_and_among_any_rows(kernel):
    """Rows are tiled by at most 12 with the remainder spread (13 = 7 + 6, 20 = 10 + 10, 25 = 9 + 8 + 8): a row's
    tile and its place in it change with the row count, its bits must not."""
    weight, b = weights(100, 96, bias=True, seed=2)
    packed = bf16_linear.pack(weight)
    x = torch.randn(28, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    full = bf16_linear.linear(x, packed, b, 100, kernel)
    for rows in (1, 2, 3, 4, 7, 9, 12, 13, 17, 25):
        assert torch.equal(bf16_linear.linear(x[-rows:], packed, b, 100, kernel), full[-rows:]), rows


def bf16_bits(*values: int) -> torch.Tensor:
    """bf16 values from their 16-bit patterns."""
    return torch.tensor([v - (1 << 16) if v >= 1 << 15 else v for v in values], dtype=torch.int16).view(torch.bfloat16)


def test_the_variants_agree_on_denormals_as_vdpbf16ps_treats_them():
    """VDPBF16PS reads a denormal input as zero and flushes a denormal result (DAZ, FTZ); the FMA variant must too.
    2^-133 (a denormal) times 2^100 is 2^-33 if the denormal is used, 0 if it is read as zero; four products of
    2^-70 and 2^-70 sum to a denormal; two denormals times 2^100 sum to 63 2^-33 unless read as zero. The torch
    reference, which keeps denormals, gives 2^-33 and 63 2^-33 in the first and last cells: what the FMA variant
    would give without DAZ."""
    big, tiny, denormal = 0x7180, 0x1C80, 0x0001  # 2^100, 2^-70, the least positive bf16 denormal
    x = torch.stack([bf16_bits(denormal, 0, 0, 0), bf16_bits(tiny, tiny, tiny, tiny), bf16_bits(big, big, 0, 0),
                     bf16_bits(0, 0x0040, 0, 0x8001)])  # 2^-127 and -2^-133, denormals
    weight = torch.stack([bf16_bits(big, 0, 0, 0), bf16_bits(tiny, tiny, tiny, tiny),
                          bf16_bits(denormal, 0x0040, 0, 0), bf16_bits(0, big, 0, big)])
    packed = bf16_linear.pack(weight)
    got = {v: bf16_linear.linear(x, packed, None, 4, v) for v in bf16_linear.VARIANTS}
    assert torch.equal(got["dpbf16"].view(torch.int16), got["fma"].view(torch.int16))
    reference = bf16_linear.bf16_linear_reference(x, weight)
    assert reference[0, 0].item() == 2.0**-33 and reference[3, 3].item() == 63 * 2.0**-33  # the checks bite
    assert got["fma"][0, 0].item() == 0.0  # denormal x 2^100 read as 0 (2^-33 otherwise)
    assert got["fma"][1, 1].item() == 0.0  # 4 x 2^-140, denormal, flushed
    assert got["fma"][3, 3].item() == 0.0  # 2^-127 2^100 - 2^-133 2^100: 63 2^-33 unless read as zero


def test_the_variant_is_timed_once_or_chosen_by_the_environment(monkeypatch):
    times = bf16_linear.time_variants(rows=4, n=64, k=64, calls=2)
    assert set(times) == set(bf16_linear.VARIANTS) and all(0 < t < float("inf") for t in times.values())
    bf16_linear.variant.cache_clear()
    try:
        monkeypatch.setenv(bf16_linear.VARIANT_ENV, "fma")
        bf16_linear._variant_index.cache_clear()
        assert bf16_linear.variant() == "fma" and bf16_linear._variant_index() == 1
        bf16_linear.variant.cache_clear()
        monkeypatch.setenv(bf16_linear.VARIANT_ENV, "avx2")
        with pytest.raises(ValueError, match="SPECACTOR_BF16_KERNEL='avx2': expected one of dpbf16, fma"):
            bf16_linear.variant()
        bf16_linear.variant.cache_clear()
        monkeypatch.delenv(bf16_linear.VARIANT_ENV)
        assert bf16_linear.variant() in bf16_linear.VARIANTS
    finally:
        bf16_linear.variant.cache_clear()
        bf16_linear._variant_index.cache_clear()


def test_leading_dimensions_and_an_empty_input():
    weight, _ = weights(48, 32, bias=False)
    packed = bf16_linear.pack(weight)
    x = torch.randn(2, 3, 32).bfloat16()
    assert torch.equal(bf16_linear.linear(x, packed, None, 48), bf16_linear.linear(x.reshape(6, 32), packed, None,
                                                                                    48).reshape(2, 3, 48))
    assert bf16_linear.linear(torch.empty(0, 32, dtype=torch.bfloat16), packed, None, 48).shape == (0, 48)


def test_bad_inputs_are_refused_with_what_was_expected():
    weight, _ = weights(48, 32, bias=False)
    packed = bf16_linear.pack(weight)
    with pytest.raises(RuntimeError, match="must be even"):
        bf16_linear.pack(torch.randn(8, 7).bfloat16())
    with pytest.raises(RuntimeError, match="x has 30 columns"):
        bf16_linear.linear(torch.randn(2, 30).bfloat16(), packed, None, 48)
    with pytest.raises(RuntimeError, match="bias has 47 values"):
        bf16_linear.linear(torch.randn(2, 32).bfloat16(), packed, torch.zeros(47, dtype=torch.bfloat16), 48)


def test_packed_linear_serves_bf16_through_the_kernel_and_follows_weight_updates():
    torch.manual_seed(0)
    modules = [nn.Linear(64, n).bfloat16() for n in (32, 16, 16)]
    fused = PackedLinear(modules)
    x = torch.randn(3, 64).bfloat16()
    got = fused(x)
    assert fused._kernel
    weight = torch.cat([m.weight for m in modules]).detach()
    bias = torch.cat([m.bias for m in modules]).detach()
    assert torch.equal(got, bf16_linear.bf16_linear_reference(x, weight, bias))
    want = F.linear(x.float(), weight.float(), bias.float())
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    with torch.no_grad():
        modules[1].weight.mul_(2.0)  # an in-place update (a weight sync) re-packs
    weight = torch.cat([m.weight for m in modules]).detach()
    assert torch.equal(fused(x), bf16_linear.bf16_linear_reference(x, weight, bias))
