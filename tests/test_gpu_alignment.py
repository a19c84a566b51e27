"""What CUDA's kernels need, checked on a CPU: every tensor the static-cache forwards hand to
attention starts at a 16-byte-aligned address. CUDA's SDPA faults on a misaligned one (the H100
run of 2026-11-27: a one-row causal mask was a view 4 bytes into its template), and a CUDA error
ends the process's use of the device, so the bug only showed on a GPU. Here every attention
call of every method's static-cache forwards (eager, as `--capture` runs them inside CUDA
graphs) is checked, hidden-state reads included."""

import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.session import ModelSession

PROMPT = [5, 17, 9, 30, 4, 22, 11]


def checked_sdpa(monkeypatch) -> list[int]:
    """Route torch's SDPA through an alignment check; returns the list of calls checked."""
    real = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        for name, t in (("query", query), ("key", key), ("value", value), ("mask", attn_mask)):
            if isinstance(t, torch.Tensor):
                assert t.data_ptr() % 16 == 0, f"{name} {tuple(t.shape)} starts {t.data_ptr() % 16} bytes off 16"
        calls.append(1)
        return real(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    return calls


def uncompiled(engine: Engine) -> Engine:
    for session in (engine.target, engine.draft):
        session.runner.fn = session.runner.model  # the padded shapes eagerly: what a CUDA graph captures
    return engine


def test_every_method_hands_attention_aligned_tensors(monkeypatch):
    calls = checked_sdpa(monkeypatch)
    target, draft = tiny_llama(0, layers=2, dtype=torch.float32), tiny_llama(1, layers=1, dtype=torch.float32)
    engine = uncompiled(Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on"))
    for name, params in [("autoregressive", {}), ("speculative", {"gamma": 3}), ("opt-tree", {}), ("tree", {}),
                         ("mcsd", {}), ("specdec++", {}), ("lookup", {}), ("auto", {})]:
        engine.generate(GenerationRequest(list(PROMPT), 12), make_method(name, **params)).run()
    assert len(calls) > 100


def test_hidden_state_reads_hand_attention_aligned_tensors(monkeypatch):
    """The forward that faulted: one token, its hidden state read through hooks (SpecDec++'s
    head, MCSD's decision models), at every offset into the cache."""
    calls = checked_sdpa(monkeypatch)
    session = ModelSession(tiny_llama(2, layers=1, dtype=torch.float32), capture="on")
    session.runner.fn = session.runner.model
    ids = list(PROMPT)
    session.advance(ids, 1)
    for i in range(9):
        ids.append(3 + i)
        session.advance_with_hidden(ids, 1)
    assert len(calls) == 10
