"""Row-exact attention on a CPU (kernels/attend.cpp): every query row computed by one fixed sequence
of float operations, whatever else is scored with it, so a token scored alone (decoding) and the
same token scored among a chain's or a tree's (verification) get the same bits.

torch's SDPA does not promise that (its blocking follows the number of queries: one query over
200 keys and the same query among 9 differ in the last bits), which did not matter until the
activations are rounded: w8a8 / w4a8 round every matrix input to int8, so a last-bit difference
can flip a rounding and grow into different logits. Their models therefore ran the rest in
float64 (differences far below any rounding step); with this attention the rest can run in
float32: RMSNorm, SiLU and the other elementwise ops are row by row already, and so are the
kernels (tests/test_attend.py scores a float32 w4a8 / w8a8 model's tokens together and one by one).

`use_exact_attention(model)` routes a float32 / float64 CPU model's attention here (a note, or
None where it cannot: no kernels, another device or dtype, not SDPA-served). The load routes
float32 w8a8 / w4a8 models only: the float64 path is a scalar loop, slower than SDPA's."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specui.engine.attention import attention_configs, specui_attention
from specui.weights.native import native

ATTENTION = "specui_exact"
EXACT_DTYPES = (torch.float32, torch.float64)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
           scale: float) -> torch.Tensor:
    """query (B, H, q, D) contiguous, key / value (B, Hk, L, D), allowed (B or 1, q, L) bool or
    empty (row i sees keys 0 .. L - q + i) -> (B, q, H, D). One torch operator (the kernel's own,
    module.cpp) for torch.compile."""
    return torch.ops.specui_native.attend(query, key, value, allowed, scale)


def _allowed(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The kernel's (B or 1, q, L) bool mask from transformers' (B, 1, q, >= L) one (bool, or
    additive 0 / lowest as SpecUI's sessions build); None where the mask is per head."""
    if attention_mask is None:
        return torch.empty(0, dtype=torch.bool)
    mask = attention_mask[..., :length]
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[:, 0].contiguous()


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: (B, q, H, D) output, no weights. Anything the kernel
    does not serve (dropout, another dtype or device, a per-head mask) goes to specui_attention (SDPA)."""
    allowed = None
    served = (not dropout and query.device.type == "cpu" and query.dtype in EXACT_DTYPES
              and key.dtype == query.dtype and value.dtype == query.dtype)
    if served:
        allowed = _allowed(attention_mask, key.shape[2])
    if allowed is None or (not allowed.numel() and key.shape[2] < query.shape[2]):
        return specui_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if torch.compiler.is_compiling():  # one op to the compiler, which cannot trace into the extension
        return attend(query.contiguous(), key, value, allowed, float(scale)), None
    return native()[0].attend(query.contiguous(), key, value, allowed, float(scale)), None  # no dispatch cost


def exact_attention_ready() -> bool:
    """Whether SpecUI's kernels (this one among them) are built here."""
    return native()[0] is not None


def use_exact_attention(model: PreTrainedModel) -> str | None:
    """Route `model`'s attention through `exact_attention`: float32 / float64 on a CPU, served by
    transformers' SDPA (or SpecUI's own routing of it), with SpecUI's kernels built here."""
    config = model.config
    if (not exact_attention_ready() or next(model.parameters()).device.type != "cpu" or model.dtype not in EXACT_DTYPES
            or getattr(config, "_attn_implementation", None) not in ("sdpa", "specui", ATTENTION)):
        return None
    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, exact_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    for c in attention_configs(model):
        c._attn_implementation = ATTENTION
    return "attention: SpecUI's row-exact kernel (a token gets the same bits scored alone or with others)"
