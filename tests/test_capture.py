"""Static caches and captured forwards (engine/static_cache.py, engine/capture.py): every
lossless method equals autoregressive decoding token for token with `capture` on, the cache
after each commit equals a fresh prefill, the padded shapes and masks are right, and the logic
around CUDA graphs (capture once per shape, replay on the same static inputs, fall back on a
failed capture, recapture after the store grows) runs on a CPU through a stand-in graph."""

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama
from test_cache import assert_cache_is_fresh_prefill
from test_greedy_equivalence import PROMPTS, near_copy

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine import capture as capture_module
from specui.engine import session as session_module
from specui.engine.capture import StaticForward, bucket_for, capture_mode, round_up
from specui.engine.session import ModelSession
from specui.engine.static_cache import StaticKVCache
from specui.errors import SpecUIError

LOSSLESS = [("autoregressive", {}), ("speculative", {"gamma": 3}), ("speculative", {"gamma": 6}), ("auto", {}),
            ("opt-tree", {}), ("tree", {}), ("mcsd", {}), ("specdec++", {}), ("lookup", {})]


class EagerGraphs:
    """A CUDA graph's contract on a CPU: capture runs the forward once and keeps its output;
    replay runs it again on whatever the static inputs hold then, writing into that output."""

    def __init__(self, fail: bool = False) -> None:
        self.captures, self.fail = 0, fail

    def capture(self, forward):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        out = forward()  # a tensor, or a tuple of them (a forward that returns hidden states too)

        def replay():
            for kept, fresh in zip(*((o if isinstance(o, tuple) else (o,)) for o in (out, forward())), strict=True):
                kept.copy_(fresh)

        return replay, out


def static(engine: Engine, mode: str = "graphs", fail: bool = False) -> list[EagerGraphs]:
    """Give the engine's static sessions uncompiled forwards in `mode` (graphs: over a stand-in
    graph); `capture="on"` itself compiles, which test_compiled_* covers."""
    backends = []
    for session in (engine.target, engine.draft):
        if session is not None and session.runner is not None:
            graphs = EagerGraphs(fail) if mode == "graphs" else None
            backends += [graphs] if graphs else []
            session.runner = StaticForward(session.model, session.cache, mode, graphs=graphs)
    return backends


def uncompiled(session: ModelSession, mode: str = "buckets") -> ModelSession:
    session.runner = StaticForward(session.model, session.cache, mode)
    return session


def run(engine, prompt, n, name, **params):
    return engine.generate(GenerationRequest(list(prompt), n), make_method(name, **params)).run()


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, layers=3)
    return target, near_copy(target, 0.01, 7)


def test_capture_mode_by_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert capture_mode("off", cuda) is None and capture_mode("auto", cpu) is None
    assert capture_mode("auto", cuda) == "graphs" and capture_mode("on", cuda) == "graphs"
    assert capture_mode("on", cpu) == "buckets"
    with pytest.raises(SpecUIError, match="auto, on, off"):
        capture_mode("yes", cpu)
    assert [bucket_for(m) for m in (1, 3, 5, 16, 17, 64, 65)] == [1, 4, 8, 16, 32, 64, None]
    assert round_up(1) == 256 and round_up(256) == 256 and round_up(257) == 512


@pytest.mark.parametrize("mode", ["buckets", "graphs"])
@pytest.mark.parametrize("name,params", LOSSLESS)
def test_lossless_methods_equal_autoregressive_with_capture_on(pair, mode, name, params):
    target, draft = pair
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    backends = static(on, mode)
    for prompt in PROMPTS:
        reference = run(off, prompt, 40, "autoregressive").output_ids
        assert run(on, prompt, 40, name, **params).output_ids == reference
    assert isinstance(on.target.cache, StaticKVCache)
    if mode == "graphs":  # replayed, and captured once per shape only
        assert on.target.runner.replays > 0 and not on.target.runner.failed
        assert sum(b.captures for b in backends) == sum(len(s.runner.captured()) for s in (on.target, on.draft))


