"""Hidden states without hooks (engine/hidden.py): over a static cache a forward asked for the
hidden states its output layer read returns them beside the logits, in every forward mode
(exact, padded buckets, CUDA graphs through a stand-in graph, compiled), equal to what a hook
reads on the eager growing cache; a model with no known hook-free forward still reads them
through hooks; SpecDec++'s and MCSD's drafts replay captured hidden-state forwards and decode as
autoregressive; a hidden-state compile that fails leaves only those forwards eager."""

import copy
import threading

import pytest
import torch
from conftest import EOS, TINY_VOCAB, TinyTokenizer, tiny_llama
from test_capture import EagerGraphs, static
from test_greedy_equivalence import PROMPTS
from test_mcsd_fork import decision_models
from test_specdec import make_head
from transformers import LlamaForCausalLM

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.capture import StaticForward
from specui.engine.hidden import logits_and_hidden
from specui.engine.session import ModelSession
from specui.weights.draft import SpecUIDraftForCausalLM


def specui_draft(seed: int = 2) -> SpecUIDraftForCausalLM:
    """A SpecUI draft (reduced head, a token map) over a tiny Llama's weights: half the
    vocabulary in its head, so the logits it returns are a scatter, not the head's own."""
    source = tiny_llama(seed, layers=2)
    config = copy.deepcopy(source.config)
    config.specui_draft = {"head_size": TINY_VOCAB // 2}
    draft = SpecUIDraftForCausalLM(config).to(source.dtype)
    state = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    draft.load_state_dict(state, strict=False)
    with torch.no_grad():
        draft.lm_head.weight.copy_(source.lm_head.weight[: TINY_VOCAB // 2])
        order = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(seed))
        draft.token_map.copy_(order[: TINY_VOCAB // 2])
    return draft.eval()


class CustomForward(LlamaForCausalLM):
    """A causal LM whose forward is its own: no hook-free hidden-state forward is assumed."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def with_runner(model, mode: str, compiled: bool = False) -> ModelSession:
    session = ModelSession(model, capture="on")
    graphs = EagerGraphs() if mode == "graphs" else None
    session.runner = StaticForward(model, session.cache, mode, graphs=graphs, compiled=compiled)
    return session


def hidden_steps(session: ModelSession) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prefill's last row, a chain of 3 tokens, one token, and a tree of 4 nodes: (logits, hidden) each."""
    from specui.engine.tree import TokenTree

    ids = [1, 5, 9, 13, 7]
    out = [session.advance_with_hidden(ids, 1)]
    ids += [22, 4, 30]
    out.append(session.advance_with_hidden(ids, 3))
    ids += [8]
    out.append(session.advance_with_hidden(ids, 1))
    tree = TokenTree(tokens=[3, 11, 12, 40], parents=[-1, 0, 0, 1])
    out.append(session.with_hidden(session.forward_tree, ids + [17], tree))
    return out


@pytest.mark.parametrize("make", [lambda: tiny_llama(4, layers=2), specui_draft], ids=["llama", "specui-draft"])
@pytest.mark.parametrize("mode", ["exact", "buckets", "graphs"])
def test_the_runner_returns_the_hidden_states_a_hook_reads(make, mode, monkeypatch):
    from specui.engine import session as session_module

    model = make()
    assert logits_and_hidden(model) is not None
    session = with_runner(model, mode)
    reference = hidden_steps(ModelSession(model))  # the growing cache: read through a hook
    monkeypatch.setattr(session_module, "output_layer_inputs", lambda _m: pytest.fail("a hook read them"))
    for (logits, hidden), (ref_logits, ref_hidden) in zip(hidden_steps(session), reference, strict=True):
        assert hidden.shape == ref_hidden.shape == (logits.shape[0], model.config.hidden_size)
        assert torch.allclose(logits, ref_logits, atol=1e-10) and torch.allclose(hidden, ref_hidden, atol=1e-10)
    runner = session.runner
    if mode == "graphs":  # replayed from graphs of their own, beside none of the plain forward's
        assert runner.replays > 0 and runner.captured() and all(k[-1] == "hidden" for k in runner.captured())
    if mode == "exact":
        assert runner.eager == 4


def test_a_model_without_a_known_hook_free_forward_reads_through_hooks():
    source = tiny_llama(4, layers=2)
    model = CustomForward(source.config).to(source.dtype).eval()
    model.load_state_dict(source.state_dict())
    assert logits_and_hidden(model) is None
    session = with_runner(model, "graphs")
    reference = hidden_steps(ModelSession(source))
    for (logits, hidden), (ref_logits, ref_hidden) in zip(hidden_steps(session), reference, strict=True):
        assert torch.allclose(logits, ref_logits, atol=1e-10) and torch.allclose(hidden, ref_hidden, atol=1e-10)
    assert session.runner.replays == 0 and session.runner.eager == 4  # exact forwards, as before


def test_compiled_hidden_state_forwards_equal_the_hooked_ones():
    model = tiny_llama(6, layers=1, dtype=torch.float32)
    session = with_runner(model, "buckets", compiled=True)
    reference = hidden_steps(ModelSession(model))
    for (logits, hidden), (ref_logits, ref_hidden) in zip(hidden_steps(session), reference, strict=True):
        assert torch.allclose(logits, ref_logits, atol=1e-4) and torch.allclose(hidden, ref_hidden, atol=1e-5)
    runner = session.runner
    if runner.hidden_problem:  # a machine without a C++ compiler: eager, and said
        assert any(n.startswith("hidden-state forwards not compiled") for n in runner.notes)
    else:
        assert runner.compiled_runs == 4 and runner.eager == 0


@pytest.mark.parametrize("name,params,extra,waits", [
    ("specdec++", {"threshold": 0.6}, lambda: {"acceptance_head": make_head(32, 1, 1.0)}, False),
    ("specdec++", {"threshold": 0.6}, lambda: {"acceptance_head": make_head(32, 1, 1.0, reads="before")}, True),
    ("mcsd", {"width": 3, "gamma": 3}, lambda: {"decision": decision_models(32, 0.0)}, False),
])
def test_specdec_and_mcsd_drafts_replay_captured_hidden_state_forwards(name, params, extra, waits, monkeypatch):
    """`waits`: reads treated as a GPU's (SpecDec++ then drafts on the device, in chunks)."""
    from specui.engine import sampling
    from specui.engine import session as session_module

    monkeypatch.setattr(sampling, "reads_wait", lambda device: waits)

    def no_hooks(_model):
        raise AssertionError("a hook was asked for the hidden states")

    monkeypatch.setattr(session_module, "output_layer_inputs", no_hooks)
    target, draft = tiny_llama(0, layers=3), tiny_llama(1, layers=1)
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on", **extra())
    static(on, "graphs")
    for prompt in PROMPTS:
        reference = off.generate(GenerationRequest(list(prompt), 30), make_method("autoregressive")).run()
        gen = on.generate(GenerationRequest(list(prompt), 30), make_method(name, **params)).run()
        assert gen.output_ids == reference.output_ids
        assert any(s.drafted for s in gen.steps)
    runner = on.draft.runner
    assert any(k[-1] == "hidden" for k in runner.captured()) and runner.replays > 0


def test_a_failed_hidden_state_compile_leaves_only_those_forwards_eager():
    from torch._dynamo.exc import BackendCompilerFailed

    model = tiny_llama(7, layers=1)
    session = with_runner(model, "buckets")
    runner = session.runner
    runner.fn = lambda **kw: model(**kw)  # stands for a compiled forward that works

    def broken(**_kw):
        raise BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler"), None)

    runner.hidden_fn = broken
    reference = hidden_steps(ModelSession(model))
    for (logits, hidden), (ref_logits, ref_hidden) in zip(hidden_steps(session), reference, strict=True):
        assert torch.allclose(logits, ref_logits, atol=1e-10) and torch.allclose(hidden, ref_hidden, atol=1e-10)
    assert runner.hidden_fn is runner.hidden_call and runner.fn is not runner.model
    assert "hidden-state forwards not compiled: BackendCompilerFailed" in runner.notes[0]
    session.advance([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1)
    assert runner.compiled_runs == 1  # the plain forward still runs its compile


def paused_background(model) -> tuple[ModelSession, "threading.Event"]:
    """A session that compiles in the background, paused while the returned event is set (a
    reply decodes), its first plain shapes cancelled: only what a test asks for compiles."""
    decoding = threading.Event()
    decoding.set()
    session = ModelSession(model, capture="on", background=True)
    session.runner.warmup.paused = decoding.is_set
    session.runner.warmup.cancel()
    return session, decoding


def test_hidden_state_shapes_compile_in_the_background_and_run_compiled_once_ready():
    """With a Warmup (`--capture auto` on a CPU that measured compiled forwards faster), a
    hidden-state forward whose shape is not compiled yet runs eagerly and asks for it; the
    Warmup compiles it on a scratch cache once no reply decodes; from then on it runs compiled,
    and the Model tab's line counts it."""
    from test_background_compile import SETTLE_S

    from specui.service.reports import capture_line

    model = tiny_llama(8, layers=1, dtype=torch.float32, hidden=48)  # shapes no other test compiled
    session, decoding = paused_background(model)
    runner = session.runner
    warmup = runner.warmup
    reference = ModelSession(model)
    ids = [1, 5, 9, 13, 7]
    got, want = session.advance_with_hidden(ids, 1), reference.advance_with_hidden(ids, 1)
    assert runner.compiled_runs == 0
    shape = (5, 256, runner.cache.capacity, "hidden")
    assert shape in warmup.queue
    decoding.clear()
    assert warmup.wait(SETTLE_S), warmup.queue
    assert shape in warmup.compiled and not runner.hidden_problem, runner.notes
    ids += [22, 4, 30, 8, 17]
    got2, want2 = session.advance_with_hidden(ids, 5), reference.advance_with_hidden(ids, 5)
    assert runner.compiled_runs == 1
    for (a, ha), (b, hb) in ((got, want), (got2, want2)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ha, hb, atol=1e-5, rtol=1e-5)
    report = {"setting": "auto", "draft": {"mode": "buckets+compiled", "background": True, "notes": [],
                                           "compiled": [list(s) for s in warmup.compiled],
                                           "compiling": [], "compile_s": warmup.seconds}}
    assert "1 hidden-state shape" in capture_line(report) and "beam-rows" not in capture_line(report)


def test_a_failed_hidden_state_capture_runs_eagerly_and_says_so():
    """A CUDA graph of a hidden-state forward that fails to capture leaves that shape eager, and
    the capture report (the Model tab's) names it."""
    target, draft = tiny_llama(0, layers=3), tiny_llama(1, layers=1)
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on",
                acceptance_head=make_head(32, 1, 1.0))
    static(on, "graphs", fail=True)
    want = off.generate(GenerationRequest(list(PROMPTS[0]), 24), make_method("autoregressive")).run().output_ids
    got = on.generate(GenerationRequest(list(PROMPTS[0]), 24), make_method("specdec++", threshold=0.6)).run()
    assert got.output_ids == want
    notes = on.capture_report()["draft"]["notes"]
    assert any("(with hidden states): eager (capture failed: RuntimeError" in n for n in notes), notes


def test_a_background_hidden_state_compile_that_fails_leaves_those_forwards_eager(monkeypatch):
    """A Warmup whose hidden-state compile fails turns only those forwards eager (with a note),
    drops the hidden-state shapes still queued, and keeps compiling the plain forward's."""
    from test_background_compile import SETTLE_S
    from torch._dynamo.exc import BackendCompilerFailed

    from specui.engine import warmup as warmup_module

    monkeypatch.setattr(warmup_module, "_fresh_compile_cache", lambda: False)
    model = tiny_llama(9, layers=1, dtype=torch.float32)
    session, decoding = paused_background(model)
    runner = session.runner
    warmup = runner.warmup

    def broken(**_kw):
        raise BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler"), None)

    runner.hidden_fn = broken
    plain = runner.fn
    capacity = runner.cache.capacity
    first, second = (3, 256, capacity, "hidden"), (5, 256, capacity, "hidden")
    warmup.ask(first)
    warmup.ask(second)
    decoding.clear()
    assert warmup.wait(SETTLE_S), warmup.queue
    assert runner.hidden_fn is runner.hidden_call and runner.fn is plain
    assert first not in warmup.compiled and second not in warmup.compiled and not warmup.queue
    assert any(n.startswith("hidden-state forwards not compiled: BackendCompilerFailed") for n in runner.notes)
    warmup.ask((4, 256, capacity, "hidden"))  # that forward stays eager: nothing to ask for
    assert not warmup.queue


@pytest.mark.parametrize("reads", ["before", "after"])
def test_specdec_drafting_on_a_device_reads_in_chunks_and_drafts_the_same_chain(reads, monkeypatch):
    """Where reads wait (a GPU; a CPU told so here), SpecDec++'s greedy drafting keeps each
    argmax and a_t on the device and reads DEVICE_CHUNK candidates at a time: the same tokens,
    rows, a_t, risks and stop reasons as one candidate at a time, for stops by the head, by
    gamma_max and by an EOS, and the cache holds the chain's true ids after it."""
    from specui.engine import sampling
    from specui.engine.methods import specdec

    draft = tiny_llama(1, layers=1)
    context = [1, 5, 9, 13, 7, 22]
    cases, reasons = [], set()
    for bias, threshold, gamma_max in ((3.0, 0.9, 3), (1.0, 0.6, 8), (0.0, 0.3, 8), (2.0, 0.5, 6), (4.0, 0.95, 2)):
        head = make_head(32, 1, bias, reads=reads)
        for eos in (frozenset(), None):
            one = with_runner(draft, "buckets")
            want = specdec.draft_adaptive(one, head, context, threshold, gamma_max, SamplingConfig(), None,
                                          eos or frozenset())
            if eos is None:  # the second candidate an EOS, where there is one
                if len(want.tokens) < 2:
                    continue
                eos = frozenset({want.tokens[1]})
                one = with_runner(draft, "buckets")
                want = specdec.draft_adaptive(one, head, context, threshold, gamma_max, SamplingConfig(), None, eos)
            cases.append((head, threshold, gamma_max, eos, want, one))
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "reads_wait", lambda device: True)
        patch.setattr(specdec, "drawn", lambda *a: pytest.fail("a candidate was read on its own"))
        for head, threshold, gamma_max, eos, want, one in cases:
            chained = with_runner(draft, "buckets")
            assert chained.feeds_device_tokens and chained.hidden_without_hooks
            got = specdec.draft_adaptive(chained, head, context, threshold, gamma_max, SamplingConfig(), None, eos)
            assert (got.tokens, got.stop_reason) == (want.tokens, want.stop_reason)
            assert got.accept == want.accept and got.risk == want.risk
            assert all(torch.equal(a, b) for a, b in zip(got.q_rows, want.q_rows, strict=True))
            assert chained.cached_ids[: len(one.cached_ids)] == one.cached_ids and -1 not in chained.cached_ids
            reasons.add(want.stop_reason)
    assert {"threshold", "gamma_max", "eos"} <= reasons
