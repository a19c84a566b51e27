"""Where the model work runs when a web server calls it.

On CPU, PyTorch's OpenMP workers are fastest when every forward pass comes from one thread:
measured on 2 cores (bundled pair, speculative gamma=2, 96 tokens), decoding from the thread
that loaded the models took 3.1 s, the same decoding from a second thread 5.1 s, and once a
second thread had run torch work the first slowed down too. Gradio calls handlers from a pool
of worker threads, so the app hands generations and model loads to the main thread instead:
`MainThreadRunner.serve()` runs there and executes what handlers `submit`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class MainThreadRunner:
    """Run submitted callables, one at a time, on the thread that calls `serve`."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._stopped = threading.Event()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> None:
        self._stopped.set()

    def waiting(self) -> bool:
        """A submitted job waits for the one running (a background measurement's timed rounds,
        run here, end at once: engine/calibration.py)."""
        return not self._jobs.empty()

    def serve(self, until: Callable[[], bool] | None = None, poll_s: float = 0.05) -> None:
        """Execute jobs until `stop()` (or until `until()` is true). Interrupted (Ctrl+C),
        it fails the jobs still waiting, so no one waits for them forever."""
        try:
            while not self._stopped.is_set() and not (until and until()):
                try:
                    future, fn, args = self._jobs.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)
                    if isinstance(e, KeyboardInterrupt):
                        raise
        except BaseException:
            self._fail_waiting()
            raise

    def _fail_waiting(self) -> None:
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the app is stopping"))


def run_in_new_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """The fallback when no runner serves: a fresh thread per job (tests, embedding)."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=work, name="specui-job", daemon=True).start()
    return future
