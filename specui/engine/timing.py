"""Timing a small piece of work on the device it runs on (the cost profile, attention choices)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warm_up: bool = True,
              budget_ms: float | None = None) -> float:
    """Median milliseconds of `repeats` calls of `fn` after one warm-up call, the device
    synchronised around each (CUDA). Without `warm_up` the first call is timed too and is
    dropped where fewer than 3 calls were timed (a median of 3 or more drops a slow first
    call by itself). `budget_ms`: stop once at least two calls were timed and they took that
    long, or after one that alone took twice that (a forward that long is timed well by fewer
    calls, and a cold call's extra cost is a small share of it)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if warm_up:
        fn()
    times: list[float] = []
    def enough() -> bool:
        if budget_ms is None or not times:
            return False
        return times[0] >= 2 * budget_ms if len(times) == 1 else sum(times) >= budget_ms

    while len(times) < repeats and not enough():
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    if not warm_up and 1 < len(times) < 3:
        times = times[1:]
    return statistics.median(times)


def fastest_in_turns(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each timer's fastest of `rounds` results, the timers taking turns round by round: a
    machine warming up or a neighbour's burst then slows every kind, not one (noise on a shared
    machine only ever slows a run down)."""
    best = dict.fromkeys(timers, float("inf"))
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = min(best[name], float(timer()))
    return best


class ForwardClock:
    """Seconds spent inside a model's own forward calls (the time a step's Python, masks,
    sampling and bookkeeping are measured against). On a CPU, each forward's wall time. On a
    GPU a forward returns once its kernels are queued, so the clock records a pair of CUDA
    events around each and sums their elapsed GPU time when read (`seconds`): a step has read
    its logits back by then, so the events are done and reading waits for nothing. A forward
    run while a CUDA graph is being captured is not timed (events cannot be recorded into a
    capture); an event pair that cannot be read makes the clock say `None` (not measured)
    rather than fail a reply. Other devices: `None`."""

    PENDING_MAX = 4096  # event pairs kept unread at most (read at once past that)

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._seconds: float | None = 0.0 if device.type in ("cpu", "cuda") else None
        self._pending: list[tuple[object, object]] = []

    @property
    def seconds(self) -> float | None:
        if self._pending:
            self._settle()
        return self._seconds

    def _settle(self) -> None:
        pending, self._pending = self._pending, []
        if self._seconds is None:
            return
        try:
            pending[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in pending) / 1000.0
        except RuntimeError:  # an event recorded where it cannot be timed: say "not measured"
            self._seconds = None

    def run(self, fn: Callable[..., object], *args, **kwargs):
        """`fn(*args, **kwargs)`, its time added to the clock."""
        if self._seconds is None:
            return fn(*args, **kwargs)
        if self._cuda:
            return self._run_cuda(fn, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._seconds += time.perf_counter() - t0

    def _run_cuda(self, fn: Callable[..., object], *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            return fn(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return fn(*args, **kwargs)
        finally:
            end.record()
            self._pending.append((start, end))
            if len(self._pending) > self.PENDING_MAX:
                self._settle()
