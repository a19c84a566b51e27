"""A GGUF's Q4_K super-blocks (llama.cpp's Q4_K_S / Q4_K_M files) as SpecUI's int4 groups, exactly
(specui/weights/gguf_blocks.py): `--quantization int4` and `w4a8` compute with the file's own
4-bit weights for those matrices instead of a second rounding of their dequantized values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specui.weights.gguf_blocks import decode_q4_k
from specui.weights.quantize import GROUP, dequantize_groups


def q4_k_bytes(rows: int, inputs: int, seed: int, scale: float = 1e-3) -> np.ndarray:
    """Random Q4_K super-blocks (every scale, minimum and nibble drawn), with d and dmin of about
    `scale` so the weights stay small."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, inputs // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(-1, 144)
    for at in (0, 2):  # d, dmin as float16
        halves = rng.uniform(0.2 * scale, scale, blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q4_k_blocks_are_int4_groups_exactly(seed):
    raw = q4_k_bytes(5, 768, seed, scale=0.05)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K)).float()  # the gguf package's (llama.cpp's)
    q, scale, low = decode_q4_k(torch.from_numpy(raw))
    assert q.shape == (5, 768) and scale.shape == low.shape == (5, 24) and int(q.max()) <= 15
    assert torch.equal(dequantize_groups(q, scale, low), want)


def _gguf_of_q4_k(path, template, layers: int = 2, hidden: int = 256, inter: int = 512, heads: int = 4,
                  kv: int = 2):
    """A small Llama GGUF: `template`'s tokenizer and metadata (the bundled file's, its vocabulary
    cut), its own shape, every layer matrix random Q4_K blocks."""
    from gguf import GGUFReader, GGUFWriter

    from specui.bench.synthetic_gguf import copy_metadata

    reader = GGUFReader(str(template))
    head_dim = hidden // heads
    shape = {"llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": inter,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv,
             "llama.rope.dimension_count": head_dim}
    writer = GGUFWriter(str(path), "llama")
    copy_metadata(reader, writer, shape)
    rng = np.random.default_rng(0)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    writer.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    seed = 0
    matrices = (("attn_q", heads * head_dim, hidden), ("attn_k", kv * head_dim, hidden),
                ("attn_v", kv * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter))
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(hidden, np.float32))
        for tensor, rows, inputs in matrices:
            seed += 1
            writer.add_tensor(f"blk.{layer}.{tensor}.weight", q4_k_bytes(rows, inputs, seed),
                              raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.bundled
@pytest.mark.parametrize("quantization", ["int4", "w4a8"])
def test_a_q4_k_gguf_computes_with_its_own_blocks(tmp_path, quantization, small_vocab_template):
    from specui.weights.concrete import load_concrete
    from specui.weights.loading import ModelSpec
    from specui.weights.w4a8 import w4a8_vector

    if quantization == "w4a8" and not w4a8_vector():
        pytest.skip("no vector path for SpecUI's w4a8 kernel on this CPU")
    path = _gguf_of_q4_k(tmp_path / "q4k.gguf", small_vocab_template)
    dense = load_concrete(ModelSpec(str(path), "float32", "cpu", "none"), "target")
    packed = load_concrete(ModelSpec(str(path), "auto", "cpu", quantization), "target")
    assert any("14 of them from the GGUF's own 4-bit blocks" in note for note in packed.notes), packed.notes
    ids = torch.tensor([[1, 200, 3000, 45, 9, 17]])
    with torch.no_grad():
        a = dense.model(input_ids=ids).logits.float()
        b = packed.model(input_ids=ids).logits.float()
    assert torch.isfinite(b).all()
    # the same weights; activations rounded (w4a8) or in bfloat16 (int4): 0.8% apart here (argmax ties of random
    # weights are too close to compare on every CPU)
    assert float((a - b).norm() / a.norm()) < 0.05


def q6_k_bytes(rows: int, inputs: int, seed: int) -> np.ndarray:
    """Random Q6_K super-blocks (ql 128, qh 64, 16 int8 scales, float16 d at byte 208): every
    payload byte drawn, d of about 1e-3 / 64."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, inputs // 256 * 210), dtype=np.uint8)
    blocks = raw.reshape(-1, 210)
    blocks[:, 208:210] = rng.uniform(0.5e-5, 2e-5, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("seed", [0, 1])
def test_q6_k_dequantized_in_torch_has_ggufs_bits(seed):
    """dequantize_q6_k (torch's threaded ops; a directly read file's Q6_K matrices at every load)
    gives exactly gguf's `dequantize`, every payload byte drawn, signed scales included."""
    from specui.weights.gguf_blocks import dequantize_q6_k

    raw = q6_k_bytes(24, 768, seed)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K))
    assert torch.equal(dequantize_q6_k(torch.from_numpy(raw)), want) and want.shape == (24, 768)


