"""The streaming kernel for float32 / bfloat16 matrices (specui/weights/stream.py): each output is
close to x W^T and does not depend on the rows scored with it, so a model on it scores k tokens
exactly as it scores each alone, and every greedy method equals autoregressive decoding token for
token; it compiles; the load measures it against torch's kernels and keeps the faster."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_cache import assert_greedy_equals_autoregressive

from specui.weights import stream
from specui.weights.quantize import batch_invariant
from specui.weights.stream import MAX_ROWS, StreamLinear, use_stream_kernel

pytestmark = pytest.mark.skipif(not stream.has_stream_kernel(),
                                reason=f"no streaming kernel here: {stream.stream_unavailable()}")


def _linear(out: int, inp: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Linear:
    linear = torch.nn.Linear(inp, out, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)))
    return linear.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out", [64, 70])  # 70: a last block narrower than the kernel's
def test_each_row_is_close_to_the_product_and_computed_the_same_alone_or_with_others(dtype, out):
    linear = _linear(out, 96, dtype)
    module = StreamLinear(linear)
    x = torch.randn(MAX_ROWS, 96, generator=torch.Generator().manual_seed(1))
    want = x.double() @ linear.weight.double().T
    got = module(x)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for rows in (1, 2, 5, 6, 7, 13, MAX_ROWS):  # full tiles of rows and each kind of remainder
        assert torch.equal(module(x[:rows]), got[:rows])
    assert batch_invariant(module, x[:8])
    more = torch.randn(MAX_ROWS + 1, 96).to(dtype)  # a prefill: torch's kernel
    assert torch.equal(module(more), linear(more))
    module.double()  # a model cast after its load: torch's kernel, not an error
    assert module(x.double()).dtype == torch.float64


def test_a_bias_and_bfloat16_inputs_come_back_as_the_linear_gives_them():
    linear = torch.nn.Linear(32, 48).to(torch.bfloat16)
    x = torch.randn(3, 2, 32).to(torch.bfloat16)
    got, want = StreamLinear(linear)(x), linear(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def _streamed(model: torch.nn.Module) -> str:
    return use_stream_kernel(model, "target", min_bytes=0, timer=lambda probes, rows: (2.0, 1.0))


def test_a_model_on_the_kernel_scores_k_tokens_exactly_as_it_scores_each_alone():
    model = tiny_llama(0, layers=2, dtype=torch.float64).float()
    reference = tiny_llama(0, layers=2, dtype=torch.float64).float()
    note = _streamed(model)
    assert "decoder matrices on the streaming kernel" in note and "output head on the streaming kernel" in note
    assert isinstance(model.lm_head, StreamLinear)
    ids = torch.tensor([[1, 5, 9, 13, 7, 21, 4, 30, 2, 17]])
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        together = model(input_ids=ids[:, 4:], past_key_values=cache).logits
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        steps = torch.cat([model(input_ids=ids[:, i:i + 1], past_key_values=cache).logits for i in range(4, 10)], 1)
    assert (together - want[:, 4:]).abs().max() <= 1e-4 * want.abs().max()
    assert (steps - together).abs().max() <= 1e-6 * together.abs().max()  # the attention's own rounding only
    assert torch.equal(steps.argmax(-1), together.argmax(-1))


@pytest.mark.parametrize("method", ["speculative", "opt-tree", "dsbd"])
def test_greedy_methods_equal_autoregressive_on_a_streamed_target(tiny_draft, method):
    target = tiny_llama(0, layers=3, dtype=torch.float32)
    _streamed(target)
    assert_greedy_equals_autoregressive(target, tiny_draft, method, check_cache=False)


def test_a_streamed_module_compiles_to_the_same_product():
    module = StreamLinear(_linear(64, 96, torch.float32, seed=4))
    x = torch.randn(5, 96)
    with torch.inference_mode():  # as the engine runs it
        assert torch.equal(torch.compile(module)(x), module(x))


def test_the_load_keeps_whichever_kernel_measures_faster():
    slow = tiny_llama(0, layers=1, dtype=torch.float32)
    note = use_stream_kernel(slow, "target", min_bytes=0, timer=lambda probes, rows: (1.0, 2.0))
    assert note.count("on torch's kernels") == 2 and not any(isinstance(m, StreamLinear) for m in slow.modules())
    slower_alone = tiny_llama(0, layers=1, dtype=torch.float32)  # faster for 8 tokens, slower for one
    use_stream_kernel(slower_alone, "target", min_bytes=0, timer=lambda probes, rows: (1.0, 1.2 if rows == 1 else 0.5))
    assert not any(isinstance(m, StreamLinear) for m in slower_alone.modules())
    assert use_stream_kernel(tiny_llama(0, layers=1, dtype=torch.float32), "target") is None  # too small to matter
    assert use_stream_kernel(tiny_llama(0, layers=1, dtype=torch.float64), "target", min_bytes=0) is None
    measured = tiny_llama(0, layers=1, dtype=torch.float32)
    note = use_stream_kernel(measured, "target", min_bytes=0, repeats=1)  # really timed: says both figures
    assert note.startswith("target float products") and note.count(" ms on the kernel vs ") == 2


def test_without_the_kernel_the_model_keeps_torchs_and_says_why(monkeypatch):
    monkeypatch.setattr(stream, "has_stream_kernel", lambda: False)
    monkeypatch.setattr(stream, "stream_unavailable", lambda: "the streaming kernel could not be built here (no g++)")
    model = tiny_llama(0, layers=1, dtype=torch.float32)
    note = use_stream_kernel(model, "target", min_bytes=0)
    assert "could not be built here (no g++)" in note and not any(isinstance(m, StreamLinear) for m in model.modules())
