"""Rows forwards (RowSession: DSBD's and beam search's beams) hand the matrix products only their
real tokens: the padding of rows with fewer pending nodes is never multiplied, and the real tokens
get the bits the padded forward gave them (row-exact kernels) or its values (float64 SDPA)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specui.engine import rows as rows_module
from specui.engine.rows import RowSession
from specui.engine.unpadded import real_tokens_only, token_modules
from specui.weights.attend import use_exact_attention
from specui.weights.w4a8 import quantize_w4a8, w4a8_unavailable

FORESTS = [[(7, -1), (8, 0), (9, 1), (10, 0)], [(11, -1)], [(7, -1), (12, 0), (13, 0), (14, 2), (15, 3)]]
PREFIX = [1, 5, 9, 13]


def leaf_products(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "in_features") and next(m.children(), None) is None]


def scored(model, unpadded: bool, monkeypatch) -> tuple[list[torch.Tensor], list[int]]:
    """Three beams' forests (rows of 4, 1 and 5 nodes) scored in one forward, then a second layer;
    the logits, and how many token rows the model's products multiplied."""
    counted: list[int] = []
    if not unpadded:
        monkeypatch.setattr(rows_module, "real_tokens_only", lambda *_a: torch.no_grad())

    def counting(forward):
        def run(x, *args, **kwargs):
            counted.append(x.numel() // x.shape[-1])  # what the product itself is handed
            return forward(x, *args, **kwargs)
        return run

    modules = leaf_products(model)
    for m in modules:
        m.forward = counting(m.forward)
    try:
        rows = RowSession(model)
        rows.prefill(PREFIX)
        rows.commit([(0, []), (0, []), (0, [])])
        logits = rows.forward(FORESTS)
        logits += rows.forward([[(16, 2)], [], [(17, 4)]])
    finally:
        for m in modules:
            del m.forward
        monkeypatch.undo()
    return logits, counted


def test_the_products_see_only_real_tokens_and_the_logits_are_the_padded_forwards(tiny_target, monkeypatch):
    want, padded = scored(tiny_target, False, monkeypatch)
    got, unpadded = scored(tiny_target, True, monkeypatch)
    products = len(leaf_products(tiny_target))
    assert len(token_modules(tiny_target)) == products - 2 * len(tiny_target.model.layers)  # MLPs whole
    assert padded[:products] == [4] * (products - 1) + [1]  # the prefill: 4 tokens, the last one's logits
    assert padded[products:2 * products] == [3 * 5] * products  # 10 real tokens padded to 3 x 5
    assert unpadded[products:2 * products] == [10] * products
    assert unpadded[2 * products:] == [2] * products  # the second layer: 2 real of 3 x 1
    for w, g in zip(want, got):
        assert w.shape == g.shape and torch.allclose(w, g, atol=1e-12, rtol=0)


@pytest.mark.skipif(bool(w4a8_unavailable()), reason=w4a8_unavailable() or "-")
def test_on_row_exact_kernels_the_real_tokens_get_the_same_bits(monkeypatch):
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    quantize_w4a8(model)
    use_exact_attention(model)
    want, _ = scored(model, False, monkeypatch)
    got, _ = scored(model, True, monkeypatch)
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_inputs_of_another_shape_pass_untouched():
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 5, 4)
    with real_tokens_only([linear], (2, 3), torch.tensor([0, 1, 3])):
        other = linear(x)
        packed = linear(x[:, :3])
    assert torch.equal(other, linear(x))
    full = linear(x[:, :3]).reshape(6, 3)
    assert torch.equal(packed.reshape(6, 3)[[0, 1, 3]], full[[0, 1, 3]])
    assert not packed.reshape(6, 3)[[2, 4, 5]].any()  # the padding: zeros, never computed
