"""The app's side of the engine process (specui.service.engine_process): `RemoteService` answers
the page as ChatService does (the same names the page reads, the same `run` / `join_batch`
sinks), and each reply decoding over there is mirrored here by a `RemoteGeneration` that the
engine's messages keep up to date (text, token ids, figures, every step)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any

from specui.engine.trace import GenerationStats
from specui.errors import SpecUIError
from specui.service.batch_loop import DONE, Request, Started
from specui.service.engine_process import EXIT_WAIT_S, INFO_FIELDS, engine_main, reply_ids
from specui.service.process_memory import rss_bytes

CANCEL_POLL_S = 0.05  # how soon a Stop reaches the engine


class RemoteGeneration:
    """A reply decoding in the engine's process, as far as its messages have said."""

    def __init__(self) -> None:
        self.text = ""
        self.output_ids: list[int] = []
        self.steps: list = []
        self.stats = GenerationStats(method="")

    def apply(self, state: tuple) -> None:
        stats, (keep, more), (keep_ids, more_ids) = state
        self.stats = stats
        self.text = self.text[:keep] + more
        self.output_ids = self.output_ids[:keep_ids] + list(more_ids)


@dataclass
class _Reply:
    sink: Callable[[Any], None]
    cancel: threading.Event
    generation: RemoteGeneration = field(default_factory=RemoteGeneration)
    cancel_sent: bool = False


class EngineProcess:
    """The engine's process and the pipe to it: calls wait for their answer; replies' items go
    to their sinks as they arrive (a reader thread); Stop is forwarded (a watcher thread)."""

    def __init__(self, make_service: Callable[[], Any]) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: no copy of this one's threads or OpenMP pool
        self._conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(child, make_service), name="specui-engine",
                                       daemon=True)
        self.process.start()
        child.close()
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._reap = threading.RLock()  # held while waiting on the process (close() may end in _end: reentrant)
        self._ids = itertools.count()
        self._calls: dict[int, tuple[Future, Callable | None]] = {}
        self._replies: dict[int, _Reply] = {}
        self.ended: str | None = None
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise SpecUIError(f"the engine process ended while loading (exit code {self.process.exitcode})") from None
        except BaseException:
            self.close(wait=False)
            raise
        if kind != "ready":
            self.close(wait=False)
            raise payload
        self.info: dict = payload
        threading.Thread(target=self._read, name="specui-engine-reader", daemon=True).start()
        threading.Thread(target=self._forward_cancels, name="specui-engine-cancels", daemon=True).start()

    def close(self, wait: bool = True) -> None:
        """Ask the engine's process to end (it finishes the job under way), then make sure; without
        `wait` (it is still loading, or never loaded) at once."""
        with self._reap:
            if wait and not self.ended and self.process.is_alive():
                self._send(("stop",))
                self.process.join(EXIT_WAIT_S + 1)
            self._conn.close()
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for the process to end: its exit code, None while it runs.
        Reaping it takes this lock: two threads reaping at once race for its exit status (the
        loser's waitpid finds no child and reads None, as a test run once showed). The wait for
        the end itself takes no lock, so a thread asking about a live process is never held up."""
        if not mp_wait([self.process.sentinel], timeout):
            return None
        with self._reap:
            self.process.join(EXIT_WAIT_S)  # it has ended (its sentinel said so): this reaps it
            return self.process.exitcode

    def call(self, name: str, *args: Any, progress: Callable | None = None) -> Any:
        """The engine's ChatService.`name`(*args[, progress]), answered (on the model thread
        where engine_process.ON_MODEL_THREAD says)."""
        cid = next(self._ids)
        future: Future = Future()
        with self._lock:
            self._calls[cid] = (future, progress)
        self._send(("call", cid, name, args, progress is not None))
        return future.result()

    def run(self, items: Sequence[tuple[list, Any, threading.Event, Callable]], join: bool) -> None:
        """Replies (messages, settings, cancel, sink) to decode: each alone, or joining the batch."""
        entries = []
        with self._lock:
            for messages, settings, cancel, sink in items:
                gid = next(self._ids)
                self._replies[gid] = _Reply(sink, cancel)
                entries.append((gid, messages, settings))
        if join:
            self._send(("join", entries))
        else:
            for entry in entries:
                self._send(("run", *entry))

    def _send(self, message: tuple) -> None:
        if self.ended:
            self._fail(message)
            return
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):
            self._end()

    def _fail(self, message: tuple) -> None:
        error = SpecUIError(self.ended or "the engine process is not running")
        if message[0] == "call":
            with self._lock:
                future, _ = self._calls.pop(message[1], (None, None))
            if future is not None:
                future.set_exception(error)
        for gid in reply_ids(message):
            with self._lock:
                reply = self._replies.pop(gid, None)
            if reply is not None:
                reply.sink(error)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] in ("result", "error", "progress"):
                self._answer(message)
            else:
                self._deliver(message)
        self._end()

    def _answer(self, message: tuple) -> None:
        kind, cid, *rest = message
        with self._lock:
            future, progress = self._calls.get(cid, (None, None)) if kind == "progress" else \
                self._calls.pop(cid, (None, None))
        if future is None:
            return
        if kind == "progress":
            if progress is not None:
                progress(*rest)
        elif kind == "result":
            future.set_result(rest[0])
        else:
            future.set_exception(rest[0])

    def _deliver(self, message: tuple) -> None:
        kind, gid, *rest = message
        with self._lock:
            reply = self._replies.get(gid) if kind in ("started", "step") else self._replies.pop(gid, None)
        if reply is None:
            return
        g = reply.generation
        if kind == "failed":
            reply.sink(rest[0])
            return
        if kind == "step":
            g.steps.append(rest[0])
        g.apply(rest[-1])
        reply.sink(Started(g, rest[0]) if kind == "started" else rest[0] if kind == "step" else DONE)

    def _forward_cancels(self) -> None:
        while not self.ended:
            with self._lock:
                stopped = [(gid, r) for gid, r in self._replies.items() if r.cancel.is_set() and not r.cancel_sent]
            for gid, reply in stopped:
                reply.cancel_sent = True
                self._send(("cancel", gid))
            if mp_wait([self.process.sentinel], CANCEL_POLL_S):  # the process ended (reaping it is the app's)
                self._end()

    def _end(self) -> None:
        """The engine's process is gone: everyone waiting on it hears so."""
        if self.ended:
            return
        code = self.wait(1)  # before the lock: a close() under way holds the wait's lock and may send
        with self._lock:
            if self.ended:
                return
            self.ended = (f"the engine process stopped (exit code {code}); the app starts it "
                          "again with the models it was launched with")
            calls, self._calls = self._calls, {}
            replies, self._replies = self._replies, {}
        error = SpecUIError(self.ended)
        for future, _ in calls.values():
            future.set_exception(error)
        for reply in replies.values():
            reply.sink(error)


