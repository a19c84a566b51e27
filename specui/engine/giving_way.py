"""How a compile thread gives way: to a reply (it sleeps while one decodes, at the lowest CPU
priority otherwise) and to the interpreter's exit (it is ended). Shared by the Warmup's
per-shape compiles (engine/warmup.py) and the background measurement (engine/calibration.py).

While any thread compiles, torch's `torch.compiler.is_compiling()` is true in every thread (one
process-wide flag, held for the whole compile). Eager forwards on the decoding thread would then
take transformers' compile-time branches (its output collector becomes a plain global shared
with the compile) and torch would skip `always_call` forward hooks after a failed forward. A
paused compile clears the flag for as long as it sleeps (`eager_meanwhile`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

# code that may hold a lock the decoding thread can ask for (a module's import lock, a logging
# handler's lock): a compile is not paused inside it, only once it is out again
# (not threading.py: every thread's first frames are there)
HOLDS_LOCKS = ("importlib._bootstrap", f"{os.sep}logging{os.sep}")


def may_pause(frame) -> bool:
    """Whether a compile may sleep at `frame` (called from a profile hook while a reply decodes):
    not inside an import or logging (a paused thread holding their locks would stall a reply that
    imports or logs, and the reply holds what the pause waits for)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in HOLDS_LOCKS):
            return False
        frame = frame.f_back
    return True


def sleep_while(waiting: Callable[[], bool], frame, paused: Callable[[], object]) -> float:
    """In a compile thread's profile hook at `frame`: while `waiting()` (a reply decodes), sleep,
    holding neither the GIL nor a core, unless a pause there may stall the reply (may_pause);
    `paused()` is called as the pause begins. Returns the seconds slept (0 where it did not)."""
    if not waiting() or not may_pause(frame):
        return 0.0
    paused()
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


PAUSE_POLL_S = 0.02  # how often a paused compile looks whether the reply is done
EXIT_WAIT_S = 10.0  # at exit, how long the compile under way may take to finish
STOP_WAIT_S = 60.0  # a replaced pair's: it ends once it is back in Python (not inside the C++ compiler)


def end_threads(worker, wait_s: float = EXIT_WAIT_S) -> None:
    """Until `worker` has nothing left (its `wait(0.1)`; at most `wait_s`): raise Stopped in its
    thread while that one compiles (`worker._compiling`, `worker._ident`), again each second it
    goes on. The hook's own exception may meet a clause that catches BaseException, and CPython
    drops a hook that raised. `worker`: a Warmup or a Calibration."""
    deadline, sent = time.monotonic() + wait_s, 0.0
    _silence_stopped()
    while not worker.wait(0.1) and time.monotonic() < deadline:
        ident = worker._ident if worker._compiling else None
        if ident is not None and time.monotonic() - sent > 1.0:  # the last one may still be unwinding
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(Stopped))
            sent = time.monotonic()


def end_soon(worker) -> None:
    """The pair is replaced: end `worker`'s compile under way now, on a thread of its own
    (end_threads). Nothing pauses that compile any more, and left to finish (minutes for a fresh
    shape of the bundled pair) it would take the GIL from the next pair's replies."""
    threading.Thread(target=end_threads, args=(worker, STOP_WAIT_S), name="specui-ending", daemon=True).start()


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
    dynamo) would swallow it and the compile would go on."""


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
