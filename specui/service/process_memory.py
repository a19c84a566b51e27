"""The app's process memory: what it holds (Linux /proc), and giving a swapped-out pair's
pages back to the system."""

from __future__ import annotations

import gc
import sys

from specui.engine.host_memory import trim_heap


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident memory of this process (or `pid`; Linux), or None where /proc is not there (or
    the process ended)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as status:
            lines = status.readlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:")), None)


def release_freed_memory() -> None:
    """After a model swap: collect the old pair and hand its freed heap back to the system.
    Without malloc_trim, glibc keeps the old weights' pages (measured: the app stayed ~500 MB
    above its starting RSS after one reload of the bundled pair; with it, back to the start)."""
    gc.collect()
    torch = sys.modules.get("torch")  # no torch imported, no CUDA memory to give back (the web server's process)
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_heap()
