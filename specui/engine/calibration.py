"""`--capture auto` on a CPU with no record for a model: eager against compiled forwards measured
in the background (engine/capture_choice.py's timers and decide), while no reply decodes.

The pair decodes eagerly meanwhile. Each step runs on a fresh thread at the lowest CPU
priority: preparing one kind of forward (compiled, compiled with grouped attention, eager) on a
session of its own, the thread sleeping while a reply decodes (a profile hook, as the Warmup's
compiles wait) and going on where it was after; then timing the kinds' rounds taking turns,
with no profile hook (a hook on every Python call would slow eager rounds more than compiled
ones) but a check before each timed token, so a reply that starts ends the rounds, which are
timed again once nothing decodes. The record it writes is what the engine adopts (as the last
step ends, or before its next reply): compiled in the background where compiled measured
faster, eager otherwise; every later load on this machine reads it without measuring again."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from specui.engine import capture_choice
from specui.engine.giving_way import EXIT_WAIT_S, Stopped, lowest_priority, sleep_while, stop_at_exit, stop_here

ENV = "SPECUI_MEASURE_CAPTURE"  # "0": never measure in the background (tests; benches that must not)
IDLE_S = 0.5  # how long no reply must have decoded before a measurement (re)starts


def enabled() -> bool:
    """Whether `--capture auto` may measure unmeasured models in the background (the default)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "no", "false")


