"""Reading a step's probabilities where each read waits for the device (a GPU): the greedy
step's argmax, log-sum-exp and largest logit in one read (`device_row_stats`), a trace's
entries in one read (`read_entries`), the same values the one-by-one reads give. The GPU's
path is run here on a CPU by making the engine treat CPU memory as a GPU's."""

import math

import numpy as np
import pytest
import torch

from specui.engine import sampling
from specui.engine.sampling import SamplingConfig, SoftmaxEntries, device_row_stats, read_entries


def logit_rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(5, 3001, generator=g) * 3
    rows[1] = (rows[1] * 2).round() / 2  # ties: the first maximum wins, as numpy's argmax
    rows[2, ::2] = float("-inf")  # masked entries
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_device_row_stats_are_argmax_logsumexp_and_the_top_logit(dtype):
    rows = logit_rows(0).to(dtype)
    best, lse, top = device_row_stats(rows)
    assert best == np.argmax(rows.numpy(), axis=-1).tolist()
    assert lse == pytest.approx(torch.logsumexp(rows.double(), -1).tolist(), rel=1e-6)
    assert top == [float(rows[r, b]) for r, b in enumerate(best)]  # exactly the entry at the argmax
    one = device_row_stats(rows[3])  # one row (V,)
    assert one[0] == [best[3]] and one[2] == [top[3]]


def test_softmax_entries_with_the_top_logit_read_the_same_probabilities():
    rows = logit_rows(1)
    best, lse, top = device_row_stats(rows)
    shown = SoftmaxEntries(rows, lse, best, top)
    want = rows.double().softmax(-1)
    pairs = [(r, c) for r in range(5) for c in (0, 7, 3000, best[r])]
    for r, c in pairs:
        assert shown[r, c] == pytest.approx(float(want[r, c]), rel=1e-5, abs=1e-12)
    rs, cs = [r for r, _ in pairs], [c for _, c in pairs]
    assert shown.read(rs, cs) == [shown[r, c] for r, c in pairs]
    one = SoftmaxEntries(rows[4], [lse[4]], [best[4]], [top[4]])
    assert one[best[4]] == math.exp(top[4] - lse[4]) and one[9] == pytest.approx(float(want[4, 9]), rel=1e-5)


@pytest.mark.parametrize("waits", [False, True])
def test_read_entries_gives_what_reading_one_by_one_gives(monkeypatch, waits):
    table = logit_rows(2).softmax(-1)
    rows, cols = [0, 4, 4, 1, 2], [5, 0, 2999, 17, 4]
    want = [float(table[r, c]) for r, c in zip(rows, cols)]
    monkeypatch.setattr(sampling, "reads_wait", lambda device: waits)  # True: one gather, as on a GPU
    assert sampling._gather(table, rows, cols) == want
    assert read_entries(table, rows, cols) == want
    assert read_entries(table, [], []) == []
    best, lse, _ = device_row_stats(logit_rows(2))
    no_top = SoftmaxEntries(logit_rows(2), lse, best)  # the CPU kernel's kind: no top logits
    assert no_top.read(rows, cols) == [no_top[r, c] for r, c in zip(rows, cols)]


@pytest.mark.parametrize("method,params", [("autoregressive", {}), ("speculative", {"gamma": 3}),
                                           ("speculative", {"gamma": 5, "confidence": 0.5}), ("auto", {}),
                                           ("opt-tree", {"nodes": 8, "delta": 0.05}), ("mcsd", {}), ("specdec++", {})])
