"""One parse of a GGUF's header per load, where transformers would make four.

transformers reads a GGUF through the `gguf` package's GGUFReader, and builds a new one for the
config, another for the tokenizer and another for the weights; SpecUI's own reader (its 4-bit
blocks, gguf_blocks.open_gguf) is a fourth. Each parses the whole header, the vocabulary and merge
table included, as hundreds of thousands of small numpy views: 3.1 s for the bundled file on a
2-core AMD EPYC Zen 3. Mapping the file's tensor names to the model's also builds gguf's name table
for the architecture once per module of the model (397 times for the bundled one, 17 ms each).

`shared_reads(reader, path)`: while it lasts, a GGUFReader asked for the file at `path` is
`reader`, that file's open reader (any other file gets a new one, as before), and the name table
is built once per architecture and depth. Both stand in where transformers looks them up when it runs (`from gguf
import GGUFReader` inside its functions), so nothing of transformers is copied or changed; where a
later transformers looks them up otherwise, its loads are as slow as before and the same. One such
load at a time in a process (the lookups are the `gguf` module's)."""

from __future__ import annotations

import contextlib
import functools
import os
import threading

# the `gguf` module's two names are swapped for a load's duration: one load at a time in the process
# (re-entrant: a load inside a load swaps again and puts back the outer load's names)
_SWAPPING = threading.RLock()


@contextlib.contextmanager
def shared_reads(reader, path):
    """Within: GGUFReader(`path`) is `reader` (the file's open reader), and gguf's tensor-name table
    is built once per (architecture, layers). `reader` None: nothing is shared."""
    if reader is None:
        yield
        return
    import gguf

    fresh_reader, fresh_names = gguf.GGUFReader, gguf.get_tensor_name_map
    path = os.path.realpath(str(path))

    def opened(file, *args, **kwargs):
        if args or kwargs or os.path.realpath(str(file)) != path:
            return fresh_reader(file, *args, **kwargs)
        return reader

    with _SWAPPING:
        gguf.GGUFReader, gguf.get_tensor_name_map = opened, functools.cache(fresh_names)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = fresh_reader, fresh_names
