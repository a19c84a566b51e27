"""How a compile thread gives way: to a reply (it sleeps while one decodes, at the lowest CPU
priority otherwise) and to the interpreter's exit or a replaced pair (it is ended, where ending
it leaves no lock held: stop_here). Shared by the Warmup's
per-shape compiles (engine/warmup.py) and the background measurement (engine/calibration.py).

While any thread compiles, torch's `torch.compiler.is_compiling()` is true in every thread (one
process-wide flag, held for the whole compile). Eager forwards on the decoding thread would then
take transformers' compile-time branches (its output collector becomes a plain global shared
with the compile) and torch would skip `always_call` forward hooks after a failed forward. A
paused compile clears the flag for as long as it sleeps (`eager_meanwhile`)."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

from specui.engine import openmp_team

# code that may hold a lock the decoding thread (or this one, later) can ask for: a module's
# import lock, a logging handler's, an inductor cache's file lock, a pool's queue. A compile is
# neither paused nor ended inside it, only once it is out again. threading.py only past a
# thread's first frames (every thread starts there).
HOLDS_LOCKS = tuple(part.replace("/", os.sep) for part in (
    "importlib._bootstrap", "/logging/", "/filelock/", "/contextlib.py", "/concurrent/futures/",
    "/queue.py", "/threading.py"))
THREAD_START = frozenset({"_bootstrap", "_bootstrap_inner", "run"})
# functions that release (or take) what a `try` or `with` holds: a compile is not ended in them
CLEANUP = frozenset({"__exit__", "__aexit__", "__enter__", "__del__", "acquire", "release", "_release", "close"})
SUSPENDS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _frames(frame):
    """`frame` and its callers, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def _holds_locks(code) -> bool:
    return any(part in code.co_filename for part in HOLDS_LOCKS) and not (
        code.co_filename.endswith("threading.py") and code.co_name in THREAD_START)


def may_pause(frame) -> bool:
    """Whether a compile may sleep at `frame` (called from a profile hook while a reply decodes):
    not inside an import or logging (a paused thread holding their locks would stall a reply that
    imports or logs, and the reply holds what the pause waits for)."""
    return not any(_holds_locks(f.f_code) for f in _frames(frame))


def may_stop(frame) -> bool:
    """Whether a compile may be ended at the start of `frame` (a profile hook's "call"): where
    it may pause, and not while this thread handles an exception (a Stopped unwinding runs the
    `finally` and `__exit__` clauses that release locks: a second one there would skip the
    release and leave the lock held for ever), not inside a function that takes or releases
    something, not at a generator's resumption (its exception could land later than its start)."""
    if sys.exc_info()[1] is not None or frame.f_code.co_flags & SUSPENDS:
        return False
    return not any(f.f_code.co_name in CLEANUP or _holds_locks(f.f_code) for f in _frames(frame))


def stop_here(frame, worker, hook: Callable) -> None:
    """In a compile thread's profile hook (`hook`, of `worker`: a Warmup or a Calibration) once
    the compile is to end: where `may_stop(frame)`, raise Stopped (at the start of `frame`).
    CPython drops a hook that raised, so the Stopped re-arms it where it is let go of (a clause
    that caught and dropped it, or an unraisable one: a weakref callback), in the worker's thread
    while that one still compiles (`worker._compiling`, `worker._ident`): the compile then ends at
    the next place it may instead of running on unhooked."""
    if may_stop(frame):
        _silence_stopped()
        raise Stopped("the interpreter is exiting, or the pair was replaced", rearm=lambda: _rearm(worker, hook))


def _rearm(worker, hook: Callable) -> None:
    if worker._compiling and worker._ident == threading.get_ident():
        sys.setprofile(hook)


def sleep_while(waiting: Callable[[], bool], frame, paused: Callable[[], object]) -> float:
    """In a compile thread's profile hook at `frame`: while `waiting()` (a reply decodes), sleep,
    holding neither the GIL nor a core, unless a pause there may stall the reply (may_pause);
    `paused()` is called as the pause begins. The thread's OpenMP team is handed back first
    (engine/openmp_team.py: kept, it stops libgomp spinning the reply's workers). Returns the
    seconds slept (0 where it did not)."""
    if not waiting():
        return 0.0
    if not may_pause(frame):
        time.sleep(0)  # hand the GIL to the reply at each call: else it waits a switch interval per op
        return 0.0
    paused()
    openmp_team.release()
    t0 = time.perf_counter()
    with eager_meanwhile():
        while waiting():
            time.sleep(PAUSE_POLL_S)
    return time.perf_counter() - t0


