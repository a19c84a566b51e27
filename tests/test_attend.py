"""SpecUI's row-exact attention (specui.weights.attend): each query row gets the same bits scored
alone or among others, and a float32 w4a8 / w8a8 model on it verifies losslessly."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_cache import (
    assert_compiled_methods_equal_compiled_autoregressive,
    assert_greedy_equals_autoregressive,
    scored_together_and_alone,
)

from specui.weights.attend import ATTENTION, attend, exact_attention, exact_attention_ready, use_exact_attention
from specui.weights.concrete import rest_dtype
from specui.weights.w4a8 import quantize_w4a8, w4a8_unavailable
from specui.weights.w8a8 import has_w8a8_kernel, quantize_w8a8

pytestmark = pytest.mark.skipif(not exact_attention_ready(), reason="SpecUI's kernels are not built here")
NONE = torch.empty(0, dtype=torch.bool)


def _inputs(dtype, heads=6, kv_heads=2, dim=64, length=40, queries=9, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
    # key / value as views of a longer buffer, as a cache hands them over
    key, value = (torch.randn(batch, kv_heads, length + 8, dim, generator=g).to(dtype)[:, :, :length] for _ in range(2))
    return query, key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [64, 8, 24, 16, 32, 128])  # 16-128: value sums of several rows at once
def test_every_row_has_the_bits_it_has_alone(dtype, dim):
    query, key, value = _inputs(dtype, dim=dim, queries=19)  # 3 x 19 rows: lanes in blocks of 16 and a tail
    q, length = query.shape[2], key.shape[2]
    allowed = torch.ones(q, length, dtype=torch.bool).tril(length - q)[None]
    together = attend(query, key, value, allowed, dim ** -0.5)
    assert torch.equal(together, attend(query, key, value, NONE, dim ** -0.5))  # no mask: the same causal rows
    for i in range(q):  # decoding: the row alone over exactly the keys it sees
        seen = length - q + i + 1
        alone = attend(query[:, :, i:i + 1].contiguous(), key[:, :, :seen], value[:, :, :seen], NONE, dim ** -0.5)
        assert torch.equal(alone, together[:, i:i + 1])
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=allowed[:, None], enable_gqa=True).transpose(1, 2)
    assert (together.double() - want).abs().max() < (1e-5 if dtype == torch.float32 else 1e-12)


def test_tree_masks_batches_and_rows_that_see_nothing():
    query, key, value = _inputs(torch.float32, queries=4, batch=2)
    allowed = torch.rand(2, 4, key.shape[2], generator=torch.Generator().manual_seed(1)) < 0.5
    allowed[1, 2] = False  # a padding row: sees nothing, gets zeros (no NaN)
    out = attend(query, key, value, allowed, 0.125)
    assert not out.isnan().any() and torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    for b in range(2):
        for i in range(4):
            if not allowed[b, i].any():
                continue
            seen = allowed[b, i]
            alone = attend(query[b:b + 1, :, i:i + 1].contiguous(), key[b:b + 1, :, seen], value[b:b + 1, :, seen],
                           NONE, 0.125)
            assert torch.equal(alone[0, 0], out[b, i])  # masked keys add exact zeros



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_no_row_of_a_block_sees_are_left_out_without_changing_a_bit(dtype):
    """The kernel reads only the keys some row of a block of 16 sees (a causal prefill's first rows, a
    window): the rows get the bits of the full computation, which is each row alone over its own keys."""
    query, key, value = _inputs(dtype, heads=3, kv_heads=1, queries=40, length=70)
    q, length = query.shape[2], key.shape[2]
    allowed = torch.zeros(1, q, length, dtype=torch.bool)
    for i in range(q):  # windows that start and end at different keys: blocks see different key ranges
        lo = min(i, length - 1) if i < 20 else 0
        allowed[0, i, lo:min(length, lo + 5 + i)] = True
    allowed[0, 7] = False  # a row that sees nothing, in a block whose others see a window
    out = attend(query, key, value, allowed, 0.125)
    assert torch.equal(out[0, 7], torch.zeros_like(out[0, 7]))
    for i in range(q):
        seen = allowed[0, i]
        if not seen.any():
            continue
        alone = attend(query[:, :, i:i + 1].contiguous(), key[:, :, seen], value[:, :, seen], NONE, 0.125)
        assert torch.equal(alone[0, 0], out[0, i])
    causal = attend(query, key, value, NONE, 0.125)  # a prefill's causal rows: row i sees keys up to 30 + i
    for i in (0, 15, 16, 39):
        alone = attend(query[:, :, i:i + 1].contiguous(), key[:, :, :length - q + i + 1],
                       value[:, :, :length - q + i + 1], NONE, 0.125)
        assert torch.equal(alone[0, 0], causal[0, i])

def test_the_attention_interface_takes_transformers_masks_and_hands_the_rest_to_sdpa():
    query, key, value = _inputs(torch.float32, queries=3)
    allowed = torch.ones(3, key.shape[2], dtype=torch.bool).tril(key.shape[2] - 3)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.is_causal = True
    by_bool, _ = exact_attention(module, query, key, value, allowed[None, None])
    by_add, _ = exact_attention(module, query, key, value, additive[None, None])
    assert torch.equal(by_bool, by_add) and torch.equal(by_bool, attend(query, key, value, allowed[None], 0.125))
    half, _ = exact_attention(module, *(t.bfloat16() for t in (query, key, value)), allowed[None, None])
    assert half.dtype == torch.bfloat16 and (half.float() - by_bool).abs().max() < 0.05  # SDPA's


def _float32_model(quantize):
    model = tiny_llama(0, layers=3, dtype=torch.float32)
    quantize(model)
    assert use_exact_attention(model) and model.config._attn_implementation == ATTENTION
    return model


@pytest.mark.parametrize("kind", ["w4a8", "w8a8"])
def test_a_float32_model_on_rounding_kernels_scores_k_tokens_exactly_as_each_alone(kind):
    if kind == "w4a8" and w4a8_unavailable() or kind == "w8a8" and not has_w8a8_kernel():
        pytest.skip(f"no {kind} kernel here")
    model = _float32_model(quantize_w4a8 if kind == "w4a8" else quantize_w8a8)
    whole, alone = scored_together_and_alone(model, [1, 5, 9, 13, 7, 21, 4, 30, 2, 17, 11, 3])
    assert whole.dtype == torch.float32 and torch.equal(alone, whole)


@pytest.mark.parametrize("method", ["speculative", "opt-tree", "dsbd"])
def test_greedy_methods_equal_autoregressive_on_a_float32_w4a8_target(tiny_draft, method):
    if w4a8_unavailable():
        pytest.skip(w4a8_unavailable())
    assert_greedy_equals_autoregressive(_float32_model(quantize_w4a8), tiny_draft, method)


def test_compiled_forwards_on_a_float32_w4a8_target_equal_its_compiled_autoregressive():
    if w4a8_unavailable():
        pytest.skip(w4a8_unavailable())
    assert_compiled_methods_equal_compiled_autoregressive(_float32_model(quantize_w4a8))


def test_dtype_auto_runs_the_rest_in_float32_where_the_kernel_is():
    assert rest_dtype() == torch.float32
