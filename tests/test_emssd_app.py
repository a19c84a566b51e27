"""Continuous batching in the app: ems-sd chats from several sessions decode together in one
engine loop, each streaming its own reply (no cross-talk); a request that fails or is
stopped leaves the others untouched; 8 HTTP clients at once through the named API."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specui.errors import SpecUIError
from specui.service.chat_service import ChatService
from specui.service.pair import load_pair
from specui.service.runner import run_in_new_thread
from specui.settings import ChatSettings
from specui.ui.streaming import Started, run_in_background
from specui.weights.loading import ModelSpec

PROMPTS = [f"w{i} w{i + 3} w{2 * i + 1}" for i in range(1, 9)]


@pytest.fixture()
def service(tiny_dirs):
    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    return ChatService(load_pair(spec, spec.with_source(str(draft))))


class GatedRunner:
    """A model thread whose jobs start only once the gate opens (so the requests overlap)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def submit(self, fn, *args):
        return run_in_new_thread(lambda: self.gate.wait(30) and fn(*args))


def reply(service, submit, prompt: str, method: str, n: int = 12, cancel: threading.Event | None = None,
          on_step=None, **settings) -> tuple[object, list]:
    settings = ChatSettings(method=method, max_new_tokens=n, gamma=2, **settings)
    cancel = cancel or threading.Event()
    generation, steps = None, []
    for item in run_in_background(service, submit, [{"role": "user", "content": prompt}], settings, cancel, 0.0):
        if isinstance(item, Started):
            generation = item.generation
        else:
            steps.append(item)
            if on_step:
                on_step(item)
    return generation, steps


def wait_for_inbox(service, runner, n: int, pending=()) -> None:
    """Until n requests wait in the batch loop's inbox; a request in `pending` (futures) that ends
    first shows why it never queued."""
    loop = service.batch_loop(runner.submit)
    for _ in range(3000):
        with loop._lock:
            if len(loop._inbox) >= n:
                return
        for future in pending:
            if future.done():
                raise AssertionError(f"a request ended before {n} queued: {future.result()!r}")
        threading.Event().wait(0.01)
    raise AssertionError(f"{n} requests never queued")


def test_chats_from_several_sessions_decode_in_one_batch(service):
    reference = {p: reply(service, run_in_new_thread, p, "autoregressive")[0].text for p in PROMPTS}
    runner = GatedRunner()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        runs = [pool.submit(reply, service, runner.submit, p, "ems-sd") for p in PROMPTS]
        wait_for_inbox(service, runner, len(PROMPTS))
        runner.gate.set()
        results = [r.result(timeout=120) for r in runs]
    for p, (generation, steps) in zip(PROMPTS, results):
        assert generation.text == reference[p]  # its own reply: no cross-talk
        assert generation.stats.method == "ems-sd" and steps[0].batch_size == len(PROMPTS)
        assert generation.stats.mean_batch_size > 1
    assert max(service.batch_loop(runner.submit).sizes) == len(PROMPTS)


def test_a_stopped_and_a_failing_request_leave_the_others_untouched(service):
    reference = {p: reply(service, run_in_new_thread, p, "autoregressive", n=20)[0].text for p in PROMPTS[:3]}
    stop = threading.Event()
    runner = GatedRunner()

    def stop_after_two(step) -> None:
        if step.index >= 1:
            stop.set()

    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(reply, service, runner.submit, p, "ems-sd", 20) for p in PROMPTS[:2]]
        stopped = pool.submit(reply, service, runner.submit, PROMPTS[2], "ems-sd", 20, stop, stop_after_two)
        bad = pool.submit(reply, service, runner.submit, PROMPTS[3], "ems-sd", 4, top_p=0.0)
        wait_for_inbox(service, runner, 4)
        runner.gate.set()
        done = [r.result(timeout=120) for r in runs]
        cut, _ = stopped.result(timeout=120)
        with pytest.raises(SpecUIError, match="top-p"):
            bad.result(timeout=120)
    assert [g.text for g, _ in done] == [reference[p] for p in PROMPTS[:2]]
    assert cut.stats.finish_reason == "cancelled" and reference[PROMPTS[2]].startswith(cut.text)
    assert len(cut.output_ids) < 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_eight_http_clients_at_once_each_get_their_own_reply(service):
    from gradio_client import Client

    from specui.service.runner import MainThreadRunner
    from specui.ui.chat_ui import build_ui

    runner = MainThreadRunner()
    serving = threading.Thread(target=runner.serve, daemon=True)  # the app's model thread
    serving.start()
    demo = build_ui(service, ChatSettings(method="ems-sd", max_new_tokens=16), submit=runner.submit)
    demo.queue(default_concurrency_limit=1)
    port = _free_port()
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        warm = Client(url, verbose=False)
        reference = {p: warm.predict(p, method="autoregressive", api_name="/chat")["reply"] for p in PROMPTS}
        loop = service.batch_loop(runner.submit)
        before = len(loop.sizes)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            clients = list(pool.map(lambda _: Client(url, verbose=False), PROMPTS))  # each reads the page first
            # the model thread busy until all eight have queued (each reply takes a few ms: clients that
            # arrive one after another would otherwise each find the engine free)
            busy = threading.Event()
            runner.submit(busy.wait, 60)
            asked = [pool.submit(c.predict, p, method="ems-sd", api_name="/chat") for c, p in zip(clients, PROMPTS)]
            try:
                wait_for_inbox(service, runner, len(PROMPTS), asked)
            finally:
                busy.set()
            answers = [a.result(timeout=120) for a in asked]
        for p, out in zip(PROMPTS, answers):
            assert out["reply"] == reference[p] and out["stats"]["method"] == "ems-sd"
        assert max(loop.sizes[before:]) == len(PROMPTS)  # they decoded together
        assert max(out["stats"]["mean_batch_size"] for out in answers) > 1
    finally:
        demo.close()
        runner.stop()


def test_alternative_replies_on_the_page_and_the_api(service):
    from conftest import form_values

    from specui.ui.api import ChatAPI
    from specui.ui.chat_ui import ChatPage
    from specui.ui.streaming import to_messages

    page = ChatPage(service)
    sampled = dict(temperature=0.9, seed=11, max_new_tokens=10, gamma=2, adaptive_gamma=False)
    outs = list(page.respond(None, "w1 w2", [], "ems-sd", *form_values(replies=3, **sampled)))
    history = outs[-1][1]
    alternatives = [m for m in history if (m.get("metadata") or {}).get("title", "").startswith("alternative")]
    assert [m["metadata"]["title"] for m in alternatives] == ["alternative 1 of 3", "alternative 2 of 3"]
    # each row is its own seeded sample: the same as decoding it alone with that seed
    alone = [reply(service, run_in_new_thread, "w1 w2", "ems-sd", 10, temperature=0.9, seed=11 + k,
                   adaptive_gamma=False)[0].text for k in range(3)]
    assert [m["content"] for m in alternatives] + [history[-1]["content"]] == alone
    assert len(set(alone)) > 1
    # the next message keeps them in view but never sends them to the model
    later = list(page.respond(None, "w3", history, "ems-sd", *form_values(**sampled)))[-1][1]
    assert later[: len(history)] == history and len(to_messages(later)) == 4
    api = list(ChatAPI(page).chat("w1 w2", method="ems-sd", replies=3, **sampled))[-1]
    assert api["alternatives"] == alone[:2] and api["reply"] == alone[2]
