"""Timing a small piece of work on the device it runs on (the cost profile, attention choices)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warm_up: bool = True,
              budget_ms: float | None = None) -> float:
    """Median milliseconds of `repeats` calls of `fn` after one warm-up call (`warm_up`; without
    it a slow first call is one of the timed ones, which the median of 3 or more drops), the
    device synchronised around each (CUDA). `budget_ms`: stop early once the timed calls took
    that long (at least one call): a forward that long is timed well by fewer calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if warm_up:
        fn()
    times: list[float] = []
    while len(times) < repeats and (budget_ms is None or not times or sum(times) < budget_ms):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)
