"""The SpecUI draft: a few decoder layers with the target's architecture, the target's own
input embeddings (shared at load time, never stored), and a reduced output head over the
K most frequent answer tokens (FR-Spec's idea). Logits come back over the full vocabulary,
-inf outside the head's tokens, so q~ is an ordinary distribution with q~(x) = 0 there and
verification stays lossless.

A subclass that only replaces the output head; the decoder itself is transformers' own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from specui.errors import SpecUIError
from specui.heads.feature_draft import MARKER, feature_layers, reads_features
from specui.weights.quantize import (
    GROUP,
    Int4Linear,
    Int8Linear,
    dequantize_groups,
    pack4,
    quantize_groups,
    quantize_rows,
    replace_module,
    unpack4,
    use_long_path,
)
from specui.weights.stand_in import draft_embeddings
from specui.weights.w4a8 import W4A8Linear, w4a8_vector
from specui.weights.w8a8 import W8A8Linear, full_range_exact, has_w8a8_kernel

EMBED_KEY = "model.embed_tokens.weight"
SCALE = ".int8_scale"
Q4, G_SCALE, G_LOW = ".int4_groups", ".int4_scale", ".int4_low"  # 4-bit groups: two per byte, low nibble first


class SpecUIDraftForCausalLM(LlamaForCausalLM):
    """Llama-architecture draft with a reduced-vocabulary head.
    config.specui_draft = {"head_size": K, "target_vocab": V, ...}; buffer token_map (K,)
    maps head rows to vocabulary ids. With "features": true it also reads the target's
    hidden state before each position (`features`, zeros where unknown), mixed into the
    token's embedding by `feature_fc` (H + H -> H): the state after the final norm, or with
    "feature_layers": [l1, l2, ...] the states after those decoder layers, each brought to the
    embeddings' RMS on its own (H + n H -> H)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        k = int(config.specui_draft["head_size"])
        self.lm_head = torch.nn.Linear(config.hidden_size, k, bias=False)
        self.register_buffer("token_map", torch.arange(k, dtype=torch.long), persistent=True)
        h = config.hidden_size
        sources = max(1, len(feature_layers(config)))
        self.feature_fc = torch.nn.Linear((1 + sources) * h, h, bias=False) if reads_features(config) else None

    def mix_features(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The decoder's input: the token embeddings with the target's states (zeros where None)."""
        emb = self.model.embed_tokens(input_ids)
        if features is None:
            features = emb.new_zeros((*emb.shape[:-1], self.feature_fc.in_features - emb.shape[-1]))
        scale = float(self.config.specui_draft.get("feature_scale", 1.0))  # states to the embeddings' size
        features = features.to(emb.dtype)
        if feature_layers(self.config):  # residual streams: sizes differ by layer and by token, so per vector
            parts = features.unflatten(-1, (-1, emb.shape[-1]))
            rms = parts.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
            features = (parts / rms).flatten(-2)
        return self.feature_fc(torch.cat([emb, features * scale], dim=-1))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., K) logits over the head's tokens."""
        return self.lm_head(hidden)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, logits_to_keep=0, labels=None, features=None, **kwargs):
        logits, _hidden, out = self._forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                             use_cache, logits_to_keep, features, **kwargs)
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states, attentions=out.attentions)

    def logits_and_hidden(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                          inputs_embeds=None, use_cache=None, logits_to_keep=0, features=None, **kwargs):
        """The forward's logits (1, rows, V) and the hidden states its head read (1, rows, H), no
        hook needed (engine/hidden.py: so SpecDec++'s and MCSD's draft forwards can be compiled)."""
        logits, hidden, _out = self._forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                             use_cache, logits_to_keep, features, **kwargs)
        return logits, hidden

    def _forward(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
                 logits_to_keep, features, **kwargs):
        if self.feature_fc is not None and inputs_embeds is None:
            inputs_embeds, input_ids = self.mix_features(input_ids, features), None
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        small = self.head_logits(hidden)
        logits = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        logits.index_copy_(-1, self.token_map, small)
        return logits, hidden, out