def lowest_priority() -> None:
    """Run this thread, and the C++ compilers it starts, at the lowest CPU priority (Linux: a
    thread's nice value is its own, and a child inherits it): a compiler running while a reply
    decodes then takes only idle cores (measured on 2 cores: at equal priority the eager reply
    decoded at about half speed beside inductor's g++)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass


class CompileTurn:
    """dynamo compiles one frame at a time in a process: whoever may compile takes this turn
    first (`with DYNAMO:`). A background compile (a Warmup's, a Calibration's: threads marked with
    `mark_background`) sleeps while a reply decodes and keeps the turn meanwhile; where the
    decoding thread itself must compile (a cost profile's timed forwards, a runner without a
    Warmup) it waits for the turn, and `wanted` then tells the paused compile to go on, else each
    would wait for the other for ever (the app's reply hung in its cost profile while a background
    measurement's compile slept, 2026-12-05). A background thread that waits for the turn does not
    count: a reply still pauses the compile that holds it; it hands back its OpenMP team first
    (engine/openmp_team.py), as a paused compile does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0  # decoding threads waiting for the turn
        self._marks = threading.local()

    def __enter__(self) -> CompileTurn:
        counted = not getattr(self._marks, "background", False)
        while not counted and self._waiting:  # a decoding thread waits for the turn: it goes first
            time.sleep(PAUSE_POLL_S)
        if self._lock.acquire(blocking=False):
            return self
        if counted:
            with self._count:
                self._waiting += 1
        else:  # waiting perhaps for minutes: its OpenMP team would slow every reply meanwhile
            openmp_team.release()
        try:
            self._lock.acquire()
        finally:
            if counted:
                with self._count:
                    self._waiting -= 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def mark_background(self) -> None:
        """The calling thread compiles in the background (for as long as it lives)."""
        self._marks.background = True

    @property
    def wanted(self) -> bool:
        """A decoding thread waits for the turn: a compile that holds it must not pause."""
        return self._waiting > 0


DYNAMO = CompileTurn()  # one per process, as dynamo's own compiling is
PAUSE_POLL_S = 0.02  # how often a paused compile looks whether the reply is done
EXIT_WAIT_S = 10.0  # at exit, how long the compile under way may take to end


def stop_at_exit(ref: weakref.ref) -> None:
    """Interpreter exit (atexit, with a weak reference to a Warmup or a Calibration): it does
    nothing more and its compile under way ends before the interpreter does (a compile thread
    still running as the interpreter ends aborts the process: "terminate called without an
    active exception")."""
    worker = ref()
    if worker is not None:
        worker.stop(at_exit=True)


def _silence_stopped() -> None:
    """A Stopped that lands in a weakref callback is printed as "ignored": not ours to print."""
    previous = sys.unraisablehook
    if getattr(previous, "silences_stopped", False):
        return

    def hook(raised) -> None:
        if not isinstance(raised.exc_value, Stopped):
            previous(raised)

    hook.silences_stopped = True
    sys.unraisablehook = hook


class Stopped(BaseException):
    """Raised inside a compile to end it (the interpreter exits; a measurement's timed rounds
    when a reply starts). Not an Exception: the compiler's own `except Exception` clauses (sympy,
    dynamo) would swallow it and the compile would go on. `rearm`: called when it is let go of,
    in the thread that lets go of it (stop_here)."""

    def __init__(self, *args, rearm: Callable[[], object] | None = None) -> None:
        super().__init__(*args)
        self.rearm = rearm

    def __del__(self) -> None:
        if self.rearm is not None:
            self.rearm()


@contextlib.contextmanager
def eager_meanwhile():
    """While inside: torch.compiler.is_compiling() false again (the compile under way sleeps)."""
    compiler = torch.compiler
    was = getattr(compiler, "_is_compiling_flag", None)
    if was is None:  # a torch without the process-wide flag
        yield
        return
    compiler._is_compiling_flag = False
    try:
        yield
    finally:
        compiler._is_compiling_flag = was
