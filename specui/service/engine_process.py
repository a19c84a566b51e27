"""The engine in a process of its own (issue 45, item 4): the web server and the engine no
longer share one interpreter. In one process every update the server builds (postprocessing,
JSON) held the lock the engine needs between its tensor ops, and the page got 0.85-0.92x of
the CLI's tokens/s on a 2-core EPYC; here the engine's process runs the pair on its main thread
(specui/service/runner.py says why that thread) and the app's process only serves pages.

One duplex pipe, plain tuples both ways:
  app -> engine: ("call", id, name, args, with_progress), ("run", gid, messages,
                 settings), ("join", [(gid, messages, settings), ...]), ("cancel", gid), ("stop",)
  engine -> app: ("ready", info) or ("not loaded", error) once it tried to load; ("result", id, value),
                 ("error", id, error), ("progress", id, fraction, text); for a reply: ("started",
                 gid, notes, state), ("step", gid, trace, state), ("done", gid, state), ("failed",
                 gid, error), where state is (stats, text edit, token ids edit): only what changed.
The app's side is specui.service.remote."""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import pickle
import signal
import threading
from collections.abc import Callable
from typing import Any

from specui.engine.trace import StepTrace
from specui.errors import SpecUIError
from specui.service.batch_loop import DONE, Request, Started
from specui.service.runner import MainThreadRunner, run_in_new_thread

# What the page reads of the engine's ChatService as plain data, sent once it loads a pair.
INFO_FIELDS = ("methods", "presets", "tree_presets", "quantizations", "dtypes", "stand_in_sizes", "device_label",
               "target_label", "draft_label", "target_spec", "load_notes", "dtype_names", "capture_setting",
               "context_len", "threads_note", "method_field_sets")
# what the app may ask of the engine's ChatService, and which of those run on the model thread
CALLS = frozenset({"memory_report", "cost_profile", "quantization_options", "doctor_report", "load", "info",
                   "capture_report", "compiles_quiet_s", "complete", "settle"})
ON_MODEL_THREAD = frozenset({"load", "complete"})
EXIT_WAIT_S = 10.0  # how long the app waits for this process to end when asked


def portable(error: BaseException) -> Exception:
    """An error that crosses the pipe: a Python or SpecUI error itself where it pickles; any other
    (a library's: torch's out-of-memory, dynamo's) a SpecUIError saying it, since unpickling its
    class would import that library into the web server's process."""
    if isinstance(error, SpecUIError):
        return error
    if type(error).__module__ != "builtins":
        return SpecUIError(f"{type(error).__name__}: {error}")
    try:
        pickle.loads(pickle.dumps(error))
        return error if isinstance(error, Exception) else SpecUIError(str(error))
    except Exception:  # noqa: BLE001 - any error that does not survive pickling is described instead
        return SpecUIError(f"{type(error).__name__}: {error}")


def reply_ids(message: tuple) -> list[int]:
    """The replies an app -> engine message starts ("run", "join"): whoever to tell if it fails."""
    if message[0] == "run":
        return [message[1]]
    return [gid for gid, _, _ in message[1]] if message[0] == "join" else []


def edit(old, new) -> tuple[int, Any]:
    """(how much of `old` stays, what follows it in `new`): a reply's text and tokens usually
    only grow, but a beam method may switch to another beam."""
    if new[: len(old)] == old:
        return len(old), new[len(old):]
    keep = 0
    for a, b in zip(old, new):
        if a != b:
            break
        keep += 1
    return keep, new[keep:]


class _Sender:
    def __init__(self, conn) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def __call__(self, message: tuple) -> None:
        try:
            with self._lock:
                self._conn.send(message)
        except (OSError, EOFError, ValueError):  # the app is gone: nothing is waiting for this process
            _exit_now()
        except pickle.PicklingError as e:
            raise SpecUIError(f"could not send {message[0]} to the app: {e}") from None