@pytest.mark.parametrize("name,params", [("speculative", {"gamma": 4}), ("opt-tree", {})])
def test_static_caches_equal_fresh_prefill_after_each_step(pair, name, params):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    static(engine)
    request = GenerationRequest([1, 9, 4, 22], 30, SamplingConfig(temperature=1.0, seed=3))
    gen = engine.generate(request, make_method(name, **params))
    for _ in gen:
        committed = request.prompt_ids + gen.output_ids
        assert_cache_is_fresh_prefill(engine.target, committed)
        assert_cache_is_fresh_prefill(engine.draft, committed)


def test_padded_rows_never_reach_real_ones():
    """A bucket's padded rows write past the valid length; the slots hold whatever they wrote
    (finite), and the real rows' logits equal an unpadded forward's."""
    model = tiny_llama(3, layers=2)
    exact, padded = (uncompiled(ModelSession(model, capture="on"), mode) for mode in ("exact", "buckets"))
    ids = [1, 4, 9, 16, 25, 36]
    a, b = exact.advance(ids, need=1), padded.advance(ids, need=1)  # 5 cached + bucket 8
    assert torch.allclose(a, b, atol=1e-10)
    for step in ([7, 8, 9], [3]):
        ids = ids + step
        assert torch.allclose(exact.advance(ids, need=len(step)), padded.advance(ids, need=len(step)), atol=1e-10)
    assert torch.isfinite(padded.cache.store).all()
    assert padded.length == len(ids) and padded.cache.length == len(ids)


def test_compiled_forwards_on_a_cpu_run_unpadded_and_graphs_keep_their_buckets():
    """Compiled outside CUDA graphs, every size from 2 is one dynamic compile: a forward runs
    its own rows (a gamma-4 chain 5, not 8); CUDA graphs and eager padded shapes keep the bucket,
    and a compile that failed (eager from then on) keeps it too."""
    model = tiny_llama(3, layers=1)
    cache = StaticKVCache(model.config, 64, torch.device("cpu"), model.dtype)
    compiled = StaticForward(model, cache, "buckets", compiled=True)  # nothing compiles until a forward runs
    padded = StaticForward(model, cache, "buckets")
    graphs = StaticForward(model, cache, "graphs", graphs=EagerGraphs())
    assert [compiled.width_for(m) for m in (1, 3, 5, 9, 64, 65)] == [1, 3, 5, 9, 64, None]
    for runner in (padded, graphs):
        assert [runner.width_for(m) for m in (1, 3, 5, 9, 64, 65)] == [1, 4, 8, 16, 64, None]
    compiled.fn = compiled.model  # what a failed compile leaves
    assert compiled.width_for(5) == 8


def test_store_grows_and_graphs_are_captured_again(pair, monkeypatch):
    monkeypatch.setattr(session_module, "STATIC_SLOTS", 8)  # 8 + 64 slots: a 120-token reply must grow
    monkeypatch.setattr(capture_module, "WINDOW", 16)
    target, draft = pair
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[], capture="on")
    static(on)
    first = on.target.cache.capacity
    reference = run(off, PROMPTS[0], 120, "autoregressive").output_ids
    assert run(on, PROMPTS[0], 120, "speculative", gamma=4).output_ids == reference
    assert on.target.cache.capacity > first and on.target.cache.generation > 1
    assert all(w <= on.target.cache.capacity for _, w in on.target.runner.captured())


def test_a_failed_capture_runs_eagerly_with_a_note(pair):
    target, draft = pair
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    static(on, fail=True)
    assert run(on, PROMPTS[1], 30, "speculative", gamma=3).output_ids == run(off, PROMPTS[1], 30,
                                                                             "autoregressive").output_ids
    runner = on.target.runner
    assert runner.replays == 0 and runner.eager > 0 and not runner.captured()
    assert runner.notes and "capture failed: RuntimeError" in runner.notes[0]


