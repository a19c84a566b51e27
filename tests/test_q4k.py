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
from specui.weights.quantize import dequantize_groups


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


def _gguf_of_q4_k(path, layers: int = 2, hidden: int = 256, inter: int = 512, heads: int = 4, kv: int = 2):
    """A small Llama GGUF: the bundled file's tokenizer and metadata, its own shape, every layer
    matrix random Q4_K blocks."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from specui.weights.sources import BUNDLED, locate

    where, name, _ = locate(BUNDLED)
    reader = GGUFReader(f"{where}/{name}")
    head_dim = hidden // heads
    shape = {"llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": inter,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv,
             "llama.rope.dimension_count": head_dim}
    writer = GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind, value = field.types[0], shape.get(key, field.contents())
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, value)
        else:
            writer.add_key_value(key, value, kind)
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
def test_a_q4_k_gguf_computes_with_its_own_blocks(tmp_path, quantization):
    from specui.weights.concrete import load_concrete
    from specui.weights.loading import ModelSpec
    from specui.weights.w4a8 import w4a8_vector

    if quantization == "w4a8" and not w4a8_vector():
        pytest.skip("no vector path for SpecUI's w4a8 kernel on this CPU")
    path = _gguf_of_q4_k(tmp_path / "q4k.gguf")
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


def test_quantization_auto_on_a_q4_k_file_says_what_an_explicit_one_would_do():
    from specui.weights.loading import ModelSpec, auto_candidates

    candidates, note = auto_candidates(ModelSpec("x", quantization="auto"), torch.device("cpu"),
                                       {"Q4_K": 150, "Q6_K": 20, "F32": 50}, "target")
    assert candidates == ("none",) and "(Q4_K, Q6_K) are not all Q4_0 / Q4_1" in note
    assert "--quantization w4a8 or int4 computes with its Q4_K blocks" in note
