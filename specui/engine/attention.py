"""Attention for half-precision models on a CPU, chosen by measurement at load.

On some CPUs (measured: a 2-core AMD EPYC with avx2, torch 2.13) PyTorch's attention kernels
are slow in bfloat16 for the few-query forwards decoding runs: one query over 300 cached keys
(a view of the cache's buffer) took 250 us in bfloat16 against 51 us in float32, and 965 vs
148 us over 1500 keys; a model runs one such call per layer and token. So a half-precision
model may keep its KV cache in float32 (`specui_cache_dtype`: GrowingCache reads it) and
attend in float32, casting only the few new queries and the output; and a short query may run
as two matmuls and a softmax with the query heads that share a key/value head stacked on one
matrix (`grouped`, no `repeat_kv` copy), where that is faster than SDPA.

`use_measured_attention` times the options on the model's own head shapes and records the
choice on the model's configs (two loaded models never share it). Float32 models and other
devices keep transformers' SDPA kernel, and every CPU model with grouped heads skips only its
copy of the cache per query head (`use_shared_kv_heads`): the outputs are bit for bit the same.
The masks are SDPA's: the attention is registered with SDPA's mask function.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specui.engine.timing import median_ms

ATTENTION = "specui"
CACHE_KEY, GROUPED_KEY = "specui_cache_dtype", "specui_grouped_max_query"
SHARED_KEY = "specui_shared_heads"  # routed only to share the key/value heads inside SDPA (no grouped option)
QUERY_SIZES = (1, 4, 16)  # query lengths timed at load: a decode token, a chain, a tree
CONTEXT = 512  # keys in the timed calls
REPEATS = 15  # timed calls per option (median)
MARGIN = 0.8  # an option must take at most this share of the current one's time to replace it


def specui_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of query (B, H, q, D) over key/value (B, Hkv, L, D), returned as (B, q, H, D)
    in the query's dtype, computed in the cache's dtype; grouped matmuls for queries up to the
    config's measured length, SDPA otherwise."""
    config = getattr(module, "config", None)
    limit = getattr(config, GROUPED_KEY, 0) if config is not None else 0
    out_dtype = query.dtype
    if key.dtype != out_dtype:
        query = query.to(key.dtype)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(key.dtype)
    if dropout:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                        dropout=dropout, **kwargs)
    elif query.shape[2] > limit:
        out = _sdpa(module, query, key, value, attention_mask, scaling)
    else:
        out = _grouped(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling)
    return out.to(out_dtype), None


def _sdpa(module, query, key, value, attention_mask, scaling) -> torch.Tensor:
    """torch's SDPA with the key/value heads shared by GQA inside the kernel: transformers'
    own call copies them (`repeat_kv`) whenever a mask is given, which a batch of rows always
    has (32 rows, one query each over 300 float32 keys: 0.74 ms against 19 ms with the copy
    here). Returns (B, q, H, D)."""
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[2]]
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2)


def _grouped(query, key, value, attention_mask, scaling: float) -> torch.Tensor:
    b, h, q, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    rep = h // kv_heads
    wide = torch.promote_types(query.dtype, torch.float32)  # softmax in float32, or float64's own precision
    scores = (query.reshape(b, kv_heads, rep * q, d) @ key.transpose(-1, -2)).to(wide) * scaling
    scores = scores.view(b, kv_heads, rep, q, length)
    # masked scores get the lowest finite value, not -inf: a query that may see nothing
    # (a padding position) gets finite weights, and padding keys never spread NaN into a row
    lowest = torch.finfo(wide).min
    if attention_mask is not None:
        mask = attention_mask[..., :length]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[:, :, None], lowest)
        else:
            scores = scores + mask[:, :, None].to(wide)
    elif q > 1:  # no mask given: causal over the last q positions
        allowed = torch.ones(q, length, dtype=torch.bool, device=query.device).tril(length - q)
        scores = scores.masked_fill(~allowed, lowest)
    probs = scores.softmax(-1).to(value.dtype).view(b, kv_heads, rep * q, length)
    return (probs @ value).view(b, h, q, d).transpose(1, 2)