def test_greedy_methods_decode_and_trace_the_same_when_reads_wait(monkeypatch, method, params):
    """The GPU's way of reading (stats and entries in one read each, no kernel) gives the same
    reply token for token and the same trace probabilities as the CPU's."""
    from conftest import EOS, TinyTokenizer, assert_same_node_probabilities, tiny_llama

    from specui.engine import Engine, GenerationRequest, make_method

    target, draft = tiny_llama(3, layers=2, dtype=torch.float32), tiny_llama(4, layers=1, dtype=torch.float32)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    runs, reads = {}, []
    gather = sampling._gather
    for waits in (False, True):
        if waits:
            monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
            monkeypatch.setattr(sampling, "row_stats", lambda rows, lse: None)
            monkeypatch.setattr(sampling, "_gather", lambda *a, **k: reads.append(len(a[1])) or gather(*a, **k))
        gen = engine.generate(GenerationRequest([1, 5, 9, 13], 24, SamplingConfig()), make_method(method, **params))
        gen.run()
        runs[waits] = gen
    cpu, gpu = runs[False], runs[True]
    assert gpu.output_ids == cpu.output_ids
    if method == "auto":  # its choices follow the timings it measures: the replies are what must agree
        return
    assert len(gpu.steps) == len(cpu.steps)
    for a, b in zip(gpu.steps, cpu.steps):
        assert [(n.token_id, n.status) for n in a.nodes] == [(n.token_id, n.status) for n in b.nodes]
        assert_same_node_probabilities(a.nodes, b.nodes)
    if method in ("autoregressive", "speculative"):
        # autoregressive: its token's p is the top logit's, read with the argmax; a chain: every entry
        # its trace shows came with its one read (methods/device_verify.py)
        assert not any(reads)
    else:
        assert reads, "the trace's entries went through one read a table"


def test_a_greedy_chain_on_a_device_feeds_its_drafts_back_unread(monkeypatch):
    """Where reads wait (a GPU; here a CPU told so), a greedy chain feeds each drafted argmax back
    as a device tensor and reads the chain once: the same tokens and rows as drafting one token at
    a time, nothing read per token, the draft's cache holding the same ids after it, and drafts
    after an EOS dropped as the one-at-a-time chain stops there."""
    from conftest import tiny_llama

    from specui.engine import device_chain
    from specui.engine.methods import speculative
    from specui.engine.session import ModelSession

    draft = tiny_llama(4, layers=1, dtype=torch.float32)
    context = [1, 5, 9, 13, 7, 22]
    stops = 0
    for gamma, confidence, floor in ((2, None, 0), (5, None, 0), (5, 0.3, 0), (6, 0.6, 0), (7, 0.9, 0), (8, 0.0, 0),
                                     (6, 0.999999, 3)):  # every draft unsure: the third ends the chain
        one = ModelSession(draft)
        want = speculative.draft_chain(one, context, gamma, SamplingConfig(), None, frozenset(), confidence, floor)
        assert len(want[0]) == 3 if floor else True
        stops += len(want[0]) < gamma
        monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
        monkeypatch.setattr(speculative, "drawn", lambda *a: pytest.fail("a drafted token was read on its own"))
        chained = ModelSession(draft)
        assert chained.feeds_device_tokens
        got = speculative.draft_chain(chained, context, gamma, SamplingConfig(), None, frozenset(), confidence,
                                      floor)
        assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        # past a confidence stop up to CONFIDENCE_CHUNK - 1 more drafts were fed, with their true ids
        assert chained.cached_ids[: len(one.cached_ids)] == one.cached_ids == context + want[0][:-1]
        assert len(chained.cached_ids) - len(one.cached_ids) < device_chain.CONFIDENCE_CHUNK
        assert -1 not in chained.cached_ids
        for (k1, v1), (k2, v2) in zip(chained.kv(), one.kv()):
            n = k2.shape[-2]
            assert torch.equal(k1[..., :n, :], k2) and torch.equal(v1[..., :n, :], v2)
        eos = frozenset({want[0][1]}) if len(want[0]) > 1 else frozenset()  # the second draft an EOS: it ends there
        if eos:
            stopped = speculative.draft_chain(ModelSession(draft), context, gamma, SamplingConfig(), None, eos,
                                              confidence, floor)
            assert stopped[0] == want[0][: want[0].index(want[0][1]) + 1]
            assert stopped[1].shape[0] == len(stopped[0])
        monkeypatch.undo()
    assert stops >= 2  # the confidences stopped some chains early


