"""The 8-bit-group head of w4a8 (specui.weights.q8a8): llama.cpp's Q8_0 blocks times 8-bit
activation groups. What makes it usable: the product is the arithmetic the kernel's header states,
the vector paths (AVX512-VNNI, AVX2) and the portable loop give the same bits, a row's output does
not depend on the rows scored with it, Q8_0 blocks come back exactly, and w4a8 puts the head on it
where oneDNN would round the activations to 7 bits."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specui.weights.native import native, native_unavailable
from specui.weights.q8a8 import Q8A8Linear, pack_q8, quantize_q8
from specui.weights.quantize import GROUP
from specui.weights.w4a8 import quantize_w4a8
from specui.weights.w8a8 import W8A8Linear, full_range_exact, has_w8a8_kernel

pytestmark = pytest.mark.skipif(bool(native_unavailable()), reason=native_unavailable() or "-")


def _formula(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """acc = fma(float(sum(q a)), d * da, acc) per group, a and da as groups.h rounds them, in torch."""
    rows, k = x.shape
    xg = x.reshape(rows, -1, GROUP)
    top = xg.abs().amax(-1, keepdim=True)
    a = torch.round(xg * torch.where(top > 0, 127 / top, torch.zeros_like(top)))
    da = (top[..., 0] / 127).float()
    s = torch.einsum("tgi,ngi->tng", a.double(), q.reshape(q.shape[0], -1, GROUP).double()).float()  # exact
    out = torch.zeros(rows, q.shape[0])
    for g in range(k // GROUP):
        scale = (d[None, :, g] * da[:, None, g]).float()
        out = (s[:, :, g].double() * scale.double() + out.double()).float()
    return out


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :GROUP] = 0  # a zero group (scale 0)
    w[n // 2, GROUP:] *= 40  # an outlier row, as a real head has
    return w


@pytest.mark.parametrize("n,k", [(48, 64), (37, 96), (8, 32), (1000, 576)])
def test_the_product_is_the_stated_arithmetic_and_each_row_is_computed_on_its_own(n, k):
    module = Q8A8Linear.from_weight(_weight(n, k))
    assert module is not None
    q, d = quantize_q8(_weight(n, k))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = module(x)
    assert got.dtype == torch.float64 and got.shape == (11, n)
    assert torch.allclose(got.float(), _formula(x, q, d), rtol=1e-6, atol=1e-6)
    for i in range(11):
        assert torch.equal(module(x[i:i + 1])[0], got[i])
    want = x.float() @ _weight(n, k).T
    assert (got.float() - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_vector_path_and_the_portable_loop_give_the_same_bits(dtype):
    kernels = native()[0]
    for n, k in ((64, 128), (50, 96), (13, 64), (300, 576)):
        packed, scales = pack_q8(*quantize_q8(_weight(n, k, seed=n)))
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 19):  # the VNNI path's passes of 8 rows and every remainder
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows), dtype=dtype)
            x[0, :GROUP] = 0
            x[-1, GROUP:2 * GROUP] = torch.arange(GROUP, dtype=dtype) - 15.5  # exact halves of a level
            want = kernels.q8a8_mm_portable(x, packed, scales, n)
            assert want.dtype == dtype and torch.equal(kernels.q8a8_mm(x, packed, scales, n), want)


def test_q8_0_blocks_come_back_exactly():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
    q[:, ::GROUP] = 127  # llama.cpp's rounding puts +-127 on each block's largest weight
    d = (torch.rand(16, 2, generator=g) * 0.01).half().float()
    w = (q.float().reshape(16, 2, GROUP) * d[..., None]).reshape(16, 64)
    q2, d2 = quantize_q8(w)
    assert torch.equal(q2, q) and torch.equal(d2, d)


def test_w4a8_puts_the_head_on_8_bit_groups_where_onednn_would_round_activations_to_7_bits():
    model = tiny_llama(0, layers=1, dtype=torch.float32)
    counts = quantize_w4a8(model)
    exact = has_w8a8_kernel() and full_range_exact()
    assert isinstance(model.lm_head, W8A8Linear if exact else Q8A8Linear)
    assert counts["w8a8" if exact else "q8a8"] == 1
