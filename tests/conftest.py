"""Shared fixtures: tiny random-weight models built from a config (no hub, no files)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_VOCAB = 64
EOS = 2


class TinyTokenizer:
    """Decodes ids as 't<id> ' words; enough for the engine (which works on ids)."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"t{i} " for i in ids if not (skip_special_tokens and i == EOS))


def tiny_llama(seed: int, layers: int = 2, vocab: int = TINY_VOCAB, dtype=torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # sharper distributions than the default init, so runs are varied
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    return tiny_llama(0, layers=3)


@pytest.fixture(scope="session")
def tiny_draft() -> LlamaForCausalLM:
    return tiny_llama(1, layers=1)


@pytest.fixture()
def tiny_engine(tiny_target, tiny_draft):
    from specui.engine import Engine

    return Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
