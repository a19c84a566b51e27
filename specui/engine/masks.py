"""The additive attention masks of forwards over a static cache (engine/capture.py's StaticForward):
causal rows, a tree's or a forest's own pattern, slots past a row's reach hidden; built with as few
small ops as a decoding step can take on a CPU (a slice of one causal template per capacity, one
kept row per window for single tokens)."""

from __future__ import annotations

import torch

from specui.engine.static_cache import StaticKVCache, cpu_view


def mask_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of a model's additive attention masks: its own, float32 where that is not a
    floating dtype (a quantized model's). `model.dtype` walks the parameters: read it once."""
    dtype = model.dtype
    return dtype if dtype.is_floating_point else torch.float32


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of a boolean one: 0 where `allowed`, the dtype's lowest value elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


class StaticMasks:
    """Masks (width, window) in `mask_dtype` for forwards over `cache`; the causal template holds
    at least `widest` rows (the biggest bucket)."""

    def __init__(self, cache: StaticKVCache, mask_dtype: torch.dtype, widest: int) -> None:
        self.cache, self.mask_dtype, self.widest = cache, mask_dtype, widest
        self._causal: torch.Tensor | None = None  # every causal mask is a slice of this (see causal)
        self._causal_view = None  # its numpy view, on a CPU
        self._rows: dict[int, tuple] = {}  # window: (one token's mask, its numpy view on a CPU or None, its start)

    def build(self, start: int, m: int, width: int, window: int, attend: torch.Tensor | None) -> torch.Tensor:
        """Additive mask (width, window): causal rows (the padded ones too), the real rows'
        own pattern where `attend` gives one; slots past a row's reach are hidden."""
        if attend is None:
            return self.causal(start, width, window)
        device = self.cache.device
        cols = self.cache.offsets[:window]
        reach = start + torch.arange(width, device=device)
        allowed = cols[None, :] <= reach[:, None]
        allowed[:m, : start + m] = attend.to(device, non_blocking=True)
        lowest = torch.finfo(self.mask_dtype).min
        return torch.zeros((width, window), dtype=self.mask_dtype, device=device).masked_fill_(~allowed, lowest)

    def causal(self, start: int, width: int, window: int) -> torch.Tensor:
        """The causal mask (row i sees slots <= start + i) as one copy of a slice of a template
        built once per capacity: template[i, c] = 0 where c <= i + capacity, so columns from
        capacity - start on are the mask (a decoding step made it in 6 small ops before)."""
        if width == 1:
            return self.one_row(start, window)
        capacity = self.cache.capacity
        template = self._causal
        if template is None or template.shape[1] != 2 * capacity or template.shape[0] < width:
            rows = max(width, self.widest)
            i = torch.arange(rows, device=self.cache.device)[:, None]
            c = torch.arange(2 * capacity, device=self.cache.device)[None, :]
            template = torch.zeros((rows, 2 * capacity), dtype=self.mask_dtype, device=self.cache.device)
            self._causal = template.masked_fill_(c > i + capacity, torch.finfo(self.mask_dtype).min)
            self._causal_view = cpu_view(template)  # on a CPU masks are copied from it through numpy
        # always a copy: a one-row slice counts as contiguous, and `.contiguous()` would hand
        # SDPA a view 4 bytes into the template (CUDA's kernels fault on a misaligned mask)
        out = torch.empty((width, window), dtype=self.mask_dtype, device=self.cache.device)
        if self._causal_view is not None:
            out.numpy()[...] = self._causal_view[:width, capacity - start: capacity - start + window]
            return out
        return out.copy_(template[:width, capacity - start: capacity - start + window])

    def one_row(self, start: int, window: int) -> torch.Tensor:
        """The causal mask of one new token (1, window): slots <= start visible. One per window,
        kept and changed in place where the start moved (decoding: one slot a forward), as
        `causal`'s copy cost two to three times its few small ops on a CPU. The forward
        reads it before the next one changes it (the same stream on a GPU; a graph copies it)."""
        row, view, seen = self._rows.get(window, (None, None, -1))
        if row is None:
            row = torch.full((1, window), torch.finfo(self.mask_dtype).min, dtype=self.mask_dtype,
                             device=self.cache.device)
            view = cpu_view(row)  # on a CPU its slots change through numpy
        if start > seen:  # (start < window: the window holds the new token)
            _fill(row, view, seen + 1, start + 1, 0.0)
        elif start < seen:
            _fill(row, view, start + 1, seen + 1, torch.finfo(self.mask_dtype).min)
        self._rows[window] = (row, view, start)
        return row


def _fill(row: torch.Tensor, view, lo: int, hi: int, value: float) -> None:
    """Slots [lo, hi) of a one-row mask (1, window) set to `value`: through its numpy view `view`
    where it has one, else with a torch op."""
    if view is not None:
        view[0, lo:hi] = value
    else:
        row.narrow(1, lo, hi - lo).fill_(value)