def use_kernels(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Swap every Linear whose weight was stored quantized for a module over those bytes
    (float32 CPU drafts): 4-bit groups on SpecUI's w4a8 kernel where it runs a vector path
    here (else torch's int4 kernel), int8 rows on w8a8's oneDNN product where it takes 8-bit
    activations exactly (else torch's int8 kernel): the draft's one-token forward is mostly
    these products' fixed costs, which SpecUI's kernels pay less of (README, "The draft on the
    target's kernels"). One no kernel takes stays dequantized. Returns how many of each kind
    were swapped ("w4a8", "int4", "w8a8", "int8")."""
    cpu = next(model.parameters()).device.type == "cpu"  # asked only there: asking builds SpecUI's kernels
    groups_here = cpu and w4a8_vector()
    rows_here = cpu and has_w8a8_kernel() and full_range_exact()
    swapped = {"w4a8": 0, "int4": 0, "w8a8": 0, "int8": 0}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or module.bias is not None:
            continue
        key, device, fast, kind = name + ".weight", module.weight.device, None, ""
        if key + Q4 in state:
            groups = _groups(state, key)
            if groups_here:
                fast, kind = W4A8Linear.from_groups(*groups), "w4a8"
            if fast is None:
                fast, kind = Int4Linear.from_groups(*groups, device), "int4"
        elif key + SCALE in state and state[key].dtype == torch.int8:
            rows, scale = state[key], state[key + SCALE].float().reshape(-1)
            if rows_here:
                fast, kind = W8A8Linear.from_rows(rows, scale), "w8a8"
            if fast is None:
                fast, kind = Int8Linear.from_stored(rows, scale, device), "int8"
        if fast is None:
            continue
        replace_module(model, name, fast)
        swapped[kind] += 1
    return swapped


def _groups(state: dict[str, torch.Tensor], key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, low) of a matrix stored as 4-bit groups (see quantize.quantize_groups)."""
    return unpack4(state[key + Q4]), state[key + G_SCALE].float(), state[key + G_LOW].float()


def is_specui_draft(folder: str | Path) -> bool:
    cfg = Path(folder) / "config.json"
    return cfg.is_file() and MARKER in json.loads(cfg.read_text(encoding="utf-8"))


def vocab_fingerprint(tokenizer) -> str:
    """A short hash of the token -> id map: a draft only fits targets with the same one."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha1(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def _int4_storable(key: str, v: torch.Tensor) -> bool:
    """The decoder layers' matrices go to 4-bit groups; the output head (and a feature
    draft's input mixer) stay on int8 rows, where 4 bits cost measurable agreement."""
    return key.startswith("model.layers.") and v.dim() == 2 and v.shape[1] % GROUP == 0


def _storage(key: str, v: torch.Tensor, layer_bits: int) -> str:
    """How a quantized save stores state-dict entry `key`: "int4" (4-bit groups), "int8" (rows)
    or "fp16" (everything that is not a float matrix)."""
    if not v.is_floating_point() or v.dim() != 2:
        return "fp16"
    return "int4" if layer_bits == 4 and _int4_storable(key, v) else "int8"


def stored_matrix(key: str, weight: torch.Tensor, layer_bits: int = 4) -> torch.Tensor:
    """What save_draft then load_draft (dequantized) give back for the 2-D float `weight` at
    state-dict `key`: 4-bit groups or int8 rows by save_draft's rule, scales rounded to fp16."""
    w = weight.detach().float()
    if _storage(key, w, layer_bits) == "int4":
        q, scale, low = quantize_groups(w)
        return dequantize_groups(q, scale.half().float(), low.half().float())
    rows, scale = quantize_rows(w)
    return rows.float() * scale.half().float()[:, None]


def save_draft(model: SpecUIDraftForCausalLM, folder: Path, tokenizer=None, quantized: bool = True,
               layer_bits: int = 4) -> None:
    """config.json + model.safetensors, without the input embeddings (they are the
    target's). Quantized (the default): the decoder layers' matrices as `layer_bits` 4
    (groups of 32 inputs, each with an fp16 scale and minimum) or 8 (int8 rows, one fp16
    scale per row), every other matrix as int8 rows; the rest as fp16. Loading dequantizes
    them or computes with them directly (use_kernels); the draft's quality is measured
    after this round trip."""
    if layer_bits not in (4, 8):
        raise ValueError(f"layer_bits must be 4 or 8, not {layer_bits}")
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [SpecUIDraftForCausalLM.__name__]
    if tokenizer is not None:
        model.config.specui_draft = {**model.config.specui_draft, "vocab_fingerprint": vocab_fingerprint(tokenizer)}
    model.config.save_pretrained(folder)
    state = {}
    for k, v in model.state_dict().items():
        if k == EMBED_KEY:
            continue
        v = v.detach().cpu()
        kind = _storage(k, v, layer_bits) if quantized else "fp16"
        if kind == "int4":
            q, scale, low = quantize_groups(v)
            state.update({k + Q4: pack4(q), k + G_SCALE: scale.to(torch.float16).contiguous(),
                          k + G_LOW: low.to(torch.float16).contiguous()})
        elif kind == "int8":
            rows, scale = quantize_rows(v)
            state[k] = rows.contiguous()
            state[k + SCALE] = scale[:, None].to(torch.float16)
        else:
            state[k] = v.to(torch.float16).contiguous() if v.is_floating_point() else v.contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _dequantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.endswith((SCALE, G_SCALE, G_LOW)):
            continue
        if k.endswith(Q4):
            key = k.removesuffix(Q4)
            out[key] = dequantize_groups(*_groups(state, key))
            continue
        scale = state.get(k + SCALE)
        out[k] = v.float() * scale.float() if scale is not None else v
    return out


class CastEmbedding(torch.nn.Module):
    """The target's input embeddings (shared, not copied) seen in the draft's dtype, for a
    draft that runs in another dtype than its target (e.g. a float32 int8-kernel draft
    beside a bfloat16 target). The table is held outside the module tree, so the draft's
    parameters (and `draft.dtype`, which transformers reads for its masks) are its own."""

    def __init__(self, embedding: torch.nn.Embedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.__dict__["embedding"] = embedding  # not registered: the target owns it
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).to(self.dtype)


def made_for_vocabulary(folder: str | Path, tokenizer) -> bool:
    """Whether the SpecUI draft in `folder` was trained on `tokenizer`'s vocabulary."""
    return AutoConfig.from_pretrained(folder).specui_draft.get("vocab_fingerprint") == vocab_fingerprint(tokenizer)


def misfit(folder: str | Path, target: PreTrainedModel, tokenizer=None, config=None) -> str | None:
    """Why the SpecUI draft in `folder` cannot draft for `target` (it shares the target's
    embeddings, so it fits only the vocabulary and width it was trained on), or None."""
    config = config if config is not None else AutoConfig.from_pretrained(folder)
    made_for = config.specui_draft.get("vocab_fingerprint")
    if tokenizer is not None and made_for and made_for != vocab_fingerprint(tokenizer):
        return (f"the draft in {folder} was trained for a target with another tokenizer "
                "(vocabulary fingerprints differ); pick the target it was made for")
    emb = draft_embeddings(target)  # a stand-in's source columns: the draft was made for the source
    if config.vocab_size != emb.num_embeddings or config.hidden_size != emb.embedding_dim:
        return (f"the draft in {folder} was made for a target with vocabulary {config.vocab_size} and hidden size "
                f"{config.hidden_size}; this target has {emb.num_embeddings} and {emb.embedding_dim}")
    return None


def load_draft(folder: str | Path, target: PreTrainedModel, tokenizer=None,
               kernels: bool = True, dtype: torch.dtype | None = None) -> SpecUIDraftForCausalLM:
    """Load a SpecUI draft and share the target's input embeddings with it. With the
    target's tokenizer given, check the draft was made for this vocabulary. The draft runs
    in `dtype` (default: the target's). A float32 draft on CPU computes its quantized
    matrices on kernels (use_kernels: SpecUI's w4a8 / w8a8 where they run here, else torch's
    int4 / int8) unless `kernels` is False (then they are dequantized to float32)."""
    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    why = misfit(folder, target, tokenizer, config)
    if why:
        raise SpecUIError(why)
    emb = draft_embeddings(target)  # a stand-in's source columns: the draft was made for the source
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # no random draws for weights read next (0.6 s of a 3 s load)
        model = SpecUIDraftForCausalLM(config)
    model.model.embed_tokens = torch.nn.Embedding(1, 1)  # placeholder until the target's is attached
    stored = load_file(str(folder / "model.safetensors"))
    state = _dequantize(stored)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {EMBED_KEY}:
        raise SpecUIError(f"the draft weights in {folder} do not match its config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    if dtype is None:
        dtype = emb.weight.dtype if emb.weight.is_floating_point() else torch.float32
    model = model.to(device=emb.weight.device, dtype=dtype)
    # shared with the target, not copied
    model.model.embed_tokens = emb if emb.weight.dtype == dtype else CastEmbedding(emb, dtype)
    if kernels and dtype == torch.float32:
        use_kernels(model, stored)
        use_long_path(model, "draft")
    return model.eval()
