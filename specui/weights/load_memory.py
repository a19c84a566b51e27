"""What a load holds in memory at its peak, told from the files before any weight is read, and a
clear refusal where it will not fit: a load past the machine's memory is not an exception the
app can catch, the kernel kills the process, the app and its conversations with it.

The peaks are measured (anonymous resident memory, sampled every 20 ms while loading; a 1.07B
Llama, 2-core AMD EPYC, torch 2.13, transformers 5, 2026-12-05), in bytes a parameter:

| source | none | int8 / int4 | w8a8 / w4a8 |
|---|---|---|---|
| a folder in the dtype loaded (mapped, not copied) | the dtype's bytes + 0.4 | 2.5 | 1.9 |
| a folder in another dtype (converted as read) | the dtype's bytes + 0.4 | 4.3 / 3.6 | 5.4 |
| a GGUF read directly (dequantized as read) | the dtype's bytes + 0.7 | 5.4 | 7.2 |
| ... its 4-bit decoder matrices packed from its blocks (gguf_packed) | - | int4: packed* | w4a8: packed* |

(*: PACKED_BYTES for those matrices, the dtype's bytes + 0.5 for the rest.)

(the last row measured 2026-12-05 on a Zen 5 with random-weight Q4_0 files: Llama-2-7B's shape on
w4a8, 7.3 GB anonymous at the peak for 6.88B parameters, 1.06 a parameter, where the row says 1.35;
SmolLM2-1.7B's, 2.9 GB for 1.71B.)

A folder mapped in the dtype loaded costs little anonymous memory, but every forward reads the
mapped files: they must fit in memory too, or each token reads the model from the disk.

(a float32 folder: none 0.06, bfloat16 2.3, int4 3.6, int8 4.3, w4a8 1.55, w8a8 1.9; a bfloat16
folder: bfloat16 0.4, float32 4.0, int4 2.5, int8 2.5, w4a8 5.4; a 656 MB Q4_0 GGUF: float32 4.45,
bfloat16 2.67, int4 5.3, w4a8 7.2.) int8 / int4 build the model in bfloat16 under `--dtype auto`,
w8a8 / w4a8 in float32; `--dtype auto` without quantization also holds a bfloat16 copy while it
times the two. Where the files cannot be read without loading them (a hub id, pickled .bin
weights), nothing is checked. bitsandbytes loads onto the GPU, whose own
out-of-memory error the loader already turns into a message.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from specui.engine.host_memory import LOAD_SHARE, free_memory
from specui.errors import SpecUIError
from specui.weights.gguf_blocks import gguf_weights
from specui.weights.gguf_packed import packed_params
from specui.weights.sources import CPU_KERNELS, ROUNDS_ACTIVATIONS

MAPPED = {"none": 0.4, "int8": 2.5, "int4": 2.5, "w8a8": 1.9, "w4a8": 1.9}  # none: besides the dtype's bytes
CONVERTED = {"none": 0.4, "int8": 4.3, "int4": 3.6, "w8a8": 5.4, "w4a8": 5.4}  # (and in GGUF)
GGUF = {"none": 0.7, "int8": 5.4, "int4": 5.4, "w8a8": 7.2, "w4a8": 7.2}
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# what a refusal suggests instead, where it fits: the quantizations that hold the least
OTHERS = (("w4a8", torch.float32, "auto"), ("int4", torch.bfloat16, "auto"), ("none", torch.bfloat16, "bfloat16"))
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
# a decoder matrix packed straight from a GGUF's 4-bit blocks (w4a8 / int4: specui.weights.gguf_packed, and
# a stand-in's padded groups), at the load's peak: 4 bits and a float16 scale a group of 32 kept, one
# matrix's int4 groups while it is packed and self-checked, the allocator's share (a 7b stand-in of the
# bundled GGUF peaked at 7.9 GiB resident, 2026-12-05: this estimates 7.6 beside the rest's 4.5 a weight)
PACKED_BYTES = 1.15


def weight_files(folder: Path) -> list[Path]:
    """The safetensors transformers reads as the model's weights: the shards an index names, else
    model.safetensors (not a converted GGUF's four_bit.safetensors, nor the consolidated copy some
    hub folders ship beside their shards)."""
    index = folder / "model.safetensors.index.json"
    try:
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / name for name in names]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def folder_weights(folder: Path) -> tuple[int, torch.dtype | None] | None:
    """(parameters, the dtype most of them are stored in) of a folder's weights, from the
    safetensors headers alone; None where there are none (pickled weights) or one is unreadable
    (loading it says what is wrong)."""
    files = weight_files(folder)
    if not files:
        return None
    by_dtype: dict[str, int] = {}
    try:
        for file in files:
            with open(file, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                if size > MAX_HEADER:
                    return None
                header = json.loads(f.read(size))
            if not isinstance(header, dict):
                return None
            for name, entry in header.items():
                if name != "__metadata__":
                    count = 1
                    for n in entry["shape"]:
                        count *= int(n)
                    by_dtype[entry["dtype"]] = by_dtype.get(entry["dtype"], 0) + count
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, struct.error):
        return None
    if not by_dtype:
        return None
    stored = max(by_dtype, key=by_dtype.__getitem__)
    return sum(by_dtype.values()), SAFETENSORS_DTYPES.get(stored)


def peak_bytes(quantization: str, built: torch.dtype, stored: torch.dtype | None, gguf: bool,
               measures_dtype: bool) -> float:
    """Bytes a parameter at the load's peak (the table above)."""
    table = GGUF if gguf else MAPPED if stored == built else CONVERTED
    own = torch.finfo(built).bits / 8
    per = table[quantization] + own if quantization == "none" else table[quantization]
    if quantization in ("int8", "int4") and stored != built:  # measured building bfloat16; float32 holds more
        per = max(per, own + CONVERTED["none"] + 1.0)
    return per + (2.0 if measures_dtype else 0.0)  # the bfloat16 copy --dtype auto times


