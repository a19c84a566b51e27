"""Where a compile thread may be ended (engine/giving_way.py): never where ending it would leave a
lock held for ever (a module's import lock, a cache's file lock), and again after a clause that
swallowed the first Stopped. A lock left held hangs the next thread that asks for it."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from specui.engine import giving_way, openmp_team
from specui.engine.giving_way import Stopped, stop_here


class Held:
    """A lock taken and given back in Python code, as filelock's and an import's are."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __enter__(self) -> Held:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()


def run_stopping(body) -> list[str]:
    """Run `body(armed)` on a thread whose profile hook ends it (stop_here at each call, as a
    Warmup's does) once `armed` holds something; returns the calls the hook saw from there and
    how the thread ended."""
    seen: list[str] = []
    armed: list[bool] = []
    worker = SimpleNamespace(_compiling=True, _ident=None)  # as a Warmup says what its thread does

    def hook(frame, event, _arg) -> None:
        if event == "call" and armed:
            seen.append(frame.f_code.co_name)
            stop_here(frame, worker, hook)

    def target() -> None:
        worker._ident = threading.get_ident()
        sys.setprofile(hook)
        try:
            body(armed)
            seen.append("returned")
        except Stopped:
            seen.append("stopped")
        finally:
            worker._compiling = False
            sys.setprofile(None)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return seen


def step() -> int:
    return 1


def test_a_stopped_compile_gives_back_what_it_holds():
    """Asked to end from before a `with` that takes a lock in Python code: it does not end in
    the taking (the lock would stay held), but at the first call inside, and the release in
    __exit__ runs as the Stopped unwinds."""
    held = Held()
    reached = []

    def body(armed) -> None:
        armed.append(True)
        with held:
            reached.append("inside")
            step()
            reached.append("after step")

    seen = run_stopping(body)
    assert seen == ["__enter__", "acquire", "step", "stopped"]
    assert reached == ["inside"] and not held.lock.locked()


def test_a_swallowed_stop_is_raised_again():
    """A clause that catches BaseException swallows the first Stopped: the hook stays in place
    (it never raises itself) and the next call ends the compile."""
    swallowed = []

    def body(armed) -> None:
        armed.append(True)
        try:
            step()
        except BaseException:  # noqa: BLE001 - as some of the compiler's clauses do
            swallowed.append(True)
        step()

    assert run_stopping(body)[-1] == "stopped" and swallowed == [True]


def test_nowhere_unsafe():
    """Not while an exception is being handled, not in a function that takes or releases, not
    at a generator's resumption; at a plain call, yes (inside an import or logging: as may_pause,
    tests/test_background_compile.py)."""
    here = sys._getframe()
    assert giving_way.may_stop(here)
    try:
        raise ValueError("handled")
    except ValueError:
        assert not giving_way.may_stop(sys._getframe())

    def release() -> bool:
        return giving_way.may_stop(sys._getframe())

    def gen():
        yield giving_way.may_stop(sys._getframe())

    assert not release() and next(gen()) is False


def test_a_stop_printed_as_unraisable_is_raised_again():
    """A Stopped raised in a weakref callback (run wherever the collector runs) is printed as
    unraisable, not raised in the compile: the hook is put back and the next call ends it."""
    import weakref

    class Thing:
        pass

    kept = []

    def body(armed) -> None:
        thing = Thing()
        kept.append(weakref.ref(thing, lambda _ref: step()))
        armed.append(True)
        del thing  # the callback runs here, and is where the hook first may stop the thread
        step()

    assert run_stopping(body) == ["<lambda>", "step", "stopped"]


EXITS_MID_COMPILE = """
import sys, time
sys.path.insert(0, {tests!r})
import torch
from conftest import tiny_llama
from specui.engine.session import ModelSession
session = ModelSession(tiny_llama(7, layers=1, dtype=torch.float32, hidden=40), capture="on", background=True)
warmup = session.runner.warmup
deadline = time.monotonic() + 120
while not warmup._compiling and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(1.0)  # well inside the first shape's compile
print("compiling", warmup._compiling, flush=True)
"""


def test_the_interpreter_exits_mid_compile(tmp_path):
    """The app quits while a shape compiles: the compile ends (at a place where that leaves no
    lock held) and the process exits cleanly within seconds, not aborting ("terminate called
    without an active exception") nor hanging."""
    import os
    import subprocess
    from pathlib import Path

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # a compile that takes a while
    script = EXITS_MID_COMPILE.format(tests=str(Path(__file__).parent))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiling True" in done.stdout and "terminate called" not in done.stderr
    assert time.monotonic() - t0 < 200


