"""`--capture auto` on a CPU whose compiled forwards measured faster: the forwards compile on a
thread of their own (engine/warmup.py) and no forward waits for a compile. A reply
pauses the compile under way (it goes on after); forwards whose shape has not compiled yet run eagerly; every
forward equals the eager model's; once a shape has compiled, forwards of that shape run
compiled; a shape first met while decoding (a longer context, a grown cache) is compiled next;
a compile that fails leaves the model eager with a note; the cost profile is not measured
from eager stand-ins for compiled forwards."""

import json
import os
import threading
import time

import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, capture_choice, giving_way, make_method
from specui.engine import capture as capture_module
from specui.engine import warmup as warmup_module
from specui.engine.rows import RowSession
from specui.engine.session import ModelSession
from specui.service.reports import capture_line

SETTLE_S = 300  # a tiny model's shapes compile in well under a minute on 2 cores


def decode(session: ModelSession, ids: list[int], n: int) -> list[torch.Tensor]:
    rows = []
    for i in range(n):
        ids.append((7 * i + 3) % 40 + 5)
        rows.append(session.advance(ids, 1))
    return rows


def test_forwards_never_wait_and_switch_to_compiled_when_ready():
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    decoding = threading.Event()
    decoding.set()  # as if a reply were decoding from the start: nothing compiles
    session = ModelSession(model, capture="on", background=True)
    warmup = session.runner.warmup
    warmup.paused = decoding.is_set
    reference = ModelSession(model)
    prompt = list(range(5, 25))
    ids, ref_ids = list(prompt), list(prompt)
    got, want = decode(session, ids, 6), decode(reference, ref_ids, 6)
    assert session.runner.compiled_runs == 0 and session.runner.eager >= 6  # nothing compiled yet: eager
    deadline = time.monotonic() + SETTLE_S
    while not warmup.interrupted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warmup.interrupted and warmup._compiling  # the compile thread sleeps where it was
    assert not torch.compiler.is_compiling()  # and replies' eager forwards are not "compiling" meanwhile
    time.sleep(1.0)
    assert not warmup.settled and not warmup.compiled
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)

    decoding.clear()  # the reply ended: the compile starts again
    assert warmup.wait(SETTLE_S), warmup.queue
    # every bucket, and the 21 tokens the prompt's forward met meanwhile (compiled, sizes are not padded)
    assert {shape[0] for shape in warmup.compiled} == {*capture_module.BUCKETS, 21}
    assert not session.runner.notes and session.runner.compiled
    before = session.runner.compiled_runs
    got, want = decode(session, ids, 4), decode(reference, ref_ids, 4)
    assert session.runner.compiled_runs == before + 4  # every one of these ran compiled
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_shape_first_met_while_decoding_is_compiled_next():
    model = tiny_llama(1, layers=1, dtype=torch.float32)
    session = ModelSession(model, capture="on", background=True)
    warmup = session.runner.warmup
    assert warmup.wait(SETTLE_S)
    asked = len(warmup.compiled)
    capacity = session.cache.capacity
    ids = [(3 * i) % 40 + 5 for i in range(capacity - 2)]  # a prefill longer than a bucket: exact, eager
    session.advance(ids, 1)
    ran = session.runner.compiled_runs
    decode(session, ids, 4)  # the cache grows past its capacity: a new shape, eager until compiled
    assert session.cache.capacity > capacity
    assert warmup.wait(SETTLE_S)
    compiled_next = len(warmup.compiled) > asked and any(shape[2] == session.cache.capacity
                                                         for shape in warmup.compiled)
    # or no compile was needed: this model's graph already takes the capacity as a dynamic size
    assert compiled_next or session.runner.compiled_runs > ran
    before = session.runner.compiled_runs
    got = decode(session, ids, 2)
    assert session.runner.compiled_runs == before + 2
    reference = ModelSession(model)
    torch.testing.assert_close(got[-1], reference.advance(ids, 1), atol=1e-4, rtol=1e-4)