class RemoteService:
    """What the page calls, answered by the ChatService in the engine's process."""

    def __init__(self, make_service: Callable[[], Any]) -> None:
        self._make = make_service
        self.gate = None  # a shared app's FairGate: turns are taken here, before work reaches the engine
        self.engine_process = EngineProcess(make_service)

    def __getattr__(self, name: str) -> Any:
        if name in INFO_FIELDS:
            return self.__dict__["engine_process"].info[name]
        raise AttributeError(name)

    def restart(self) -> None:
        """A new engine process on the launch's models (the old one ended)."""
        self.engine_process.close()
        self.engine_process = EngineProcess(self._make)

    def close(self) -> None:
        self.engine_process.close()

    def _call(self, name: str, *args: Any, progress: Callable | None = None) -> Any:
        return self.engine_process.call(name, *args, progress=progress)

    def run(self, messages, settings, cancel: threading.Event, sink, submit=None) -> None:
        self.engine_process.run([(messages, settings, cancel, sink)], join=settings.method == "ems-sd")

    def join_batch(self, requests: Sequence[Request], submit=None) -> None:
        self.engine_process.run([(r.messages, r.settings, r.cancel, r.sink) for r in requests], join=True)

    def load(self, choice, progress=None) -> str:
        message = self._call("load", choice, progress=progress)
        self.engine_process.info = self._call("info")
        return message

    def complete(self, messages, settings) -> tuple[str, float]:
        return self._call("complete", messages, settings)

    def cost_profile(self, measure: bool = False, progress=None) -> tuple[dict | None, str]:
        return self._call("cost_profile", measure, progress=progress)

    def quantization_options(self, progress=None) -> str:
        return self._call("quantization_options", progress=progress)

    def memory_report(self) -> str:
        """The engine's report (its process holds the weights), with this process's memory beside."""
        report = self._call("memory_report")
        rss = rss_bytes()
        here = f"web server RSS {rss / (1 << 20):,.0f} MB · engine " if rss else "engine "
        return report.replace("process RSS", here + "process RSS", 1)

    def doctor_report(self) -> str:
        return self._call("doctor_report")

    def capture_report(self) -> dict:
        return self._call("capture_report")

    def compiles_quiet_s(self) -> float | None:
        return self._call("compiles_quiet_s")

    def settle(self) -> None:
        self._call("settle")

    def method_fields(self, method: str) -> set[str]:
        """ChatService.method_fields, from the engine's plain-data answer (this process has no engine)."""
        return set(self.engine_process.info["method_field_sets"].get(method, ()))
