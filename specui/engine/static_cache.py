"""A static, position-indexed KV cache (DESIGN.md 4.5): one preallocated store for every layer,
written at explicit slots, so a forward neither allocates nor concatenates and can be captured
(a CUDA graph, a compiled CPU forward) once per shape and replayed.

The store is one tensor (layers, 2, batch, kv heads, capacity, head dim); each layer's keys and
values are views of it. A forward writes its k new entries at slots `start .. start + k - 1`,
`start` being a one-element device tensor the caller fills before the forward (so a captured
forward reads it at replay time, as transformers' own StaticLayer reads `cumulative_length`),
and attention reads the first `window` slots (the length of `columns`, so a compiled forward
sees it as a tensor size, not a constant; the caller's mask hides the slots past the valid
length). The valid length is the caller's
bookkeeping (`set_length`), never the forward's: a replayed graph runs no Python.

Moving accepted tree entries into place after a step is one gather and one scatter over the
whole store (`move`), not two copies per layer. Growing (a reply longer than the capacity)
reallocates the store; whoever captured forwards over the old one must capture again
(`generation` changes). Several rows (beams: RowSession) share the slots: every row holds the
same committed length, and `keep_rows` moves, copies and drops rows after a beam step.
"""

from __future__ import annotations

import threading

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specui.engine.attention import cache_dtype
from specui.engine.kvcache import GrowingLayer
from specui.errors import SpecUIError

NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.long)  # dtypes numpy can view


def cpu_view(tensor: torch.Tensor):
    """The tensor's numpy view (sharing its memory) on a CPU where numpy holds its dtype, else None:
    writing a few entries through it costs a fifth to a third of a small torch op there."""
    return tensor.numpy() if tensor.device.type == "cpu" and tensor.dtype in NUMPY_DTYPES else None