def test_device_chains_over_captured_graphs_equal_autoregressive(monkeypatch):
    """The device chain over a static cache whose forwards replay graphs (a CPU stand-in for
    CUDA graphs): the drafted token enters the graph's static input by a device copy, and the
    replies equal autoregressive decoding."""
    from conftest import EOS, TinyTokenizer, tiny_llama
    from test_capture import static
    from test_greedy_equivalence import PROMPTS

    from specui.engine import Engine, GenerationRequest, make_method

    target, draft = tiny_llama(0, layers=3), tiny_llama(1, layers=1)
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    static(on, "graphs")
    monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
    fed = []
    feed = type(on.draft).advance_token
    monkeypatch.setattr(type(on.draft), "advance_token", lambda self, token: fed.append(1) or feed(self, token))
    for prompt in PROMPTS:
        want = off.generate(GenerationRequest(list(prompt), 30), make_method("autoregressive")).run().output_ids
        for params in ({"gamma": 2}, {"gamma": 4}, {"gamma": 5, "confidence": 0.5}):
            assert on.generate(GenerationRequest(list(prompt), 30), make_method("speculative", **params)).run(
            ).output_ids == want
        # a static tree queued whole, its layers' tokens fed unread into the graphs (tree_device.py)
        assert on.generate(GenerationRequest(list(prompt), 30), make_method("tree", preset="binary-14")).run(
        ).output_ids == want
    assert on.draft.runner.replays > 0 and on.draft.feeds_device_tokens and fed  # drafts fed back unread


def test_a_device_chain_that_fails_leaves_no_unread_id(monkeypatch):
    """A failure inside a device chain (a cancel, out of memory) crops the draft back to the
    committed ids: no PENDING id stays in the session, and the next chain drafts as usual."""
    from conftest import tiny_llama

    from specui.engine.methods import speculative
    from specui.engine.session import ModelSession

    draft = tiny_llama(4, layers=1, dtype=torch.float32)
    context = [1, 5, 9, 13, 7, 22]
    want = speculative.draft_chain(ModelSession(draft), context, 4, SamplingConfig(), None, frozenset())
    monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
    session = ModelSession(draft)
    feed, fed = ModelSession.advance_token, []

    def failing(self, token):
        fed.append(1)
        if len(fed) == 2:
            raise KeyboardInterrupt  # stands for a cancel mid-chain
        return feed(self, token)

    monkeypatch.setattr(ModelSession, "advance_token", failing)
    with pytest.raises(KeyboardInterrupt):
        speculative.draft_chain(session, context, 4, SamplingConfig(), None, frozenset())
    assert -1 not in session.cached_ids and session.cached_ids == context[: len(session.cached_ids)]
    monkeypatch.setattr(ModelSession, "advance_token", feed)
    assert speculative.draft_chain(session, context, 4, SamplingConfig(), None, frozenset())[0] == want[0]


