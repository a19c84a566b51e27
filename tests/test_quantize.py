"""`--quantization int8 | int4`: the target's matrices on torch's weight-only CPU kernels, a
GGUF's own 4-bit blocks included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import save_tiny_model, tiny_llama

from specui.errors import SpecUIError
from specui.weights.gguf_blocks import _row_permutation, decode_blocks, matched
from specui.weights.loading import ModelSpec, load_model
from specui.weights.quantize import (
    GROUP,
    Int4Linear,
    Int8Linear,
    dequantize_groups,
    quantize_groups,
    quantize_model,
    quantize_rows,
)
from specui.weights.w4a8 import w4a8_vector


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    rows, scale = quantize_rows(w)
    assert rows.dtype == torch.int8 and rows.abs().max() <= 127
    assert ((rows.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_every_linear_is_swapped_and_logits_stay_close():
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    reference = tiny_llama(0, layers=2, dtype=torch.float32)
    counts = quantize_model(model)
    swapped, kept = counts["int8"], counts["kept"]
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


# -- int4: 4-bit groups of 32 on torch's int4 CPU kernel -------------------------------------

def test_groups_round_trip_within_half_a_step():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    q, scale, low = quantize_groups(w)
    assert q.shape == w.shape and int(q.max()) <= 15 and scale.shape == (48, 96 // GROUP)
    step = scale.repeat_interleave(GROUP, dim=1)
    assert ((dequantize_groups(q, scale, low) - w).abs() <= step / 2 + 1e-6).all()


def test_int4_linear_matches_its_dequantized_weight_and_refuses_odd_shapes():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(64)
    module = Int4Linear.from_groups(*quantize_groups(w), torch.device("cpu"), bias)
    assert module is not None
    x = torch.randn(3, 7, 96)
    want = x @ dequantize_groups(*quantize_groups(w)).T + bias
    got = module(x)
    assert got.shape == (3, 7, 64) and got.dtype == x.dtype
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    odd = torch.randn(64, 40)  # 40 inputs: not whole groups of 32
    q = torch.zeros(64, 40, dtype=torch.uint8)
    assert Int4Linear.from_groups(q, torch.ones(64, 1), torch.zeros(64, 1), torch.device("cpu")) is None
    assert Int4Linear.from_groups(*quantize_groups(w), torch.device("meta")) is None
    assert odd.shape[1] % GROUP



def test_the_bfloat16_fast_path_computes_exactly_what_the_general_path_does():
    """A bfloat16 input without bias skips the conversions (decoding's case); a float32 input
    takes the general path through the same kernel: the products must be identical."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 5, 96).bfloat16()
    modules = [Int4Linear.from_groups(*quantize_groups(w), torch.device("cpu")),
               Int8Linear.from_stored(*quantize_rows(w), torch.device("cpu"))]
    for module in modules:
        fast = module(x)
        assert fast.shape == (2, 5, 64) and fast.dtype == torch.bfloat16
        assert torch.equal(fast.float(), module(x.float()))

def test_int4_model_keeps_the_head_on_int8_rows_and_logits_stay_close():
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    reference = tiny_llama(0, layers=2, dtype=torch.float32)
    counts = quantize_model(model, "int4")
    layers = [m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert counts == {"int8": 1, "int4": len(layers), "from_file": 0, "eight_bit": 0, "kept": 0}
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)
    ids = torch.tensor([[1, 5, 9, 13, 7, 21]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert (a - b).abs().max() <= 0.1 * b.abs().max()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_decode_to_what_gguf_itself_dequantizes(kind):
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
    qtype = getattr(GGMLQuantizationType, kind)
    raw = quants.quantize(w, qtype)
    q, scale, low = decode_blocks(torch.from_numpy(raw), kind)
    assert q.shape == (16, 128) and int(q.max()) <= 15
    assert torch.equal(dequantize_groups(q, scale, low), torch.from_numpy(quants.dequantize(raw, qtype)))


def test_gguf_blocks_are_matched_to_modules_with_llamas_query_rows_unpermuted():
    model = tiny_llama(0, layers=1, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    heads = model.config.num_attention_heads
    q, scale, low = quantize_groups(attn.q_proj.weight)
    with torch.no_grad():
        attn.q_proj.weight.copy_(dequantize_groups(q, scale, low))
    perm = _row_permutation(q.shape[0], heads)
    inverse = torch.argsort(perm)  # a file in llama.cpp's layout: its row perm[i] is transformers' row i
    stored = (q[inverse], scale[inverse], low[inverse])
    assert not torch.equal(stored[0], q)
    v = quantize_groups(attn.v_proj.weight)  # not the loaded weight: left out
    found = matched({"model.layers.0.self_attn.q_proj": stored, "model.layers.0.self_attn.v_proj": v}, model)
    assert list(found) == ["model.layers.0.self_attn.q_proj"]
    assert torch.equal(dequantize_groups(*found["model.layers.0.self_attn.q_proj"]), attn.q_proj.weight)


def test_load_model_int4_says_what_it_did(tmp_path):
    folder = save_tiny_model(tmp_path / "m", seed=0, layers=1, hidden=64)
    loaded = load_model(ModelSpec(str(folder), quantization="int4"), role="target")
    assert loaded.model.dtype == torch.bfloat16
    note = next(n for n in loaded.notes if n.startswith("target int4:"))
    assert "on the weight-only int4 kernel" in note and "int8 kernel" in note  # layers int4, head int8
    with pytest.raises(SpecUIError, match="CPU kernel|no CUDA GPU"):  # refused before any weights load
        load_model(ModelSpec(str(folder), quantization="int4", device="cuda"), role="target")


def test_a_torch_without_the_int4_kernel_loads_int4_on_int8_rows_and_says_why(tmp_path, monkeypatch):
    """Bad input (issue 41): a build without the int4 op falls back to a path that works."""
    folder = save_tiny_model(tmp_path / "m", seed=0, layers=1, hidden=64)

    class NoInt4:
        def __getattr__(self, name):
            if "int4" in name:
                raise AttributeError(name)
            return getattr(torch.ops.aten, name)

    aten = torch.ops.aten
    monkeypatch.setattr(torch.ops, "aten", NoInt4())
    try:
        loaded = load_model(ModelSpec(str(folder), quantization="int4"), role="target")
    finally:
        monkeypatch.setattr(torch.ops, "aten", aten)
    note = next(n for n in loaded.notes if n.startswith("target int4:"))
    assert "int4 kernel" not in note.split(",")[0] and "matrices on the weight-only int8 kernel" in note
    assert f"none on int4: torch {torch.__version__} has no int4 CPU kernel" in note
    assert torch.isfinite(loaded.model(input_ids=torch.tensor([[3, 4, 5]])).logits).all()


@pytest.mark.bundled
def test_the_bundled_gguf_runs_on_its_own_4bit_blocks(bundled_pair):
    from specui.weights.loading import BUNDLED

    loaded = load_model(ModelSpec(BUNDLED, quantization="int4"), role="target")
    note = next(n for n in loaded.notes if n.startswith("target int4:"))
    assert "210 matrices on the weight-only int4 kernel" in note
    assert "210 of them from the GGUF's own 4-bit blocks" in note
    dense = bundled_pair.target  # float32, dequantized
    assert loaded.memory_bytes < 0.45 * dense.memory_bytes
    tok = loaded.tokenizer
    ids = tok("In 1905, Albert Einstein published four papers that changed physics", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = loaded.model(input_ids=ids).logits[0].float(), dense.model(input_ids=ids).logits[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85  # the same weights, computed in bfloat16


def _gguf_with(path, kinds: dict[str, str]):
    """A GGUF file holding one (16, 64) tensor per name, quantized as given (header test only)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    writer = GGUFWriter(str(path), "llama")
    for name, kind in kinds.items():
        w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
        qtype = getattr(GGMLQuantizationType, kind)
        data = w if kind == "F32" else quants.quantize(w, qtype)
        writer.add_tensor(name, data, raw_dtype=None if kind == "F32" else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_quantization_auto_weighs_int4_against_none_for_a_4bit_gguf_on_a_cpu_and_is_none_otherwise(tmp_path):
    from specui.weights.gguf_blocks import block_types, open_gguf
    from specui.weights.loading import auto_candidates

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kinds = {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_norm.weight": "F32"}
    four = block_types(open_gguf(_gguf_with(tmp_path / "four.gguf", kinds)))
    eight = block_types(open_gguf(_gguf_with(tmp_path / "eight.gguf", {"blk.0.attn_q.weight": "Q8_0"})))
    spec = ModelSpec("x", quantization="auto")
    candidates, note = auto_candidates(spec, cpu, four, "target")
    with_w4a8 = ("int4", "none") + (("w4a8",) if w4a8_vector() else ())  # w4a8: SpecUI's kernel, if fast here
    assert candidates == with_w4a8 and "own 4-bit blocks (1 matrices)" in note
    as_bfloat16 = ModelSpec("x", dtype="bfloat16", quantization="auto")  # w4a8's rest runs in float64: not then
    assert auto_candidates(as_bfloat16, cpu, four, "target")[0] == ("int4", "none")
    candidates, note = auto_candidates(spec, cpu, eight, "target")  # Q8_0 blocks: 8-bit groups on w4a8's kernels
    assert candidates == (("none", "w4a8") if w4a8_vector() else ("none",)) and "Q8_0 matrices on 8-bit groups" in note
    candidates, note = auto_candidates(spec, cpu, {"F16": 3, "F32": 2}, "target")  # unquantized
    assert candidates == ("none",) and "have no SpecUI kernel" in note
    as_float32 = ModelSpec("x", dtype="float32", quantization="auto")
    for args in ((spec, cpu, None), (spec, cuda, four), (as_float32, cpu, four)):
        assert auto_candidates(*args, "target") == (("none",), None)  # a folder, a GPU, float32 asked for
