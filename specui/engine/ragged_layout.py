"""Where one forward of a RaggedSession (engine/ragged.py) puts its tokens and how they
attend: the Layout (each token's cache row, input column and cache slot, and the mask over
each row's cache), the packed attention function `ragged_attention` that transformers'
AttentionInterface runs for "unpad" forwards (`ragged_attention_in` switches a model's
attention to it for the duration of one), and PaddingStats, what the forwards computed and
stored as padding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specui.engine.attention import specui_attention

ATTENTION = "specui_ragged"


@dataclass
class Layout:
    """Where one forward's tokens go. Input token t (of `rows.numel()` written tokens, in
    row order) belongs to cache row rows[t], sits at input column cols[t] of the padded
    view (B, width) and is written at cache slot slots[t]. `mask`: (B, 1, width, kv_len)
    additive, the padded view's attention over cache slots [0, kv_len); `attend` the same as
    booleans. `kernel`: how the packed path attends ("sdpa", or "flex" with `flex`, the
    session's FlexAttention function)."""

    rows: torch.Tensor
    cols: torch.Tensor
    slots: torch.Tensor
    width: int
    kv_len: int
    mask: torch.Tensor
    packed: bool
    attend: torch.Tensor | None = None
    kernel: str = "sdpa"
    flex: Callable | None = None
    # packed forwards feeding only some rows (prompts joining a batch): the padded view holds
    # those rows only, `active` (their cache rows) and `view_rows` (each token's view row)
    active: torch.Tensor | None = None
    view_rows: torch.Tensor | None = None
    _block_mask: object = None

    def block_mask(self):
        """FlexAttention's block mask of `attend` (made once per forward, shared by the layers)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            attend = self.attend
            b, width, kv_len = attend.shape
            self._block_mask = create_block_mask(lambda bi, h, q, k: attend[bi, q, k], b, None, width, kv_len,
                                                 device=attend.device)
        return self._block_mask


def ragged_attention(module, query, key, value, attention_mask, specui_layout: Layout | None = None, **kwargs):
    """Packed queries (1, H, T, D) -> the padded view (B, H, width, D), attention over each
    row's cache (SDPA with the layout's mask, or FlexAttention with its block mask, which skips
    the masked blocks), and back to (1, T, H, D). Without a layout (a forward that is not a
    ragged one), plain SDPA."""
    if specui_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    lay = specui_layout
    rows = lay.rows
    if lay.active is not None:
        key, value, rows = key.index_select(0, lay.active), value.index_select(0, lay.active), lay.view_rows
    q = query.new_zeros((key.shape[0], query.shape[1], lay.width, query.shape[-1]))
    q[rows, :, lay.cols] = query[0].transpose(0, 1)
    if lay.kernel == "flex":
        out = lay.flex(q, key, value, block_mask=lay.block_mask(), scale=kwargs.get("scaling"),
                       enable_gqa=key.shape[1] != q.shape[1]).transpose(1, 2)
    else:  # SDPA or grouped matmuls, in the cache's dtype, as measured at load (attention.py)
        out, _ = specui_attention(module, q, key, value, lay.mask, **kwargs)  # (B, width, H, D)
    return out[rows, lay.cols][None], None


@contextmanager
def ragged_attention_in(configs: list) -> Iterator[None]:
    """Route the attention of the modules reading `configs` through `ragged_attention` for
    the duration of the block."""
    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, ragged_attention)
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = ATTENTION
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation = name


@dataclass
class PaddingStats:
    """What the forwards computed and stored, padding included."""

    input_tokens: int = 0  # input positions computed (padding included)
    input_padding: int = 0
    kv_slots: int = 0  # cache slots held after each forward (up to each row's end; vanilla: the longest's)
    kv_padding: int = 0  # of them, slots holding padding or rejected entries of no row

    @property
    def padding_ratio(self) -> float:
        """Share of computed input positions and held cache slots that were padding."""
        total = self.input_tokens + self.kv_slots
        return (self.input_padding + self.kv_padding) / total if total else 0.0

    def to_dict(self) -> dict:
        return {"input_tokens": self.input_tokens, "input_padding": self.input_padding,
                "kv_slots": self.kv_slots, "kv_padding": self.kv_padding,
                "padding_ratio": round(self.padding_ratio, 4)}
