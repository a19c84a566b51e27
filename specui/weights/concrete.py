"""Load a model with one concrete quantization: transformers' loader (hub id, local folder,
GGUF), then SpecUI's int8 / int4 CPU kernels or bitsandbytes 8-bit / 4-bit (nf4), the measured
dtype and attention. Every failure becomes a SpecUIError with a clear message."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specui.engine.attention import use_measured_attention, use_shared_kv_heads
from specui.errors import SpecUIError
from specui.settings import QUANTIZATIONS
from specui.weights import stand_in
from specui.weights.attend import exact_attention_ready, use_exact_attention
from specui.weights.bnb_logs import NOTE, quiet_int8_cast
from specui.weights.dtypes import auto_dtype_model
from specui.weights.gguf_blocks import four_bit_tensors
from specui.weights.gguf_cache import GGUFSource
from specui.weights.gguf_packed import load_packed, packed_params
from specui.weights.gguf_reads import shared_reads
from specui.weights.load_memory import PACKED_BYTES, check_plain_load
from specui.weights.native import native
from specui.weights.on_kernels import on_kernels
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


@dataclass(frozen=True)
class _Plan:
    """What a load decided before reading anything: where the weights are, the device and dtypes,
    the bitsandbytes config, the stand-in's shape, and whether the 4-bit matrices come packed
    straight from the GGUF's blocks (never in float)."""

    where: str
    gguf: str | None
    local: bool
    source: GGUFSource | None
    device: torch.device
    dtype: torch.dtype  # what the model computes in
    built: torch.dtype  # what it is read in (w8a8 / w4a8 round float32 weights, then cast the rest)
    quant: object  # bitsandbytes' config, or None
    lazy: bool  # w4a8 whose every matrix is in the GGUF's 4-bit blocks: no float copy of them
    shape: stand_in.StandIn | None
    direct: object  # the GGUF's reader where the file is read as it is
    packs: bool


def _plan(spec: ModelSpec, source: GGUFSource | None) -> _Plan:
    """Resolve the load's choices; refuse, with the figures, a load that will not fit."""
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
    built = torch.float32 if spec.quantization in ROUNDS_ACTIVATIONS else dtype
    quant = _quantization_config(spec.quantization, dtype)
    lazy = spec.quantization == "w4a8" and covers_matrices(source)  # matrices from the GGUF's blocks alone
    direct = source.reader if source is not None and source.folder is None else None  # a GGUF read as it is
    with shared_reads(direct, source.path if direct is not None else None):
        shape = plan_stand_in(spec, where, gguf, local, dtype, device, quant, lazy) if spec.stand_in else None
    wide = spec.quantization == "w4a8"  # a GGUF's matrices in more than 4 bits on 8-bit groups
    packed = packed_params(direct, wide) if direct is not None and device.type == "cpu" else 0
    if shape is None:  # refused here, with the figures, rather than killed by the kernel halfway through
        check_plain_load(spec.source, where, gguf, local, direct, spec.quantization, built, device,
                         measures_dtype(spec, device), packed)
    packs = bool(packed) and shape is None and spec.quantization in ("int4", "w4a8")
    return _Plan(where, gguf, local, source, device, dtype, built, quant, lazy, shape, direct, packs)


def _read(plan: _Plan, spec: ModelSpec, role: str, say: Progress) -> tuple[PreTrainedModel, dict | None, dict | None]:
    """The model as transformers (or, packed, SpecUI's GGUF reader) reads it: (model, its 4-bit
    groups, its matrices in more bits) where packed, else (model, None, None)."""
    kwargs = dict(gguf_file=plan.gguf, dtype=torch.float32 if plan.shape else plan.built,
                  trust_remote_code=spec.trust_remote_code, local_files_only=plan.local)
    if plan.quant is not None and plan.shape is None:  # a stand-in is padded first, then quantized
        kwargs.update(quantization_config=plan.quant, device_map={"": plan.device})  # (stand_in.bitsandbytes)
    say(0.0, f"{role}: reading {spec.source}")
    try:
        if plan.packs:
            return load_packed(plan.where, plan.gguf, plan.direct, plan.built, spec.trust_remote_code,
                               lambda d, n: say(0.4 * d / n, f"{role}: reading {spec.source} (tensor {d + 1} of {n})"),
                               spec.quantization == "w4a8")
        return AutoModelForCausalLM.from_pretrained(plan.where, **kwargs), None, None
    except SpecUIError:
        raise
    except torch.cuda.OutOfMemoryError:
        raise SpecUIError(
            f"out of GPU memory loading '{spec.source}'; try --quantization 4bit or a smaller model"
        ) from None
    except Exception as e:  # noqa: BLE001
        hint = " (no internet? use a local folder or the bundled model)" if not plan.local else ""
        raise SpecUIError(f"could not load model '{spec.source}'{hint}: {short_error(e)}") from None


