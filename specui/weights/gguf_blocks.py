"""A GGUF's own 4-bit weights, as the groups SpecUI's int4 kernel takes.

transformers loads a GGUF by dequantizing it (its packed path needs kernels from the hub).
A Q4_0 / Q4_1 block is 32 consecutive inputs of one output row with one scale (and, Q4_1, one
minimum) in float16: w = d * q + m (Q4_1) or d * (q - 8) (Q4_0), q in 0..15. That is exactly an
int4 group (specui/weights/quantize.py), so `--quantization int4` on a GGUF computes with the file's
own weights, not a second rounding of the dequantized ones. A Q4_K super-block (256 inputs) is
eight such groups whose scales and minimums are 6-bit integers times the block's float16 d and
dmin: exactly int4 groups too (`decode_q4_k`), for an explicit int4 / w4a8 on a Q4_K file (the
kernels then hold those products as they hold scales: float16 on w4a8, rounding d * sc by about
5e-4 relative, where a Q4_0 / Q4_1 scale is a float16 already).

Each block tensor is matched to the module whose dequantized weight it equals: as stored, or
with the rows of llama's query/key permutation undone (llama.cpp's converter permutes them for
its RoPE layout). A tensor that matches neither is left out, and that module is quantized
from its loaded weight instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specui.weights.quantize import GROUP, dequantize_groups

Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q (N, K) in 0..15, scale, low (N, K / GROUP)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # what quantization auto counts as a GGUF of 4-bit blocks
# what an explicit int4 / w4a8 takes from a file: also Q4_K (a super-block of 256 inputs, eight
# groups of 32, each with its own 6-bit scale and minimum times the block's float16 d and dmin)
DECODED_BYTES = {**BLOCK_BYTES, "Q4_K": 144}
# what w4a8 holds on 8-bit groups (specui.weights.q8a8) rather than re-rounding to 4 bits: a file's decoder
# matrices in more than 4 bits (a Q4_K_M file's Q6_K attention values and down matrices, its Q5_0 fallbacks
# where a width is not a multiple of 256). Q8_0 blocks go there exactly; Q6_K and Q5_0 within an eighth of
# their own rounding step (a Q6_K group of 32 spans at most 32 steps of its coarser 16: 32 / 127 of a step
# apart, half that in error; tests/test_q4k.py); Q5_1 / Q5_K, offset from zero, within a few of theirs
EIGHT_BIT = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1")
FLOATS = ("F32", "F16", "BF16")  # a GGUF's unquantized tensors (norms; embeddings in some files)
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def decode_blocks(raw: torch.Tensor, kind: str) -> Groups:
    """Q4_0 / Q4_1 blocks, raw bytes (N, K / 32 * block bytes), as int4 groups."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, BLOCK_BYTES[kind])
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().reshape(rows, -1)
    qs = blocks[:, -16:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).reshape(rows, -1)  # low nibbles are inputs 0-15
    low = (blocks[:, 2:4].contiguous().view(torch.float16).float().reshape(rows, -1) if kind == "Q4_1"
           else -8 * d)
    return q, d, low


def decode_q4_k(raw: torch.Tensor) -> Groups:
    """Q4_K super-blocks, raw bytes (N, K / 256 * 144), as int4 groups of 32, exactly: group j of a
    block is w = (d * sc_j) * q - dmin * m_j (llama.cpp's dequantize_row_q4_K): its 6-bit sc_j, m_j
    packed in 12 bytes (get_scale_min_k4), its 32 q the low (j even) or high (j odd) nibbles of the
    block's 32 bytes j // 2."""
    rows = raw.shape[0]
    stored = raw.reshape(-1, 144)
    d = stored[:, 0:2].contiguous().view(torch.float16).float()
    dmin = stored[:, 2:4].contiguous().view(torch.float16).float()
    packed = stored[:, 4:16].to(torch.int32)
    low, high = packed[:, 0:4], packed[:, 4:8]  # scales[j], j < 4; scales[j + 4]
    tail = packed[:, 8:12]  # scales[j + 4] for j >= 4
    sc = torch.cat([low & 63, (tail & 0xF) | ((low >> 6) << 4)], dim=1)  # (blocks, 8)
    mn = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=1)
    qs = stored[:, 16:].reshape(-1, 4, 32)  # bytes as they are: nibbles need no wider type
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(rows, -1)  # chunk c: groups 2c, 2c + 1
    scale = (d * sc).reshape(rows, -1)
    return q, scale, (-dmin * mn).reshape(rows, -1)


