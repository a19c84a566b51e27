"""Load a model with one concrete quantization: transformers' loader (hub id, local folder,
GGUF), then SpecUI's int8 / int4 CPU kernels or bitsandbytes 8-bit / 4-bit (nf4), the measured
dtype and attention. Every failure becomes a SpecUIError with a clear message."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specui.engine.attention import use_measured_attention, use_shared_kv_heads
from specui.errors import SpecUIError
from specui.settings import QUANTIZATIONS
from specui.weights import stand_in
from specui.weights.attend import exact_attention_ready, use_exact_attention
from specui.weights.bnb_logs import NOTE, quiet_int8_cast
from specui.weights.dtypes import auto_dtype_model
from specui.weights.gguf_blocks import DECODED_BYTES, four_bit_tensors
from specui.weights.gguf_cache import GGUFSource
from specui.weights.gguf_packed import load_packed, packed_params
from specui.weights.load_memory import PACKED_BYTES, check_plain_load
from specui.weights.native import has_native, native, native_unavailable
from specui.weights.quantize import int4_unavailable, quantize_model, use_long_path
from specui.weights.sources import (
    BUNDLED,
    BUNDLED_GGUF,
    CPU_KERNELS,
    ROUNDS_ACTIVATIONS,
    LoadedModel,
    ModelSpec,
    gguf_source,
    load_tokenizer,
    locate,
    measures_dtype,
    resolve_device,
    resolve_dtype,
    short_error,
)
from specui.weights.stream import use_stream_kernel
from specui.weights.w4a8 import quantize_w4a8, w4a8_path, w4a8_unavailable, w4a8_vector
from specui.weights.w8a8 import has_w8a8_kernel, quantize_w8a8


def _quantization_config(quantization: str, dtype: torch.dtype):
    if quantization not in QUANTIZATIONS:
        raise SpecUIError(f"unknown quantization '{quantization}'; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none" or quantization in CPU_KERNELS:
        return None  # int8 / int4 are applied after loading (specui.weights.quantize)
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise SpecUIError("quantization needs bitsandbytes: pip install bitsandbytes") from None
    if quantization == "8bit":
        quiet_int8_cast()  # said once, in the load note (bnb_logs.NOTE)
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)


Progress = Callable[[float, str], None]  # (fraction of this model's load done, what it is doing)


def rest_dtype() -> torch.dtype:
    """The dtype of the rest of a w8a8 / w4a8 model under `--dtype auto`. Rounding activations is
    discontinuous, so a token's input must have the same bits scored alone (decoding) and among
    others (verification): float32 with torch's SDPA does not (its sums run in other orders, ~1e-7
    apart, flipping a few roundings that grow: the bundled model's logits for one position 2.66
    apart). float32 with SpecUI's row-exact attention (specui.weights.attend) does, and is the
    cheaper (the 1.7b stand-in on w4a8, one process, ms for 1 / 5 / 9 tokens: 73.9 / 90.4 / 116.2
    against 74.5 / 104.3 / 139.4 in float64); without SpecUI's kernels, float64, whose differences
    stay below every rounding step."""
    return torch.float32 if exact_attention_ready() else torch.float64


def load_concrete(spec: ModelSpec, role: str, given: tuple[str, ...] = (),
                  source: GGUFSource | None = None, progress: Progress | None = None) -> LoadedModel:
    """Load with a concrete quantization. `given`: notes to put first (quantization auto's
    choice: then a quantization no kernel serves here loads dequantized, not refused);
    `source`: the GGUF as gguf_source gave it, if already opened; `progress` hears the slow
    parts (reading, building a stand-in, quantizing matrix by matrix)."""
    say = progress or (lambda _fraction, _what: None)
    where, gguf, local = locate(spec.source)
    if gguf and local:
        source = source or gguf_source(spec)
        where, gguf = source.location()
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    if device.type == "cpu":  # a greedy step reads the logits with the kernels' row_stats wherever they build:
        native()  # loaded with every CPU model, so the same pair gives the same figures in every process
    if spec.quantization in CPU_KERNELS:
        if device.type != "cpu":
            raise SpecUIError(f"--quantization {spec.quantization} is SpecUI's CPU kernel; "
                              "on a GPU use 8bit or 4bit (bitsandbytes)")
        if spec.dtype == "auto":  # int8 / int4 compute in bfloat16: the rest of the model follows them;
            rounds = spec.quantization in ROUNDS_ACTIVATIONS  # w8a8 / w4a8: see rest_dtype
            dtype = rest_dtype() if rounds else torch.bfloat16
    # w8a8 / w4a8 round float32 weights (or take a GGUF's blocks), then cast the rest
    built = torch.float32 if spec.quantization in ROUNDS_ACTIVATIONS else dtype
    quant = _quantization_config(spec.quantization, dtype)
    lazy = spec.quantization == "w4a8" and covers_matrices(source)  # matrices from the GGUF's blocks alone
    shape = plan_stand_in(spec, where, gguf, local, dtype, device, quant, lazy) if spec.stand_in else None
    direct = source.reader if source is not None and source.folder is None else None  # a GGUF read as it is
    wide = spec.quantization == "w4a8"  # a GGUF's matrices in more than 4 bits on 8-bit groups
    packed = packed_params(direct, wide) if direct is not None and device.type == "cpu" else 0
    if shape is None:  # refused here, with the figures, rather than killed by the kernel halfway through
        check_plain_load(spec.source, where, gguf, local, direct, spec.quantization, built, device,
                         measures_dtype(spec, device), packed)
    packs = packed and shape is None and spec.quantization in ("int4", "w4a8")  # its 4-bit matrices never in float
    tokenizer = load_tokenizer(spec, (where, gguf, local))
    kwargs = dict(gguf_file=gguf, dtype=torch.float32 if shape else built, trust_remote_code=spec.trust_remote_code,
                  local_files_only=local)
    if quant is not None and shape is None:  # a stand-in is padded first, then quantized (stand_in.bitsandbytes)
        kwargs.update(quantization_config=quant, device_map={"": device})
    say(0.0, f"{role}: reading {spec.source}")
    try:
        if packs:
            model, groups, eight_bit = load_packed(where, gguf, direct, built, spec.trust_remote_code, lambda d, n: say(
                0.4 * d / n, f"{role}: reading {spec.source} (tensor {d + 1} of {n})"), wide)
        else:
            model, groups, eight_bit = AutoModelForCausalLM.from_pretrained(where, **kwargs), None, None
    except SpecUIError:
        raise
    except torch.cuda.OutOfMemoryError:
        raise SpecUIError(
            f"out of GPU memory loading '{spec.source}'; try --quantization 4bit or a smaller model"
        ) from None
    except Exception as e:  # noqa: BLE001
        hint = " (no internet? use a local folder or the bundled model)" if not local else ""
        raise SpecUIError(f"could not load model '{spec.source}'{hint}: {short_error(e)}") from None
    notes: tuple[str, ...] = given
    if packs:
        why = f" ({source.problem})" if source.problem else ""
        said = [f"its {len(groups)} 4-bit matrices packed from the file's blocks one by one, never dequantized"
                ] if groups else []
        said += [f"its {len(eight_bit)} in more bits dequantized one at a time for 8-bit groups"] if eight_bit else []
        notes += (f"{role}: read from the GGUF directly{why}, " + "; ".join(said),)
    blocks = groups if packs else \
        source.four_bit(model) if source is not None and spec.quantization in ("int4", "w4a8") else None
    if shape is not None and lazy and not blocks:  # the header promised blocks the file did not give
        stand_in.check_memory(shape, 4.5, device, "(built in float32: this GGUF's 4-bit blocks could not be read)")
    if shape is not None:  # the source, exactly as loaded (float32), zero-padded to the stand-in's cost
        padded = stand_in.build(model, shape, built, lambda done, total: say(
            0.2 + 0.2 * done / total, f"{role}: building stand-in {shape.size} ({done} of {total} tensors)"),
            frozenset(blocks or {}) if lazy else frozenset())  # (no blocks: nothing left unbuilt)
        model, blocks = padded, stand_in.pad_groups(blocks or {}, padded, model.config)
        notes += (f"{role} {shape.label}",)
        if quant is not None:
            notes += (stand_in.bitsandbytes(model, spec.quantization, dtype),)
    elif spec.quantization == "8bit":
        notes += (f"{role} {NOTE}",)
    if wide and not packs and source is not None:  # a converted GGUF's (or its stand-in's) 8-bit-kind matrices
        eight_bit = source.eight_bit(model)
    if quant is None or shape is not None:  # bitsandbytes layers quantize as they move to the device
        model = model.to(device)
    model.eval()
    if measures_dtype(spec, device) and model.dtype == torch.float32:
        model, choice = auto_dtype_model(model)
        notes += (choice.note(role),)
    if spec.quantization == "w8a8":
        notes += (_quantize_w8a8(model, spec, role, progress=lambda done, total: say(
            0.4 + 0.6 * done / total, f"{role}: w8a8, matrix {done + 1} of {total}")),)
        model = model.to(dtype)  # the rest of the model (norms, attention, cache) in the dtype asked for
    elif spec.quantization == "w4a8":
        notes += (_quantize_w4a8(model, spec, role, source, blocks, eight_bit, progress=lambda done, total: say(
            0.4 + 0.6 * done / total, f"{role}: w4a8, matrix {done + 1} of {total}")),)
        model = model.to(dtype)
    elif spec.quantization in CPU_KERNELS:
        notes += (_quantize(model, spec, role, source, blocks, chosen=bool(given), progress=lambda done, total: say(
            0.4 + 0.6 * done / total, f"{role}: {spec.quantization}, matrix {done + 1} of {total}")),)
        long_inputs = use_long_path(model, role)
        notes += (long_inputs,) if long_inputs else ()
    elif spec.quantization == "none" and device.type == "cpu":
        streamed = use_stream_kernel(model, role)
        notes += (streamed,) if streamed else ()
    row_exact = spec.quantization in ROUNDS_ACTIVATIONS and model.dtype == torch.float32  # see rest_dtype
    exact = use_exact_attention(model) if row_exact else None
    for attention in (exact,) if exact else (use_measured_attention(model), use_shared_kv_heads(model)):
        notes += (f"{role} {attention}",) if attention else ()
    label = f"{BUNDLED_GGUF} (bundled)" if spec.source == BUNDLED else spec.source
    label = f"stand-in {shape.size} ({shape.params / 1e9:.2f}B) of {label}" if shape is not None else label
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer, device=device, label=label, notes=notes)


def covers_matrices(source: GGUFSource | None) -> bool:
    """Whether a GGUF holds its every decoder matrix as 4-bit blocks SpecUI reads (Q4_0 / Q4_1: the
    header's counts against 7 matrices a layer of its layer count), so w4a8 needs no float copy of them."""
    if source is None or not source.types:
        return False
    four_bit = four_bit_tensors(source.types)
    matrices = sum(source.types.values()) - four_bit  # the rest: embeddings, norms, head (at least 2 a layer)
    return four_bit > 0 and four_bit % 7 == 0 and matrices >= 2 * (four_bit // 7)


def plan_stand_in(spec: ModelSpec, where: str, gguf: str | None, local: bool, dtype: torch.dtype,
                  device: torch.device, quant, lazy: bool = False) -> stand_in.StandIn:
    """The stand-in's shape from the source's config alone, refused (with the figures) before any
    weight is loaded where it is unknown, not Llama-family, too small or would not fit (`lazy`: its
    decoder matrices come from a GGUF's blocks, never built in float32)."""
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=gguf, trust_remote_code=spec.trust_remote_code,
                                            local_files_only=local)
    except Exception as e:  # noqa: BLE001
        raise SpecUIError(f"could not read the config of '{spec.source}': {short_error(e)}") from None
    shape = stand_in.plan(config, spec.stand_in)
    per_param = torch.finfo(dtype).bits / 8
    if quant is not None:  # built in `dtype` on the CPU, then quantized as it moves to the device
        per_param, what = (0.5 if spec.quantization == "4bit" else 1.0), f"in bitsandbytes {spec.quantization}"
    elif lazy:  # float32 for the rest, the matrices packed from the GGUF's blocks one at a time
        matrices = stand_in.matrix_params(shape)
        per_param = (4.5 * (shape.params - matrices) + PACKED_BYTES * matrices) / shape.params
        what = ("(the rest in float32, the decoder matrices packed one by one from the GGUF's 4-bit blocks "
                "on the w4a8 kernel)")
    elif spec.quantization in ROUNDS_ACTIVATIONS:  # float32 matrices replaced one by one by int8 / int4 ones
        per_param, what = 4.5, f"(built in float32, then put on the {spec.quantization} kernel matrix by matrix)"
    elif spec.quantization in CPU_KERNELS:  # measured: a 6.74B stand-in in int4 peaked at 20.4 GB resident
        per_param, what = 3.0, (f"(built in {str(dtype).removeprefix('torch.')}, then put on the {spec.quantization} "
                                "kernel matrix by matrix: about 3 bytes a parameter at the peak)")
    elif measures_dtype(spec, device):  # --dtype auto times float32 against a bfloat16 copy
        per_param, what = 6, "(float32 and a bfloat16 copy, for --dtype auto; --dtype bfloat16 needs a third)"
    else:
        what = f"in {str(dtype).removeprefix('torch.')}"
    stand_in.check_memory(shape, per_param, device, what)
    return shape


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
