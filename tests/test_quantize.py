"""`--quantization int8`: every matrix of the target on the weight-only int8 kernel (CPU)."""

from __future__ import annotations

import torch
from conftest import save_tiny_model, tiny_llama

from specui.loading import ModelSpec, load_model
from specui.quantize import Int8Linear, quantize_int8, quantize_rows


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    rows, scale = quantize_rows(w)
    assert rows.dtype == torch.int8 and rows.abs().max() <= 127
    assert ((rows.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_every_linear_is_swapped_and_logits_stay_close():
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    reference = tiny_llama(0, layers=2, dtype=torch.float32)
    swapped, kept = quantize_int8(model)
    linears = [m for m in reference.modules() if isinstance(m, torch.nn.Linear)]
    assert (swapped, kept) == (len(linears), 0)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    ids = torch.tensor([[1, 5, 9, 13, 7, 21]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def test_load_model_int8_says_what_it_did(tmp_path):
    folder = save_tiny_model(tmp_path / "m", seed=0, layers=1, hidden=64)
    loaded = load_model(ModelSpec(str(folder), quantization="int8"), role="target")
    assert loaded.model.dtype == torch.bfloat16  # dtype auto follows the kernel's compute dtype
    assert any(n.startswith("target int8:") and "matrices" in n for n in loaded.notes)
    fp32 = load_model(ModelSpec(str(folder), dtype="float32"))
    assert loaded.memory_bytes < fp32.memory_bytes
