"""A GGUF of a published model's shape with random weights: for measuring what loading and decoding
a real 1.7B or 7B Q4_0 file costs here, where such files cannot be fetched.

It keeps the bundled GGUF's metadata and tokenizer (so the app and llama.cpp load it as they load
any llama GGUF), with the dimensions of the stand-in sizes' real models
(specui.weights.stand_in.SIZES: SmolLM2-1.7B, Llama-2-7B), every decoder matrix as random Q4_0
blocks (llama.cpp's Q4_0 files hold exactly these), the embeddings and an untied head (the 7b) as
random Q8_0 blocks, the norms ones; or, with `--layout q4_k_m`, as llama.cpp's Q4_K_M files hold
them (Q4_K, the value and down matrices of some layers Q6_K, the embeddings and head Q6_K), or with
`--layout q8_0` all Q8_0. Its replies are noise; its costs, bytes and shapes are the real model's.
Written tensor by tensor (never more than one in memory):

    python -m specui.bench.synthetic_gguf --size 7b --out /tmp/llama-7b-shape.Q4_0.gguf
    python -m specui.bench.synthetic_gguf --size 1.7b --layout q4_k_m --out /tmp/smollm2-1.7b-shape.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from specui.weights.stand_in import SIZES, RealModel

TIED = {"1.7b": True, "7b": False}  # SmolLM2-1.7B ties its head to the embeddings, Llama-2-7B does not
LAYOUTS = {"q4_0": 2, "q4_k_m": 15, "q8_0": 7}  # general.file_type: llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_0 / ...
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


# (inputs a block, bytes a block, offset of its float16 scale d, std of w / d for random payload bytes):
# Q4_0 w = d (q - 8), q uniform in 0..15; Q8_0 w = d q, q in -127..127; Q4_K w = d sc q - dmin m with 6-bit
# sc, m (its dmin set to 7.5 d: about zero mean); Q6_K w = d sc (q - 32), q in 0..63, sc int8
BLOCKS = {"Q4_0": (32, 18, 0, 4.6), "Q8_0": (32, 34, 0, 73.0), "Q4_K": (256, 144, 0, 270.0),
          "Q6_K": (256, 210, 208, 1350.0)}


def _blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `kind` (BLOCKS) for a (rows, cols) matrix, as the raw bytes (rows, cols / block
    inputs * block bytes): every payload byte drawn, the scales set for weights of about 1 / sqrt(cols)."""
    inputs, size, at, spread = BLOCKS[kind]
    blocks = rows * cols // inputs
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=blocks) / np.sqrt(cols) / spread).astype(np.float16)
    raw[:, at:at + 2] = d.view(np.uint8).reshape(blocks, 2)
    if kind == "Q8_0":  # q in -127..127 with one +-127 a block, as llama.cpp rounds (d = max |w| / 127)
        payload = raw[:, 2:]
        payload[payload == 128] = 129
        payload[:, 0] = rng.choice(np.array([127, 129], dtype=np.uint8), size=blocks)  # 129: -127
    if kind == "Q4_K":  # dmin
        raw[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, -1)


def _kinds(layout: str, layers: int, layer: int) -> dict[str, str]:
    """Each decoder matrix's block kind in one layer: all Q4_0 (or Q8_0), or llama.cpp's Q4_K_M mix (Q4_K, with the
    value and down matrices in Q6_K in its `use_more_bits` layers: the first and last eighth, every third
    between)."""
    if layout in ("q4_0", "q8_0"):
        return dict.fromkeys(MATRICES, layout.upper())
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    return {m: "Q6_K" if more and m in ("attn_v", "ffn_down") else "Q4_K" for m in MATRICES}


