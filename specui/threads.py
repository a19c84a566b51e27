"""How many threads torch should use, by measurement.

On a small CPU the app shares the cores with the web server and, when the page is open on the
same machine, with the browser drawing the live panels. torch's OpenMP workers then lose most
of their speed: a forward waits at every barrier for the worker whose core the browser took.
So when the app serves a local browser, the thread count is measured at start: the target's
one-token forward is timed with every core and with one core fewer, each while a competing
process keeps one core busy (standing in for the browser), and the faster count wins. The CLI
and a remote browser keep torch's default. `--threads N` overrides."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

SPIN = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def _forward_ms(model, threads: int, repeats: int = 5) -> float:
    """Median ms of one cached next-token forward after a 32-token context, with `threads`."""
    torch.set_num_threads(threads)
    device = next(model.parameters()).device
    ids = torch.arange(1, 33, device=device)[None]
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model(input_ids=ids[:, -1:], past_key_values=_copy(out.past_key_values), use_cache=True)
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times[1:])


def _copy(cache):
    from copy import deepcopy

    return deepcopy(cache)


def choose_threads(model, local_browser: bool, requested: int = 0) -> ThreadChoice:
    """The thread count for this app (and why), measured when it serves a local browser."""
    cores = torch.get_num_threads()
    if requested:
        torch.set_num_threads(requested)
        return ThreadChoice(requested, f"{requested} (--threads)")
    if next(model.parameters()).device.type != "cpu" or cores < 2:
        return ThreadChoice(cores, f"{cores} (torch default)")
    if not local_browser:
        return ThreadChoice(cores, f"{cores} (torch default: no browser on this machine to leave room for)")
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.2)
        ms = {n: _forward_ms(model, n) for n in (cores, cores - 1)}
    finally:
        spinner.kill()
        spinner.wait()
    best = min(ms, key=ms.get)
    torch.set_num_threads(best)
    other = cores - 1 if best == cores else cores
    return ThreadChoice(best, f"{best} of {cores} cores: measured with one core busy (as a local browser drawing "
                              f"the panels would keep it), {ms[best]:.1f} ms per token vs {ms[other]:.1f} ms "
                              f"with {other}")