def test_hidden_states_read_through_hooks_come_from_an_exact_forward():
    model = tiny_llama(4, layers=2)
    on, off = uncompiled(ModelSession(model, capture="on")), ModelSession(model)
    ids = [1, 5, 7, 9]
    (lo, ho), (lf, hf) = on.advance_with_hidden(ids, 2), off.advance_with_hidden(ids, 2)
    assert ho.shape == hf.shape == (2, model.config.hidden_size)
    assert torch.allclose(ho, hf, atol=1e-10) and torch.allclose(lo, lf, atol=1e-10)


def test_a_model_with_sliding_window_layers_refuses_capture():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cfg.layer_types, cfg.sliding_window = ["full_attention", "sliding_attention"], 8
    with pytest.raises(SpecUIError, match="full-attention layers only"):
        StaticKVCache(cfg, 64, torch.device("cpu"))


@pytest.mark.bundled
def test_bundled_pair_float32_capture_on_equals_autoregressive(bundled_pair):
    from specui.chat import build_prompt

    tok = bundled_pair.target.tokenizer
    prompt, _ = build_prompt(tok, [{"role": "user", "content": "Name three colours of the rainbow."}], 4096)
    reference = run(bundled_pair.engine(), prompt, 24, "autoregressive").output_ids
    engine = bundled_pair.engine(capture="on")
    static(engine, "buckets")  # compiling the bundled model on a CPU takes minutes: the shapes are what is checked
    for name, params in [("autoregressive", {}), ("speculative", {"gamma": 3}), ("opt-tree", {})]:
        assert run(engine, prompt, 24, name, **params).output_ids == reference, name


ROWS = [("beam", {"width": 3}), ("dsbd", {"width": 2, "gamma": 3}),
        ("dsbd", {"width": 3, "gamma": 2, "width_threshold": 0.5})]


@pytest.mark.parametrize("name,params", ROWS)
def test_beam_rows_on_static_caches_equal_growing_ones(pair, name, params):
    """Beam search and DSBD keep their rows in static caches when the sessions capture (rows
    moved, copied, dropped and added by StaticKVCache.keep_rows): the same replies."""
    target, draft = pair
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    static(on, "buckets")
    for prompt in PROMPTS:
        method = make_method(name, **params)
        assert run(off, prompt, 30, name, **params).output_ids == on.generate(
            GenerationRequest(list(prompt), 30), method).run().output_ids
        rows = method.rows if name == "beam" else method.target
        # the reply's end released the rows: their store (several rows) waits for the next reply's
        assert isinstance(rows.cache, StaticKVCache) and rows.cache.store is None
        kept = on.target.runner.spare_rows.take()
        assert kept is not None and kept.shape[2] > 1
        on.target.runner.spare_rows.give(kept)


def test_a_beam_reply_hands_its_rows_store_to_the_next_even_when_stopped_early(pair):
    """Beam rows' store (several rows of every layer) is the next reply's once a reply ends,
    also one whose stream was closed half-way: no fresh store (and its page faults) a reply,
    and the stale entries in it change nothing (the same reply as over growing caches)."""
    target, draft = pair
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    static(on, "buckets")
    spare = on.target.runner.spare_rows
    steps = iter(on.generate(GenerationRequest(list(PROMPTS[0]), 30), make_method("beam", width=3)))
    next(steps)
    next(steps)
    assert spare.take() is None  # the running reply holds it
    steps.close()  # the consumer stopped: the rows are let go all the same
    kept = spare.take()
    assert kept is not None and kept.shape[2] == 3
    spare.give(kept)
    for prompt in PROMPTS[1:]:
        method = make_method("beam", width=3)
        got = on.generate(GenerationRequest(list(prompt), 30), method).run().output_ids
        assert got == run(off, prompt, 30, "beam", width=3).output_ids
        assert method.rows.cache.store is None and spare.take() is kept  # the same store, handed on again
        spare.give(kept)


