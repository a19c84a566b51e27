"""`--capture auto` on a CPU with no record for a model: eager against compiled forwards measured
in the background (engine/capture_choice.py's timers and decide), while no reply decodes.

The pair decodes eagerly meanwhile. Each step runs on a fresh thread at the lowest CPU
priority: preparing one kind of forward (compiled, compiled with grouped attention, eager) on a
session of its own, the thread sleeping while a reply decodes (a profile hook, as the Warmup's
compiles wait) and going on where it was after; then timing the kinds' rounds taking turns,
with no profile hook (a hook on every Python call would slow eager rounds more than compiled
ones) but a check before each timed token, so a reply that starts ends the rounds, which are
timed again once nothing decodes. Where a model thread serves the app (service/runner.py: the
thread every reply decodes on), the rounds are timed there, as a job of its own while nothing
decodes, and end once any other job waits: a forward on a thread beside the decoding one runs
where libgomp counts more OpenMP teams than cores and barely spins its workers (on a 2-core Zen 4
EPYC the same eager int4 round took 17-20 ms a token on the decoding thread, 35-40 ms on a fresh
one; a measurement timed there recorded 39.4 / 27.8 ms eager / compiled against 17.4 / 10.8 in
the foreground). The record it writes is what the engine adopts (as the last
step ends, or before its next reply): compiled in the background where compiled measured
faster, eager otherwise; every later load on this machine reads it without measuring again.

One measurement per model at a time: an engine made on a model that another engine's measurement
has under way follows that one (`measuring`, `follow`) instead of measuring it beside it. A
bench makes an engine per row on one pair, and each measured the same models at once: on a
2-core Zen 4 EPYC (bench of 3 rows, w4a8 target) four measurements at a time timed the 12 ms
target at 345 ms a token compiled and 488 eager, and took 13 minutes."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specui.engine import capture_choice
from specui.engine.giving_way import DYNAMO, EXIT_WAIT_S, Stopped, lowest_priority, sleep_while, stop_at_exit, stop_here

ENV = "SPECUI_MEASURE_CAPTURE"  # "0": never measure in the background (tests; benches that must not)
IDLE_S = 0.5  # how long no reply must have decoded before a measurement (re)starts
MEASURING = "_specui_measuring"  # where a model keeps the measurement under way for it (its id, the Calibration)


class ModelThread(Protocol):
    """Where replies decode (service/runner.py's MainThreadRunner): runs submitted jobs one at a
    time; `waiting()`: a job waits for the one that runs."""

    def submit(self, fn: Callable, *args) -> Future: ...

    def waiting(self) -> bool: ...


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
        the last thread once finished (the engine adopts the choice then, if no reply decodes).
        More engines may follow it (`follow`): it pauses while any of them decodes, calls each
        one's `done`, and ends early only once every one of them has left it."""
        self.models: list[tuple[str, PreTrainedModel]] = []
        self._followers: list[tuple[Callable[[], bool], Callable[[], object] | None]] = [(paused, done)]
        self._add(models)
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
        self._joining = threading.Lock()  # followers join, and the measurement ends, one at a time
        self.model_thread: ModelThread | None = None  # where the rounds are timed (run_on); None: this thread
        atexit.register(stop_at_exit, weakref.ref(self))

    def start(self) -> Calibration:
        """Begin on a thread of its own; returns self."""
        self._next()
        return self

    def _add(self, models: list[tuple[str, PreTrainedModel]]) -> None:
        """Queue the models not queued yet; each keeps this measurement while it is under way."""
        queued = {id(m) for _, m in self.models}
        for role, model in models:
            if id(model) not in queued:
                self.models.append((role, model))
                queued.add(id(model))
            model.__dict__[MEASURING] = (id(model), self)  # not a submodule: state_dict and .to() skip it

    def follow(self, paused: Callable[[], bool], done: Callable[[], object] | None,
               models: list[tuple[str, PreTrainedModel]] = ()) -> Calibration | None:
        """Another engine's interest: it pauses this measurement while `paused()` (its reply
        decodes), hears `done` once it finishes, and adds any of `models` not queued yet.
        None if the measurement has ended (or is cancelled) meanwhile: measure anew."""
        with self._joining:
            if self.done or self.cancelled:
                return None
            self._followers.append((paused, done))
            self._add(list(models))
        return self

    def leave(self, done: Callable[[], object] | None) -> None:
        """An engine (known by its `done`) is closed: once no engine follows, measure nothing
        more, and end the compile under way (as `stop`)."""
        with self._joining:
            self._followers = [f for f in self._followers if f[1] != done]
            if not self._followers and not self.done:
                self.cancel()

    def run_on(self, model_thread: ModelThread | None) -> None:
        """Time the rounds on `model_thread` (the app's: where replies decode), from the next
        timing on; None: on the measuring thread (the CLI, tests, embedding)."""
        self.model_thread = model_thread

    def _release(self, model: PreTrainedModel) -> None:
        """`model` is no longer measured here (measured, or left unmeasured at the end)."""
        if model.__dict__.get(MEASURING, (None, None))[1] is self:
            del model.__dict__[MEASURING]

    def paused(self) -> bool:
        """A reply decodes on an engine that follows this measurement, or a job (a reply, a load)
        waits for the model thread."""
        model_thread = self.model_thread
        return any(paused() for paused, _ in self._followers) or (model_thread is not None and model_thread.waiting())

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

    def _waiting(self) -> bool:  # not while a decoding thread waits for the compile's turn (giving_way.DYNAMO)
        return self.paused() and not self._stopping and not DYNAMO.wanted

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
        DYNAMO.mark_background()
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
                    self.entries[role] = self._timed(model)
                except Stopped:
                    self.interrupted += 1
                else:
                    self._release(self.models.pop(0)[1])
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

    def _timed(self, model: PreTrainedModel) -> dict:
        """decide() on the prepared kinds: on the model thread where one serves (waited for
        here; a job that queues behind it ends it, check()), else on this thread. The rounds a
        reply did not end are kept (Remembered): timed again, decide() goes on from there."""
        for one_round, _ in self._kinds.values():
            one_round.rewind()
        model_thread = self.model_thread
        if model_thread is None:
            return self.decide(model, self._kinds)
        job = model_thread.submit(self._decide_there, model)
        while True:
            try:
                return job.result(timeout=0.1)
            except TimeoutError:
                if self._stopping and job.cancel():  # never started (the app is stopping)
                    raise Stopped("the measurement is cancelled") from None

    def _decide_there(self, model: PreTrainedModel) -> dict:
        """The model thread's job: nothing started decoding while it queued (else ended at once)."""
        self._check()
        return self.decide(model, self._kinds)

    def _prepare(self, kind: str, make: Callable) -> None:
        """Compile (or warm) one kind under the profile hook; its rounds are timed later. A
        reply that ends it (Stopped, from check()) leaves it to be prepared again on a fresh
        thread (compiled already: the model keeps its compiled callable)."""
        self._ident = threading.get_ident()
        # a compiled kind's first forward compiles: paused by replies; after it (and an eager
        # kind's every forward) the thread has an OpenMP team, so a reply ends it (check())
        self._compiling = kind.rsplit("|", 1)[-1].startswith("on")  # (a kind may be named "<option>|on")
        sys.setprofile(self._hook)  # this thread only
        try:
            # kernels for the pair's thread count (inductor reads this thread's at compile time)
            with torch._inductor.config.patch({"cpp.threads": self.threads}), torch.inference_mode():
                one_round, first = make(self._past_the_compile)
                self._kinds[kind] = (Remembered(one_round), first)
        finally:
            self._compiling = False
            sys.setprofile(None)

    def _finish(self) -> None:
        with self._joining:
            if self.models and not self._stopping and self.state != "failed":
                return self._next()  # a follower added a model as the last one was done: measured too
            if not self._stopping and self.state != "failed":
                self.state = "done"
            for _, model in self.models:  # left unmeasured (cancelled, failed): a later engine measures them anew
                self._release(model)
            self._done.set()
            followers = list(self._followers)
        for _, on_done in followers:
            if on_done is None:
                continue
            if self._stopping:  # the pair is replaced or the interpreter exits (where no thread may start)
                on_done()
            else:  # on a fresh thread: this one ran forwards (an OpenMP team), and on_done may wait for a reply
                threading.Thread(target=on_done, name="specui-measure", daemon=True).start()


class Remembered:
    """A kind's round timer whose results outlive an interrupted timing: called again after
    rewind(), it returns the rounds already timed, in order, and times only the rest. Without it
    every timing started from the first round, and with replies a few seconds apart the rounds
    never finished (the app's int4 target, three kinds of 3 rounds: longer than the quiet
    between a chat client's replies every 4 s, measured for 7 minutes without a record)."""

    def __init__(self, one_round: Callable[[], float]) -> None:
        self.one_round, self.results, self.calls = one_round, [], 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls <= len(self.results):
            return self.results[self.calls - 1]
        ms = self.one_round()  # a reply ends it here (Stopped): this round is not kept
        self.results.append(ms)
        return ms

    def rewind(self) -> None:
        self.calls = 0


def measuring(model: PreTrainedModel) -> Calibration | None:
    """The background measurement under way for `model` (not finished, not cancelled), if any."""
    owner, measured = model.__dict__.get(MEASURING, (None, None))
    if owner != id(model) or measured is None or measured.done or measured.cancelled:
        return None  # (a deep copy of a model carries its source's entry: not its own)
    return measured
