"""The engine in its own process (issue 45, item 4): the app's RemoteService answers the page as
ChatService does, replies there equal the same replies decoded in this process (text, tokens,
every step), Stop reaches it, a bad load keeps the pair, and an engine process that dies is
reported to whoever waits and can be started again."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import asdict
from functools import partial

import pytest
from conftest import form_values

from specui.engine.trace import StepTrace
from specui.errors import SpecUIError
from specui.service.batch_loop import DONE, Started
from specui.service.chat_service import INFO_FIELDS, ChatService
from specui.service.engine_process import edit, portable
from specui.service.pair import load_pair
from specui.service.remote import RemoteService
from specui.settings import ChatSettings
from specui.ui.chat_ui import ChatPage, build_ui
from specui.ui.streaming import run_alternatives
from specui.weights.loading import ModelSpec

MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]


def tiny_service(target: str, draft: str) -> ChatService:
    """The engine process's factory (picklable: this module is importable there too)."""
    spec = ModelSpec(target, dtype="float32", device="cpu")
    return ChatService(load_pair(spec, spec.with_source(draft)))


@pytest.fixture(scope="module")
def pair_dirs(tiny_dirs):
    target, draft, _ = tiny_dirs
    return str(target), str(draft)


@pytest.fixture(scope="module")
def remote(pair_dirs):
    service = RemoteService(partial(tiny_service, *pair_dirs))
    yield service
    service.engine_process.close()


@pytest.fixture(scope="module")
def local(pair_dirs):
    return tiny_service(*pair_dirs)


def collect(service, settings: ChatSettings, cancel: threading.Event | None = None, after_first=None) -> tuple:
    """Run one reply through `service.run`; (its generation, the items its sink got, in order)."""
    items: queue.Queue = queue.Queue()
    service.run(MESSAGES, settings, cancel or threading.Event(), items.put, _submit_here)
    seen = []
    while True:
        item = items.get(timeout=120)
        seen.append(item)
        if isinstance(item, StepTrace) and after_first and len(seen) == 2:
            after_first()
        if item is DONE or isinstance(item, BaseException):
            return seen[0].generation if isinstance(seen[0], Started) else None, seen


def _submit_here(fn, *args):
    from specui.service.runner import run_in_new_thread

    return run_in_new_thread(fn, *args)


def _plain(step: StepTrace) -> dict:
    """A step's fields but its timings."""
    return {k: v for k, v in asdict(step).items() if not k.endswith("_ms")}


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "opt-tree", "beam"])
def test_a_reply_over_there_equals_the_same_reply_here(remote, local, method):
    settings = ChatSettings(method=method, max_new_tokens=24)
    mirror, items = collect(remote, settings)
    here, local_items = collect(local, settings)
    assert items[-1] is DONE and isinstance(items[0], Started)
    assert mirror.text == here.text and mirror.output_ids == here.output_ids
    assert len(mirror.steps) == sum(isinstance(i, StepTrace) for i in items)
    if method != "opt-tree":  # its trees follow costs timed in each process, so its steps may differ
        assert [_plain(s) for s in mirror.steps] == [_plain(s) for s in here.steps]
    assert mirror.stats.new_tokens == here.stats.new_tokens and mirror.stats.finish_reason == here.stats.finish_reason


def test_stop_reaches_the_engine_and_the_next_reply_runs(remote):
    cancel = threading.Event()
    mirror, items = collect(remote, ChatSettings(method="autoregressive", max_new_tokens=200), cancel,
                            after_first=cancel.set)
    assert items[-1] is DONE and mirror.stats.finish_reason == "cancelled" and len(mirror.output_ids) < 200
    again, items = collect(remote, ChatSettings(method="autoregressive", max_new_tokens=8))
    assert items[-1] is DONE and again.stats.new_tokens == 8


def test_the_page_over_the_engine_process(remote, local, pair_dirs):
    values = form_values
    far, near = ChatPage(remote), ChatPage(local)
    build_ui(remote)  # every control the page reads from the service
    shown = ("methods", "context_len", "dtype_names", "target_label", "presets")
    assert {k: getattr(remote, k) for k in shown} == {k: getattr(local, k) for k in shown}
    reply = list(far.respond(None, "w1 w2", [], "speculative", *values(max_new_tokens=20)))[-1]
    same = list(near.respond(None, "w1 w2", [], "speculative", *values(max_new_tokens=20)))[-1]
    untimed = [[{k: v for k, v in step.items() if not k.endswith("_ms")} for step in r[-4]] for r in (reply, same)]
    assert reply[1] == same[1] and untimed[0] == untimed[1]  # the chat, and the steps the panels draw
    replies = far.respond(None, "w1 w2", [], "autoregressive", *values(max_new_tokens=200))
    next(replies), next(replies)
    far.stop(None)
    last = list(replies)[-1]
    assert last[1][-1]["content"].endswith("⏹") and len(last[8]) < 200
    memory = remote.memory_report()
    assert "target weights" in memory and "web server RSS" in memory and "engine process RSS" in memory
    assert remote.capture_report()["setting"]
    profile, note = remote.cost_profile()
    assert isinstance(note, str)