@pytest.mark.parametrize("seed", [0, 1])
def test_q6_k_weights_on_8_bit_groups_stay_within_an_eighth_of_their_own_step(seed):
    """What w4a8 does with a Q4_K_M file's Q6_K matrices (gguf_blocks.EIGHT_BIT): each weight moves
    at most an eighth (and a little, for float16's d) of the coarser step of its two 16-input sub-blocks."""
    from specui.weights.native import native_unavailable
    from specui.weights.q8a8 import Q8A8Linear, quantize_q8

    raw = q6_k_bytes(16, 512, seed)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K)).float()
    blocks = torch.from_numpy(raw.reshape(-1, 210).copy())
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()  # (blocks, 1)
    step = (d * blocks[:, 192:208].contiguous().view(torch.int8).float().abs()).reshape(16, -1, 2)  # 16-input steps
    coarser = step.amax(-1).repeat_interleave(GROUP, dim=1)  # each input's group of 32
    if not native_unavailable():
        assert Q8A8Linear.from_weight(weight) is not None  # the kernel takes them (its self-check passes)
    q, groups = quantize_q8(weight)
    moved = ((q.float().reshape(16, -1, GROUP) * groups[..., None]).reshape(16, 512) - weight).abs()
    assert float((moved / coarser.clamp_min(1e-12)).max()) <= 0.127


def _synthetic_gguf(path, template, layout: str = "q4_k_m"):
    """A tiny Llama GGUF (specui.bench.synthetic_gguf) in llama.cpp's Q4_K_M mix (Q4_K matrices, the
    value and down matrices of its last layer Q6_K, embeddings and head Q6_K) or all Q8_0; `template`'s
    metadata and tokenizer."""
    from specui.bench.synthetic_gguf import write
    from specui.weights.stand_in import RealModel

    write(RealModel("tiny-k", 0, 256, 512, 2, 4, 2), False, path, template, 5, layout)
    return path


@pytest.mark.bundled
def test_a_q4_k_m_gguf_on_w4a8_keeps_its_q6_k_matrices_on_8_bit_groups(tmp_path, small_vocab_template):
    """Converted (small) and read directly (as a file too large to convert is): the same model, its
    Q4_K blocks as they are and its two Q6_K layer matrices on 8-bit groups, near the dequantized file."""
    from specui.weights.concrete import load_concrete
    from specui.weights.gguf_blocks import block_types, open_gguf
    from specui.weights.gguf_cache import GGUFSource
    from specui.weights.loading import ModelSpec
    from specui.weights.q8a8 import Q8A8Linear
    from specui.weights.w4a8 import w4a8_vector

    if not w4a8_vector():
        pytest.skip("no vector path for SpecUI's w4a8 kernel on this CPU")
    path = _synthetic_gguf(tmp_path / "tiny.Q4_K_M.gguf", small_vocab_template)
    reader = open_gguf(path)
    assert block_types(reader) == {"Q6_K": 4, "Q4_K": 12, "F32": 5}
    from specui.weights.gguf_packed import packed_params

    # the memory check counts w4a8's 8-bit matrices (its last layer's value and down) as packed too, not int4's
    assert packed_params(reader, wide=True) - packed_params(reader) == 128 * 256 + 256 * 512
    spec = ModelSpec(str(path), "auto", "cpu", "w4a8")
    converted = load_concrete(spec, "target")
    direct = load_concrete(spec, "target", source=GGUFSource(path, types=block_types(reader), reader=reader))
    dense = load_concrete(ModelSpec(str(path), "float32", "cpu", "none"), "target")
    for loaded in (converted, direct):
        said = " ".join(loaded.notes)
        assert "12 of them from the GGUF's own 4-bit blocks, 2 the GGUF holds in more than 4 bits" in said, said
        layer = loaded.model.model.layers[1]
        assert isinstance(layer.self_attn.v_proj, Q8A8Linear) and isinstance(layer.mlp.down_proj, Q8A8Linear)
    assert "its 2 in more bits dequantized one at a time for 8-bit groups" in " ".join(direct.notes)
    ids = torch.tensor([[1, 200, 3000, 45, 9, 17]])
    with torch.inference_mode():
        a, b, want = (m.model(input_ids=ids).logits.float() for m in (converted, direct, dense))
    assert torch.equal(a, b)
    assert float((a - want).norm() / want.norm()) < 0.05  # activations rounded to 8 bits, as for w4a8 anywhere


