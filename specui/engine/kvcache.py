"""A KV cache that appends in place: one preallocated buffer per layer and a length.

transformers' DynamicLayer re-concatenates the whole past on every forward (`torch.cat`,
a growing share of a CPU decode step) and crops by slicing. GrowingLayer writes the new
keys/values at the current length of a buffer whose capacity doubles when needed, returns
views of the valid part, and crops by moving the length. `layer.keys` / `layer.values` are
those views (writes through them reach the buffer); assigning a tensor to them adopts it
as the new buffer, so DynamicLayer's own reorder/offload/batch methods keep working.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specui.engine.attention import cache_dtype

MIN_CAPACITY = 256  # slots a buffer starts with (doubling from there)


def doubled(capacity: int, need: int) -> int:
    """`capacity` doubled until it holds `need` slots: every cache here grows by doubling, so the
    shapes its buffers take (and the compiles that see them) are few."""
    while capacity < need:
        capacity *= 2
    return capacity


class GrowingLayer(DynamicLayer):
    """A full-attention DynamicLayer backed by a buffer of shape (B, H, capacity, D)."""

    def __init__(self, store_dtype: torch.dtype | None = None, **kwargs) -> None:
        self.store_dtype = store_dtype  # None: the dtype of the keys/values it is given
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0
        super().__init__(**kwargs)

    # keys / values: views of the valid length; assigning adopts the tensor as the buffer
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._kbuf is None else self._kbuf[..., : self._len, :]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._kbuf = tensor
        self._len = 0 if tensor is None else tensor.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._vbuf is None else self._vbuf[..., : self._len, :]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._vbuf = tensor
        self._len = 0 if tensor is None else tensor.shape[-2]

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.store_dtype or key_states.dtype, key_states.device
        # capacity 0: the first update allocates
        self.keys = torch.empty((*key_states.shape[:-2], 0, key_states.shape[-1]), dtype=self.dtype, device=self.device)
        self.values = torch.empty(
            (*value_states.shape[:-2], 0, value_states.shape[-1]), dtype=self.dtype, device=self.device
        )
        self.is_initialized = True

    @staticmethod
    def _grown(buf: torch.Tensor, like: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        new = torch.empty((*like.shape[:-2], capacity, like.shape[-1]), dtype=buf.dtype, device=buf.device)
        new[..., :length, :] = buf[..., :length, :]
        return new

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._len
        end = start + key_states.shape[-2]
        if end > self.capacity:
            capacity = doubled(max(MIN_CAPACITY, self.capacity), end)
            self._kbuf = self._grown(self._kbuf, key_states, start, capacity)
            self._vbuf = self._grown(self._vbuf, value_states, start, capacity)
        self._kbuf[..., start:end, :] = key_states
        self._vbuf[..., start:end, :] = value_states
        self._len = end
        return self._kbuf[..., :end, :], self._vbuf[..., :end, :]

    def keep_rows(self, rows: torch.Tensor, prefix: int, tail: torch.Tensor, start: int = 0) -> None:
        """Beam rows (RowSession.commit): new row i = old row rows[i], its first `prefix`
        entries then the entries at positions tail[i] (all rows keep as many). A row moved in
        place of another already holds its source's first `start` entries: only the rest is copied."""
        if not self.is_initialized:
            return
        m = tail.shape[1]
        b = self._kbuf.shape[0]
        order = rows.tolist()
        # rows that take another row's entries: only those are copied, and only their valid
        # prefix (a beam step moves each copied row's whole cache: memory-bound, outside the forwards)
        moved = [i for i, src in enumerate(order) if src != i] if len(order) == b else []
        dst = torch.tensor(moved, dtype=torch.long, device=rows.device)
        for name in ("_kbuf", "_vbuf"):
            buf = getattr(self, name)
            kept = buf[rows[:, None], :, tail].transpose(1, 2)  # (rows, h, m, d): read before any write
            if len(order) != b:  # fewer or more rows: a buffer of the new size
                buf = buf.index_select(0, rows)
            elif moved:
                buf[dst, :, start:prefix] = buf[rows[dst], :, start:prefix]  # the right side is read whole first
            buf[:, :, prefix:prefix + m] = kept
            setattr(self, name, buf)
        self._len = prefix + m

    def tile_to(self, length: int, capacity: int) -> None:
        """Timing only (the cost profile): hold `length` entries, the ones held repeated in
        order, in a buffer of at least `capacity`. Attention's cost depends on how many keys it
        reads, not on what they are, so a forward after this costs what it does after `length`
        real entries, without computing them."""
        if not self.is_initialized or self._len == 0:
            raise ValueError("tile_to needs a layer that holds entries")
        index = torch.arange(length, device=self._kbuf.device) % self._len
        for name in ("_kbuf", "_vbuf"):
            buf = getattr(self, name)
            new = torch.empty((*buf.shape[:-2], max(capacity, length), buf.shape[-1]), dtype=buf.dtype,
                              device=buf.device)
            new[..., :length, :] = buf[..., : self._len, :].index_select(-2, index)
            setattr(self, name, new)
        self._len = length

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """transformers-5 semantics: a negative value is the number of tokens to drop."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        if self.is_initialized:
            self._len = max(0, self._len + tokens_to_remove)


class GrowingCache(DynamicCache):
    """DynamicCache whose full-attention layers are GrowingLayers; other layer kinds (sliding
    window, linear attention, ...) keep DynamicCache's own layers. The layers store keys and
    values in the dtype the model's attention measurement chose (specui.engine.attention),
    by default the model's own."""

    def __init__(self, config=None) -> None:
        super().__init__(config=config)
        layer = partial(GrowingLayer, store_dtype=cache_dtype(config) if config is not None else None)
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = layer
        self.layers = [layer() if type(existing) is DynamicLayer else existing for existing in self.layers]

    def nbytes(self) -> int:
        """Memory the cache's buffers hold (their capacity, not only the valid entries)."""
        total = 0
        for layer in self.layers:
            tensors = (layer._kbuf, layer._vbuf) if isinstance(layer, GrowingLayer) else (
                getattr(layer, "keys", None), getattr(layer, "values", None))
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return total
