"""A local GGUF converted once, then loaded as a folder.

transformers reads a GGUF by parsing its header (the whole vocabulary, as hundreds of
thousands of small numpy views) once for the config, once for the tokenizer and once for the
weights, then maps and dequantizes every tensor: about 19 s for the bundled 98 MB file on a
2-core CPU, each time the app starts. The first load of a GGUF writes what those parses yield
into a folder under ~/.cache/specui/gguf/: the config, the tokenizer, the weights in float32
(safetensors, exactly the dequantized values), the file's own 4-bit blocks already matched to
their modules (specui/weights/gguf_blocks.py), the file's tensor types and which of its matrices
are in more than 4 bits. Later loads read the
folder instead. The folder's name holds the file's path, size and mtime and the transformers
version; it is built under a temporary name and renamed when complete, so an interrupted or
concurrent build never leaves a half-written folder in use. Where it cannot be built (a full
disk, an unwritable cache) or would be large (float32 weights over MAX_CONVERTED), the GGUF
is loaded directly, as before."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from specui.engine.host_memory import LOAD_SHARE, free_memory
from specui.engine.measure import cache_root as specui_cache_root
from specui.weights.gguf_blocks import (
    Groups,
    block_types,
    eight_bit_names,
    gguf_weights,
    matched,
    open_gguf,
    read_four_bit,
)
from specui.weights.gguf_reads import shared_reads

FORMAT = 3  # bump when what the folder holds changes (2: Q4_K blocks kept too; 3: its 8-bit matrices named)
MANIFEST = "specui_gguf.json"
FOUR_BIT = "four_bit.safetensors"
# larger GGUFs load directly: a float32 copy would cost that much disk, and that much memory
# while it is written (the direct load of a 4-bit target holds it in bfloat16)
MAX_CONVERTED = 4 << 30
# converting holds the float32 model transformers dequantizes (4.45 bytes a parameter at the peak, measured
# for a direct load, specui/weights/load_memory.py) and writes it: about 1.2x its float32 size
CONVERT_PEAK = 1.2


def cache_root() -> Path:
    return specui_cache_root() / "gguf"


def folder_for(path: Path) -> Path:
    """Where the converted copy of `path` lives (whether or not it exists yet)."""
    st = path.stat()
    raw = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, transformers.__version__, FORMAT])
    return cache_root() / f"{path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


@dataclass
class GGUFSource:
    """A local GGUF as SpecUI loads it: from its converted folder where there is one, else
    the file itself (with its open reader, or the reason it could not be read)."""

    path: Path
    folder: Path | None = None
    types: dict[str, int] = field(default_factory=dict)  # tensors per GGML type, from the header
    reader: object | None = None
    problem: str = ""  # why the file could not be read or converted
    # its decoder matrices in more than 4 bits, by module name (gguf_blocks.EIGHT_BIT), from the header
    eight_bit_names: tuple[str, ...] = ()

    def location(self) -> tuple[str, str | None]:
        """(where, gguf file name or None) for transformers' from_pretrained."""
        return (str(self.folder), None) if self.folder else (str(self.path.parent), self.path.name)

    def four_bit(self, model: torch.nn.Module) -> dict[str, Groups]:
        """The file's own 4-bit blocks by module name, matched to `model`'s weights."""
        if self.folder is not None:
            return load_four_bit(self.folder / FOUR_BIT) if (self.folder / FOUR_BIT).is_file() else {}
        return matched(read_four_bit(self.reader), model) if self.reader is not None else {}

    def eight_bit(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`model`'s weights of the matrices the file holds in more than 4 bits, by module name (for w4a8)."""
        modules = dict(model.named_modules())
        return {name: modules[name].weight for name in self.eight_bit_names
                if isinstance(modules.get(name), torch.nn.Linear)}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) bytes, even columns in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def save_four_bit(groups: dict[str, Groups], file: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, (q, scale, low) in groups.items():
        tensors |= {f"{name}.q": pack_nibbles(q), f"{name}.scale": scale.float().contiguous(),
                    f"{name}.low": low.float().contiguous()}
    save_file(tensors, str(file))


def load_four_bit(file: Path) -> dict[str, Groups]:
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    return {n: (unpack_nibbles(tensors[f"{n}.q"]), tensors[f"{n}.scale"], tensors[f"{n}.low"]) for n in names}


def _save_weights(model: torch.nn.Module, folder: Path) -> None:
    """Config and float32 weights as a plain transformers folder (save_pretrained refuses a
    model loaded from a GGUF: it counts as quantized)."""
    from safetensors.torch import save_model

    config = model.config
    quantization = config.__dict__.pop("quantization_config", None)
    try:
        config.save_pretrained(folder)
    finally:
        if quantization is not None:
            config.quantization_config = quantization
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _convert(path: Path, reader, folder: Path, trust_remote_code: bool) -> None:
    """Build the converted folder of `path` (`reader`: its open reader) under a temporary
    name, renamed when complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)  # an unwritable cache fails here, before the slow part
        types = block_types(reader)
        where, name = str(path.parent), path.name
        with shared_reads(reader, path):  # transformers' three parses of the header are this one
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, trust_remote_code=trust_remote_code,
                                                      local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32,
                                                         trust_remote_code=trust_remote_code, local_files_only=True)
        _save_weights(model, tmp)
        tokenizer.save_pretrained(tmp)
        groups = matched(read_four_bit(reader), model)
        if groups:
            save_four_bit(groups, tmp / FOUR_BIT)
        (tmp / MANIFEST).write_text(json.dumps({"source": str(path), "types": types, "format": FORMAT,
                                                "eight_bit": eight_bit_names(reader)}), encoding="utf-8")
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first: use its folder
            if not (folder / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_source(path: Path, trust_remote_code: bool = False) -> GGUFSource:
    """The GGUF at `path` as SpecUI loads it: its converted folder (built now on first use),
    or, where that cannot be built, the file with its open reader."""
    try:
        folder = folder_for(path)
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        return GGUFSource(path, folder, {str(k): int(v) for k, v in manifest["types"].items()},
                          eight_bit_names=tuple(str(name) for name in manifest.get("eight_bit", ())))
    except FileNotFoundError:
        pass  # not converted yet
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        shutil.rmtree(folder_for(path), ignore_errors=True)  # damaged: built again
    try:
        reader = open_gguf(path)
    except Exception as e:  # noqa: BLE001 - loading the file directly says what is wrong with it
        return GGUFSource(path, problem=_first_line(e))
    source = GGUFSource(path, types=block_types(reader), reader=reader, eight_bit_names=tuple(eight_bit_names(reader)))
    size = 4 * gguf_weights(reader)
    if size > MAX_CONVERTED:
        source.problem = (f"not converted: its weights are {size / 2**30:.1f} GiB in float32 "
                          f"(converted up to {MAX_CONVERTED / 2**30:.0f} GiB)")
        return source
    room = free_memory(torch.device("cpu"))
    if room is not None and size * CONVERT_PEAK > LOAD_SHARE * room:  # loaded directly, where its own check applies
        source.problem = (f"not converted: converting holds its weights in float32 ({size / 2**30:.1f} GiB), more "
                          f"than the {room / 2**30:.1f} GiB of memory available allow")
        return source
    try:
        _convert(path, reader, folder_for(path), trust_remote_code)
    except Exception as e:  # noqa: BLE001 - then the file is loaded directly, as before
        source.problem = _first_line(e)
        return source
    _drop_stale(path, folder_for(path))
    return GGUFSource(path, folder_for(path), source.types, eight_bit_names=source.eight_bit_names)


def _drop_stale(path: Path, keep: Path) -> None:
    """Remove the folders earlier conversions of the same file left (another format, an older
    transformers, the file since changed): each is up to MAX_CONVERTED of disk."""
    for folder in cache_root().glob(f"{path.stem}-*"):
        if folder == keep or not folder.is_dir():
            continue
        try:
            source = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("source")
        except (OSError, ValueError, AttributeError):
            continue  # not one of ours, or being written
        if source == str(path):
            shutil.rmtree(folder, ignore_errors=True)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