@pytest.mark.bundled
def test_a_q8_0_gguf_on_w4a8_computes_with_its_8_bit_blocks(tmp_path, small_vocab_template):
    """Every layer matrix of a Q8_0 file on 8-bit groups, its blocks exactly: nothing re-rounded, read
    directly or converted; not refused for having no 4-bit matrix."""
    from specui.weights.concrete import load_concrete
    from specui.weights.gguf_blocks import block_types, open_gguf
    from specui.weights.gguf_cache import GGUFSource
    from specui.weights.loading import ModelSpec
    from specui.weights.w4a8 import w4a8_vector

    if not w4a8_vector():
        pytest.skip("no vector path for SpecUI's w4a8 kernel on this CPU")
    from specui.weights.q8a8 import quantize_q8

    path = _synthetic_gguf(tmp_path / "tiny.Q8_0.gguf", small_vocab_template, "q8_0")
    reader = open_gguf(path)
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    raw = torch.from_numpy(np.array(down.data, dtype=np.uint8)).reshape(-1, 34)
    q, d = quantize_q8(torch.from_numpy(dequantize(down.data, GGMLQuantizationType.Q8_0)))  # what w4a8 packs
    assert torch.equal(q.reshape(-1, 32), raw[:, 2:].contiguous().view(torch.int8))  # the file's blocks, exactly
    assert torch.equal(d.reshape(-1), raw[:, :2].contiguous().view(torch.float16).float().reshape(-1))
    spec = ModelSpec(str(path), "auto", "cpu", "w4a8")
    converted = load_concrete(spec, "target")
    direct = load_concrete(spec, "target", source=GGUFSource(path, types=block_types(reader), reader=reader))
    for loaded in (converted, direct):
        said = " ".join(loaded.notes)
        assert "target w4a8: 14 the GGUF holds in more than 4 bits as 8-bit groups" in said, said
    ids = torch.tensor([[1, 200, 3000, 45, 9, 17]])
    with torch.inference_mode():
        assert torch.equal(converted.model(input_ids=ids).logits, direct.model(input_ids=ids).logits)


def test_quantization_auto_on_a_q4_k_file_weighs_w4a8_where_its_kernel_runs(monkeypatch):
    from specui.weights import sources
    from specui.weights.loading import ModelSpec, auto_candidates

    q4_k_m, cpu = {"Q4_K": 150, "Q6_K": 20, "F32": 50}, torch.device("cpu")
    monkeypatch.setattr(sources, "_w4a8_vector", lambda: True)
    candidates, note = auto_candidates(ModelSpec("x", quantization="auto"), cpu, q4_k_m, "target")
    assert candidates == ("none", "w4a8") and "Q4_K blocks as they are and its Q6_K matrices on 8-bit groups" in note
    candidates, note = auto_candidates(ModelSpec("x", quantization="auto"), cpu, {**q4_k_m, "Q3_K": 2}, "target")
    assert candidates == ("none",) and "(Q3_K, Q4_K, Q6_K) are not all Q4_0 / Q4_1" in note
    assert "--quantization w4a8 computes with its Q4_K blocks" in note
    assert "rounding its Q3_K matrices to 4 bits" in note
    candidates, note = auto_candidates(ModelSpec("x", quantization="auto"), cpu, {"Q8_0": 170, "F32": 50}, "target")
    assert candidates == ("none", "w4a8")
    assert note == "the GGUF's Q8_0 matrices on 8-bit groups, on SpecUI's w4a8 kernel"
    monkeypatch.setattr(sources, "_w4a8_vector", lambda: False)  # the portable loop: not weighed
    assert auto_candidates(ModelSpec("x", quantization="auto"), cpu, q4_k_m, "target")[0] == ("none",)


