"""`--capture auto` on a CPU with no record for a model: eager against compiled forwards measured
in the background (engine/capture_choice.py's prepare and decide), while no reply decodes.

The pair decodes eagerly meanwhile. One thread, at the lowest CPU priority: it compiles each
model's padded shapes on sessions of its own (a reply that starts ends the compile under way,
as the Warmup's do), then times eager and compiled rounds taking turns, with no profile hook
(a hook on every Python call would slow eager rounds more than compiled ones) but a check
before each timed token, so a reply that starts ends the round. Whatever a reply ended starts
again from the beginning once nothing decodes (inductor's disk cache keeps what compiled).
The record it writes is what the engine adopts before its next reply (Engine.generate):
compiled in the background where compiled measured faster, eager otherwise, and what every
later load on this machine reads without measuring again."""

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
from specui.engine.warmup import EXIT_WAIT_S, Stopped, lowest_priority

ENV = "SPECUI_MEASURE_CAPTURE"  # "0": never measure in the background (tests; benches that must not)
IDLE_S = 0.5  # how long no reply must have decoded before a measurement (re)starts


def enabled() -> bool:
    """Whether `--capture auto` may measure unmeasured models in the background (the default)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "no", "false")


class Calibration:
    """Measures `models` ([(role, model)], in order) in the background; plain bookkeeping for
    the report: `state` ("waiting", "compiling <role>", "timing <role>", "done", "failed"),
    `entries` (role: the record's entry), `seconds`, `interrupted`, `note`."""

    def __init__(self, models: list[tuple[str, PreTrainedModel]], paused: Callable[[], bool],
                 measure: tuple[Callable, Callable] | None = None, done: Callable[[], object] | None = None) -> None:
        """`paused`: True while a reply decodes (the engine's lock's `locked`); `measure`:
        (prepare, decide) as in capture_choice (a test passes quick ones); `done`: called on
        this thread once finished (the engine adopts the choice then, if no reply decodes)."""
        self.models = list(models)
        self.paused = paused
        self.prepare, self.decide = measure or (capture_choice.prepare, capture_choice.decide)
        self.entries: dict[str, dict] = {}
        self.state = "waiting"
        self.note = ""
        self.seconds = 0.0
        self.interrupted = 0
        self.threads = torch.get_num_threads()  # the pair's thread count: what is measured and recorded
        self._stopping = False
        self._compiling = False  # prepare() runs: the profile hook may end it
        self._done = threading.Event()
        self._on_done = done
        atexit.register(_stop_at_exit, weakref.ref(self))

    def start(self) -> Calibration:
        """Begin on a thread of its own; returns self."""
        threading.Thread(target=self._work, name="specui-measure", daemon=True).start()
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

    def choices(self) -> dict[str, str]:
        """role: "on" / "off", for the models measured."""
        return {role: entry.get("choice", "off") for role, entry in self.entries.items()}

    def _check(self) -> None:
        """Before each timed token: a reply decodes (or the app exits), so end the round."""
        if self._stopping or self.paused():
            raise Stopped("a reply decodes")

    def _hook(self, _frame, event: str, _arg) -> None:
        """This thread's profile hook while compiling: ends the compile when a reply starts."""
        if event == "call" and self._compiling and (self._stopping or self.paused()):
            raise Stopped("a reply decodes")

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

    def _work(self) -> None:
        lowest_priority()
        torch.set_num_threads(self.threads)
        try:
            for role, model in self.models:
                if not self._measure(role, model):
                    break
            if not self._stopping:
                self.state = "done"
        except Exception as e:  # noqa: BLE001 - a measurement that fails leaves the pair eager, with a note
            self.state = "failed"
            self.note = f"measuring compiled forwards failed ({type(e).__name__}: {str(e)[:200]}); eager"
        finally:
            self._done.set()
        if self._on_done is not None and not self._stopping:
            self._on_done()

    def _measure(self, role: str, model: PreTrainedModel) -> bool:
        """One model, again from the start each time a reply ends it; False if cancelled."""
        while self._idle():
            t0 = time.perf_counter()
            try:
                self.state = f"compiling {role}"
                self._compiling = True
                sys.setprofile(self._hook)  # this thread only
                # kernels for the pair's thread count (inductor reads this thread's at compile time)
                with torch._inductor.config.patch({"cpp.threads": self.threads}), torch.inference_mode():
                    kinds = self.prepare(model, self._check)
                    self._compiling = False
                    sys.setprofile(None)
                    self.state = f"timing {role}"
                    self.entries[role] = self.decide(model, kinds)
                return True
            except Stopped:
                self.interrupted += 1
            finally:
                self._compiling = False
                sys.setprofile(None)
                self.seconds += time.perf_counter() - t0
        return False


def _stop_at_exit(ref: weakref.ref) -> None:
    """Interpreter exit: end the measurement under way (a thread still compiling as the
    interpreter ends aborts the process)."""
    calibration = ref()
    if calibration is not None:
        calibration.cancel()
        calibration.wait(EXIT_WAIT_S)
