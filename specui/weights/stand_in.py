"""Stand-in targets: a model's exact function at the cost of a bigger one (DESIGN.md 4.4).

Speculation pays when a target forward is dear and nearly flat in k while the draft is cheap;
the bundled 135M target is neither, and bigger weights cannot be fetched offline. A zero-padded
copy of a Llama-family model computes the same function at a bigger model's cost: hidden size,
intermediate size and head count widened (head_dim kept; as many KV heads as the real model has for
so many query heads, where the source's grouping allows: each of the source's KV heads repeated,
so query head i still reads its source KV head's keys and values and the KV cache a token reads
is the real model's), the real weights in the top-left blocks and zeros elsewhere, every
RMSNorm weight scaled by sqrt(H / H') and its eps by H / H' (the padded zeros change the mean of
squares), all-zero layers appended where the real model is deeper (a zero layer is the identity
on the residual stream). The residual stream's first H entries are then the source model's, the
rest stay zero, so logits, acceptance and greedy replies are the source's; everything that
depends on cost (gamma, tree budget, widths, dtype, quantization, which method `auto` picks) is
the bigger model's. It is a measuring device, never a better model: every label says so.

Sizes (`--stand-in`): `360m` (SmolLM2-360M), `1.7b` (SmolLM2-1.7B), `7b` (Llama-2-7B class); the
intermediate size is chosen so the parameter count matches the real model's."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specui.engine.host_memory import LOAD_SHARE, free_memory
from specui.errors import SpecUIError
from specui.weights.quantize import replace_module

FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # same module names: q/k/v/o, gate/up/down, two RMSNorms
MULTIPLE = 64  # intermediate sizes rounded to this (4-bit groups of 32 along every input)
KV_PROJECTIONS = ("k_proj", "v_proj")  # their rows: one block of head_dim a KV head (repeat_heads)


@dataclass(frozen=True)
class RealModel:
    """The model a stand-in stands for: its name and shape as published."""

    name: str
    params: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SIZES = {
    "360m": RealModel("SmolLM2-360M", 361_821_120, 960, 2560, 32, 15, 5),
    "1.7b": RealModel("SmolLM2-1.7B", 1_711_376_384, 2048, 8192, 24, 32, 32),
    "7b": RealModel("Llama-2-7B", 6_738_415_616, 4096, 11008, 32, 32, 32),
}


@dataclass(frozen=True)
class StandIn:
    """What a stand-in was built from and to; `model.stand_in` on the padded model."""

    size: str
    real: RealModel
    source_hidden: int
    source_layers: int
    source_params: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    params: int

    @property
    def label(self) -> str:
        return (f"stand-in {self.size}: {self.params / 1e9:.2f}B parameters at the cost of {self.real.name}, "
                f"computing the {self.source_params / 1e6:.0f}M source model's function (for measuring speed "
                "at that size, not a better model)")


def _dims(config) -> tuple[int, int, int, int, int, int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            kv, head_dim)


def count_params(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv: int, head_dim: int,
                 tied: bool) -> int:
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    per_layer = attn + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def repeat_heads(rows: torch.Tensor, head_dim: int, times: int) -> torch.Tensor:
    """A key / value projection's rows (or their groups, scales, biases) with each KV head's block
    of `head_dim` rows repeated `times` times in place: KV head j of the result is head j // times."""
    if times == 1:
        return rows
    return rows.reshape(-1, head_dim, *rows.shape[1:]).repeat_interleave(times, 0).reshape(-1, *rows.shape[1:])