def test_alternative_replies_join_the_engines_batch(remote):
    settings = ChatSettings(method="ems-sd", max_new_tokens=12, replies=2, temperature=1.0, seed=3)
    ended = {}
    for k, item in run_alternatives(remote, None, MESSAGES, settings, threading.Event(), 0.0):
        if isinstance(item, Started):
            ended[k] = item.generation
    assert set(ended) == {0, 1} and all(g.stats.new_tokens for g in ended.values())


def test_a_bad_load_keeps_the_pair_and_a_good_one_swaps_it(remote, pair_dirs):
    target, _ = pair_dirs
    page = ChatPage(remote)
    before = remote.target_label
    status, memory, *_ = page.load_models("/no/such/model", "none", "none", "cpu", "float32", "speculative",
                                          progress=None)
    assert status.startswith("⚠️ could not load") and remote.target_label == before and "target weights" in memory
    status, _, header, method = page.load_models(target, "none", "none", "cpu", "float32", "speculative",
                                                 progress=None)
    assert status.startswith("✅") and "draft: `none`" in header and remote.draft_label == "none"
    assert "speculative" not in remote.methods  # the page's view follows the load
    assert set(INFO_FIELDS) <= set(remote.engine_process.info)


def test_an_engine_that_dies_is_reported_and_started_again(pair_dirs):
    service = RemoteService(partial(tiny_service, *pair_dirs))
    try:
        os.kill(service.engine_process.process.pid, signal.SIGKILL)
        service.engine_process.wait(30)
        for _ in range(100):  # the reader hears the pipe close
            if service.engine_process.ended:
                break
            time.sleep(0.05)
        _, items = collect(service, ChatSettings(method="autoregressive", max_new_tokens=4))
        assert len(items) == 1 and isinstance(items[0], SpecUIError) and "engine process stopped" in str(items[0])
        with pytest.raises(SpecUIError, match="engine process stopped"):
            service.memory_report()
        service.restart()
        _, items = collect(service, ChatSettings(method="autoregressive", max_new_tokens=4))
        assert items[-1] is DONE
        started = time.monotonic()
        service.engine_process.close()  # asked to stop, it ends at once and cleanly
        # (its exit code read once, by whichever thread waits: two waits at once lost it, as None, in 1 run of 7)
        assert service.engine_process.process.exitcode == 0 and time.monotonic() - started < 5
    finally:
        service.engine_process.close()


def test_a_pair_that_does_not_load_is_refused_at_start(pair_dirs):
    with pytest.raises(SpecUIError, match="could not load|not found|no such|does not exist"):
        RemoteService(partial(tiny_service, "/no/such/model", pair_dirs[1]))


def test_what_crosses_the_pipe():
    assert edit("ab", "abc") == (2, "c") and edit("abx", "aby") == (2, "y") and edit("", "") == (0, "")
    assert edit([1, 2, 3], [1, 2, 3, 4]) == (3, [4]) and edit([1, 2], [3]) == (0, [3])

    class Local(Exception):
        def __init__(self, a, b):
            super().__init__(a)

    sent = portable(Local("x", 1))
    assert isinstance(sent, SpecUIError) and "Local" in str(sent)
    assert isinstance(portable(ValueError("v")), ValueError)


def test_the_engine_side_answers_every_waiter_even_when_a_message_fails():
    """A call it has not got, a reply whose start raises, a batch join that raises: each waiter
    hears an error (nothing waits forever), and the host goes on."""
    from specui.service.engine_process import EngineHost
    from specui.service.runner import MainThreadRunner

    class Broken:
        def run(self, *args):
            raise RuntimeError("no engine here")

        def join_batch(self, *args):
            raise RuntimeError("no batch here")

    sent: list[tuple] = []
    host = EngineHost(Broken(), MainThreadRunner(), sent.append)
    host.receive(("call", 1, "no_such_call", (), False))
    host.receive(("run", 2, MESSAGES, ChatSettings()))
    host.receive(("join", [(3, MESSAGES, ChatSettings(method="ems-sd")), (4, MESSAGES, ChatSettings(method="ems-sd"))]))
    host.receive(("cancel", 99))  # nothing running under that id: nothing to do
    assert [m[:2] for m in sent] == [("error", 1), ("failed", 2), ("failed", 3), ("failed", 4)]
    assert "no_such_call" in str(sent[0][2]) and "no engine here" in str(sent[1][2])