def _tensors(real: RealModel, tied: bool, vocab: int,
             layout: str = "q4_0") -> list[tuple[str, tuple[int, int] | int, str]]:
    """(name, (rows, cols) or length, type) of every tensor, in file order."""
    head_dim = real.hidden // real.heads
    shapes = {"attn_q": (real.heads * head_dim, real.hidden), "attn_k": (real.kv_heads * head_dim, real.hidden),
              "attn_v": (real.kv_heads * head_dim, real.hidden), "attn_output": (real.hidden, real.heads * head_dim),
              "ffn_gate": (real.intermediate, real.hidden), "ffn_up": (real.intermediate, real.hidden),
              "ffn_down": (real.hidden, real.intermediate)}
    wide = "Q6_K" if layout == "q4_k_m" else "Q8_0"  # embeddings and head
    out: list[tuple[str, tuple[int, int] | int, str]] = [("token_embd.weight", (vocab, real.hidden), wide)]
    for layer in range(real.layers):
        out.append((f"blk.{layer}.attn_norm.weight", real.hidden, "F32"))
        kinds = _kinds(layout, real.layers, layer)
        out += [(f"blk.{layer}.{m}.weight", shapes[m], kinds[m]) for m in MATRICES]
        out.append((f"blk.{layer}.ffn_norm.weight", real.hidden, "F32"))
    out.append(("output_norm.weight", real.hidden, "F32"))
    if not tied:
        out.append(("output.weight", (vocab, real.hidden), wide))
    return out


def copy_metadata(reader, writer, values: dict | None = None, skip: frozenset[str] = frozenset()) -> None:
    """Every metadata field of a GGUF `reader` into a GGUFWriter, each in its own type: not the reader's
    own header fields (GGUF.*), nor the architecture (the writer is made with it), nor `skip`;
    `values[name]` in place of a field's own contents where given."""
    import gguf

    values = values or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in skip:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, values.get(field.name, field.contents()), field.types[0], sub_type=sub)


def write(real: RealModel, tied: bool, out: Path, template: Path, seed: int = 0, layout: str = "q4_0") -> int:
    """Write a GGUF of `real`'s shape (`tied`: no output.weight, the head is the embeddings) to `out`
    with `template`'s metadata and tokenizer (the bundled GGUF), its matrices in `layout` (LAYOUTS); its
    parameters."""
    import gguf

    reader = gguf.GGUFReader(str(template))
    arch = str(reader.fields["general.architecture"].contents())
    dims = {f"{arch}.embedding_length": real.hidden, f"{arch}.feed_forward_length": real.intermediate,
            f"{arch}.block_count": real.layers, f"{arch}.attention.head_count": real.heads,
            f"{arch}.attention.head_count_kv": real.kv_heads, f"{arch}.rope.dimension_count": real.hidden // real.heads,
            "general.file_type": int(LAYOUTS[layout])}
    writer = gguf.GGUFWriter(str(out), arch)
    copy_metadata(reader, writer, dims, skip=frozenset({"general.name"}))
    writer.add_string("general.name", f"random weights in the shape of {real.name} (SpecUI synthetic_gguf)")
    vocab = int(reader.fields[f"{arch}.vocab_size"].contents())
    tensors = _tensors(real, tied, vocab, layout)
    rng = np.random.default_rng(seed)
    for name, shape, kind in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, (shape,), np.dtype(np.float32), 4 * shape)
        else:
            rows, cols = shape
            nbytes = rows * cols // BLOCKS[kind][0] * BLOCKS[kind][1]
            writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    params = 0
    for _name, shape, kind in tensors:
        if kind == "F32":
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            params += shape
        else:
            writer.write_tensor_data(_blocks(*shape, kind, rng))
            params += shape[0] * shape[1]
    writer.close()
    return params


def main(argv: list[str] | None = None) -> None:
    from specui.weights.sources import bundled_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(TIED), default="7b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="q4_0",
                        help="q4_0 / q8_0: every decoder matrix Q4_0 / Q8_0; q4_k_m: llama.cpp's Q4_K_M mix of Q4_K "
                        "and Q6_K")
    args = parser.parse_args(argv)
    params = write(SIZES[args.size], TIED[args.size], args.out, bundled_gguf_path(), args.seed, args.layout)
    print(f"wrote {args.out}: {params / 1e9:.2f}B parameters, {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
