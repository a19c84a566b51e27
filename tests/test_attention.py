"""Attention for half-precision models on a CPU (specui.engine.attention): a float32 KV cache
and grouped matmuls where they measure faster, equal to SDPA up to rounding, with SDPA's masks."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specui.engine import attention
from specui.engine.attention import CACHE_KEY, GROUPED_KEY, specui_attention, use_measured_attention
from specui.engine.kvcache import GrowingCache
from specui.engine.session import ModelSession


class _Module:
    def __init__(self, limit: int) -> None:
        self.config = type("C", (), {GROUPED_KEY: limit})()
        self.is_causal = True
        self.num_key_value_groups = 3


def _reference(query, key, value, mask):
    rep = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(rep, 1), value.double().repeat_interleave(rep, 1),
        attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("limit", [0, 16])  # SDPA, grouped
@pytest.mark.parametrize("q", [1, 3, 16])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_half_queries_over_a_float32_cache_equal_sdpa(limit, q, mask_kind):
    gen = torch.Generator().manual_seed(q)
    length = q if mask_kind == "none" and q > 1 else 40  # transformers omits the mask only then
    query = torch.randn(1, q, 9, 16, generator=gen).bfloat16().transpose(1, 2)  # as the model hands it over
    buffer = torch.randn(2, 1, 3, 64, 16, generator=gen)
    key, value = buffer[0, ..., :length, :], buffer[1, ..., :length, :]  # views of a larger cache buffer
    allowed = torch.ones(q, length, dtype=torch.bool).tril(length - q)
    allowed[-1, 0] = False  # a tree-like hole
    mask = {"none": None, "bool": allowed[None, None],
            "float": torch.zeros(1, 1, q, length).masked_fill(~allowed, torch.finfo(torch.float32).min).bfloat16()}
    got, _ = specui_attention(_Module(limit), query, key, value, mask[mask_kind], scaling=16 ** -0.5)
    if mask_kind == "none":  # no mask: causal
        allowed = torch.ones(q, length, dtype=torch.bool).tril(length - q)
    ref_mask = torch.where(allowed, 0.0, float("-inf")).double()[None, None]
    want = _reference(query.float(), key, value, ref_mask)
    assert got.dtype == torch.bfloat16 and got.shape == (1, q, 9, 16)
    assert (got.double() - want).abs().max() < 0.02


def test_a_float32_model_is_left_on_sdpa():
    model = tiny_llama(0, layers=1, dtype=torch.float32)
    assert use_measured_attention(model) is None
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.config, CACHE_KEY)


def _forced(monkeypatch, model, limit: int):
    monkeypatch.setattr(attention, "measure_attention",
                        lambda *a: (torch.float32, limit, f"attention: float32 KV cache, grouped up to {limit}"))
    return use_measured_attention(model)


def test_the_measured_choice_reaches_the_cache_and_the_decode(monkeypatch):
    model = tiny_llama(0, layers=2, dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    reference = tiny_llama(0, layers=2, dtype=torch.bfloat16)
    reference.config._attn_implementation = "sdpa"
    note = _forced(monkeypatch, model, 4)
    assert "float32 KV cache" in note and model.config._attn_implementation == attention.ATTENTION
    session = ModelSession(model)
    ids = [1, 5, 9, 13, 7, 21, 4, 8]
    rows = [session.advance(ids[:6])]
    for n in (7, 8):
        rows.append(session.advance(ids[:n]))
    assert all(layer.keys.dtype == torch.float32 for layer in session.cache.layers)
    assert isinstance(session.cache, GrowingCache)
    with torch.no_grad():
        full = reference(input_ids=torch.tensor([ids])).logits[0].float()
    got = torch.stack([r[-1].float() for r in rows])
    assert (got - full[5:8]).abs().max() <= 0.05 * full.abs().max()


def test_padding_masks_still_reach_the_attention(monkeypatch):
    """A left-padded batch (transformers' generate, the draft trainer's collection) must keep
    its 2-D mask: the attention is registered with SDPA's mask function."""
    model = tiny_llama(0, layers=2, dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    _forced(monkeypatch, model, 16)
    short, long = [3, 8, 2], [5, 9, 4, 7, 6]
    ids = torch.tensor([[0, 0] + short, long])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).logits[0, 2:].float()
        alone = model(input_ids=torch.tensor([short])).logits[0].float()
    assert (batched - alone).abs().max() <= 0.05 * alone.abs().max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_model_shares_its_key_value_heads_and_keeps_its_logits(dtype):
    """SDPA with the GQA heads shared in the kernel (no copy of the cache per query head): the
    same logits as transformers' own call, and for w8a8's float64 models a token scored with
    others exactly as alone."""
    from specui.engine.attention import SHARED_KEY, routed_attention, use_shared_kv_heads
    from specui.weights.w8a8 import has_w8a8_kernel, quantize_w8a8

    def build():
        model = tiny_llama(0, layers=2, dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
        if dtype == torch.float64 and has_w8a8_kernel():
            quantize_w8a8(model)
        return model.to(dtype)

    model, reference = build(), build()
    note = use_shared_kv_heads(model)
    assert "sharing 2 key/value heads" in note and model.config._attn_implementation == attention.ATTENTION
    assert getattr(model.config, GROUPED_KEY) == 0 and getattr(model.config, CACHE_KEY) is None
    assert getattr(model.config, SHARED_KEY) and not routed_attention(model)  # no grouped kind to capture
    ids = torch.tensor([[1, 5, 9, 13, 7, 21, 4, 30, 2, 17]])
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        steps = [model(input_ids=ids[:, i:i + 2], past_key_values=cache).logits for i in (4, 6, 8)]
        cache = reference(input_ids=ids[:, :4], use_cache=True).past_key_values
        theirs = [reference(input_ids=ids[:, i:i + 2], past_key_values=cache).logits for i in (4, 6, 8)]
    assert (whole - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(torch.cat(steps, 1), torch.cat(theirs, 1))  # 2-token steps: the copy's path, the same bits
    if dtype == torch.float64:
        assert torch.equal(torch.cat(steps, 1), whole[:, 4:])


def test_a_model_without_grouped_heads_is_left_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    from specui.engine.attention import use_shared_kv_heads

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    assert use_shared_kv_heads(model) is None and model.config._attn_implementation == "sdpa"


def test_grouped_matmuls_keep_float64_precision():
    """A compiled float64 model (w8a8's) may attend with grouped matmuls (capture_choice measures
    it): its scores must stay float64, or a token scored with others differs from itself alone."""
    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64)
    key, value = (torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool).tril(7)
    got = attention._grouped(query, key, value, mask, 8 ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    assert got.dtype == torch.float64 and (got - want.transpose(1, 2)).abs().max() < 1e-12
