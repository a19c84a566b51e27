"""`--quantization w4a8`: 4-bit weight groups times int8 activation groups on SpecUI's kernel. What
makes it usable: the product is the arithmetic the kernel's header states (checked against the same
formula written in torch), the vector path (AVX512-VNNI or AVX2) and the portable loop give the same bits,
a row's output does not depend on the rows scored with it (so every lossless method equals
autoregressive decoding of the quantized target), a GGUF's blocks are kept exactly, a stand-in's
zero groups stay zeros, it compiles, and the load says what it did."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model, tiny_llama
from test_cache import (
    assert_compiled_methods_equal_compiled_autoregressive,
    assert_greedy_equals_autoregressive,
    scored_together_and_alone,
)

from specui.weights.concrete import rest_dtype
from specui.weights.native import native
from specui.weights.q8a8 import Q8A8Linear
from specui.weights.quantize import GROUP, dequantize_groups, quantize_groups
from specui.weights.w4a8 import W4A8Linear, pack_groups, quantize_w4a8, w4a8_unavailable
from specui.weights.w8a8 import W8A8Linear

pytestmark = pytest.mark.skipif(bool(w4a8_unavailable()), reason=w4a8_unavailable() or "-")


def _groups(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize_groups(torch.randn(n, k, generator=g) * 0.05)


def _formula(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's stated arithmetic, in torch, one row and group at a time in float32."""
    rows, k = x.shape
    xg = x.reshape(rows, -1, GROUP)
    top = xg.abs().amax(-1, keepdim=True)
    a = torch.round(xg * torch.where(top > 0, 127 / top, torch.zeros_like(top))).to(torch.int32)
    da, sa = (top[..., 0] / 127).float(), a.sum(-1).float()
    d, m = scale.half().float(), low.half().float()
    s = torch.einsum("tgi,ngi->tng", a.double(), q.reshape(q.shape[0], -1, GROUP).double()).float()  # exact
    out = torch.zeros(rows, q.shape[0])
    for g in range(k // GROUP):  # acc = fma(fma(s, d, m * sa), da, acc), in float32
        term = (s[:, :, g].double() * d[None, :, g].double() + (m[None, :, g] * sa[:, None, g]).double()).float()
        out = (term.double() * da[:, None, g].double() + out.double()).float()
    return out


@pytest.mark.parametrize("n,k", [(48, 64), (37, 96), (16, 32)])
def test_the_product_is_the_stated_arithmetic_and_each_row_is_computed_on_its_own(n, k):
    q, scale, low = _groups(n, k)
    module = W4A8Linear.from_groups(q, scale, low)
    assert module is not None
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = module(x)
    assert got.dtype == torch.float64 and got.shape == (11, n)
    # fma against a float64 multiply-add rounded once: equal but for a last-bit tie
    assert torch.allclose(got.float(), _formula(x, q, scale, low), rtol=1e-6, atol=1e-6)
    for i in range(11):
        assert torch.equal(module(x[i:i + 1])[0], got[i])
    assert (got.float() - x.float() @ dequantize_groups(q, scale.half().float(), low.half().float()).T).abs().max() \
        <= 0.02 * got.abs().max()  # 8-bit activation groups: close to the product with the 4-bit weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_vector_path_and_the_portable_loop_give_the_same_bits(dtype):
    kernels = native()[0]
    # blocks of 16 rows whole, with 2 or 12 rows (AVX2: one half partial, or none of the second), 5
    for n, k in ((64, 128), (50, 96), (60, 64), (37, 64), (1536 // 8, 576)):
        q, scale, low = _groups(n, k, seed=n)
        packed, scales = pack_groups(q, scale, low)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17):  # AVX2 takes 4 at a time, then the 3, 2 or 1 left
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows), dtype=dtype)
            x[0, :GROUP] = 0  # a group of zeros (scale 0) and one on exact halves of a level
            x[-1, GROUP:2 * GROUP] = torch.arange(GROUP, dtype=dtype) - 15.5
            want = kernels.q4a8_mm_portable(x, packed, scales, n)
            assert want.dtype == dtype and torch.equal(kernels.q4a8_mm(x, packed, scales, n), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_amx_tiles_give_the_vector_paths_bits_from_any_row_count(dtype):
    """q4a8_mm_from(..., amx_from=1) puts every product on AMX tiles where the CPU, the OS and the
    build allow (passes of up to 16 rows, 20 rows as 10 + 10); elsewhere it is the vector path."""
    kernels = native()[0]
    for n, k in ((64, 128), (37, 96), (1536 // 8, 576)):
        q, scale, low = _groups(n, k, seed=n + 1)
        packed, scales = pack_groups(q, scale, low)
        for rows in (1, 2, 5, 11, 12, 16, 17, 20, 33):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows), dtype=dtype)
            x[0, :GROUP] = 0
            want = kernels.q4a8_mm_portable(x, packed, scales, n)
            assert torch.equal(kernels.q4a8_mm_from(x, packed, scales, n, 1), want), rows
            assert torch.equal(kernels.q4a8_mm_from(x, packed, scales, n, 0), want), rows


def test_a_ggufs_blocks_are_kept_exactly_and_zero_groups_stay_zero():
    q = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    d = (torch.rand(32, 2) * 0.1).half().float()
    low = -8 * d  # Q4_0: w = d (q - 8)
    d[:16], low[:16] = 0, 0  # the first rows all-zero groups, as a stand-in's padding
    module = W4A8Linear(q, d, low)
    assert torch.equal(module.dense(), dequantize_groups(q, d, low))
    x = torch.randn(4, 64, dtype=torch.float64)
    out = module(x)
    assert torch.equal(out[:, :16], torch.zeros(4, 16, dtype=torch.float64))


def test_inputs_other_than_32_wide_groups_are_left_alone():
    assert W4A8Linear.from_groups(*quantize_groups(torch.randn(8, 32)), None) is not None
    model = tiny_llama(0, layers=1, dtype=torch.float32, hidden=48)  # 48 inputs: not whole groups
    counts = quantize_w4a8(model)  # only the MLP's down matrix (96 inputs) goes on the kernel
    assert counts["w4a8"] == 1 and isinstance(model.model.layers[0].mlp.down_proj, W4A8Linear)
    assert counts["kept"] == 6 - counts["w8a8"] - counts["q8a8"] + 1
    assert isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)


