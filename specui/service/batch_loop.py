"""Continuous batching for the app: every ems-sd chat, from any browser tab or API client,
decodes in one engine loop (DESIGN.md 3.8). A request waits in an inbox; the loop runs as
one job on the model thread while any request is waiting or decoding, takes waiting ones
in between steps (prefilled together), hands each row's steps to that request's own sink,
and drops a row that finished, was cancelled or failed without disturbing the others.

A sink receives, in order: a `Started` (the generation and its notes), the StepTraces of
its row, then `DONE`, or an exception (the request's own error: a prompt that does not
fit, out of memory while joining). The engine lock is held while the loop runs, so a
model swap waits for the batch to drain."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from specui.errors import SpecUIError

log = logging.getLogger("specui")
DONE = object()  # a sink's last item after its row finished


@dataclass
class Started:
    """The generation was built (prompt fitted); `notes` say what was dropped or cut."""

    generation: Any
    notes: list[str] = field(default_factory=list)


@dataclass
class Request:
    messages: list
    settings: Any  # ChatSettings with method ems-sd
    cancel: threading.Event
    sink: Callable[[Any], None]


class BatchLoop:
    def __init__(self, service, submit: Callable[..., Future]) -> None:
        self.service = service
        self.submit = submit  # runs the loop on the model thread
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._active = False  # a loop job is queued or running
        self.sizes: list[int] = []  # batch size of every step so far (tests, the page's panels read traces)

    def join(self, *requests: Request) -> None:
        """Queue requests; they join the running batch together between two steps (or start one)."""
        with self._lock:
            self._inbox.extend(requests)
            if self._active:
                return
            self._active = True
        job = self.submit(self._run)
        job.add_done_callback(self._job_ended)

    def _job_ended(self, job: Future) -> None:
        error = job.exception()
        if error is None:
            return
        with self._lock:  # the job never ran (the app is stopping) or died: fail whoever waits
            waiting, self._inbox, self._active = self._inbox, [], False
        for request in waiting:
            request.sink(error if isinstance(error, Exception) else SpecUIError("the app is stopping"))

    def _run(self) -> None:
        while True:
            engine = self.service.engine
            with engine.lock:
                if engine is self.service.engine:  # not swapped for another pair while we waited
                    self._serve(engine)
                    return

    def _serve(self, engine) -> None:
        batch, sinks = None, {}
        while True:
            with self._lock:
                waiting, self._inbox = self._inbox, []
                if not waiting and (batch is None or not batch.running):
                    self._active = False
                    return
            batch = self._admit(engine, waiting, batch, sinks)
            if batch is not None and batch.running:
                self._step(batch, sinks)

    def _step(self, batch, sinks: dict) -> None:
        try:
            steps = batch.step()
        except Exception as e:  # noqa: BLE001 - the newest row leaves with the error; the rest retry
            log.exception("batched step failed")
            victim = batch.running[-1].generation
            batch.leave(victim)
            batch.drain_left()
            sinks.pop(id(victim))(_join_error(e) if _is_memory(e) else
                                  SpecUIError(f"generation failed ({type(e).__name__}: {e}); try again"))
            return
        self.sizes.append(len(steps))
        for g, trace in steps:
            sinks[id(g)](trace)
        for g in batch.drain_left():
            sinks.pop(id(g))(DONE)

    def _admit(self, engine, waiting: list[Request], batch, sinks: dict) -> Any:
        """Build the waiting requests' generations and join them to the batch (a new one when
        there is none, or the waiting ones ask for another padding layout than it has)."""
        started = []
        for request in waiting:
            try:
                generation, notes = self.service.start(request.messages, request.settings, request.cancel,
                                                       truncate=True)
            except Exception as e:  # noqa: BLE001 - the request's own error, reported to it alone
                request.sink(e)
                continue
            request.sink(Started(generation, notes))
            if request.cancel.is_set():  # stopped while it waited: it never joins
                generation.stats.finish_reason = "cancelled"
                request.sink(DONE)
                continue
            sinks[id(generation)] = request.sink
            started.append(generation)
        if not started:
            return batch
        for padding in dict.fromkeys(g.method.padding for g in started):
            group = [g for g in started if g.method.padding == padding]
            if batch is None or (not batch.running and batch.decoder.padding != padding):
                batch = engine.batch(group[0].method)
            if batch.decoder.padding != padding:
                for g in group:  # one layout per batch: the other waits for the batch to drain
                    sinks.pop(id(g))(SpecUIError(
                        f"the running batch uses padding '{batch.decoder.padding}'; send again when it is done"))
                continue
            batch.join(group, on_error=lambda g, e: sinks.pop(id(g))(_join_error(e)))
        return batch


def _is_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower()


def _join_error(error: BaseException) -> SpecUIError:
    if _is_memory(error):
        return SpecUIError(f"this request does not fit in memory beside the running batch ({error}); shorten it, "
                           "lower max new tokens, or wait for the batch to finish")
    return SpecUIError(f"could not join the batch ({type(error).__name__}: {error})")
