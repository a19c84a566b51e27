"""A GGUF of a published model's shape with random weights: for measuring what loading and decoding
a real 1.7B or 7B Q4_0 file costs here, where such files cannot be fetched.

It keeps the bundled GGUF's metadata and tokenizer (so the app and llama.cpp load it as they load
any llama GGUF), with the dimensions of the stand-in sizes' real models (specui.weights.stand_in.SIZES:
SmolLM2-1.7B, Llama-2-7B), every decoder matrix as random Q4_0 blocks (llama.cpp's Q4_0 files hold
exactly these), the embeddings and an untied head (the 7b) as random Q8_0 blocks, the norms ones.
Its replies are noise; its costs, bytes and shapes are the real model's. Written tensor by tensor
(never more than one in memory):

    python -m specui.bench.synthetic_gguf --size 7b --out /tmp/llama-7b-shape.Q4_0.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from specui.weights.stand_in import SIZES, RealModel

TIED = {"1.7b": True, "7b": False}  # SmolLM2-1.7B ties its head to the embeddings, Llama-2-7B does not
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 (a float16 scale, 16 bytes of nibbles) or Q8_0 (a float16 scale, 32 int8) blocks of a
    (rows, cols) matrix, as the raw bytes (rows, cols / 32 * block bytes); weights of about 1 / sqrt(cols)."""
    groups = rows * cols // 32
    spread = 1 / np.sqrt(cols)
    if kind == "Q4_0":  # w = d * (q - 8), q uniform in 0..15: std about 4.6 d
        scale, payload = spread / 4.6, rng.integers(0, 256, size=(groups, 16), dtype=np.uint8)
    else:  # Q8_0: w = d * q, q uniform in -127..127: std about 73 d
        scale, payload = spread / 73, rng.integers(0, 256, size=(groups, 32), dtype=np.uint8)
    d = (scale * rng.uniform(0.5, 1.5, size=groups)).astype(np.float16).view(np.uint8).reshape(groups, 2)
    return np.concatenate([d, payload], axis=1).reshape(rows, -1)


def _tensors(real: RealModel, tied: bool, vocab: int) -> list[tuple[str, tuple[int, int] | int, str]]:
    """(name, (rows, cols) or length, type) of every tensor, in file order."""
    head_dim = real.hidden // real.heads
    shapes = {"attn_q": (real.heads * head_dim, real.hidden), "attn_k": (real.kv_heads * head_dim, real.hidden),
              "attn_v": (real.kv_heads * head_dim, real.hidden), "attn_output": (real.hidden, real.heads * head_dim),
              "ffn_gate": (real.intermediate, real.hidden), "ffn_up": (real.intermediate, real.hidden),
              "ffn_down": (real.hidden, real.intermediate)}
    out: list[tuple[str, tuple[int, int] | int, str]] = [("token_embd.weight", (vocab, real.hidden), "Q8_0")]
    for layer in range(real.layers):
        out.append((f"blk.{layer}.attn_norm.weight", real.hidden, "F32"))
        out += [(f"blk.{layer}.{m}.weight", shapes[m], "Q4_0") for m in MATRICES]
        out.append((f"blk.{layer}.ffn_norm.weight", real.hidden, "F32"))
    out.append(("output_norm.weight", real.hidden, "F32"))
    if not tied:
        out.append(("output.weight", (vocab, real.hidden), "Q8_0"))
    return out


def write(real: RealModel, tied: bool, out: Path, template: Path, seed: int = 0) -> int:
    """Write a GGUF of `real`'s shape (`tied`: no output.weight, the head is the embeddings) to `out`
    with `template`'s metadata and tokenizer (the bundled GGUF); its parameters."""
    import gguf

    reader = gguf.GGUFReader(str(template))
    arch = str(reader.fields["general.architecture"].contents())
    dims = {f"{arch}.embedding_length": real.hidden, f"{arch}.feed_forward_length": real.intermediate,
            f"{arch}.block_count": real.layers, f"{arch}.attention.head_count": real.heads,
            f"{arch}.attention.head_count_kv": real.kv_heads, f"{arch}.rope.dimension_count": real.hidden // real.heads,
            "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_0)}
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.name"):
            continue
        if field.name in dims:
            writer.add_uint32(field.name, dims[field.name])
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_string("general.name", f"random weights in the shape of {real.name} (SpecUI synthetic_gguf)")
    vocab = int(reader.fields[f"{arch}.vocab_size"].contents())
    tensors = _tensors(real, tied, vocab)
    rng = np.random.default_rng(seed)
    for name, shape, kind in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, (shape,), np.dtype(np.float32), 4 * shape)
        else:
            rows, cols = shape
            nbytes = rows * cols // 32 * (18 if kind == "Q4_0" else 34)
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
    args = parser.parse_args(argv)
    params = write(SIZES[args.size], TIED[args.size], args.out, bundled_gguf_path(), args.seed)
    print(f"wrote {args.out}: {params / 1e9:.2f}B parameters, {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