def test_a_failed_compile_leaves_the_model_eager_with_a_note(monkeypatch, tmp_path):
    model = tiny_llama(2, layers=1, dtype=torch.float32)

    def broken(_model, _variant=None, _call=None):
        def fn(**_kw):
            raise AssertionError("inductor could not lower this graph")
        return fn

    monkeypatch.setattr(capture_module, "compile_model", broken)
    cleared = []
    monkeypatch.setattr(warmup_module, "_fresh_compile_cache", lambda: cleared.append(1) or True)
    session = ModelSession(model, capture="on", background=True)
    assert session.runner.warmup.wait(SETTLE_S)
    assert cleared == [1]  # a stale compile cache could explain it: rebuilt once, then given up
    assert not session.runner.compiled and session.runner.warmup.settled
    assert any("not compiled: AssertionError" in note for note in session.runner.notes)
    reference = ModelSession(model)
    ids = list(range(5, 15))
    torch.testing.assert_close(session.advance(ids, 1), reference.advance(ids, 1))


def test_the_fresh_compile_cache_only_removes_our_own(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = tmp_path / "specui" / "inductor"
    (ours / "fxgraph").mkdir(parents=True)
    (ours / "fxgraph" / "entry").write_text("corrupt")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(ours))
    assert warmup_module._fresh_compile_cache() and not ours.exists()
    theirs = tmp_path / "elsewhere"
    theirs.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(theirs))
    assert not warmup_module._fresh_compile_cache() and theirs.exists()


def test_engine_auto_compiles_in_the_background_and_a_reply_pauses_it(tmp_path, monkeypatch):
    model = tiny_llama(3, layers=1, dtype=torch.float32)
    path = tmp_path / "capture_choices.json"
    monkeypatch.setattr(capture_choice, "cache_file", lambda: path)
    path.write_text(json.dumps({capture_choice.choice_key(model): {"choice": "on"}}))
    draft = tiny_llama(4, layers=2, dtype=torch.float32)  # another model: not measured
    engine = Engine(model, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="auto", profile_dir=tmp_path)
    try:
        runner = engine.target.runner
        assert runner.warmup is not None and runner.warmup.paused == engine.lock.locked
        assert engine.draft.runner is None  # the draft was not measured faster: eager as asked
        report = engine.capture_report()
        assert report["target"]["background"] and report["target"]["mode"] == "buckets+compiled"
        with engine.lock:  # a reply decodes: nothing compiles meanwhile
            if not engine.settled():
                costs = engine.ensure_profile()
                assert costs.profile is None and "compiling in the background" in costs.note
                assert "compiling in the background" in capture_line(engine.capture_report())
            gen = engine.generate(GenerationRequest([5, 6, 7, 8], 8), make_method("speculative", gamma=2)).run()
        assert engine.settle(SETTLE_S) and engine.settled()
        line = capture_line(engine.capture_report())
        # every bucket, and the 3 tokens gamma 2 scores (compiled, sizes are not padded: one dynamic compile)
        assert "target compiled (1, 2, 3, 4, 8, 16, 32, 64 tokens" in line
        with engine.lock:
            again = engine.generate(GenerationRequest([5, 6, 7, 8], 8), make_method("speculative", gamma=2)).run()
        assert again.output_ids == gen.output_ids and runner.compiled_runs > 0
    finally:
        engine.close()
        engine.settle(SETTLE_S)


def test_close_cancels_what_is_left():
    model = tiny_llama(5, layers=1, dtype=torch.float32, hidden=48)  # shapes no other test compiled
    session = ModelSession(model, capture="on", background=True)
    warmup = session.runner.warmup
    with warmup._cond:  # what finished before the cancel (a warm disk cache compiles fast) is not counted
        done = len(warmup.compiled)
        waiting = len(warmup.queue)
        warmup.cancel()
    assert warmup.wait(SETTLE_S)
    assert waiting > 1 or done > 0  # there was something to cancel
    assert len(warmup.compiled) <= done + 1 and not warmup.queue  # at most the shape under way finished


def test_a_replaced_pairs_compile_ends_where_it_was():
    """Engine.close (the pair is replaced): the compile under way ends too. Nothing would pause
    it any more, and beside the next pair's replies it would hold the GIL for minutes."""
    model = tiny_llama(6, layers=1, dtype=torch.float32)
    session = ModelSession(model, capture="on", background=True)
    warmup = session.runner.warmup
    warmup.paused = lambda: True  # a reply decodes: the compile pauses as it begins
    deadline = time.monotonic() + SETTLE_S
    while not (warmup.interrupted and warmup._compiling) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warmup.interrupted and warmup._compiling
    warmup.stop()
    assert warmup.wait(60) and not warmup.compiled and not warmup.queue  # ended where it was
    warmup.ask((1, 64, session.cache.capacity))  # and nothing more is compiled for it
    assert warmup.settled and not warmup.note
    for thread in threading.enumerate():  # an earlier test's compile may still finish its shape (cancel lets it)
        if thread.name == "specui-compile" and thread is not threading.current_thread():
            thread.join(SETTLE_S)
    assert not torch.compiler.is_compiling()  # and nothing left dynamo's state as if it still traced


