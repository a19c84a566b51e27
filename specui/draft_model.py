"""The SpecUI draft: a few decoder layers with the target's architecture, the target's own
input embeddings (shared at load time, never stored), and a reduced output head over the
K most frequent answer tokens (FR-Spec's idea). Logits come back over the full vocabulary,
-inf outside the head's tokens, so q~ is an ordinary distribution with q~(x) = 0 there and
verification stays lossless.

A subclass that only replaces the output head; the decoder itself is transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from specui.errors import SpecUIError

MARKER = "specui_draft"  # config.json key that marks a SpecUI draft folder
EMBED_KEY = "model.embed_tokens.weight"


class SpecUIDraftForCausalLM(LlamaForCausalLM):
    """Llama-architecture draft with a reduced-vocabulary head.
    config.specui_draft = {"head_size": K, "target_vocab": V, ...}; buffer token_map (K,)
    maps head rows to vocabulary ids."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        k = int(config.specui_draft["head_size"])
        self.lm_head = torch.nn.Linear(config.hidden_size, k, bias=False)
        self.register_buffer("token_map", torch.arange(k, dtype=torch.long), persistent=True)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., K) logits over the head's tokens."""
        return self.lm_head(hidden)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, logits_to_keep=0, labels=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        small = self.head_logits(hidden)
        logits = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        logits.index_copy_(-1, self.token_map, small)
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states, attentions=out.attentions)


def is_specui_draft(folder: str | Path) -> bool:
    cfg = Path(folder) / "config.json"
    return cfg.is_file() and MARKER in json.loads(cfg.read_text())


def save_draft(model: SpecUIDraftForCausalLM, folder: Path, dtype: torch.dtype = torch.float16) -> None:
    """config.json + model.safetensors (no input embeddings: they are the target's)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [SpecUIDraftForCausalLM.__name__]
    model.config.save_pretrained(folder)
    state = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in model.state_dict().items() if k != EMBED_KEY}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_draft(folder: str | Path, target: PreTrainedModel) -> SpecUIDraftForCausalLM:
    """Load a SpecUI draft and share the target's input embeddings with it."""
    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    emb = target.get_input_embeddings()
    if config.vocab_size != emb.num_embeddings or config.hidden_size != emb.embedding_dim:
        raise SpecUIError(
            f"the draft in {folder} was made for a target with vocabulary {config.vocab_size} and hidden size "
            f"{config.hidden_size}; this target has {emb.num_embeddings} and {emb.embedding_dim}"
        )
    model = SpecUIDraftForCausalLM(config)
    model.model.embed_tokens = torch.nn.Embedding(1, 1)  # placeholder until the target's is attached
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {EMBED_KEY}:
        raise SpecUIError(f"the draft weights in {folder} do not match its config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    dtype = emb.weight.dtype if emb.weight.is_floating_point() else torch.float32
    model = model.to(device=emb.weight.device, dtype=dtype)
    model.model.embed_tokens = emb  # shared with the target, not copied
    return model.eval()
