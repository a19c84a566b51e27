"""How many threads torch should use, by measurement.

On a small CPU the app shares the cores with the web server and, when the page is open on the
same machine, with the browser drawing the live panels. torch's OpenMP workers then lose most
of their speed: a forward waits at every barrier for the worker whose core the browser took.
So when the app serves a local browser, the thread count is measured at start: the target's
one-token forward is timed with every core and with one core fewer, each while a competing
process keeps one core busy (standing in for the browser), and the faster count wins. The CLI
and a remote browser keep torch's default. `--threads N` overrides.

Long inputs apart: a long prompt's prefill is a few large matrix products, and while it runs the
page has nothing new to draw (no token has come yet). So where one core is left to the browser,
a forward of LONG_ROWS tokens is also timed with every core and with that count (no competing
process: the page is idle then), and where every core is faster, forwards that long use them
(use_long_threads) and the rest keep the count above."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from specui.engine.host_cpus import fit_workers, usable_cpus
from specui.weights.quantize import LONG_ROWS

SPIN = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    long_threads: int | None = None  # for forwards of LONG_ROWS+ tokens where that differs; None: the same


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


def _long_forward_ms(model, threads: int, rows: int = LONG_ROWS, repeats: int = 1) -> float:
    """Fastest ms of a forward of `rows` tokens (no cache), with `threads`, after one to warm up."""
    torch.set_num_threads(threads)
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(rows) % (vocab - 1) + 1)[None].to(next(model.parameters()).device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append((time.perf_counter() - t0) * 1000.0)
    return min(times[1:])


def _copy(cache):
    from copy import deepcopy

    return deepcopy(cache)


def choose_threads(model, local_browser: bool, requested: int = 0) -> ThreadChoice:
    """The thread count for this app (and why), measured when it serves a local browser."""
    cores = torch.get_num_threads()
    if requested:
        torch.set_num_threads(requested)
        return ThreadChoice(requested, f"{requested} (--threads)")
    default = "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in os.environ else "torch default"
    if next(model.parameters()).device.type != "cpu" or cores < 2:
        return ThreadChoice(cores, f"{cores} ({default})")
    if not local_browser:
        return ThreadChoice(cores, f"{cores} ({default}: no browser on this machine to leave room for)")
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.2)
        ms = {n: _forward_ms(model, n) for n in (cores, cores - 1)}
    finally:
        spinner.kill()
        spinner.wait()
    best = min(ms, key=ms.get)
    long_ms = {n: _long_forward_ms(model, n) for n in (cores, best)} if best != cores else {}
    torch.set_num_threads(best)
    other = cores - 1 if best == cores else cores
    reason = (f"{best} of {cores} cores: measured with one core busy (as a local browser drawing the panels would "
              f"keep it), {ms[best]:.1f} ms per token vs {ms[other]:.1f} ms with {other}")
    if long_ms and long_ms[cores] < long_ms[best]:
        return ThreadChoice(best, reason + f"; {cores} for inputs of {LONG_ROWS}+ tokens, while the page waits "
                                           f"({long_ms[cores]:.0f} vs {long_ms[best]:.0f} ms)", long_threads=cores)
    return ThreadChoice(best, reason)


def threads_within_quota() -> str | None:
    """torch's thread count cut to what this process's CPU quota allows (specui.engine.host_cpus),
    where nothing chose the count (no OMP_NUM_THREADS): for processes not started through app.py,
    which sets that before torch is imported (the benches, training). The note that says so."""
    allowed, why = usable_cpus()
    if why is None:
        return None
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:  # inductor's config read it when imported
        import torch._inductor.config as inductor

        inductor.compile_threads = allowed
    fit_workers(allowed)
    before = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or before <= allowed:
        return None
    torch.set_num_threads(allowed)
    os.environ["OMP_NUM_THREADS"] = str(allowed)  # processes started from here (inductor's, an engine's) too
    return f"torch threads: {allowed} of {before}, as {why} (more would wait on each other; OMP_NUM_THREADS to choose)"


def use_long_threads(model: torch.nn.Module, threads: int, rows: int = LONG_ROWS) -> None:
    """Every forward of `model` over at least `rows` tokens a row runs with `threads` (then the
    count before it is restored, also when the forward fails).

    torch skips `always_call` hooks after a failed forward while any thread compiles (its
    `is_compiling()` flag is process-wide, and the Warmup compiles beside replies), so each
    forward first restores a count that a skipped end hook left set."""
    before: list[int] = []

    def start(_module, args, kwargs):
        if before:  # the last long forward failed and its end hook was skipped
            torch.set_num_threads(before.pop())
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds", args[0] if args else None)
        if ids is not None and ids.dim() >= 2 and ids.shape[1] >= rows:
            before.append(torch.get_num_threads())
            torch.set_num_threads(threads)

    def end(_module, _args, _kwargs, _output):
        if before:
            torch.set_num_threads(before.pop())

    model.register_forward_pre_hook(start, with_kwargs=True)
    model.register_forward_hook(end, with_kwargs=True, always_call=True)
