"""The KV cache of a RaggedSession (engine/ragged.py): a transformers DynamicCache whose
full-attention layers are row buffers (RaggedLayer) that write each token of a forward at the
(row, slot) the session's Layout gives, and that let rows leave and join between forwards
without copying the cache."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specui.engine.attention import cache_dtype
from specui.engine.kvcache import MIN_CAPACITY, doubled
from specui.errors import SpecUIError


class RowsInLayout(Protocol):
    """What the cache reads of its session (engine/ragged.py's RaggedSession, which owns the
    cache): the model (for its config), the rows in order, and the layout of the forward
    being run (None between forwards)."""

    model: torch.nn.Module
    rows: list
    layout: Any


class RaggedLayer(DynamicLayer):
    """A full-attention layer of buffers (row capacity, heads, capacity, D); buffer rows
    [0, live) are the session's rows, in order; `update` writes each token where the layout
    says. Masked slots must hold finite numbers: zeros where never written, else a departed
    row's entries (a row never attends to a slot it did not write).

    Rows leave and join without copying the whole cache: a leaving row's buffer row takes
    one of the rows above the new count (`move_rows`), and a joining row reuses a free buffer
    row (the row capacity doubles only when every one is in use). Copying every row on each
    change cost more than a decode step in a 64-row collection batch on a 2-core CPU."""

    def __init__(self, session: RowsInLayout) -> None:
        super().__init__()
        self.session = session
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.live = 0  # buffer rows in use
        self._added = 0  # rows added since the buffers last took them in (together, once, when next used)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # a half-precision model on a CPU may keep its cache in float32, where that measured faster
        self.dtype, self.device = cache_dtype(self.session.model.config) or key_states.dtype, key_states.device
        rows = len(self.session.rows)
        self.kbuf = key_states.new_zeros((rows, key_states.shape[1], MIN_CAPACITY, key_states.shape[-1]),
                                         dtype=self.dtype)
        self.vbuf = value_states.new_zeros((rows, value_states.shape[1], MIN_CAPACITY, value_states.shape[-1]),
                                           dtype=self.dtype)
        self.live, self._added = rows, 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._grow_rows()
        lay = self.session.layout
        if lay.kv_len > self.kbuf.shape[2]:
            capacity = doubled(self.kbuf.shape[2], lay.kv_len)
            self.kbuf, self.vbuf = (_resized(b, self.live, len(b), capacity) for b in (self.kbuf, self.vbuf))
        for buf, new in ((self.kbuf, key_states), (self.vbuf, value_states)):
            src = new[0].transpose(0, 1) if lay.packed else new[lay.rows, :, lay.cols]  # (T, H, D)
            buf[lay.rows, :, lay.slots] = src.to(buf.dtype)
        return self.kbuf[: self.live, :, : lay.kv_len], self.vbuf[: self.live, :, : lay.kv_len]

    @torch.inference_mode()
    def move_rows(self, src: list[int], dst: list[int], live: int) -> None:
        """Rows left: buffer rows `src` move into `dst` (the holes below the new count) and
        rows [0, live) stay in use; no other row is copied."""
        if not self.is_initialized:
            return
        self._grow_rows()
        if src:
            s = torch.tensor(src, dtype=torch.long, device=self.kbuf.device)
            d = torch.tensor(dst, dtype=torch.long, device=self.kbuf.device)
            for buf in (self.kbuf, self.vbuf):
                buf[d] = buf.index_select(0, s)
        self.live = live

    def add_row(self) -> None:
        if self.is_initialized:
            self._added += 1

    def _grow_rows(self) -> None:
        if self._added:
            need = self.live + self._added
            if need > self.kbuf.shape[0]:
                rows = max(need, 2 * self.kbuf.shape[0])
                self.kbuf, self.vbuf = (_resized(b, self.live, rows, b.shape[2]) for b in (self.kbuf, self.vbuf))
            self.live, self._added = need, 0

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._grow_rows()
        return self.kbuf[: self.live], self.vbuf[: self.live]

    def get_seq_length(self) -> int:
        return self.session.layout.kv_len if self.session.layout is not None else 0


def _resized(buf: torch.Tensor, live: int, rows: int, capacity: int) -> torch.Tensor:
    """A zeroed buffer of `rows` rows and `capacity` slots holding buf's rows [0, live)."""
    new = buf.new_zeros((rows, buf.shape[1], capacity, buf.shape[-1]))
    new[:live, :, : buf.shape[2]] = buf[:live]
    return new


class RaggedCache(DynamicCache):
    def __init__(self, session: RowsInLayout, config) -> None:
        super().__init__(config=config)
        if any(type(layer) is not DynamicLayer for layer in self.layers):
            raise SpecUIError("batched decoding needs a model whose layers all use full attention")
        self.layers = [RaggedLayer(session) for _ in self.layers]
