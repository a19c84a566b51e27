"""A forward that returns the hidden states its output layer read beside the logits, with no hook.

SpecDec++'s acceptance head and MCSD's decision models read the draft's hidden state after the
final norm (what the output layer reads). Read through a hook, that forward had to run eagerly
at its real shapes (a compiled or captured forward runs no Python hook), so those methods' drafts
paid the eager cost: on an H200, 9.9 ms (specdec++) and 25.1 ms (mcsd) of draft a step against
1.1 ms for a captured gamma-2 chain (assets/bench/gpu/2026-12-04-h200-second/). Here the forward
returns both, so it compiles and captures like any other (engine/capture.py, `hidden=True`).

Which models: one that says how (`logits_and_hidden`, as SpecUI's drafts do: weights/draft.py),
or one whose class's forward is known to be exactly "decoder, then the output layer on the last
rows" (the Llama-family classes below); any other reads its hidden states through hooks, as
before (None here)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

import torch

# (module, class) of causal LMs whose forward is the decoder, then the output layer on the last
# `logits_to_keep` rows and nothing after it (no soft-capping, no logit scale)
PLAIN = (("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
         ("qwen3", "Qwen3ForCausalLM"))


def _plain_forwards() -> set:
    forwards = set()
    for module, name in PLAIN:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
        except (ImportError, AttributeError):  # a transformers without that model
            continue
        forwards.add(cls.forward)
    return forwards


def decoder_then_head(model: torch.nn.Module, input_ids=None, attention_mask=None, position_ids=None,
                      past_key_values=None, use_cache=None, logits_to_keep: int = 0, **kwargs):
    """What a plain causal LM's forward computes, with the output layer's input kept:
    (logits (1, rows, V), hidden (1, rows, H)) for the last `logits_to_keep` rows (0: all)."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache, **kwargs)
    hidden = out.last_hidden_state
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:]
    return model.get_output_embeddings()(hidden), hidden


def logits_and_hidden(model: torch.nn.Module) -> Callable | None:
    """The model's forward returning (logits, hidden) (each (1, rows, .)), taking the model's
    keyword arguments; None where only a hook can read its hidden states."""
    own = getattr(model, "logits_and_hidden", None)
    if callable(own):
        return own
    if type(model).forward in _plain_forwards():
        return partial(decoder_then_head, model)
    return None
