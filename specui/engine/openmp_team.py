"""A background thread's OpenMP team, handed back while it waits.

libgomp (the OpenMP runtime of torch's Linux wheels) keeps a team of worker threads for every
thread that ran a parallel region, for as long as that thread lives, and counts them all: once
it counts more threads than cores it all but stops spinning the workers between parallel regions
(`gomp_throttled_spin_count_var`), and every parallel region of the decoding thread then waits
for its workers to wake from a futex. A compile paused for a reply (engine/giving_way.py) is
such a thread: on a 2-core AMD EPYC Zen 3 the bundled target's eager replies decoded at 13-20
tok/s beside the app's paused background measurement, against about 55 with nothing beside
them. OpenMP 5.0's `omp_pause_resource_all(omp_pause_soft)` ends the calling thread's team in
libgomp (`gomp_pause_host`: its pool freed, the count lowered); its next parallel region starts
a new one. Only libgomp's: LLVM's libomp pauses the whole runtime instead, so elsewhere (another
runtime, no /proc) nothing is done."""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return lib
    return None


def release() -> bool:
    """End the calling thread's OpenMP team (libgomp), outside any parallel region: True where
    it was handed back (or there was none), False where this runtime offers no way to."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
