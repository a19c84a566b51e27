"""RaggedSession: one model and a KV cache of several independent sequences (rows) whose
committed lengths differ and change by different amounts each step: EMS-SD's batches
(DESIGN.md 3.8, seed 003). Rows join and leave between forwards (continuous batching).

Padding is a strategy of this one piece (PADDINGS):
- "vanilla": every row's input is padded to the step's longest and every row's new
  entries are written at one common cache offset (the longest row's end), so shorter rows
  store padding in their cache and attend around it. Kept as the comparison; `stats`
  counts the padding it computes and stores.
- "unpad-kv": per-row cache lengths; each row's new entries go right after its own
  committed ones; inputs are still padded to the step's longest row.
- "unpad" (EMS-SD): per-row cache lengths, and the rows' new tokens are concatenated into
  one (1, T) sequence, so the linear layers see no padding token at all; inside attention
  each token's row and position are recovered from the forward's Layout.

In transformers terms: the cache is a DynamicCache whose layers (RaggedLayer, in
engine/ragged_cache.py) write each token at its (row, slot), and "unpad" runs through an
attention function registered with transformers' AttentionInterface (`ragged_attention`, in
engine/ragged_layout.py with the forward's Layout and PaddingStats: the packed queries'
padded view attends to each row's cache, with SDPA and an explicit per-row mask on a CPU, or
with FlexAttention and a block mask, compiled, on a GPU, falling back to SDPA with a note
where FlexAttention fails). No modeling code is forked. The model's attention implementation
is switched to it only for the duration of a packed forward, so the single-sequence sessions
that share the model keep their own attention.

Why not DSBD's RowSession: its rows share one committed length (beams), and padding of
committed entries is what EMS-SD exists to remove. A row's committed entries here always
sit in slots [0, len) under "unpad" / "unpad-kv" (a chain's accepted tokens are a prefix of
what was fed, so committing is cropping the row's length), which is what keeps the cache
free of padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from specui.engine.attention import attention_configs, cache_dtype
from specui.engine.kvcache import MIN_CAPACITY, doubled
from specui.engine.masks import additive, mask_dtype
from specui.engine.ragged_cache import RaggedCache
from specui.engine.ragged_layout import Layout, PaddingStats, ragged_attention_in
from specui.engine.session import common_prefix
from specui.errors import SpecUIError
from specui.settings import PADDINGS


class SessionRow:
    """One sequence of a RaggedSession: the token ids its cache entries hold, in the cache
    slots listed (slots [0, len) except under "vanilla"). `commit(ids)` crops it to the
    longest prefix of `ids` it holds, like ModelSession.commit."""

    def __init__(self, session: RaggedSession) -> None:
        self.session = session
        self.cached: list[int] = []
        self.slots: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.session.device

    @property
    def end(self) -> int:
        return self.slots[-1] + 1 if self.slots else 0

    def commit(self, ids: Sequence[int]) -> None:
        keep = common_prefix(self.cached, ids)
        del self.cached[keep:], self.slots[keep:]


class RaggedSession:
    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, padding: str = "unpad",
                 kernel: str | None = None) -> None:
        if padding not in PADDINGS:
            raise SpecUIError(f"unknown padding '{padding}'; choose one of: {', '.join(PADDINGS)}")
        self.model = model
        self.vocab_size = vocab_size or model.config.vocab_size
        self.device = next(model.parameters()).device
        self.padding = padding
        self.rows: list[SessionRow] = []
        self.layout: Layout | None = None
        self.cache = RaggedCache(self, model.config)
        self.stats = PaddingStats()
        self._configs = attention_configs(model)
        # the packed path's attention: FlexAttention (compiled) on a GPU, SDPA with a mask on a CPU
        self.kernel = kernel or ("flex" if self.device.type == "cuda" else "sdpa")
        self._flex: Callable | None = None
        self.notes: list[str] = []  # what the session fell back on (FlexAttention failing)
        self.mask_dtype = mask_dtype(model)

    def bytes_per_slot(self) -> int:
        """Cache bytes one token of one row takes (keys and values, every layer)."""
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = cache_dtype(cfg) or self.model.dtype
        size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
        return 2 * cfg.num_hidden_layers * heads * head_dim * size

    def cache_bytes(self, rows: int, tokens: int) -> int:
        """The buffers for `rows` rows holding up to `tokens` each (capacity grows by doubling)."""
        return rows * doubled(MIN_CAPACITY, tokens) * self.bytes_per_slot()

    # -- rows --------------------------------------------------------------------------
    def add_row(self) -> SessionRow:
        row = SessionRow(self)
        self.rows.append(row)
        for layer in self.cache.layers:
            layer.add_row()
        return row

    def remove_rows(self, gone: Sequence[SessionRow]) -> None:
        """The rows leave; each hole below the new count takes a row from above it (the rows'
        order changes: they are known by object, never by position)."""
        leaving = {i for i, row in enumerate(self.rows) if row in gone}
        if not leaving:
            return
        left = len(self.rows) - len(leaving)
        holes = sorted(i for i in leaving if i < left)
        movers = [i for i in range(left, len(self.rows)) if i not in leaving]
        for layer in self.cache.layers:
            layer.move_rows(movers, holes, left)
        rows = list(self.rows)
        for h, m in zip(holes, movers):
            rows[h] = rows[m]
        self.rows = rows[:left]

    def padding_slots(self) -> int:
        """Cache slots below some row's end that hold none of that row's tokens."""
        if self.padding != "vanilla":
            return sum(row.end - len(row.slots) for row in self.rows)
        end = max((row.end for row in self.rows), default=0)
        return sum(end - len(row.slots) for row in self.rows)

    # -- forwards ----------------------------------------------------------------------
    @torch.inference_mode()
    def advance(self, feeds: Sequence[tuple[SessionRow, Sequence[int], int]]) -> list[torch.Tensor]:
        """For each (row, ids, need): make the row's cache hold all of `ids` (feeding what it
        lacks, its rejected entries cropped first) and return the logits (need, V) at its last
        `need` positions. Rows not named feed nothing. One forward for all rows."""
        plan = []
        for row, ids, need in feeds:
            if row.session is not self:
                raise ValueError("a row of another session")
            need = max(1, min(need, len(ids)))
            row.commit(ids[: len(ids) - need])
            plan.append((row, list(ids[len(row.cached):]), need))
        if not plan:
            return []
        # the packed input follows the session's row order (which leaving rows change), not the caller's
        where = {id(row): i for i, row in enumerate(self.rows)}
        order = sorted(range(len(plan)), key=lambda i: where[id(plan[i][0])])
        plan = [plan[i] for i in order]
        self.layout = self._layout(plan)
        lay = self.layout
        try:
            ran = self._run(plan, lay)
        finally:
            self.layout = None
        out: list[torch.Tensor] = [ran[0]] * len(ran)
        for k, i in enumerate(order):
            out[i] = ran[k]
        common = max(r.end for r in self.rows)  # vanilla's one write offset
        for row, fresh, _ in plan:
            start = common if self.padding == "vanilla" else row.end
            row.slots.extend(range(start, start + len(fresh)))
            row.cached.extend(fresh)
        padding = self.padding_slots()
        self.stats.kv_slots += sum(len(row.slots) for row in self.rows) + padding
        self.stats.kv_padding += padding
        return out

    def _layout(self, plan: list[tuple[SessionRow, list[int], int]]) -> Layout:
        index = {id(row): i for i, row in enumerate(self.rows)}
        b = len(self.rows)
        width = max(len(fresh) for _, fresh, _ in plan)
        common = max((row.end for row in self.rows), default=0)  # vanilla's one write offset
        starts = [common if self.padding == "vanilla" else row.end for row in self.rows]
        kv_len = max(s + width if self.padding == "vanilla" else s for s in starts)
        kv_len = max(kv_len, *(starts[index[id(row)]] + len(fresh) for row, fresh, _ in plan))
        # filled through its numpy view (the layout of a B = 8 step: 4.2 ms with a torch op per row and part, 1.1 now)
        attend = torch.zeros((b, width, kv_len), dtype=torch.bool)
        allowed = attend.numpy()
        rows, cols, slots = [], [], []
        counts = [0] * b
        for row, fresh, _ in plan:
            counts[index[id(row)]] = len(fresh)
        for r, row in enumerate(self.rows):
            k, s = counts[r], starts[r]
            if row.slots:
                allowed[r, :k, row.slots] = True
            allowed[r, :k, s:s + k] |= np.tri(k, dtype=bool)
            written = width if self.padding == "vanilla" else k  # vanilla stores its padding too
            rows += [r] * written
            cols += range(written)
            slots += range(s, s + written)
            allowed[r, range(k, written), range(s + k, s + written)] = True  # vanilla padding: itself only
        real = sum(counts)
        computed = real if self.padding == "unpad" else b * width
        self.stats.input_tokens += computed
        self.stats.input_padding += computed - real
        mask = additive(attend, self.mask_dtype)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        packed = self.padding == "unpad"
        kernel = self.kernel if packed else "sdpa"
        active = view_rows = None
        fed = [r for r in range(b) if counts[r]]
        if packed and len(fed) < b:  # only the fed rows' queries are computed, against their own cache rows
            view_of = {r: i for i, r in enumerate(fed)}
            view_rows, active = as_tensor([view_of[r] for r in rows]), as_tensor(fed)
            mask, attend = mask[fed], attend[fed]
        return Layout(as_tensor(rows), as_tensor(cols), as_tensor(slots), width, kv_len,
                      mask[:, None].to(self.device), packed=packed, attend=attend.to(self.device),
                      kernel=kernel, flex=self._flex_attention() if kernel == "flex" else None,
                      active=active, view_rows=view_rows)

    def _flex_attention(self) -> Callable:
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention, dynamic=True) if self.device.type == "cuda" else flex_attention
        return self._flex

    def _run(self, plan: list[tuple[SessionRow, list[int], int]], lay: Layout) -> list[torch.Tensor]:
        index = {id(row): i for i, row in enumerate(self.rows)}
        positions = {id(row): len(row.cached) for row in self.rows}
        if lay.packed:
            ids = [t for _, fresh, _ in plan for t in fresh]
            pos = [positions[id(row)] + j for row, fresh, _ in plan for j in range(len(fresh))]
            ends, keep, at = [], [], 0
            for _, fresh, need in plan:
                at += len(fresh)
                ends.append(at)
                keep.extend(range(at - need, at))
            out = self._packed_forward(ids, pos, keep, lay)
            logits, result, at = out.logits[0, :, : self.vocab_size], [], 0
            for _, _, need in plan:
                result.append(logits[at:at + need])
                at += need
            return result
        b = len(self.rows)
        ids = torch.zeros((b, lay.width), dtype=torch.long)
        pos = torch.zeros((b, lay.width), dtype=torch.long)
        for r, row in enumerate(self.rows):
            pos[r] = positions[id(row)] + torch.arange(lay.width)
        for row, fresh, _ in plan:
            ids[index[id(row)], : len(fresh)] = torch.tensor(fresh, dtype=torch.long)
        lo = min(len(fresh) - need for _, fresh, need in plan)
        hi = max(len(fresh) for _, fresh, _ in plan)
        out = self.model(input_ids=ids.to(self.device), past_key_values=self.cache, position_ids=pos.to(self.device),
                         attention_mask=lay.mask, use_cache=True,
                         logits_to_keep=torch.arange(lo, hi, device=self.device))
        logits = out.logits[..., : self.vocab_size]
        return [logits[index[id(row)], len(fresh) - need - lo:len(fresh) - lo] for row, fresh, need in plan]

    def _packed_forward(self, ids: list[int], pos: list[int], keep: list[int], lay: Layout):
        """The model on the packed input; a FlexAttention failure (a GPU or torch without
        support for it) falls back to SDPA for good, with a note, and the forward is retried
        (the rows' committed entries were not touched)."""
        while True:
            try:
                with ragged_attention_in(self._configs):
                    return self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=self.cache,
                                      position_ids=torch.tensor([pos], device=self.device), use_cache=True,
                                      logits_to_keep=torch.tensor(keep, device=self.device), specui_layout=lay)
            except Exception as e:  # noqa: BLE001 - any kernel failure: retried once with SDPA
                if lay.kernel != "flex":
                    raise
                self.kernel = lay.kernel = "sdpa"
                self.notes.append(f"FlexAttention failed ({type(e).__name__}: {e}); attending with SDPA and a "
                                  "mask from now on")

    def kv(self, row: SessionRow) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) (heads, len, D) of one row's committed entries (tests)."""
        r = self.rows.index(row)
        slots = torch.tensor(row.slots, dtype=torch.long, device=self.device)
        return [tuple(b[r].index_select(1, slots) for b in layer.buffers()) for layer in self.cache.layers]