def activation_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype the model's hidden states (and so its keys and values) are computed in: its
    input embeddings' (a draft's cast embeddings say theirs), else its own floating dtype."""
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    cast = getattr(embeddings, "dtype", None)
    if isinstance(cast, torch.dtype):
        return cast
    return model.dtype if model.dtype.is_floating_point else torch.float32


class SlotLayer(GrowingLayer):
    """One layer of a StaticKVCache: views of the cache's store; `keys` / `values` are the
    valid entries (the first `length` slots), as in GrowingLayer."""

    def __init__(self, owner: StaticKVCache, index: int) -> None:
        self.owner, self.index = owner, index
        super().__init__()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.allocate(key_states)

    def attach(self, store: torch.Tensor, length: int, rows: int | None = None) -> None:
        """Point this layer at its part of a (new) store: its first `rows` rows (None: all)."""
        self._kbuf, self._vbuf = store[self.index, 0, :rows], store[self.index, 1, :rows]
        self._len = length
        self.dtype, self.device = store.dtype, store.device
        self.is_initialized = True

    def detach(self) -> None:
        """Let go of the store (the cache is released): no views of it are left here."""
        self._kbuf = self._vbuf = None
        self._len, self.is_initialized = 0, False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.slots(key_states.shape[-2])
        self._kbuf.index_copy_(2, slots, key_states.to(self._kbuf.dtype))
        self._vbuf.index_copy_(2, slots, value_states.to(self._vbuf.dtype))
        window = self.owner.columns.shape[0]
        return self._kbuf[..., :window, :], self._vbuf[..., :window, :]

    def keep_rows(self, rows, prefix, tail, start=0) -> None:
        raise NotImplementedError("a static cache moves rows for every layer at once: StaticKVCache.keep_rows")

    def tile_to(self, length: int, capacity: int) -> None:
        raise NotImplementedError("a static cache is not stretched for timing")


SPARE_BYTES = 768 * 2**20  # the largest finished rows store a SpareStore keeps for the next one


class SpareStore:
    """The store of a finished rows cache (a reply's beams, RowSession), kept for the next rows cache
    over the same model. A fresh store costs its page faults when first written: the bundled
    target's 4 beams over 512 slots are 94 MB, about 60 ms to zero and as much again to copy the
    prompt into, every beam reply (2-core Zen 5). A store is held by one cache at a time (`take`
    hands it over); its stale entries are finite (keys and values, or zeros), which is all a
    masked slot needs. Stores over `limit` bytes are not kept (memory goes back at once)."""

    def __init__(self, limit: int = SPARE_BYTES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._store: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        with self._lock:
            store, self._store = self._store, None
        return store

    def give(self, store: torch.Tensor) -> None:
        """Keep a finished cache's store, the larger where one is kept already."""
        if store.numel() * store.element_size() > self.limit:
            return
        with self._lock:
            if self._store is None or self._store.numel() < store.numel():
                self._store = store


class StaticKVCache(DynamicCache):
    """Full-attention layers only (a sliding-window or linear-attention layer refuses: its cache
    is not a slot array). `capacity` slots are allocated at the first forward; `room` more
    than the context are kept for a padded shape's extra slots."""

    def __init__(self, config, capacity: int, device: torch.device, dtype: torch.dtype = torch.float32,
                 spare: SpareStore | None = None) -> None:
        super().__init__(config=config)
        if not all(type(layer) is DynamicLayer for layer in self.layers):
            kinds = sorted({type(layer).__name__ for layer in self.layers})
            raise SpecUIError(f"captured forwards need full-attention layers only; this model has {', '.join(kinds)}")
        self.store_dtype = cache_dtype(config) or dtype  # the measured cache dtype, else the activations'
        self.config = config.get_text_config(decoder=True)
        self.capacity = capacity
        self.device = torch.device(device)
        self.layers = [SlotLayer(self, i) for i in range(len(self.layers))]
        self.store: torch.Tensor | None = None
        self.rows = 0  # rows in use: the store's first ones (RowSession's beams; one otherwise)
        with torch.inference_mode(False):  # index tensors of one kind, whenever made (compiled guards read it)
            self.start = torch.zeros(1, dtype=torch.long, device=self.device)
            self.offsets = torch.arange(capacity, dtype=torch.long, device=self.device)
        self._start_view = cpu_view(self.start)  # on a CPU `prepare` writes the start through numpy
        self._sizers: dict[int, torch.Tensor] = {}  # window: its sizer (prepare)
        self.columns = _sizer(0, self.device)  # attention reads this many slots: its only content is its length
        self.generation = 0  # bumped whenever the store is reallocated
        self.spare = spare  # where `release` puts the store, and where `allocate` looks first

    # -- the store ---------------------------------------------------------------------
    def allocate(self, like: torch.Tensor | None = None) -> None:
        """Allocate the store (before the first forward: never inside a capture) for one row of
        the config's key/value heads, or for keys shaped like `like` (B, kv heads, k, D); zeros,
        so slots never written hold finite values (a masked score must not be NaN)."""
        if like is not None:
            b, h, _, d = like.shape
        else:
            c = self.config
            heads = c.num_attention_heads
            b, h = 1, getattr(c, "num_key_value_heads", None) or heads
            d = getattr(c, "head_dim", None) or c.hidden_size // heads
        shape = (len(self.layers), 2, b, h, self.capacity, d)
        kept = self.spare.take() if self.spare is not None else None
        if (kept is not None and kept.shape[:2] == shape[:2] and kept.shape[3] == h and kept.shape[5] == d
                and kept.shape[4] >= self.capacity and kept.dtype == self.store_dtype and kept.device == self.device):
            self.grow(kept.shape[4], exact=True)  # its capacity (no store yet: the slot offsets only)
            self._adopt(kept, 0, b)  # the rows in use are its first b
            return
        self._adopt(torch.zeros(shape, dtype=self.store_dtype, device=self.device), 0)

    def _adopt(self, store: torch.Tensor, length: int, rows: int | None = None) -> None:
        """Use `store`, its first `rows` rows (None: all) holding `length` entries."""
        self.store = store
        self._use_rows(store.shape[2] if rows is None else rows, length)
        self.generation += 1

    def _use_rows(self, rows: int, length: int) -> None:
        """The store's first `rows` rows are the ones in use: every layer's views of them."""
        self.rows = rows
        for layer in self.layers:
            layer.attach(self.store, length, rows)

    def release(self) -> None:
        """Done with this cache: its store goes to the spare (if it has one) and the layers let go
        of it, so its memory is reused or freed now, not when the garbage collector meets the
        cache (its layers and it refer to each other)."""
        if self.store is not None and self.spare is not None:
            self.spare.give(self.store)
        self.store, self.rows = None, 0
        for layer in self.layers:
            layer.detach()

    def keep_rows(self, rows: torch.Tensor, prefix: int, tail: torch.Tensor, start: int = 0) -> None:
        """Beam rows (RowSession.commit), every layer at once: new row i = old row rows[i], its
        first `prefix` entries then the entries at slots tail[i] (all rows keep as many). Only
        rows that take another row's entries copy their prefix, and only from `start` (a row
        moved already holds its source's first `start` entries); more rows than the store holds
        reallocate it (`generation` changes), fewer use its first rows."""
        if self.store is None:
            return
        order, m, live, before = rows.tolist(), tail.shape[1], self.store[:, :, : self.rows], self.rows
        # (rows, m, layers, 2, heads, dim): read before any write
        kept = live.permute(2, 4, 0, 1, 3, 5)[rows[:, None], tail].permute(2, 3, 0, 4, 1, 5)
        grown = len(order) > self.store.shape[2]
        if grown:
            new = torch.zeros((*self.store.shape[:2], len(order), *self.store.shape[3:]), dtype=self.store.dtype,
                              device=self.store.device)
            new[:, :, :, :, :prefix] = live[:, :, :, :, :prefix].index_select(2, rows)
            self._adopt(new, prefix + m)  # its rows are the new ones
        else:
            moved = [i for i, src in enumerate(order) if src != i]
            if moved:
                dst = torch.tensor(moved, dtype=torch.long, device=rows.device)
                self.store[:, :, dst, :, start:prefix] = live[:, :, :, :, start:prefix].index_select(2, rows[dst])
        self.store[:, :, : len(order), :, prefix:prefix + m] = kept
        if not grown and len(order) != before:  # the layers' views of the rows in use change
            self._use_rows(len(order), prefix + m)
        elif not grown:  # the same views (30 layers' attach: ~95 us of a beam step on the bundled target)
            self.set_length(prefix + m)

    def grow(self, needed: int, exact: bool = False) -> None:
        """Make room for `needed` slots (at least double, unless `exact`), keeping the valid entries."""
        if needed <= self.capacity:
            return
        capacity = needed if exact else max(needed, 2 * self.capacity)
        if self.store is not None:
            length = self.length
            new = torch.zeros((*self.store.shape[:4], capacity, self.store.shape[-1]), dtype=self.store.dtype,
                              device=self.store.device)
            new[..., :length, :] = self.store[..., :length, :]
            self._adopt(new, length, self.rows)  # the rows in use stay the store's first ones
        self.capacity = capacity
        with torch.inference_mode(False):  # as __init__'s, though a forward (inference mode) grows it
            self.offsets = torch.arange(capacity, dtype=torch.long, device=self.device)

    # -- what a forward reads ----------------------------------------------------------
    def prepare(self, start: int, window: int) -> None:
        """Before a forward: its entries go to slots from `start`; attention reads `window` slots."""
        if self.store is None:
            self.allocate()
        if self._start_view is not None:
            self._start_view[0] = start
        else:
            self.start.fill_(start)
        sizer = self._sizers.get(window)
        if sizer is None:  # a few windows (multiples of WINDOW): one each, not one a forward
            sizer = self._sizers[window] = _sizer(window, self.device)
        self.columns = sizer

    @property
    def window(self) -> int:
        return self.columns.shape[0]

    def slots(self, k: int) -> torch.Tensor:
        return self.offsets[:k] + self.start

    # -- bookkeeping (the caller's) ----------------------------------------------------
    @property
    def length(self) -> int:
        return self.layers[0]._len if self.layers else 0

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer._len = length

    def crop(self, max_length: int) -> None:
        """transformers-5 semantics: a negative value is the number of tokens to drop."""
        self.set_length(max(0, self.length + max_length) if max_length < 0 else min(self.length, max_length))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def move(self, src: torch.Tensor, dst: int) -> None:
        """Copy the entries at slots `src` to slots dst, dst + 1, ... in every layer at once."""
        if self.store is None or not len(src):
            return
        picked = self.store.index_select(-2, src)
        self.store[..., dst:dst + len(src), :] = picked

    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.numel() * self.store.element_size()


def _sizer(n: int, device: torch.device) -> torch.Tensor:
    """A tensor of n x 0 elements (no storage): a compiled forward sees n as a tensor size, so
    one compile serves every window. Not a view: dynamo gives a view's base a size symbol of its
    own with no source to guard it by, and the compile then failed ("sources must not be empty for
    symbol s79", the window a slice `offsets[:window]`, once the cache had grown: bundled target,
    2-core Xeon, 2026-11-29); made outside inference mode, like the other index tensors, so its
    kind never changes between forwards."""
    with torch.inference_mode(False):
        return torch.empty((n, 0), dtype=torch.long, device=device)