def dequantize_q6_k(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks, raw bytes (N, K / 256 * 210), as float32 (N, K), the same bits as gguf's
    `dequantize` (llama.cpp's dequantize_row_q6_K: w = (d * sc_j) * (q - 32), 16 inputs a scale),
    in torch's threaded ops rather than numpy a few rows at a time: a Q4_K_M file's Q6_K matrices
    are what w4a8 holds on 8-bit groups, dequantized at every load of a file read directly (gguf's
    took 9 of a 1.7B file's 35 s to load here)."""
    rows = raw.shape[0]
    stored = raw.reshape(-1, 210)  # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, float16 d
    n = stored.shape[0]
    d = stored[:, 208:210].contiguous().view(torch.float16).float()
    scale = (d * stored[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    low = ((stored[:, :128].reshape(n, 2, 1, 64) >> shifts) & 0x0F).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((stored[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    return (scale * q).reshape(rows, -1)


def dequantized(tensor) -> np.ndarray:
    """gguf's `dequantize` of a reader's tensor, a Q6_K matrix through dequantize_q6_k (the same bits)."""
    if tensor.tensor_type.name == "Q6_K" and tensor.data.ndim == 2:
        return dequantize_q6_k(torch.from_numpy(np.array(tensor.data, dtype=np.uint8))).numpy()
    from gguf.quants import dequantize

    return dequantize(tensor.data, tensor.tensor_type)


def open_gguf(path: str | Path):
    """The `gguf` package's reader over the file (header parsed, weights memory-mapped): one
    per load, shared by `block_types` and `read_four_bit`."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _layer_matrix(tensor, kinds) -> bool:
    """Whether a reader's tensor is a layer matrix (blk.N.<matrix>.weight) in one of `kinds`."""
    parts = tensor.name.split(".")
    return (tensor.tensor_type.name in kinds and len(parts) == 4 and parts[0] == "blk"
            and parts[2] in LAYER_NAMES and parts[3] == "weight")


def four_bit_matrix(tensor) -> bool:
    """Whether a reader's tensor is a layer matrix in 4-bit blocks SpecUI decodes."""
    return _layer_matrix(tensor, DECODED_BYTES)


def eight_bit_matrix(tensor) -> bool:
    """Whether a reader's tensor is a layer matrix in more than 4 bits that w4a8 holds on 8-bit groups."""
    return _layer_matrix(tensor, EIGHT_BIT)


def module_name(tensor) -> str:
    """A layer matrix's transformers module (llama's layout): blk.3.ffn_down.weight -> model.layers.3.mlp.down_proj."""
    _, layer, matrix, _ = tensor.name.split(".")
    return f"model.layers.{layer}.{LAYER_NAMES[matrix]}"


def eight_bit_names(reader) -> list[str]:
    """The transformers module names of the file's eight_bit_matrix tensors."""
    return [module_name(t) for t in filter(eight_bit_matrix, reader.tensors)]


def decode_tensor(tensor) -> Groups:
    """A four_bit_matrix's blocks, read from the (memory-mapped) file, as int4 groups, rows as stored."""
    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
    kind = tensor.tensor_type.name
    return decode_q4_k(raw) if kind == "Q4_K" else decode_blocks(raw, kind)


def read_four_bit(reader) -> dict[str, Groups]:
    """The file's Q4_0 / Q4_1 / Q4_K layer matrices by transformers module name, as int4 groups
    (not yet matched to the loaded weights: see `matched`)."""
    return {module_name(tensor): decode_tensor(tensor) for tensor in filter(four_bit_matrix, reader.tensors)}


def gguf_weights(reader) -> int:
    """Parameters of a GGUF, from its header (the reader's tensor table)."""
    return sum(int(t.n_elements) for t in reader.tensors)


def four_bit_tensors(types: dict[str, int]) -> int:
    """How many of a GGUF's tensors (`types`: its tensors per GGML type) are Q4_0 / Q4_1 blocks."""
    return sum(types.get(kind, 0) for kind in BLOCK_BYTES)


def block_types(reader) -> dict[str, int]:
    """How many tensors of each GGML type the file holds (from the header, not the weights)."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def _row_permutation(rows: int, heads: int) -> torch.Tensor:
    """Row i of transformers' weight is row perm[i] of the file's (llama's reverse permute)."""
    index = torch.arange(rows)
    return index.reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def matched(groups: dict[str, Groups], model: torch.nn.Module) -> dict[str, Groups]:
    """The groups whose dequantized weight equals the loaded module's, rows reordered where
    the file stores llama's permuted query/key rows; others left out."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    modules = dict(model.named_modules())
    out: dict[str, Groups] = {}
    for name, (q, scale, low) in groups.items():
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear) or tuple(module.weight.shape) != tuple(q.shape):
            continue
        weight = module.weight.detach().float()
        tolerance = 0.01 * float(weight.abs().max()) + 1e-6
        candidates = [None]
        if name.endswith(("q_proj", "k_proj")):
            count = heads if name.endswith("q_proj") else kv_heads
            if q.shape[0] % (2 * count) == 0 and q.shape[1] % GROUP == 0:
                candidates.append(_row_permutation(q.shape[0], count))
        for perm in candidates:
            picked = (q, scale, low) if perm is None else (q[perm], scale[perm], low[perm])
            if float((dequantize_groups(*picked) - weight).abs().max()) <= tolerance:
                out[name] = picked
                break
    return out