@pytest.mark.parametrize("gamma,confidence", [(1, None), (3, None), (6, None), (5, 0.5)])
def test_a_greedy_chain_step_on_a_device_reads_once_and_equals_the_token_path(monkeypatch, gamma, confidence):
    """Where reads wait, a fixed greedy chain's tokens go into the target's verification unread
    and the step reads the device once (ChainStats); a chain that stops on the draft's confidence
    reads its tokens as it drafts, then once after verification. Either way the same replies, step
    for step the same nodes and trace probabilities as the one-token path, the same caches, no
    PENDING id left; with an EOS among the drafts (a second EOS id the draft proposes), the chain
    ends there as the one-token chain does."""
    from conftest import EOS, TinyTokenizer, assert_same_node_probabilities, tiny_llama

    from specui.engine import Engine, GenerationRequest, device_chain, make_method

    target, draft = tiny_llama(3, layers=2, dtype=torch.float32), tiny_llama(4, layers=1, dtype=torch.float32)
    prompt = [1, 5, 9, 13]
    first = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS]).generate(
        GenerationRequest(prompt, 12, SamplingConfig()), make_method("speculative", gamma=4)).run()
    eos_too = first.steps[0].nodes[1].token_id  # the draft's second token of the first step
    for eos_ids in ([EOS], [EOS, eos_too]):
        runs = {}
        for waits in (False, True):
            engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=eos_ids)
            reads = []
            if waits:
                monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
                monkeypatch.setattr(sampling, "row_stats", lambda rows, lse: None)
                monkeypatch.setattr(sampling, "_gather",
                                    lambda table, rows, cols: rows and pytest.fail("an entry read on its own") or [])
                count_reads(monkeypatch, reads)
            gen = engine.generate(GenerationRequest(prompt, 24, SamplingConfig()),
                                  make_method("speculative", gamma=gamma, confidence=confidence))
            reads.clear()  # what the reply's steps read of the device, from here
            gen.run()
            runs[waits] = (gen, engine)
            if waits:
                monkeypatch.undo()
                if confidence is None:
                    assert len(reads) == len(gen.steps)  # one read a step
                else:  # the chain's tokens two at a time as it drafts, then one read
                    assert len(reads) <= len(gen.steps) * (-(-gamma // device_chain.CONFIDENCE_CHUNK) + 1)
        (cpu, cpu_engine), (gpu, gpu_engine) = runs[False], runs[True]
        assert gpu.output_ids == cpu.output_ids
        assert len(gpu.steps) == len(cpu.steps)
        for a, b in zip(gpu.steps, cpu.steps):
            assert [(n.token_id, n.status) for n in a.nodes] == [(n.token_id, n.status) for n in b.nodes]
            assert_same_node_probabilities(a.nodes, b.nodes)
        for session in (gpu_engine.target, gpu_engine.draft):
            assert -1 not in session.cached_ids
        for a_session, b_session in ((gpu_engine.target, cpu_engine.target), (gpu_engine.draft, cpu_engine.draft)):
            assert a_session.cached_ids == b_session.cached_ids
            for (k1, v1), (k2, v2) in zip(a_session.kv(), b_session.kv()):
                n = len(b_session.cached_ids)
                assert torch.allclose(k1[..., :n, :], k2[..., :n, :], atol=1e-5)
                assert torch.allclose(v1[..., :n, :], v2[..., :n, :], atol=1e-5)
        if len(eos_ids) > 1 and gamma > 2:
            assert gpu.output_ids[-1] == eos_too  # stopped on the drafted EOS


def count_reads(monkeypatch, reads: list) -> None:
    """Note in `reads` every read of a tensor's values into Python (each a wait for a GPU)."""
    for name in ("tolist", "item", "__float__", "__int__", "__bool__", "__index__"):
        method = getattr(torch.Tensor, name)

        def read(self, *args, _method=method, **kwargs):
            reads.append(1)
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)


def assert_cancelled_cleanly(engine, method, prompt: list[int]) -> None:
    """A reply stopped by a KeyboardInterrupt (a cancel) mid-step leaves both sessions holding a
    prefix of the committed ids, none of them unread."""
    from specui.engine import GenerationRequest

    gen = engine.generate(GenerationRequest(prompt, 16), method)
    with pytest.raises(KeyboardInterrupt):
        gen.run()
    for session in (engine.target, engine.draft):
        assert -1 not in session.cached_ids
        assert session.cached_ids == gen.ctx.ids[: len(session.cached_ids)]


@pytest.mark.parametrize("fails_in", ["target", "read"])
def test_a_failed_verification_of_unread_drafts_leaves_no_unread_id(monkeypatch, fails_in):
    """A failure in the target's forward over drafts still on the device, or after it in the step's
    one read (a cancel, out of memory): both sessions are cropped back to the committed ids, and the
    next reply decodes as before."""
    from conftest import EOS, TinyTokenizer, tiny_llama

    from specui.engine import Engine, GenerationRequest, make_method
    from specui.engine.methods import speculative
    from specui.engine.session import ModelSession

    target, draft = tiny_llama(3, layers=2, dtype=torch.float32), tiny_llama(4, layers=1, dtype=torch.float32)
    prompt = [1, 5, 9, 13]
    want = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS]).generate(
        GenerationRequest(prompt, 16, SamplingConfig()), make_method("speculative", gamma=3)).run().output_ids
    monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    advance, stats, calls = ModelSession.advance, speculative.ChainStats, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            if fails_in == "read":  # the drafts went to both models unread
                assert -1 in engine.target.cached_ids and -1 in engine.draft.cached_ids
            raise KeyboardInterrupt  # stands for a cancel mid-verification
        return stats(*args) if fails_in == "read" else advance(*args)

    if fails_in == "read":
        monkeypatch.setattr(speculative, "ChainStats", failing)  # after the target's forward: both hold PENDING ids
    else:
        monkeypatch.setattr(ModelSession, "advance", lambda self, ids, need=1, pending=None: failing(
            self, ids, need, pending) if pending is not None else advance(self, ids, need, pending))
    assert_cancelled_cleanly(engine, make_method("speculative", gamma=3), prompt)
    monkeypatch.setattr(ModelSession, "advance", advance)
    monkeypatch.setattr(speculative, "ChainStats", stats)
    assert engine.generate(GenerationRequest(prompt, 16, SamplingConfig()),
                           make_method("speculative", gamma=3)).run().output_ids == want


