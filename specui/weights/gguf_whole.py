"""Whether a GGUF file is whole: a download that stopped early leaves a file whose header or
tensors end past its last byte, and the loaders then fail somewhere inside (a tokenizer "cannot
reshape array of size 399424 into shape (576,960)"). The header is walked here without building
anything (the bundled file's in about 60 ms: lengths are read and skipped, the vocabulary is not
decoded) to say so plainly, before a load reads the file."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# a value's size by its GGUF type (uint8, int8, uint16, int16, uint32, int32, float32, bool; 10-12:
# uint64, int64, float64); 8 is a string, 9 an array
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
KEY_BYTES = 256  # of a key, what is compared (general.alignment); a corrupt length is never copied whole


class _Cut(Exception):
    """The header ends past the file's last byte."""


class _Walker:
    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise _Cut
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values[0] if len(values) == 1 else values

    def skip(self, size: int) -> None:
        if self.at + size > len(self.data):
            raise _Cut
        self.at += size

    def string(self, keep: bool = False) -> bytes:
        """A string skipped (its bytes kept only where asked: a key, which is short)."""
        size = self.take("<Q")
        start = self.at
        self.skip(size)
        return bytes(self.data[start:start + min(size, KEY_BYTES)]) if keep else b""

    def value(self, kind: int):
        if kind in FIXED:
            start = self.at
            self.skip(FIXED[kind])
            return bytes(self.data[start:self.at])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = self.take("<IQ")
        if item in FIXED:
            self.skip(FIXED[item] * count)
        else:
            if count * 8 > len(self.data) - self.at:  # each takes 8+ bytes: a corrupt count is never walked
                raise _Cut
            for _ in range(count):
                self.value(item)
        return None


def gguf_problem(path: str | Path) -> str | None:
    """Why `path` is not a whole GGUF file (not one at all, cut inside its header, or shorter than
    its tensors need), or None where it is whole (or of a version this walker does not know: the
    loaders then say what they find)."""
    try:
        return _walk(Path(path))
    except (OSError, ValueError):  # unreadable (permissions, a folder): the loaders say what they find
        return None


def _walk(path: Path) -> str | None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    if size < 24:
        return f"'{path}' is not a whole GGUF file: {size} bytes{_AGAIN}"
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != MAGIC:
            return f"'{path}' is not a GGUF file (it does not begin with 'GGUF')"
        walker = _Walker(data)
        walker.skip(4)
        try:
            version, tensors, fields = walker.take("<IQQ")
            if version not in (2, 3):
                return None
            alignment = DEFAULT_ALIGNMENT
            for _ in range(fields):
                key, kind = walker.string(keep=True), walker.take("<I")
                value = walker.value(kind)
                if key == b"general.alignment" and kind == UINT32:
                    alignment = struct.unpack("<I", value)[0] or DEFAULT_ALIGNMENT
            end = 0
            for _ in range(tensors):
                walker.string()
                dims = walker.take("<I")
                shape = walker.take(f"<{dims}Q") if dims else ()
                kind, offset = walker.take("<IQ")
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                elements = 1
                for d in (shape if isinstance(shape, tuple) else (shape,)):
                    elements *= d
                end = max(end, offset + elements * block_bytes // block)
        except _Cut:
            return f"'{path}' ends inside its header ({size:,} bytes): it was cut short{_AGAIN}"
        except (ValueError, KeyError, struct.error):  # a type this gguf package does not know: the loaders say so
            return None
        data_start = -(-walker.at // alignment) * alignment
    if tensors and data_start + end > size:  # (a file without tensors need not pad its header)
        return (f"'{path}' holds {size:,} bytes and its tensors need {data_start + end:,}: it was cut short"
                f"{_AGAIN}")
    return None


_AGAIN = " (a download that stopped early?); download it again"
