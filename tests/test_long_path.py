"""Long inputs (prefills) on a quantized model: the same weights dequantized to float32 where a
measurement finds that faster, never for the few-token forwards the methods compare."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.session import ModelSession
from specui.weights.quantize import (
    Int4Linear,
    Int8Linear,
    dequantize_groups,
    quantize_groups,
    quantize_model,
    quantize_rows,
    use_long_path,
)


def _modules():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    return (Int4Linear.from_groups(*quantize_groups(w), torch.device("cpu")),
            Int8Linear.from_stored(*quantize_rows(w), torch.device("cpu")))


def test_dense_weights_are_the_kernels_own():
    int4, int8 = _modules()
    q, scale, low = quantize_groups(torch.randn(96, 64, generator=torch.Generator().manual_seed(3)))
    # the kernel computes with bfloat16 scales and zeros: the dense weights are exactly those
    s16, z16 = scale.to(torch.bfloat16).float(), (low + 8 * scale).to(torch.bfloat16).float()
    want = ((q.float() - 8).reshape(96, -1, 32) * s16[..., None] + z16[..., None]).reshape(96, 64)
    assert int4.layout is not None  # the kernel's packing was recognised on this machine
    assert torch.equal(int4.dense(), want)
    assert (int4.dense() - dequantize_groups(q, scale, low)).abs().max() <= 0.01 * want.abs().max()
    assert torch.equal(int8.dense(), int8.weight.float() * int8.scale.float()[:, None])
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for module in (int4, int8):
        kernel, dense = module(x).float(), module._dense_forward(x).float()
        assert (kernel - dense).abs().max() <= 0.02 * kernel.abs().max()


@pytest.mark.parametrize("faster", [True, False])
def test_the_long_path_serves_only_forwards_that_long_and_only_where_measured_faster(faster, monkeypatch):
    model = tiny_llama(0, layers=1, dtype=torch.float32, hidden=64)
    quantize_model(model, "int4")
    note = use_long_path(model, "target", rows=16, timer=lambda m, x: (10.0, 5.0 if faster else 9.5))
    int4s = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert all(m.long_rows == (16 if faster else None) for m in int4s)
    assert model.lm_head.long_rows is None  # the head: long inputs use its last row only
    assert note.startswith(f"target long inputs: {len(int4s)} int4 matrices "
                           + ("dequantized to float32" if faster else "on the kernel"))
    assert "5.0 ms dequantized vs 10.0 ms" in note or "9.5 ms dequantized vs 10.0 ms" in note
    used = []
    monkeypatch.setattr(Int4Linear, "_dense_forward", lambda self, x: used.append(x.shape[-2]) or
                        torch.nn.functional.linear(x.float(), self.dense()).to(x.dtype))
    with torch.inference_mode():
        model(input_ids=torch.arange(3, 23)[None])  # 20 tokens: long
        model(input_ids=torch.arange(3, 8)[None])  # 5 tokens: the kernel
    assert used == ([20] * len(int4s) if faster else [])


def test_no_quantized_matrix_no_note():
    assert use_long_path(tiny_llama(0, layers=1, dtype=torch.float32)) is None


def test_greedy_methods_still_reproduce_autoregressive_with_long_prefills():
    target = tiny_llama(1, layers=2, dtype=torch.float32, hidden=64)
    draft = tiny_llama(2, layers=1, dtype=torch.float32, hidden=64)
    quantize_model(target, "int4")
    use_long_path(target, "target", rows=12, timer=lambda m, x: (10.0, 1.0))
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids={EOS})
    prompt = [1] + [3 + (7 * i) % 50 for i in range(40)]  # a 41-token prompt: its prefill is long
    runs = {name: engine.generate(GenerationRequest(list(prompt), 24), make_method(name, **params)).run().output_ids
            for name, params in (("autoregressive", {}), ("speculative", {"gamma": 3}))}
    assert runs["autoregressive"] == runs["speculative"] and len(runs["autoregressive"]) > 0
    # and the prefill's cache is what the kernel's own would be, up to bfloat16 rounding
    long, short = ModelSession(target), ModelSession(target)
    long.prefill(prompt)
    for m in target.modules():
        if isinstance(m, Int4Linear):
            m.long_rows = None
    short.prefill(prompt)
    for (k1, v1), (k2, v2) in zip(long.kv(), short.kv(), strict=True):
        assert (k1 - k2).abs().max() <= 0.05 * k2.abs().max() + 1e-3
        assert (v1 - v2).abs().max() <= 0.05 * v2.abs().max() + 1e-3