def start_beams(rows: RowSession) -> list[torch.Tensor]:
    """A prompt, one node, then three rows from it; the node's logits."""
    rows.prefill(list(range(5, 25)))
    out = rows.forward([[(9, -1)]])
    rows.commit([(0, [0])] * 3)
    return out


def beam_steps(rows: RowSession, steps: int, first: int = 0) -> list[torch.Tensor]:
    """`steps` steps of a 3-node chain per row, each keeping every row's first two nodes (rows
    reordered); the logits of every forward."""
    out = []
    for step in range(first, first + steps):
        new = [[(5 + (3 * r + step) % 30, -1), (6 + r, 0), (7 + step % 5, 1)] for r in range(3)]
        out += rows.forward(new)
        rows.commit([(r, [0, 1]) for r in (2, 0, 1)])
    return out


def test_beam_rows_compile_in_the_background_and_run_compiled_once_ready():
    """Beam search's and DSBD's rows (RowSession) over a runner that compiles in the background:
    a rows shape not compiled yet runs eagerly and is asked of the runner's Warmup, which
    compiles it on scratch rows; once compiled, rows of that shape run compiled; every forward
    equals the growing cache's eager one."""
    model = tiny_llama(6, layers=1, dtype=torch.float32, hidden=40)  # shapes no other test compiled
    decoding = threading.Event()
    decoding.set()
    session = ModelSession(model, capture="on", background=True)
    warmup = session.runner.warmup
    warmup.paused = decoding.is_set
    warmup.cancel()  # the one-row shapes (other tests compile those): only the rows' here
    reference = RowSession(model)
    want = start_beams(reference) + beam_steps(reference, 4)
    rows = RowSession(model, runner=session.runner)
    got = start_beams(rows)
    compiled, eager = rows.compiled_runs, rows.eager_runs
    got += beam_steps(rows, 2)
    assert rows.compiled_runs == compiled and rows.eager_runs == eager + 2  # not compiled yet: eager
    assert (3, 256, 256, 3) in warmup.queue  # (width, window, capacity, rows), asked once; compiled: not padded
    decoding.clear()  # no reply decodes: the Warmup compiles it on scratch rows
    assert warmup.wait(SETTLE_S), warmup.queue
    assert (3, 256, 256, 3) in warmup.compiled and not session.runner.notes
    report = {"setting": "auto", "target": {"mode": "buckets+compiled", "background": True, "notes": [],
                                            "compiled": [list(shape) for shape in warmup.compiled],
                                            "compiling": [], "compile_s": warmup.seconds}}
    assert "beam-rows shape" in capture_line(report)
    got += beam_steps(rows, 2, first=2)
    assert rows.compiled_runs == compiled + 2  # compiled from here on
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_compile_never_pauses_inside_an_import_or_logging():
    """A paused compile holding an import's or a logging handler's lock would stall the reply
    it waits for; anywhere else (a thread's own first frames included) it may pause."""
    import logging
    import sys

    seen = {}

    class Handler(logging.Handler):
        def emit(self, record):
            seen["emit"] = giving_way.may_pause(sys._getframe())

    logger = logging.getLogger("specui-test-may-pause")
    logger.addHandler(Handler())
    logger.warning("inside a handler")
    thread = threading.Thread(target=lambda: seen.setdefault("thread", giving_way.may_pause(sys._getframe())))
    thread.start()
    thread.join()
    assert seen == {"emit": False, "thread": True} and giving_way.may_pause(sys._getframe())


def test_torchs_default_compile_cache_counts_as_unset(monkeypatch, tmp_path):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's default (under /tmp) where
    it is unset, so that value must not read as the user's choice: compiled code goes to ours,
    which survives a reboot and which a failed compile may set aside."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from specui.engine.compiled import compile_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert warmup_module.compile_cache_dir() == tmp_path / "specui" / "inductor"
    compile_model(tiny_llama(12, layers=1, dtype=torch.float32))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "specui" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert warmup_module.compile_cache_dir() == tmp_path / "mine"