def test_a_failed_static_tree_step_on_a_device_leaves_no_unread_id(monkeypatch):
    """A failure in a static tree's one read, after the draft and the target were fed the tree's
    tokens unread: both sessions are cropped back to the committed ids; the next reply decodes."""
    from conftest import EOS, TinyTokenizer, tiny_llama

    from specui.engine import Engine, GenerationRequest, make_method
    from specui.engine.methods import tree as tree_module

    target, draft = tiny_llama(3, layers=2, dtype=torch.float32), tiny_llama(4, layers=1, dtype=torch.float32)
    prompt = [1, 5, 9, 13]
    want = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS]).generate(
        GenerationRequest(prompt, 16), make_method("tree", preset="binary-14")).run().output_ids
    monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    stats, calls = tree_module.TreeStats, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            assert -1 in engine.target.cached_ids and -1 in engine.draft.cached_ids  # fed unread, both
            raise KeyboardInterrupt
        return stats(*args)

    monkeypatch.setattr(tree_module, "TreeStats", failing)
    assert_cancelled_cleanly(engine, make_method("tree", preset="binary-14"), prompt)
    monkeypatch.setattr(tree_module, "TreeStats", stats)
    assert engine.generate(GenerationRequest(prompt, 16), make_method("tree", preset="binary-14")).run(
    ).output_ids == want


@pytest.mark.parametrize("preset", ["binary-14", "eagle-25", "mcsd-42211"])
def test_a_static_tree_step_on_a_device_reads_once_and_equals_the_host_path(monkeypatch, preset):
    """Where reads wait, a greedy static tree is drafted layer by layer with each layer's tokens
    picked on the device and fed unread, the target scores the whole tree unread, and the step
    reads the device once (TreeStats): the same replies, trees, verdicts, trace probabilities and
    target cache as drafting it on the host, and no PENDING id left after a step."""
    from conftest import EOS, TinyTokenizer, assert_same_node_probabilities, tiny_llama

    from specui.engine import Engine, GenerationRequest, make_method
    from specui.engine.methods import tree as tree_module

    target, draft = tiny_llama(3, layers=2, dtype=torch.float32), tiny_llama(4, layers=1, dtype=torch.float32)
    runs = {}
    for waits in (False, True):
        engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
        reads = []
        if waits:
            monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
            monkeypatch.setattr(sampling, "row_stats", lambda rows, lse: None)  # a GPU has no CPU kernel
            monkeypatch.setattr(tree_module, "top_tokens", lambda *a: pytest.fail("children read on their own"))
            monkeypatch.setattr(sampling, "_gather",
                                lambda table, rows, cols: rows and pytest.fail("an entry read on its own") or [])
            count_reads(monkeypatch, reads)
        gen = engine.generate(GenerationRequest([1, 5, 9, 13], 20), make_method("tree", preset=preset))
        reads.clear()  # what the reply's steps read of the device, from here
        steps = []
        for step in gen:
            steps.append(step)
            for session in (engine.target, engine.draft):
                assert -1 not in session.cached_ids
        runs[waits] = (gen, engine)
        if waits:
            monkeypatch.undo()
            assert len(reads) == len(steps)  # one read a step (the last step, with no room for a tree, as AR)
    (cpu, cpu_engine), (gpu, gpu_engine) = runs[False], runs[True]
    assert gpu.output_ids == cpu.output_ids
    assert len(gpu.steps) == len(cpu.steps)
    for a, b in zip(gpu.steps, cpu.steps):
        shape = [(n.token_id, n.parent, n.status) for n in a.nodes]
        assert shape == [(n.token_id, n.parent, n.status) for n in b.nodes]
        assert_same_node_probabilities(a.nodes, b.nodes)
        assert [n.p_hat for n in a.nodes] == pytest.approx([n.p_hat for n in b.nodes])
        assert a.expected_accept == pytest.approx(b.expected_accept)
    assert gpu_engine.target.cached_ids == cpu_engine.target.cached_ids
    assert gpu_engine.draft.cached_ids == cpu_engine.draft.cached_ids