def packed_peak(params: int, packed: int, built: torch.dtype) -> float:
    """Bytes a parameter at the peak of a GGUF load whose `packed` decoder parameters come straight from
    its 4-bit blocks and the rest are dequantized into `built` as read."""
    rest = torch.finfo(built).bits / 8 + 0.5
    return (rest * (params - packed) + PACKED_BYTES * packed) / params


def check_load(what: str, params: int, per_param: float, how: str, device: torch.device,
               others: dict[str, float] | None = None) -> None:
    """Refuse, before any weight is read, a load that will not fit in this machine's memory;
    `others`: bytes a parameter of other ways to load it (flags -> bytes), the cheapest that
    fits is suggested."""
    if device.type != "cpu" or params <= 0:
        return
    need, have = params * per_param, free_memory(device)
    if have is None or need <= LOAD_SHARE * have:
        return
    fits = sorted((per, flags) for flags, per in (others or {}).items() if params * per <= LOAD_SHARE * have)
    advice = (f"{fits[0][1]} would need about {params * fits[0][0] / 2**30:.1f} GiB" if fits
              else "choose a smaller model or close other programs")
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    raise SpecUIError(f"'{what}' ({count} parameters) needs about {need / 2**30:.1f} GiB of memory to "
                      f"load {how}, and this machine has {have / 2**30:.1f} GiB available (a load may plan on "
                      f"{LOAD_SHARE:.0%} of it; a pair already loaded counts until the new one replaces it); {advice}")


def describe(quantization: str, built: torch.dtype, stored: torch.dtype | None, gguf: bool,
             measures_dtype: bool = False, packed: bool = False) -> str:
    """How the load holds its weights, for the refusal."""
    dtype = str(built).removeprefix("torch.")
    if packed:
        wider = " (on w4a8 its Q6_K / Q8_0 ones too)" if quantization == "w4a8" else ""
        return (f"on the {quantization} kernel (its 4-bit decoder matrices{wider} packed one by one from the GGUF's "
                f"blocks, the rest dequantized into {dtype} as read)")
    if gguf:
        source = "(a GGUF is dequantized as it is read"
    elif stored == built:
        source = "(the files are mapped in the dtype they are stored in"
    else:
        source = f"(its {str(stored).removeprefix('torch.') if stored else 'stored'} weights converted as read"
    if quantization in ROUNDS_ACTIVATIONS:
        return f"in float32 and then on the {quantization} kernel {source}, then packed matrix by matrix)"
    if quantization in CPU_KERNELS:
        return f"in {dtype} and then on the {quantization} kernel {source}, then packed matrix by matrix)"
    timed = ", and a bfloat16 copy while --dtype auto times the two" if measures_dtype else ""
    return f"in {dtype} {source}{timed})"


def check_plain_load(what: str, where: str, gguf: str | None, local: bool, reader, quantization: str,
                     built: torch.dtype, device: torch.device, measures_dtype: bool, packed: int = 0) -> None:
    """The check for a load that is not a stand-in (a stand-in plans its own): a local folder of
    safetensors or a GGUF read directly (`reader`: its open reader; `packed`: the parameters of its
    4-bit decoder matrices, where w4a8 / int4 pack them straight from its blocks); anything else passes."""
    if device.type != "cpu" or quantization not in MAPPED:
        return
    if gguf:
        if reader is None:
            return
        params, stored = gguf_weights(reader), None
    elif local and Path(where).is_dir():
        found = folder_weights(Path(where))
        if found is None:
            return
        params, stored = found
    else:
        return

    def per(q: str, dtype: torch.dtype, measures: bool) -> float:
        if packed and q in ("w4a8", "int4"):  # w4a8 packs the file's 8-bit kinds too, int4 dequantizes them
            return packed_peak(params, packed_params(reader, q == "w4a8"), dtype)
        return peak_bytes(q, dtype, stored, bool(gguf), measures)

    others = {f"--quantization {q} --dtype {name}": per(q, dtype, False)
              for q, dtype, name in OTHERS if (q, dtype) != (quantization, built)}
    how = describe(quantization, built, stored, bool(gguf), measures_dtype, bool(packed and quantization in
                                                                                 ("w4a8", "int4")))
    check_load(what, params, per(quantization, built, measures_dtype), how, device, others)