def _packed_note(plan: _Plan, role: str, groups: dict | None, eight_bit: dict | None) -> str:
    why = f" ({plan.source.problem})" if plan.source.problem else ""
    said = [f"its {len(groups)} 4-bit matrices packed from the file's blocks one by one, never dequantized"
            ] if groups else []
    said += [f"its {len(eight_bit)} in more bits dequantized one at a time for 8-bit groups"] if eight_bit else []
    return f"{role}: read from the GGUF directly{why}, " + "; ".join(said)


def _build_stand_in(model: PreTrainedModel, plan: _Plan, spec: ModelSpec, role: str, blocks: dict | None,
                    say: Progress) -> tuple[PreTrainedModel, dict, tuple[str, ...]]:
    """The source, exactly as loaded (float32), zero-padded to the stand-in's cost; its 4-bit
    groups padded alike; bitsandbytes quantizes it after."""
    shape = plan.shape
    if plan.lazy and not blocks:  # the header promised blocks the file did not give
        stand_in.check_memory(shape, 4.5, plan.device, "(built in float32: this GGUF's 4-bit blocks could not be read)")
    padded = stand_in.build(model, shape, plan.built, lambda done, total: say(
        0.2 + 0.2 * done / total, f"{role}: building stand-in {shape.size} ({done} of {total} tensors)"),
        frozenset(blocks or {}) if plan.lazy else frozenset())  # (no blocks: nothing left unbuilt)
    notes = (f"{role} {shape.label}",)
    if plan.quant is not None:
        notes += (stand_in.bitsandbytes(padded, spec.quantization, plan.dtype),)
    return padded, stand_in.pad_groups(blocks or {}, padded, model.config), notes


def _attention(model: PreTrainedModel, spec: ModelSpec, role: str) -> tuple[str, ...]:
    """The attention a model runs: row-exact for w8a8 / w4a8 in float32 (see rest_dtype), else
    the measured one with the KV heads shared where that is faster."""
    row_exact = spec.quantization in ROUNDS_ACTIVATIONS and model.dtype == torch.float32
    exact = use_exact_attention(model) if row_exact else None
    chosen = (exact,) if exact else (use_measured_attention(model), use_shared_kv_heads(model))
    return tuple(f"{role} {attention}" for attention in chosen if attention)


def load_concrete(spec: ModelSpec, role: str, given: tuple[str, ...] = (),
                  source: GGUFSource | None = None, progress: Progress | None = None) -> LoadedModel:
    """Load with a concrete quantization. `given`: notes to put first (quantization auto's
    choice: then a quantization no kernel serves here loads dequantized, not refused);
    `source`: the GGUF as gguf_source gave it, if already opened; `progress` hears the slow
    parts (reading, building a stand-in, quantizing matrix by matrix)."""
    say = progress or (lambda _fraction, _what: None)
    plan = _plan(spec, source)
    with shared_reads(plan.direct, plan.source.path if plan.direct is not None else None):  # one parse of a GGUF
        tokenizer = load_tokenizer(spec, (plan.where, plan.gguf, plan.local))
        model, groups, eight_bit = _read(plan, spec, role, say)
    notes: tuple[str, ...] = given + ((_packed_note(plan, role, groups, eight_bit),) if plan.packs else ())
    four_bit = plan.source is not None and spec.quantization in ("int4", "w4a8")
    blocks = groups if plan.packs else plan.source.four_bit(model) if four_bit else None
    if plan.shape is not None:
        model, blocks, built = _build_stand_in(model, plan, spec, role, blocks, say)
        notes += built
    elif spec.quantization == "8bit":
        notes += (f"{role} {NOTE}",)
    if spec.quantization == "w4a8" and not plan.packs and plan.source is not None:
        eight_bit = plan.source.eight_bit(model)  # a converted GGUF's (or its stand-in's) 8-bit-kind matrices
    if plan.quant is None or plan.shape is not None:  # bitsandbytes layers quantize as they move to the device
        model = model.to(plan.device)
    model.eval()
    if measures_dtype(spec, plan.device) and model.dtype == torch.float32:
        model, choice = auto_dtype_model(model)
        notes += (choice.note(role),)
    model, kernel_notes = on_kernels(model, spec, role, plan.dtype, plan.source, blocks, eight_bit, bool(given), say)
    notes += kernel_notes + _attention(model, spec, role)
    label = f"{BUNDLED_GGUF} (bundled)" if spec.source == BUNDLED else spec.source
    if plan.shape is not None:
        label = f"stand-in {plan.shape.size} ({plan.shape.params / 1e9:.2f}B) of {label}"
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer, device=plan.device, label=label, notes=notes)


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
