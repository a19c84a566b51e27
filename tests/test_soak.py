"""Bounded soak: the real app (`python app.py`, bundled pair, loopback only) under 8 concurrent
client sessions sending 3 messages each through the named API, with Stop (cancel) at random
points and a model reload in the middle. It stops by itself.

Checked: no reply crosses sessions (greedy replies are deterministic: each finished reply
equals the reference reply to its own prompt, each stopped one is a prefix of it), no request
hangs past REQUEST_LIMIT_S, and the app's memory returns near its level before the soak."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from app_process import rss_bytes, start_app, stop_app

gradio_client = pytest.importorskip("gradio_client")

SESSIONS, MESSAGES, MAX_NEW_TOKENS = 8, 3, 16
REQUEST_LIMIT_S = 240  # a request waits behind the others and the reload, never longer than this
PLACES = ["France", "Italy", "Japan", "Egypt", "Canada", "Spain", "Brazil", "Kenya"]
PROMPTS = [f"What is the capital of {p}?" for p in PLACES] + ["Name three colours.", "Count from 1 to 5."]
METHODS = ["speculative", "autoregressive", "opt-tree"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    proc, url = start_app(tmp_path_factory.mktemp("soak") / "app.log")
    yield proc, url
    stop_app(proc)


def ask(client, prompt: str, method: str) -> dict:
    return client.predict(prompt, method=method, max_new_tokens=MAX_NEW_TOKENS, temperature=0, api_name="/chat")


def test_eight_sessions_with_stops_and_a_reload(app):
    proc, url = app
    Client = gradio_client.Client
    warm = Client(url, verbose=False)
    reference = {p: ask(warm, p, "autoregressive")["reply"] for p in PROMPTS}  # greedy: one true reply each
    rss_start = rss_bytes(proc.pid)
    rng = random.Random(0)
    plans = [[(PROMPTS[(s * 3 + m) % len(PROMPTS)], METHODS[(s + m) % len(METHODS)],
               rng.uniform(0.05, 1.5) if rng.random() < 0.4 else None) for m in range(MESSAGES)]
             for s in range(SESSIONS)]
    finished, stopped, latencies, peak = [], [], [], [rss_start]
    done_messages = threading.Semaphore(0)

    def session(plan) -> None:
        client = Client(url, verbose=False)
        for prompt, method, stop_after in plan:
            t0 = time.monotonic()
            job = client.submit(prompt, method=method, max_new_tokens=MAX_NEW_TOKENS, temperature=0,
                                api_name="/chat")
            if stop_after is not None:
                time.sleep(stop_after)
                job.cancel()
                deadline = time.monotonic() + REQUEST_LIMIT_S
                while not job.done() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert job.done(), f"a stopped request hung: {prompt!r}"
                stopped.append((prompt, [o["reply"] for o in job.outputs()]))
            else:
                out = job.result(timeout=REQUEST_LIMIT_S)
                assert out["stats"]["method"] == method
                finished.append((prompt, out["reply"]))
            latencies.append(time.monotonic() - t0)
            peak[0] = max(peak[0], rss_bytes(proc.pid))
            done_messages.release()

    t0 = time.monotonic()
    with ThreadPoolExecutor(SESSIONS + 1) as pool:
        runs = [pool.submit(session, plan) for plan in plans]
        for _ in range(SESSIONS * MESSAGES // 2):  # halfway: reload the pair while chats keep coming
            assert done_messages.acquire(timeout=REQUEST_LIMIT_S), "the soak stalled"
        reloaded = pool.submit(warm.predict, "bundled:smollm2", "default", "none", "cpu", "float32",
                               api_name="/load_models")
        for run in runs:
            run.result(timeout=REQUEST_LIMIT_S * MESSAGES)
        assert "loaded target" in reloaded.result(timeout=REQUEST_LIMIT_S)["message"]
    wall = time.monotonic() - t0

    for prompt, reply in finished:  # no cross-talk: each reply is the one to its own prompt
        assert reply == reference[prompt], (prompt, reply)
    for prompt, partials in stopped:
        assert all(reference[prompt].startswith(p) for p in partials), (prompt, partials)
    assert len(finished) + len(stopped) == SESSIONS * MESSAGES and finished and stopped
    assert ask(warm, PROMPTS[0], "speculative")["reply"] == reference[PROMPTS[0]]  # still right afterwards

    rss_end = rss_bytes(proc.pid)
    mb = 1 << 20
    print(f"\nsoak: {SESSIONS} sessions x {MESSAGES} messages ({len(stopped)} stopped) + 1 reload in {wall:.1f} s; "
          f"latency max {max(latencies):.1f} s, median {sorted(latencies)[len(latencies) // 2]:.1f} s; "
          f"RSS {rss_start / mb:.0f} MB before, {peak[0] / mb:.0f} MB peak, {rss_end / mb:.0f} MB after")
    assert rss_end < rss_start * 1.25 + 100 * mb, "memory did not return near its starting level"