@pytest.mark.bundled
def test_a_stand_in_of_a_q4_k_m_gguf_keeps_its_8_bit_matrices_on_8_bit_groups(tmp_path, monkeypatch,
                                                                               small_vocab_template):
    """A stand-in costs what the file's layout costs at the larger size: its Q6_K matrices, zero-padded,
    on 8-bit groups as auto's note for such a file says, the Q4_K ones on 4-bit groups."""
    from specui.weights import stand_in
    from specui.weights.concrete import load_concrete
    from specui.weights.loading import ModelSpec
    from specui.weights.q8a8 import Q8A8Linear
    from specui.weights.stand_in import RealModel
    from specui.weights.w4a8 import W4A8Linear, w4a8_vector

    if not w4a8_vector():
        pytest.skip("no vector path for SpecUI's w4a8 kernel on this CPU")
    monkeypatch.setitem(stand_in.SIZES, "k", RealModel("k", 42_000_000, 384, 768, 2, 6, 3))
    path = _synthetic_gguf(tmp_path / "tiny.Q4_K_M.gguf", small_vocab_template)
    loaded = load_concrete(ModelSpec(str(path), "auto", "cpu", "w4a8", stand_in="k"), "target")
    said = " ".join(loaded.notes)
    assert "stand-in k" in said and "2 the GGUF holds in more than 4 bits as 8-bit groups" in said, said
    layer = loaded.model.model.layers[1]
    assert isinstance(layer.mlp.down_proj, Q8A8Linear) and layer.mlp.down_proj.in_features > 512  # padded
    assert isinstance(layer.self_attn.v_proj, Q8A8Linear) and isinstance(layer.mlp.up_proj, W4A8Linear)


@pytest.mark.bundled
def test_int4_keeps_a_q4_k_m_files_q6_k_matrices_on_int8_rows(tmp_path, small_vocab_template):
    """`--quantization int4` on a Q4_K_M file: its Q4_K matrices on the int4 kernel from their own
    blocks, its Q6_K ones (the last layer's value and down) on int8 rows, not rounded to 4 bits;
    converted or read directly."""
    from specui.weights.concrete import load_concrete
    from specui.weights.gguf_blocks import block_types, eight_bit_names, open_gguf
    from specui.weights.gguf_cache import GGUFSource
    from specui.weights.loading import ModelSpec
    from specui.weights.quantize import Int4Linear, Int8Linear, has_int4_kernel

    if not has_int4_kernel():
        pytest.skip("no int4 kernel in this torch build")
    path = _synthetic_gguf(tmp_path / "tiny.Q4_K_M.gguf", small_vocab_template)
    reader = open_gguf(path)
    spec = ModelSpec(str(path), "float32", "cpu", "int4")
    dense = load_concrete(ModelSpec(str(path), "float32", "cpu", "none"), "target")
    ids = torch.tensor([[1, 200, 3000, 45, 9, 17]])
    with torch.inference_mode():
        want = dense.model(input_ids=ids).logits.float()
    for source in (None, GGUFSource(path, types=block_types(reader), reader=reader,
                                    eight_bit_names=tuple(eight_bit_names(reader)))):
        loaded = load_concrete(spec, "target", source=source)
        said = " ".join(loaded.notes)
        assert "2 the GGUF holds in more than 4 bits on int8 rows" in said, said
        layer = loaded.model.model.layers[1]
        assert isinstance(layer.self_attn.v_proj, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
        if not isinstance(layer.self_attn.q_proj, Int4Linear):
            pytest.skip("torch's int4 kernel refused this matrix on this CPU")
        with torch.inference_mode():
            got = loaded.model(input_ids=ids).logits.float()
        assert float((got - want).norm() / want.norm()) < 0.05  # activations in bfloat16
    # a file with no 4-bit matrix (Q8_0): int4 was asked for, so every layer matrix is rounded to it
    q8_0 = _synthetic_gguf(tmp_path / "tiny.Q8_0.gguf", small_vocab_template, "q8_0")
    all_eight = load_concrete(ModelSpec(str(q8_0), "float32", "cpu", "int4"), "target")
    assert "more than 4 bits" not in " ".join(all_eight.notes)
    assert isinstance(all_eight.model.model.layers[0].mlp.up_proj, Int4Linear)
