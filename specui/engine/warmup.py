"""Compiling a model's padded shapes off the decoding thread (`--capture auto` on a CPU that
measured compiled forwards faster; engine/capture.py runs them).

One thread per shape, at the lowest CPU priority, only while no reply decodes: a reply pauses
the compile under way (its thread sleeps, holding neither the GIL nor a core), which goes on
where it was once the reply is done. Measured on a 2-core EPYC (bundled pair, bf16 on int4
blocks), a compile beside a decoding thread cost that thread 2-8x per token (each op waits to
take the GIL back), and a thread that lives on with its OpenMP team made libgomp stop spinning
its workers (eager tokens 16 -> 25-29 ms, for as long as the thread lived): each shape
compiles on a fresh thread, which ends after the shape's one forward. Compiled code is cached on disk by inductor, under
~/.cache/specui/inductor unless TORCHINDUCTOR_CACHE_DIR was set first; a failure a stale cache
may explain is retried once on a fresh one."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from specui.engine.giving_way import DYNAMO, EXIT_WAIT_S, Stopped, lowest_priority, sleep_while, stop_at_exit, stop_here
from specui.engine.paths import cache_root
from specui.engine.static_cache import StaticKVCache

# dynamo compiles one frame at a time in a process: Warmups (and forwards that may compile) take
# turns (giving_way.DYNAMO); a forward that must not wait runs under the "fail_on_recompile" stance
RECOMPILE = "Detected recompile"  # how the fail_on_recompile stance says a call would compile
HIDDEN = "hidden"  # the last part of a shape whose forward returns hidden states too (engine/hidden.py)


class Warmup:
    """Compiles one runner's padded shapes off the decoding thread, each on a scratch cache of
    the runner's capacity (zeros: what a forward reads there does not matter, only its shapes),
    so no forward waits for a compile. Asked at the start for every bucket over the first
    window and two over the second (the shapes a reply meets first), then for any shape a
    decoding call found uncompiled. `paused` (the engine's lock held: a reply decodes) pauses the
    compile under way; it goes on once nothing decodes. A shape is (bucket, window,
    capacity) for the runner's own one-row forwards, and (bucket, window, capacity, rows) for
    several rows over the same model (beam search's and DSBD's RowSession, which asks with the
    forward that builds and runs such a shape: `ask(shape, run)`), and (bucket, window, capacity,
    HIDDEN) for the runner's forward that returns hidden states too (engine/hidden.py). Plain bookkeeping for the
    report: `compiled` (shapes done), `queue` (waiting), `seconds` (spent compiling, pauses
    included), `interrupted` (pauses), `paused_s`, `note`."""

    def __init__(self, runner, first: list[tuple[int, int]]) -> None:
        """`runner`: the StaticForward to compile for; `first`: the (bucket, window) shapes to
        compile at once."""
        self.runner = runner
        # True while a reply decodes (the engine sets its lock's `locked`): no compile runs then
        self.paused: Callable[[], bool] = lambda: False
        self.queue: list[tuple[int, ...]] = []  # shapes, in order
        self.compiled: list[tuple[int, ...]] = []
        self.asked = 0  # shapes ever queued (benches: one asked during a reply ran eagerly in it)
        self._runs: dict[tuple[int, ...], Callable] = {}  # a rows shape's forward (RowSession.compile_shape)
        self.seconds = 0.0
        self.finished_at = 0.0  # time.monotonic() when the queue last ran empty
        self.note = ""
        self._busy = False
        self._compiling = False  # inside _compile (where the profile hook may pause)
        self._stopping = False  # the interpreter exits or the pair is replaced: end the compile under way
        self._aborted = False  # the exit ended the compile under way
        self.interrupted = 0  # times a reply paused the compile under way
        self.paused_s = 0.0  # seconds compiles spent paused while replies decoded
        self._ident: int | None = None  # the compiling thread (threading.get_ident())
        self._restarts = 0
        self._retried = False
        self._scratch: StaticKVCache | None = None
        self._cond = threading.Condition()
        self.threads = torch.get_num_threads()  # the thread count the compiled kernels are built for
        atexit.register(stop_at_exit, weakref.ref(self))
        capacity = runner.cache.capacity
        for bucket, window in first:
            if window <= capacity:
                self.ask((bucket, window, capacity))

    def _off(self, shape: tuple) -> bool:
        """Whether the forward this shape is of runs eagerly for good (its compile failed): the
        hidden-state forward's for a HIDDEN shape, the plain one's for any other."""
        runner = self.runner
        return runner.hidden_fn is runner.hidden_call if _hidden(shape) else runner.fn is runner.model

    def _idle(self) -> bool:
        return not self.queue and not self._busy

    @property
    def settled(self) -> bool:
        with self._cond:
            return self._idle()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is compiling or waiting (True), or `timeout` seconds pass."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout)

    def _finish(self) -> None:
        """No thread goes on (nothing left, or the model stays eager): say so. Under the lock."""
        self.queue.clear()
        self._busy = False
        self.finished_at = time.monotonic()
        self._scratch = None  # its memory, until a shape is asked again
        self._cond.notify_all()

    def waiting(self, shape: tuple[int, ...]) -> bool:
        """Whether `shape` is queued (or compiling) still."""
        return shape in self.queue

    def cancel(self) -> None:
        """Compile nothing more (the shape under way finishes; its thread then ends)."""
        with self._cond:
            self.queue[1 if self._busy else 0:] = []

    def stop(self, at_exit: bool = False) -> None:
        """The pair is replaced (or the interpreter exits, waiting for it): compile nothing more,
        and end the compile under way (its thread ends it at the next place it may: stop_here)."""
        self._stopping = True
        self.cancel()
        if at_exit:
            self.wait(EXIT_WAIT_S)

    def ask(self, shape: tuple[int, ...], run: Callable | None = None) -> None:
        """Compile this shape when the thread gets to it: (bucket, window, capacity) of the
        runner's forward, or a rows shape with `run(probe, shape)`, which builds that shape on
        scratch rows over the probe runner, runs it, and returns what failed ("" if nothing)."""
        with self._cond:
            if self._stopping or self._off(shape) or shape in self.queue or shape in self.compiled:
                return
            self.queue.append(shape)
            self.asked += 1
            if run is not None:
                self._runs[shape] = run
            if not self._busy:
                self._busy = True
                threading.Thread(target=self._work, name="specui-compile", daemon=True).start()

    def _yield(self, _frame, event: str, _arg) -> None:
        """This thread's profile hook: at each call inside a compile, wait while a reply
        decodes (sleeping, so the compile holds neither the GIL nor a core), then go on where
        it was; end the compile when the interpreter exits (the shape stays queued). Waiting,
        not ending: raising here ended a compile only where nothing caught the exception, and
        CPython drops a profile hook that raises, so a compile whose first exception was caught
        (sympy catches them) ran on beside the reply with the GIL: measured on a 2-core Xeon
        (bundled pair, bf16 on int4 blocks, speculative gamma 3, 48 tokens), a reply 20 s into
        the compile spent 14-17 s in its first step (2.0-2.8 tok/s, eager alone 20-27), and each
        reply that did end it threw the compile's progress away. While the profile runs
        (`runner.blocking`: it waits for compiled forwards) nothing waits. Never fires where the
        thread holds the queue's lock, which a decoding thread may be asking for."""
        if event != "call" or not self._compiling:
            return
        self.paused_s += sleep_while(self._waiting, _frame, self._count_pause)
        if self._stopping:
            self._aborted = True
            stop_here(_frame, self, self._yield)

    def _waiting(self) -> bool:
        """A reply decodes, and nothing else wants the compile to go on."""
        return self.paused() and not self._stopping and not self.runner.blocking and not DYNAMO.wanted

    def _count_pause(self) -> None:
        self.interrupted += 1

    def _resume(self) -> None:
        """After a reply ended a compile: once no reply decodes, a fresh thread goes on."""
        while self.paused() and not self._stopping:
            time.sleep(0.05)
        with self._cond:
            if self._stopping or not self.queue:
                self._finish()
                return
        threading.Thread(target=self._work, name="specui-compile", daemon=True).start()

    def _work(self) -> None:
        """Compile the first queued shape, then hand on to a fresh thread (this one's OpenMP
        team ends with it) or, where the exit ended the compile, to `_resume`."""
        sys.setprofile(self._yield)  # this thread only
        lowest_priority()
        DYNAMO.mark_background()
        with self._cond:
            while self.queue and self._off(self.queue[0]):  # that forward stays eager now: nothing to compile
                self.queue.pop(0)
            if not self.queue:
                self._finish()
                return
            shape = self.queue[0]
        t0 = time.perf_counter()
        self._ident = threading.get_ident()
        self._compiling, self._aborted = True, False
        try:
            ok = self._compile(shape)
        except (Exception, Stopped) as e:  # noqa: BLE001 - a warmup that fails must not leave the queue stuck
            ok = None if self._aborted or self._stopping else False
            if ok is False:
                self.note = f"compiling {shape[0]} tokens over {shape[1]} slots failed: {type(e).__name__}: {e}"[:240]
        finally:
            self._compiling = False
            sys.setprofile(None)
        with self._cond:
            self.seconds += time.perf_counter() - t0
            if ok is None:  # ended by the exit: the shape stays queued
                nxt = self._resume
            else:
                self.queue.remove(shape)
                self._runs.pop(shape, None)
                if ok:
                    self.compiled.append(shape)
                nxt = self._work
        threading.Thread(target=nxt, name="specui-compile", daemon=True).start()

    def _compile(self, shape: tuple[int, ...]) -> bool | None:
        """Run the compiled forward once at `shape` on a scratch cache (compiling it if it
        must); a failure that a stale disk cache may explain is retried once on a fresh one,
        any other leaves the model eager with a note."""
        bucket, window, capacity = shape[:3]
        runner = self.runner
        try:
            # kernels for the thread count the pair was loaded with (inductor would read this
            # thread's at compile time); the store an inference tensor, as the decoding thread's is
            with torch._inductor.config.patch({"cpp.threads": self.threads}), torch.inference_mode():
                run = self._runs.get(shape)
                problem = self._one_row(shape) if run is None else run(self._probe(runner.cache), shape)
        except torch.OutOfMemoryError:
            self.note = f"compiling {bucket} tokens over {window} slots ran out of memory: that shape stays eager"
            self._scratch = None
            return False
        if self._aborted:
            return None
        if problem:
            if RECOMPILE in problem and self._restarts < RESTARTS:
                self._restarts += 1  # a decoding call's stance, met as this call began: again
                return self._compile(shape)
            if not self._retried and _fresh_compile_cache():
                self._retried = True
                self.note = f"compile failed ({problem}); retried on a fresh compile cache"
                return self._compile(shape)
            if _hidden(shape):  # only the hidden-state forwards stay eager
                runner.hidden_problem, runner.hidden_fn = problem, runner.hidden_call
            else:
                runner.compile_problem = problem
                runner.fn = runner.model
            return False
        return True

    def _probe(self, cache: StaticKVCache):
        """A runner over `cache` that runs (and compiles, waiting for it) the real runner's
        compiled forward, with its attention routing (a rows shape's run reads only its store's
        dtype: its scratch rows are a cache of their own)."""
        runner = self.runner
        probe = type(runner)(runner.model, cache, "buckets")
        probe.fn, probe.grouped = runner.fn, runner.grouped
        probe.spare_rows = runner.spare_rows  # scratch rows take and hand back the replies' store
        if runner.hidden_fn is not runner.hidden_call:  # (the probe's eager one is its own object)
            probe.hidden_fn = runner.hidden_fn
        return probe

    def _one_row(self, shape: tuple[int, ...]) -> str:
        """The runner's forward at (bucket, window, capacity) on the scratch cache (zeros), the
        hidden-state one for a shape that ends in HIDDEN; returns what failed, "" if nothing."""
        bucket, window, capacity = shape[:3]
        runner = self.runner
        if self._scratch is None or self._scratch.capacity != capacity:
            self._scratch = None
            self._scratch = StaticKVCache(runner.model.config, capacity, runner.cache.device, runner.cache.store_dtype)
        scratch = self._scratch
        probe = self._probe(scratch)
        scratch.allocate()
        scratch.set_length(window - bucket)
        probe.run(torch.zeros(bucket, dtype=torch.long, device=scratch.device), None, None, hidden=_hidden(shape))
        return probe.hidden_problem if _hidden(shape) else probe.compile_problem


RESTARTS = 16  # compiles begun under a decoding call's stance, tried again


def _hidden(shape: tuple) -> bool:
    """A shape of the forward that returns hidden states too (engine/capture.py's HIDDEN)."""
    return shape[-1] == HIDDEN


def compile_cache_dir() -> Path:
    """Where inductor keeps compiled code across runs: ours unless the user chose another.
    Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's default where it is unset (a
    folder under /tmp, which many systems empty at each boot), so that value counts as unset:
    before, every compile went there and a corrupt cache was never set aside (not ours)."""
    chosen, default = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), _torch_default_cache_dir()
    if chosen and not (default and os.path.abspath(chosen) == os.path.abspath(default)):
        return Path(chosen)
    return cache_root() / "inductor"


def _torch_default_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without it: a chosen folder is the user's
        return ""
    return default_cache_dir()


def _fresh_compile_cache() -> bool:
    """Set aside the compile cache if it is ours (a corrupt or stale entry is rebuilt);
    False where there is nothing of ours to set aside."""
    folder = compile_cache_dir()
    if not folder.is_dir() or cache_root() not in folder.parents:
        return False
    shutil.rmtree(folder, ignore_errors=True)
    try:
        from torch._inductor.utils import clear_caches

        clear_caches()
    except ImportError:
        pass
    return True