class _Relay:
    """A reply's sink in the engine's process: sends each item to the app, with what changed
    in the reply's text, tokens and figures since the last."""

    def __init__(self, send: Callable[[tuple], None], gid: int, ended: Callable[[int], None]) -> None:
        self.send, self.gid, self.ended = send, gid, ended
        self.generation = None
        self._text, self._ids = "", []

    def __call__(self, item: Any) -> None:
        if isinstance(item, Started):
            self.generation = item.generation
            self.send(("started", self.gid, list(item.notes), self._state()))
        elif isinstance(item, StepTrace):
            self.send(("step", self.gid, item, self._state()))
        elif item is DONE:
            self.ended(self.gid)
            self.send(("done", self.gid, self._state()))
        elif isinstance(item, BaseException):
            self.ended(self.gid)
            self.send(("failed", self.gid, portable(item)))

    def _state(self) -> tuple:
        g = self.generation
        text, ids = g.text, list(g.output_ids)
        state = (g.stats, edit(self._text, text), edit(self._ids, ids))
        self._text, self._ids = text, ids
        return state


class EngineHost:
    """The engine process's side: answers the app's calls and runs its replies."""

    def __init__(self, service, runner: MainThreadRunner, send: Callable[[tuple], None]) -> None:
        self.service, self.runner, self.send = service, runner, send
        self._cancels: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def listen(self, conn) -> None:
        """Read the app's messages until it says stop or goes away; then this process ends."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            if message[0] == "stop":
                _exit_now()
            self.receive(message)

    def receive(self, message: tuple) -> None:
        """Act on one message; an error in doing so goes to whoever waits on it."""
        try:
            self.handle(message)
        except Exception as e:  # noqa: BLE001 - a bad message must not stop the engine; its waiters hear why
            if message[0] == "call":
                self.send(("error", message[1], portable(e)))
            for gid in reply_ids(message):
                self._relay(gid)(e)

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "call":
            self._call(*message[1:])
        elif kind == "run":
            _, gid, messages, settings = message
            self.service.run(messages, settings, self._cancel(gid), self._relay(gid), self.runner.submit)
        elif kind == "join":
            self.service.join_batch([Request(messages, settings, self._cancel(gid), self._relay(gid))
                                     for gid, messages, settings in message[1]], self.runner.submit)
        elif kind == "cancel":
            with self._lock:
                event = self._cancels.get(message[1])
            if event is not None:
                event.set()

    def _cancel(self, gid: int) -> threading.Event:
        with self._lock:
            return self._cancels.setdefault(gid, threading.Event())

    def _relay(self, gid: int) -> _Relay:
        def ended(g: int) -> None:
            with self._lock:
                self._cancels.pop(g, None)
        return _Relay(self.send, gid, ended)

    def _call(self, cid: int, name: str, args: tuple, with_progress: bool) -> None:
        if name not in CALLS:
            raise SpecUIError(f"the engine has no call '{name}'")
        fn = getattr(self.service, name)
        if with_progress:
            args = (*args, lambda fraction, text="": self.send(("progress", cid, fraction, text)))
        job = (self.runner.submit if name in ON_MODEL_THREAD else run_in_new_thread)(fn, *args)

        def answer(future) -> None:
            error = future.exception()
            self.send(("result", cid, future.result()) if error is None else ("error", cid, portable(error)))
        job.add_done_callback(answer)


def _exit_now() -> None:
    """End this process at once, whatever runs (a reply, a background compile: the app is gone,
    and an interpreter shutting down under torch's compiler threads prints their errors), after
    what a normal exit of a multiprocessing child runs: its finalizers (they release the
    semaphores tqdm's lock and the compile pools registered, which the resource tracker would
    otherwise report as leaked) and its own child processes."""
    with contextlib.suppress(Exception):
        multiprocessing.util._exit_function()
    os._exit(0)


def engine_main(conn, make_service: Callable[[], Any]) -> None:
    """The engine process: load (`make_service`, a picklable callable returning the ChatService),
    say ready, then serve the app until it goes away. Ctrl+C belongs to the app, which ends this."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send = _Sender(conn)
    try:
        service = make_service()
    except Exception as e:  # noqa: BLE001 - the app reports it and exits (or keeps its last pair)
        send(("not loaded", portable(e) if isinstance(e, SpecUIError) else
              SpecUIError(f"could not load the models ({type(e).__name__}: {e})")))
        return
    send(("ready", service.info()))
    runner = MainThreadRunner()
    service.use_model_thread(runner)
    threading.Thread(target=EngineHost(service, runner, send).listen, args=(conn,), name="specui-engine-pipe",
                     daemon=True).start()
    runner.serve()