def _timings(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype,
             device: torch.device) -> dict[int, tuple[float, float]]:
    """Per query length: (SDPA s, grouped s) for a `dtype` query over a cache of `cache_dtype`,
    the keys being a view of a larger buffer as in the session's cache."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    buffers = [torch.randn(1, kv_heads, 2 * CONTEXT, head_dim, generator=gen).to(device, cache_dtype)
               for _ in range(2)]
    key, value = (b[..., :CONTEXT, :] for b in buffers)
    out = {}
    for q in QUERY_SIZES:
        query = torch.randn(1, q, heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
        mask = torch.zeros(1, 1, q, CONTEXT, dtype=cache_dtype, device=device)

        def sdpa(query=query, mask=mask):
            return torch.nn.functional.scaled_dot_product_attention(
                query.to(cache_dtype), key, value, attn_mask=mask, enable_gqa=True).to(dtype)

        def grouped(query=query, mask=mask):
            return _grouped(query.to(cache_dtype), key, value, mask, head_dim ** -0.5).to(dtype)

        out[q] = (median_ms(sdpa, device, REPEATS) / 1000, median_ms(grouped, device, REPEATS) / 1000)
    return out


def measure_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.dtype, int, str]:
    """(cache dtype, longest query for grouped matmuls or 0, a note with the figures) for a
    model of these shapes computing in `dtype`."""
    native = _timings(heads, kv_heads, head_dim, dtype, dtype, device)
    wide = _timings(heads, kv_heads, head_dim, dtype, torch.float32, device)
    best_native, best_wide = min(native[1]), min(wide[1])
    cache_dtype, timings = (torch.float32, wide) if best_wide <= MARGIN * best_native else (dtype, native)
    limit = 0
    for q in QUERY_SIZES:
        if timings[q][1] > MARGIN * timings[q][0]:
            break
        limit = q
    name = str(dtype).removeprefix("torch.")
    said = (f"one query over {CONTEXT} cached keys: {best_native * 1e6:.0f} us with a {name} cache, "
            f"{best_wide * 1e6:.0f} us with a float32 one")
    cache = "float32 KV cache" if cache_dtype == torch.float32 else f"{name} KV cache"
    how = f"grouped matmuls for queries up to {limit} tokens, SDPA beyond" if limit else "SDPA"
    return cache_dtype, limit, f"attention: {cache}, {how} ({said})"


def attention_configs(model: PreTrainedModel) -> list:
    """The config objects `model`'s modules read their attention implementation from."""
    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in model.modules())]
               if c is not None and hasattr(c, "_attn_implementation")}
    return list(configs.values())


def _cpu_sdpa_heads(model: PreTrainedModel) -> tuple[int, int] | None:
    """(query heads, key/value heads) of a model on a CPU that transformers' SDPA serves, else None."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    if (not heads or next(model.parameters()).device.type != "cpu"
            or getattr(config, "_attn_implementation", None) != "sdpa"):
        return None
    return heads, getattr(config, "num_key_value_heads", None) or heads


def use_measured_attention(model: PreTrainedModel) -> str | None:
    """Measure and route `model`'s attention through `specui_attention` with the faster cache
    dtype and grouped limit. Only half-precision models on a CPU that use SDPA; returns a note
    of the choice (None when nothing was measured)."""
    shape = _cpu_sdpa_heads(model)
    if shape is None or model.dtype not in (torch.bfloat16, torch.float16):
        return None
    heads, kv_heads = shape
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    with torch.inference_mode():
        cache_dtype, limit, note = measure_attention(heads, kv_heads, head_dim, model.dtype, torch.device("cpu"))
    if cache_dtype == model.dtype and not limit:
        return note
    _route(model, None if cache_dtype == model.dtype else str(cache_dtype).removeprefix("torch."), limit)
    return note


def _route(model: PreTrainedModel, cache: str | None, limit: int) -> None:
    """Make `model` attend through `specui_attention` with this cache dtype (None: its own) and
    grouped limit (0: SDPA, the key/value heads shared inside the kernel)."""
    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, specui_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    for c in attention_configs(model):
        setattr(c, CACHE_KEY, cache)
        setattr(c, GROUPED_KEY, limit)
        c._attn_implementation = ATTENTION


def use_shared_kv_heads(model: PreTrainedModel) -> str | None:
    """Route a CPU model that transformers' SDPA would serve through `specui_attention`'s SDPA,
    which shares the key/value heads inside the kernel: transformers' own call copies the whole
    cache for every query head (`repeat_kv`) whenever a mask is given, i.e. for every forward of
    2+ tokens. One layer of the 1.7b stand-in, 2 queries over 2048 keys: 30.5 ms against 1.5 in
    float64, 4.8 against 0.8 in float32, the outputs bit for bit equal. A model the load's
    measurement already routed keeps that choice. Returns a note, or None where nothing changed
    (not a CPU, not SDPA, or no grouped heads)."""
    shape = _cpu_sdpa_heads(model)
    if shape is None or shape[0] == shape[1]:
        return None
    heads, kv_heads = shape
    _route(model, None, 0)
    for c in attention_configs(model):
        setattr(c, SHARED_KEY, True)
    return (f"attention: SDPA with its {heads} query heads sharing {kv_heads} key/value heads inside the kernel "
            "(no copy of the cache per query head)")


def cache_dtype(config) -> torch.dtype | None:
    """The KV cache dtype the measurement chose for a model of this config (None: its own)."""
    name = getattr(config, CACHE_KEY, None)
    return getattr(torch, name) if name else None


def routed_attention(model: PreTrainedModel) -> list:
    """The configs through which `model` attends with `specui_attention` as measured at load
    (half precision on a CPU: a cache dtype or grouped matmuls), else []; not those routed only
    to share the key/value heads inside SDPA (use_shared_kv_heads)."""
    return [c for c in attention_configs(model)
            if getattr(c, "_attn_implementation", None) == ATTENTION and not getattr(c, SHARED_KEY, False)]


@contextmanager
def grouped_attention(configs: list, limit: int):
    """Queries up to `limit` attend with grouped matmuls through these configs (routed_attention's)
    while inside; what they said before is restored after."""
    before = [getattr(c, GROUPED_KEY, 0) for c in configs]
    for c in configs:
        setattr(c, GROUPED_KEY, limit)
    try:
        yield
    finally:
        for c, value in zip(configs, before, strict=True):
            setattr(c, GROUPED_KEY, value)