def test_a_model_on_w4a8_in_float64_scores_k_tokens_exactly_as_each_alone():
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    reference = tiny_llama(0, layers=2, dtype=torch.float32)
    counts = quantize_w4a8(model)
    linears = sum(isinstance(m, torch.nn.Linear) for m in reference.modules())
    assert counts["w4a8"] == linears - 1 and counts["kept"] == 0
    assert isinstance(model.lm_head, (W8A8Linear, Q8A8Linear))  # test_q8a8: which one, by the CPU
    model.to(torch.float64)  # what dtype auto does
    assert all(m.scales.dtype == torch.int16 for m in model.modules() if isinstance(m, W4A8Linear))
    ids = [1, 5, 9, 13, 7, 21, 4, 30, 2, 17]
    whole, alone = scored_together_and_alone(model, ids)
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([ids])).logits
    assert whole.dtype == torch.float64 and torch.equal(alone, whole)
    assert (whole.float() - want).abs().max() <= 0.1 * want.abs().max()  # 4-bit weights: close, not equal


@pytest.mark.parametrize("method", ["speculative", "opt-tree", "dsbd"])
def test_greedy_methods_equal_autoregressive_on_a_w4a8_target(tiny_draft, method):
    target = tiny_llama(0, layers=3, dtype=torch.float32)
    quantize_w4a8(target)
    target.to(torch.float64)
    assert_greedy_equals_autoregressive(target, tiny_draft, method)


def test_compiled_forwards_on_a_w4a8_target_equal_its_compiled_autoregressive():
    """`--capture on`: the product is one custom op to torch.compile."""
    target = tiny_llama(0, layers=2, dtype=torch.float32)
    quantize_w4a8(target)
    target.to(torch.float64)
    assert_compiled_methods_equal_compiled_autoregressive(target)


def test_load_model_w4a8_says_what_it_did(tmp_path):
    from specui.weights.loading import ModelSpec, load_model

    folder = save_tiny_model(tmp_path / "m", seed=0, layers=1, hidden=64)
    loaded = load_model(ModelSpec(str(folder), quantization="w4a8"), role="target")
    assert loaded.model.dtype == rest_dtype()  # dtype auto: float32 weights rounded, then the rest as rest_dtype says
    assert sum(isinstance(m, W4A8Linear) for m in loaded.model.modules()) == 7
    note = next(n for n in loaded.notes if n.startswith("target w4a8:"))
    assert "7 matrices as 4-bit groups times 8-bit activation groups" in note
    if rest_dtype() == torch.float32:  # the rest in float32 needs attention that is row-exact too
        assert "target attention: SpecUI's row-exact kernel" in " ".join(loaded.notes)
    fp32 = load_model(ModelSpec(str(folder), dtype="float32"))
    assert loaded.memory_bytes < fp32.memory_bytes


def test_a_large_matrix_is_self_checked_on_rows_spread_over_it():
    """Past CHECKED_ROWS outputs the load compares a spread of rows (first and last included), not
    a dense copy of the whole weight; a wrong sampled row still fails the check."""
    from specui.weights.quantize import CHECKED_ROWS, quantize_groups, sample_rows, self_checked

    assert torch.equal(sample_rows(300), torch.arange(300))
    rows = sample_rows(11008)
    assert len(rows) == CHECKED_ROWS and int(rows[0]) == 0 and int(rows[-1]) == 11007
    assert int(rows.diff().max()) <= 11008 // CHECKED_ROWS + 1  # no stretch of the matrix left out
    groups = quantize_groups(torch.randn(1000, 64, generator=torch.Generator().manual_seed(3)) * 0.05)
    module, w = W4A8Linear.from_groups(*groups), dequantize_groups(*groups)  # what it holds
    assert module is not None
    rows = sample_rows(1000)
    wrong = w[rows].clone()
    wrong[7] *= -1  # a sampled row the kernel does not hold
    assert self_checked(module, w[rows], None, rows=rows) is module
    assert self_checked(module, wrong, None, rows=rows) is None