def test_a_decoding_thread_that_must_compile_gets_the_turn_from_a_paused_compile():
    """The hang of 2026-12-05: a background compile (a Calibration's) held the compile turn and
    slept while a reply decoded; the reply's cost profile then needed the turn for a compiled
    forward. With `wanted` in the pause's condition the compile goes on, ends, gives the turn up."""
    turn = giving_way.CompileTurn()
    decoding = threading.Event()  # a reply decodes: background compiles pause
    holding, done, order = threading.Event(), threading.Event(), []

    def compile_in_background() -> None:
        turn.mark_background()
        with turn:
            holding.set()
            while not decoding.is_set():
                time.sleep(0.005)
            giving_way.sleep_while(lambda: decoding.is_set() and not turn.wanted, sys._getframe(), lambda: None)
            order.append("compiled")
        done.set()

    background = threading.Thread(target=compile_in_background, daemon=True)
    background.start()
    assert holding.wait(10)
    decoding.set()
    time.sleep(0.05)  # the compile sleeps now, holding the turn
    assert not turn.wanted
    foreground = threading.Thread(target=lambda: (turn.__enter__(), order.append("profiled"), turn.__exit__()),
                                  daemon=True)
    foreground.start()
    foreground.join(10)
    assert not foreground.is_alive(), "the decoding thread never got the turn"
    assert order == ["compiled", "profiled"] and done.is_set() and not turn.wanted


def test_a_background_thread_waiting_for_the_turn_does_not_wake_a_paused_compile():
    turn = giving_way.CompileTurn()
    with turn:
        seen = []

        def other_compile() -> None:
            turn.mark_background()
            with turn:
                pass

        waiter = threading.Thread(target=other_compile, daemon=True)
        waiter.start()
        time.sleep(0.05)
        seen.append(turn.wanted)
    waiter.join(10)
    assert seen == [False] and not waiter.is_alive()


def test_a_decoding_thread_waiting_for_the_turn_goes_before_a_background_one():
    turn, order = giving_way.CompileTurn(), []

    def take(name: str, background: bool) -> None:
        if background:
            turn.mark_background()
        with turn:
            order.append(name)

    with turn:
        decoding = threading.Thread(target=take, args=("decoding", False), daemon=True)
        decoding.start()
        while not turn.wanted:
            time.sleep(0.001)
        background = threading.Thread(target=take, args=("background", True), daemon=True)
        background.start()
        time.sleep(0.05)
    decoding.join(10)
    background.join(10)
    assert order == ["decoding", "background"]


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_a_paused_compile_hands_back_its_openmp_team():
    """A compile thread that ran a parallel region keeps an OpenMP team of worker threads; kept
    while it sleeps for a reply, libgomp counts more threads than cores and stops spinning the
    reply's workers (the bundled target's eager replies 13-20 tok/s against about 55 on a 2-core
    Zen 3). The pause ends the team: its worker thread is gone while the compile sleeps."""
    if openmp_team._libgomp() is None:
        pytest.skip("no libgomp in this process (another OpenMP runtime, or no /proc)")
    seen: dict[str, object] = {}
    reply = threading.Event()
    threads = torch.get_num_threads()  # torch keeps a process-wide count too: given back after

    def watch() -> None:  # the reply's side: which threads ended while the compile sleeps
        deadline = time.monotonic() + 10
        while not (seen["with team"] - _threads()) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["ended"] = seen["with team"] - _threads()
        reply.clear()

    def compile_thread() -> None:
        torch.set_num_threads(2)
        try:
            x = torch.ones(1 << 22)
            for _ in range(3):
                (x * 2).sum()  # a parallel region: this thread's team of 2
            seen["with team"] = _threads()
            reply.set()
            threading.Thread(target=watch).start()
            seen["slept"] = giving_way.sleep_while(reply.is_set, sys._getframe(), lambda: None)
            seen["compile thread"] = str(threading.get_native_id())
            (x * 2).sum()  # the next parallel region starts a new team
        finally:
            torch.set_num_threads(threads)

    worker = threading.Thread(target=compile_thread)
    worker.start()
    worker.join(30)
    assert seen["slept"] > 0
    assert len(seen["ended"]) == 1 and seen["compile thread"] not in seen["ended"], seen