class Calibration:
    """Measures `models` ([(role, model)], in order) in the background; plain bookkeeping for
    the report: `state` ("waiting", "compiling <role>", "timing <role>", "done", "failed"),
    `entries` (role: the record's entry), `seconds`, `interrupted` (replies that paused a
    compile or ended a timing), `note`."""

    def __init__(self, models: list[tuple[str, PreTrainedModel]], paused: Callable[[], bool],
                 measure: tuple[Callable, Callable] | None = None, done: Callable[[], object] | None = None) -> None:
        """`paused`: True while a reply decodes (the engine's lock's `locked`); `measure`:
        (timers, decide) as in capture_choice (a test passes quick ones); `done`: called on
        the last thread once finished (the engine adopts the choice then, if no reply decodes)."""
        self.models = list(models)
        self.paused = paused
        self.timers, self.decide = measure or (capture_choice.timers, capture_choice.decide)
        self.entries: dict[str, dict] = {}
        self.state = "waiting"
        self.note = ""
        self.seconds = 0.0
        self.interrupted = 0
        self.threads = torch.get_num_threads()  # the pair's thread count: what is measured and recorded
        self._kinds: dict[str, tuple] = {}  # the model under way's kinds prepared so far
        self._stopping = False
        self._compiling = False  # a kind is being prepared: the profile hook pauses it
        self._ident: int | None = None  # the thread preparing it
        self._done = threading.Event()
        self._on_done = done
        atexit.register(stop_at_exit, weakref.ref(self))

    def start(self) -> Calibration:
        """Begin on a thread of its own; returns self."""
        self._next()
        return self

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every model is measured (or the measurement failed or was cancelled)."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Measure nothing more (the pair is replaced, or the interpreter exits)."""
        self._stopping = True

    def stop(self, at_exit: bool = False) -> None:
        """The pair is replaced (or the interpreter exits, waiting for it): measure nothing more,
        and end the compile under way (its thread ends it at the next place it may: stop_here)."""
        self.cancel()
        if at_exit:
            self.wait(EXIT_WAIT_S)

    @property
    def cancelled(self) -> bool:
        return self._stopping

    def choices(self) -> dict[str, str]:
        """role: "on" / "off", for the models measured."""
        return {role: entry.get("choice", "off") for role, entry in self.entries.items()}

    def _check(self) -> None:
        """Before each timed token: a reply decodes (or the app exits), so end the round."""
        if self._stopping or self.paused():
            raise Stopped("a reply decodes")

    def _past_the_compile(self) -> None:
        """check() for a kind being prepared, called after its first forward: the compile is
        done and this thread has an OpenMP team, so from here on a reply ends it, never pauses it."""
        self._compiling = False
        self._check()

    def _hook(self, _frame, event: str, _arg) -> None:
        """This thread's profile hook while preparing a kind: wait (sleeping) while a reply
        decodes, then go on where it was (as the Warmup's compiles do); end it at exit."""
        if event != "call" or not self._compiling:
            return
        sleep_while(self._waiting, _frame, self._count_pause)
        if self._stopping:
            stop_here(_frame, self, self._hook)

    def _waiting(self) -> bool:
        return self.paused() and not self._stopping

    def _count_pause(self) -> None:
        self.interrupted += 1

    def _idle(self) -> bool:
        """Wait until no reply has decoded for IDLE_S; False if the measurement is cancelled."""
        quiet_since = time.monotonic()
        while not self._stopping:
            if self.paused():
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= IDLE_S:
                return True
            time.sleep(0.05)
        return False

    def _next(self) -> None:
        """The next step on a fresh thread: a thread that ran a model's forwards keeps an OpenMP
        team while it lives, and a second team beside a reply's makes libgomp stop spinning its
        workers (the reply's eager tokens 16 -> 25-29 ms on a 2-core EPYC: engine/warmup.py)."""
        threading.Thread(target=self._work, name="specui-measure", daemon=True).start()

    def _work(self) -> None:
        """One step: prepare the next kind of the model under way (one compile, the thread
        waiting while replies decode), or time its kinds (a reply ends the rounds: timed again
        on a fresh thread once nothing decodes), then hand on to a fresh thread."""
        lowest_priority()
        torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        try:
            if not self._idle() or not self.models:
                return self._finish()
            role, model = self.models[0]
            kinds = self.timers(model)
            todo = [kind for kind in kinds if kind not in self._kinds]
            if todo:
                self.state = f"compiling {role}"
                try:
                    self._prepare(todo[0], kinds[todo[0]])
                except Stopped:
                    if self._stopping:
                        raise
                    self.interrupted += 1
            else:
                self.state = f"timing {role}"
                try:
                    self.entries[role] = self.decide(model, self._kinds)
                except Stopped:
                    self.interrupted += 1
                else:
                    self.models.pop(0)
                    self._kinds = {}
        except Stopped:  # the interpreter exits
            return self._finish()
        except Exception as e:  # noqa: BLE001 - a measurement that fails leaves the pair eager, with a note
            if not self._stopping:
                self.state = "failed"
                self.note = f"measuring compiled forwards failed ({type(e).__name__}: {str(e)[:200]}); eager"
            return self._finish()
        finally:
            self.seconds += time.perf_counter() - t0
        self._next()

    def _prepare(self, kind: str, make: Callable) -> None:
        """Compile (or warm) one kind under the profile hook; its rounds are timed later. A
        reply that ends it (Stopped, from check()) leaves it to be prepared again on a fresh
        thread (compiled already: the model keeps its compiled callable)."""
        self._ident = threading.get_ident()
        # a compiled kind's first forward compiles: paused by replies; after it (and an eager
        # kind's every forward) the thread has an OpenMP team, so a reply ends it (check())
        self._compiling = kind.startswith("on")
        sys.setprofile(self._hook)  # this thread only
        try:
            # kernels for the pair's thread count (inductor reads this thread's at compile time)
            with torch._inductor.config.patch({"cpp.threads": self.threads}), torch.inference_mode():
                self._kinds[kind] = make(self._past_the_compile)
        finally:
            self._compiling = False
            sys.setprofile(None)

    def _finish(self) -> None:
        if not self._stopping and self.state != "failed":
            self.state = "done"
        self._done.set()
        if self._on_done is None:
            return
        if self._stopping:  # the pair is replaced or the interpreter exits (where no thread may start)
            self._on_done()
        else:  # on a fresh thread: this one ran forwards (an OpenMP team), and on_done may wait for a reply
            threading.Thread(target=self._on_done, name="specui-measure", daemon=True).start()