def test_scratch_rows_of_a_rows_shape_hand_their_store_on(pair, monkeypatch):
    """A Warmup compiles a rows shape on scratch rows (rows.compile_shape); their store goes to the
    spare the probe shares with its runner as soon as the forward ran, even a forward that failed,
    and the next reply's rows take it."""
    from specui.engine.rows import RowSession, compile_shape
    from specui.engine.warmup import Warmup

    target, draft = pair
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    static(on, "buckets")
    runner = on.target.runner
    assert Warmup(runner, [])._probe(runner.cache).spare_rows is runner.spare_rows  # a Warmup's probe shares it
    assert compile_shape(runner, (2, 64, 128, 3)) == ""
    kept = runner.spare_rows.take()
    assert kept is not None and kept.shape[2] == 3
    runner.spare_rows.give(kept)
    method = make_method("beam", width=2)
    on.generate(GenerationRequest(list(PROMPTS[0]), 12), method).run()
    assert runner.spare_rows.take() is kept  # taken by the reply's rows, handed back at its end

    def fails(*_args, **_kw):
        raise RuntimeError("forward failed")

    runner.spare_rows.take()
    monkeypatch.setattr(RowSession, "forward", fails)
    with pytest.raises(RuntimeError, match="forward failed"):
        compile_shape(runner, (2, 64, 128, 2))
    assert runner.spare_rows.take() is not None


def test_compiled_forwards_equal_autoregressive_and_a_failed_compile_runs_eagerly(pair, monkeypatch):
    """`capture="on"` runs the padded shapes through torch.compile (float32 here: equal replies);
    a compiler that fails leaves the model eager, with a note."""
    from torch._dynamo.exc import BackendCompilerFailed

    target, draft = (tiny_llama(0, layers=2, dtype=torch.float32), tiny_llama(1, layers=1, dtype=torch.float32))
    off = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    assert on.target.runner.compiled and on.draft.runner.compiled
    for name, params in [("autoregressive", {}), ("speculative", {"gamma": 3}), ("opt-tree", {})]:
        assert run(on, PROMPTS[0], 24, name, **params).output_ids == run(off, PROMPTS[0], 24,
                                                                         "autoregressive").output_ids
    for name, params in ROWS[:1]:  # beams' rows run compiled too, at their own widths (DSBD's: the same code)
        method = make_method(name, **params)
        got = on.generate(GenerationRequest(list(PROMPTS[0]), 16), method).run().output_ids
        assert got == run(off, PROMPTS[0], 16, name, **params).output_ids
        rows = method.rows if name == "beam" else method.target
        assert rows.compiled or rows.compile_problem  # a machine without a C++ compiler says why
    runner = on.target.runner  # a machine without a C++ compiler falls back, and says so
    assert runner.compiled and not runner.notes or runner.notes[0].startswith("not compiled: ")

    def broken(model, **_options):
        def fn(**kw):
            raise BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler"), None)
        return fn

    monkeypatch.setattr(torch, "compile", broken)
    # the same weights in new model objects (a model keeps its one compile: these must make theirs)
    target, draft = (tiny_llama(0, layers=2, dtype=torch.float32), tiny_llama(1, layers=1, dtype=torch.float32))
    failing = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    assert run(failing, PROMPTS[1], 16, "speculative", gamma=2).output_ids == run(off, PROMPTS[1], 16,
                                                                                  "autoregressive").output_ids
    assert not failing.target.runner.compiled
    assert failing.target.runner.notes[0].startswith("not compiled: BackendCompilerFailed")


def test_a_draft_with_cast_embeddings_gets_a_static_cache_of_its_dtype():
    """A draft that sees its target's embeddings through a cast (weights/draft.py) has no
    embedding weight of its own: the store takes the cast's dtype."""
    from specui.weights.draft import CastEmbedding

    model = tiny_llama(5, layers=1, dtype=torch.float32)
    shared = torch.nn.Embedding(model.config.vocab_size, model.config.hidden_size).to(torch.float64)
    model.model.embed_tokens = CastEmbedding(shared, torch.float32)
    session = uncompiled(ModelSession(model, capture="on"))
    assert session.advance([1, 2, 3, 4], 1).dtype == torch.float32
    assert session.cache.store.dtype == torch.float32
