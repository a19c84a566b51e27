"""A loaded model's matrices put on SpecUI's CPU kernels (w8a8, w4a8, torch's int8 / int4), or the
streamed float kernel, each with the note of what went where (concrete.py loads, then calls
`on_kernels`). Where a kernel the user asked for serves no matrix, a clear refusal."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from transformers import PreTrainedModel

from specui.errors import SpecUIError
from specui.weights.gguf_blocks import DECODED_BYTES
from specui.weights.gguf_cache import GGUFSource
from specui.weights.native import has_native, native_unavailable
from specui.weights.quantize import int4_unavailable, quantize_model, use_long_path
from specui.weights.sources import CPU_KERNELS, ModelSpec
from specui.weights.stream import use_stream_kernel
from specui.weights.w4a8 import quantize_w4a8, w4a8_path, w4a8_unavailable, w4a8_vector
from specui.weights.w8a8 import has_w8a8_kernel, quantize_w8a8


def on_kernels(model: PreTrainedModel, spec: ModelSpec, role: str, dtype: torch.dtype, source: GGUFSource | None,
               blocks: Mapping | None, eight_bit: Mapping | None, chosen: bool,
               say: Callable[[float, str], None]) -> tuple[PreTrainedModel, tuple[str, ...]]:
    """SpecUI's CPU kernels for the matrices (w8a8, w4a8, int8 / int4), or the streamed float
    kernel for an unquantized CPU model; the rest of the model in the dtype asked for."""
    def progress(done: int, total: int) -> None:
        say(0.4 + 0.6 * done / total, f"{role}: {spec.quantization}, matrix {done + 1} of {total}")

    if spec.quantization == "w8a8":
        note = _quantize_w8a8(model, spec, role, progress=progress)
        return model.to(dtype), (note,)
    if spec.quantization == "w4a8":
        note = _quantize_w4a8(model, spec, role, source, blocks, eight_bit, progress=progress)
        return model.to(dtype), (note,)
    if spec.quantization in CPU_KERNELS:
        notes = (_quantize(model, spec, role, source, blocks, chosen=chosen, progress=progress),)
        long_inputs = use_long_path(model, role)
        return model, notes + ((long_inputs,) if long_inputs else ())
    streamed = use_stream_kernel(model, role) if spec.quantization == "none" and model.device.type == "cpu" else None
    return model, (streamed,) if streamed else ()


def _quantize(model: PreTrainedModel, spec: ModelSpec, role: str, source: GGUFSource | None,
              blocks: dict | None = None, chosen: bool = False,
              progress: Callable[[int, int], None] | None = None) -> str:
    """Put `model`'s matrices on SpecUI's int8 / int4 kernels (a GGUF `source`'s own 4-bit
    blocks where it has them); the note of what went where. Where the kernels serve no
    matrix, an explicit request is refused; a `chosen` one (quantization auto) keeps the
    model as loaded."""
    blocks = blocks if blocks is not None else {}
    unread = ""
    if source is not None and spec.quantization == "int4" and source.folder is None and source.reader is None:
        unread = f"; the GGUF's 4-bit blocks could not be read ({source.problem}), so its weights were re-quantized"
    # a GGUF's matrices in more than 4 bits on int8 rows where it has 4-bit ones too (none: int4 rounds all, as asked)
    mixed = spec.quantization == "int4" and source is not None and any(source.types.get(k) for k in DECODED_BYTES)
    wide = frozenset(source.eight_bit_names) if mixed else frozenset()
    counts = quantize_model(model, spec.quantization, blocks, progress, wide)
    if not counts["int8"] + counts["int4"] and chosen:
        return f"{role} {spec.quantization}: torch's kernels serve none of its matrices here, so it runs dequantized"
    if not counts["int8"] + counts["int4"]:
        raise SpecUIError(f"--quantization {spec.quantization}: torch's kernels serve none of the matrices of "
                          f"'{spec.source}' on this machine; use none, 8bit or 4bit")
    said = [f"{counts[k]} matrices on the weight-only {k} kernel" for k in ("int4", "int8") if counts[k]]
    if counts["from_file"]:
        said.append(f"{counts['from_file']} of them from the GGUF's own 4-bit blocks")
    if counts["eight_bit"]:
        said.append(f"{counts['eight_bit']} the GGUF holds in more than 4 bits on int8 rows (not rounded to 4 bits)")
    if counts["kept"]:
        said.append(f"{counts['kept']} left in {str(model.dtype).removeprefix('torch.')}")
    if spec.quantization == "int4" and not counts["int4"]:
        said.append(f"none on int4: {int4_unavailable()}, so every matrix went to int8 rows")
    return f"{role} {spec.quantization}: " + ", ".join(said) + unread


def _quantize_w8a8(model: PreTrainedModel, spec: ModelSpec, role: str,
                   progress: Callable[[int, int], None] | None = None) -> str:
    """Put `model`'s matrices on the int8 x int8 kernel (specui.weights.w8a8); the note of
    what went where. Where it serves none, refused: the user asked for this rounding.
    `--dtype auto` then runs the rest of the model as rest_dtype says."""
    counts = quantize_w8a8(model, progress)
    if not counts["w8a8"]:
        why = "this torch build has no oneDNN int8 linear" if not has_w8a8_kernel() else \
            "every matrix failed its self-check (product or row independence) on this CPU"
        raise SpecUIError(f"--quantization w8a8: {why}; use int8, int4 or none")
    bits = "8-bit" if counts["levels"] == 127 else "7-bit (this CPU's int8 dot product saturates at 8)"
    kept = f", {counts['kept']} left in {str(model.dtype).removeprefix('torch.')}" if counts["kept"] else ""
    rounding = ("rounded and scaled on SpecUI's kernel" if has_native() else
                f"torch ops around it, {native_unavailable()}")
    return (f"{role} w8a8: {counts['w8a8']} matrices as int8 rows times {bits} activations rounded row by row "
            f"(oneDNN; {rounding}){kept}")


def _quantize_w4a8(model: PreTrainedModel, spec: ModelSpec, role: str, source: GGUFSource | None,
                   blocks: Mapping | None, eight_bit: Mapping | None,
                   progress: Callable[[int, int], None] | None = None) -> str:
    """Put `model`'s matrices on the 4-bit x 8-bit kernel (specui.weights.w4a8; a GGUF's own
    4-bit blocks where it has them, its matrices in more bits on 8-bit groups) and its output head
    on w8a8's or 8-bit groups; the note of what went where. Where the kernel serves none, refused:
    the user asked for it. The rest of the model: rest_dtype."""
    counts = quantize_w4a8(model, blocks, progress, eight_bit)
    if not counts["w4a8"] and not counts["eight_bit"]:
        why = w4a8_unavailable() or "every matrix failed its self-check (product or row independence) on this CPU"
        raise SpecUIError(f"--quantization w4a8: {why}; use int4, w8a8 or none")
    path = w4a8_path() if w4a8_vector() else "portable loop: no AVX512-VNNI or AVX2 here"
    said = [f"{counts['w4a8']} matrices as 4-bit groups times 8-bit activation groups (SpecUI's kernel, {path})"
            ] if counts["w4a8"] else []
    if counts["from_file"]:
        said.append(f"{counts['from_file']} of them from the GGUF's own 4-bit blocks")
    elif source is not None and source.folder is None and source.reader is None:
        said.append(f"the GGUF's 4-bit blocks could not be read ({source.problem}), so its weights were re-quantized")
    if counts["eight_bit"]:
        said.append(f"{counts['eight_bit']} the GGUF holds in more than 4 bits as 8-bit groups times 8-bit "
                    "activation groups (Q8_0 blocks exactly, Q6_K / Q5_0 within an eighth of their step)")
    if counts["w8a8"]:
        said.append("the output head on w8a8's int8 rows")
    if counts["q8a8"]:
        said.append("the output head as 8-bit groups times 8-bit activation groups (llama.cpp's Q8_0 arithmetic)")
    if counts["kept"]:
        said.append(f"{counts['kept']} left in {str(model.dtype).removeprefix('torch.')}")
    return f"{role} w4a8: " + ", ".join(said)
