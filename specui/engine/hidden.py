"""Hidden states: read through hooks (a forward's output-layer input, a feature draft's sources),
and a forward that returns the hidden states its output layer read beside the logits, with no hook.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from transformers import PreTrainedModel

from specui.errors import SpecUIError

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


@contextmanager
def output_layer_inputs(model: PreTrainedModel) -> Iterator[list[torch.Tensor]]:
    """Collect what the model's output layer reads (its hidden states after the final norm,
    already cut to logits_to_keep) during the forwards inside the block."""
    seen: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        hook.remove()


def feature_sources(model: PreTrainedModel, layers: Sequence[int] = ()) -> list[torch.nn.Module]:
    """The modules whose outputs a feature draft reads: the final norm (no `layers`), or these
    decoder layers (their output residual stream, low / middle / high as in EAGLE-3)."""
    decoder = model.get_decoder()
    if not layers:
        norm = getattr(decoder, "norm", None)
        if norm is None:
            raise SpecUIError("a feature draft needs a target whose decoder ends in a final norm (Llama-like)")
        return [norm]
    blocks = getattr(decoder, "layers", None)
    n = 0 if blocks is None else len(blocks)
    if not all(-n <= i < n for i in layers):
        raise SpecUIError(f"the draft reads the target's layers {list(layers)}, but the target has {n} decoder layers")
    return [blocks[i] for i in layers]


@contextmanager
def capture_features(model: PreTrainedModel, layers: Sequence[int] = ()) -> Iterator[Callable[[], torch.Tensor]]:
    """While inside, every forward of `model` records its feature sources' outputs; the yielded
    function gives the last forward's, concatenated on the last dim ((B, T, H * sources))."""
    sources = feature_sources(model, layers)
    last: list[torch.Tensor | None] = [None] * len(sources)

    def keep(i: int):
        return lambda _m, _a, out: last.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    hooks = [m.register_forward_hook(keep(i)) for i, m in enumerate(sources)]
    try:
        yield lambda: torch.cat(last, dim=-1)
    finally:
        for h in hooks:
            h.remove()