def _kv_repeat(source_config, shape: StandIn) -> int:
    """How many of the stand-in's KV heads repeat each of the source's (plan: the real model's group)."""
    _, _, _, heads, kv, _ = _dims(source_config)
    return (heads // kv) // (shape.heads // shape.kv_heads)


def check_size(size: str) -> None:
    """A clear SpecUIError for a size that is not one of SIZES (before anything loads)."""
    if size not in SIZES:
        raise SpecUIError(f"unknown stand-in size '{size}'; choose one of {', '.join(SIZES)}")


def plan(config, size: str) -> StandIn:
    """The padded shape of `config`'s model for `size`; a clear SpecUIError for an unknown size,
    a model that is not Llama-family, or one already as large."""
    check_size(size)
    if getattr(config, "model_type", None) not in FAMILY:
        raise SpecUIError(f"stand-ins are built for Llama-family models ({', '.join(FAMILY)}); this target is "
                          f"'{getattr(config, 'model_type', type(config).__name__)}'")
    real = SIZES[size]
    hidden, inter, layers, heads, kv, head_dim = _dims(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    source_params = count_params(config.vocab_size, hidden, inter, layers, heads, kv, head_dim, tied)
    if source_params >= 0.9 * real.params:
        raise SpecUIError(f"this target has {source_params / 1e6:.0f}M parameters: a {size} stand-in "
                          f"({real.name}, {real.params / 1e6:.0f}M) would not be larger; choose a bigger size")
    new_layers = max(layers, real.layers)
    # query heads a KV head serves: a divisor of the source's group (each source KV head then repeated: exact),
    # the one whose KV cache per token is closest to the real model's (SmolLM2-1.7B, Llama-2-7B: one KV head a
    # query head, so 1)
    real_kv = real.layers * real.kv_heads * real.hidden // real.heads

    def width(d: int) -> int:  # widths that keep head_dim and the group d, in whole 4-bit groups of inputs
        unit = math.lcm(d * head_dim, MULTIPLE)
        return max(hidden, math.ceil(real.hidden / unit) * unit)

    group = min((d for d in range(1, heads // kv + 1) if (heads // kv) % d == 0),
                key=lambda d: abs(math.log(new_layers * width(d) / d / real_kv)))  # KV entries a token
    new_hidden = width(group)
    new_heads = new_hidden // head_dim
    fixed = count_params(config.vocab_size, new_hidden, 0, new_layers, new_heads, new_heads // group, head_dim, tied)
    new_inter = max(inter, round((real.params - fixed) / (3 * new_hidden * new_layers) / MULTIPLE) * MULTIPLE)
    params = count_params(config.vocab_size, new_hidden, new_inter, new_layers, new_heads, new_heads // group,
                          head_dim, tied)
    return StandIn(size, real, hidden, layers, source_params, new_hidden, new_inter, new_layers, new_heads,
                   new_heads // group, params)


def check_memory(shape: StandIn, bytes_per_param: float, device: torch.device, what: str) -> None:
    """Refuse, before anything is allocated, a stand-in that will not fit (needed vs available)."""
    need = shape.params * bytes_per_param
    have, where = free_memory(device), "GPU memory free" if device.type == "cuda" else "memory available"
    if have is not None and need > LOAD_SHARE * have:
        raise SpecUIError(f"the {shape.size} stand-in needs about {need / 2**30:.1f} GiB {what} and this machine has "
                          f"{have / 2**30:.1f} GiB {where}; choose a smaller size, bfloat16 or int4")


def _pad(src: torch.Tensor, shape: torch.Size, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    out = torch.zeros(shape, dtype=dtype)
    block = tuple(slice(0, n) for n in src.shape)
    out[block] = (src.float() * scale).to(dtype) if scale != 1.0 else src.to(dtype)
    return out


def matrix_params(shape: StandIn) -> int:
    """The decoder layers' matrices' parameters (attention and MLP) of a stand-in."""
    head_dim = shape.hidden // shape.heads
    attention = 2 * shape.hidden * shape.heads * head_dim + 2 * shape.hidden * shape.kv_heads * head_dim
    return shape.layers * (attention + 3 * shape.hidden * shape.intermediate)


def build(model: PreTrainedModel, shape: StandIn, dtype: torch.dtype,
          progress: Callable[[int, int], None] | None = None, lazy: frozenset[str] = frozenset()) -> PreTrainedModel:
    """The zero-padded copy of `model` (on the CPU, in `dtype`) with `model.stand_in = shape`;
    `progress(done, total)` as each tensor starts. The weights of the modules named in `lazy` are
    not built (one zero broadcast to their shape, no memory): their values come from elsewhere
    when they are quantized (a GGUF's own 4-bit blocks, padded: PaddedGroups), so a 7b stand-in
    on w4a8 never holds its 27 GB of float32 matrices; with `lazy`, the matrices of appended
    layers (all zeros) are such broadcasts too."""
    config = copy.deepcopy(model.config)
    norm_scale = math.sqrt(shape.source_hidden / shape.hidden)
    config.hidden_size, config.intermediate_size = shape.hidden, shape.intermediate
    config.num_attention_heads, config.num_key_value_heads = shape.heads, shape.kv_heads
    config.head_dim = _dims(model.config)[5]
    config.num_hidden_layers = shape.layers
    config.rms_norm_eps = model.config.rms_norm_eps * shape.source_hidden / shape.hidden
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * (shape.layers - shape.source_layers)
    with torch.device("meta"):
        padded = type(model)(config)
    source = model.state_dict()
    state = {}
    metas = padded.state_dict()
    repeat, head_dim = _kv_repeat(model.config, shape), config.head_dim
    for done, (name, meta) in enumerate(metas.items()):
        if progress is not None:
            progress(done, len(metas))
        src = source.get(name)
        appended = lazy and src is None and meta.dim() == 2  # an appended layer's matrix: zeros anyway
        if name.endswith(".weight") and (name.removesuffix(".weight") in lazy or appended):
            state[name] = torch.zeros((), dtype=dtype).expand(meta.shape)
        elif src is None:  # an appended layer: all zeros, the identity on the residual stream
            state[name] = torch.zeros(meta.shape, dtype=dtype)
        elif "norm" in name.rsplit(".", 2)[-2] and src.dim() == 1 and src.shape[0] == shape.source_hidden:
            state[name] = _pad(src, meta.shape, dtype, norm_scale)  # RMSNorm over the residual stream
        elif name.rsplit(".", 1)[0].endswith(KV_PROJECTIONS):
            state[name] = _pad(repeat_heads(src, head_dim, repeat), meta.shape, dtype)
        else:
            state[name] = _pad(src, meta.shape, dtype)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    padded.load_state_dict(state, assign=True, strict=True)
    buffers = dict(model.named_buffers())
    for name, buf in list(padded.named_buffers()):  # non-persistent buffers (rotary): head_dim-sized, copied
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            padded.get_submodule(owner)._buffers[leaf] = buffers[name].clone()
    if getattr(config, "tie_word_embeddings", False):
        padded.tie_weights()
    padded.stand_in = shape
    padded.name_or_path = getattr(model, "name_or_path", "")
    return padded.eval()


Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class PaddedGroups(Mapping):
    """A GGUF's 4-bit groups (q, scale, low) for the source's matrices, each padded to the
    stand-in's matrix when it is read (padded groups are exact zeros: q = 0, low = 0; scale 1).
    Lazily: all of a 7b stand-in's padded groups at once would take about 8 GiB (a byte per
    weight for q, float32 scales and lows) beside the model they quantize."""

    def __init__(self, groups: dict[str, Groups], padded: torch.nn.Module, repeat: int = 1) -> None:
        self.groups, self.padded, self.repeat = groups, padded, repeat  # repeat: _kv_repeat

    def __getitem__(self, name: str) -> Groups:
        q, scale, low = self.groups[name]
        if name.endswith(KV_PROJECTIONS):
            head_dim = self.padded.config.head_dim
            q, scale, low = (repeat_heads(t, head_dim, self.repeat) for t in (q, scale, low))
        n, k = self.padded.get_submodule(name).weight.shape
        q2 = torch.zeros((n, k), dtype=q.dtype)
        q2[: q.shape[0], : q.shape[1]] = q
        s2 = torch.ones((n, k // (q.shape[1] // scale.shape[1])), dtype=scale.dtype)
        s2[: scale.shape[0], : scale.shape[1]] = scale
        l2 = torch.zeros_like(s2, dtype=low.dtype)
        l2[: low.shape[0], : low.shape[1]] = low
        return q2, s2, l2

    def __iter__(self):
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)


def pad_groups(groups: dict[str, Groups], padded: torch.nn.Module, source_config) -> PaddedGroups:
    """The GGUF's groups as the stand-in's quantization reads them, one matrix at a time."""
    return PaddedGroups(groups, padded, _kv_repeat(source_config, padded.stand_in))


def draft_embeddings(target: PreTrainedModel) -> torch.nn.Embedding:
    """The input embeddings a draft made for the source model shares: a stand-in's first H
    columns (a view: no copy), or the target's own."""
    emb = target.get_input_embeddings()
    shape = getattr(target, "stand_in", None)
    if shape is None:
        return emb
    return torch.nn.Embedding.from_pretrained(emb.weight[:, : shape.source_hidden], freeze=True)


def is_source_copy(target: PreTrainedModel, draft: PreTrainedModel) -> bool:
    """Whether `draft` is a stand-in `target`'s source model or a copy of it: the same depth and
    width and the same input embeddings as the stand-in's real columns."""
    shape = getattr(target, "stand_in", None)
    if shape is None or getattr(draft, "stand_in", None) is not None:
        return False
    config = draft.config
    if (config.hidden_size, config.num_hidden_layers) != (shape.source_hidden, shape.source_layers):
        return False
    mine, theirs = draft_embeddings(target).weight, draft.get_input_embeddings().weight
    if mine.shape != theirs.shape:
        return False
    rows = torch.arange(0, mine.shape[0], max(1, mine.shape[0] // 256))
    a, b = mine[rows].float().cpu(), theirs[rows].float().cpu()
    return bool((a - b).abs().max() <= 1e-2 * a.abs().max())


def bitsandbytes(model: torch.nn.Module, quantization: str, dtype: torch.dtype) -> str:
    """Put a built stand-in's decoder matrices on bitsandbytes layers (4bit: nf4, computing in
    `dtype`; 8bit: LLM.int8()); they quantize when the model moves to its device. The output
    layer stays as it is (as transformers leaves it). The padding stays exact: nf4 quantizes
    blocks of 64 consecutive weights and int8 whole rows, so where the source's width is a
    multiple of 64 the real blocks are the source's own and the padded ones all zero (double
    quantization off, as transformers' own 4-bit config has it). Returns the load note."""
    import bitsandbytes as bnb

    from specui.weights.bnb_logs import NOTE, quiet_int8_cast

    swapped = 0
    for name, module in list(model.get_decoder().named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight.data
        if quantization == "4bit":
            layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                      compute_dtype=dtype, quant_type="nf4")
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=False)
        else:
            layer = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias=module.bias is not None,
                                        has_fp16_weights=False, threshold=6.0)
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        if module.bias is not None:
            layer.bias = module.bias
        replace_module(model.get_decoder(), name, layer)
        swapped += 1
    if quantization == "8bit":
        quiet_int8_cast()
    cast = f" ({NOTE.split(': ', 1)[1]})" if quantization == "8bit" else ""
    return f"stand-in quantized with bitsandbytes {quantization}: {swapped} decoder matrices{cast}"

