"""Who spends the CPU while a reply streams: the engine thread, the app's other threads (the web
server building and sending updates) and the browser (every process under it), in CPU seconds
per wall second. Linux only (reads /proc); elsewhere the browser's share reads as unknown."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started that are still alive (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text(encoding="utf-8").split()]
        except OSError:
            continue
    return out


def tree_cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of `pid` and every live process below it (None off Linux)."""
    if not Path(f"/proc/{pid}").exists():
        return None
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        seconds = _stat_seconds(f"/proc/{p}/stat")
        if seconds is None:
            continue  # ended meanwhile
        total += seconds
        todo += child_pids(p)
    return total


def _stat_seconds(path: str) -> float | None:
    """user + system CPU seconds from a /proc stat file (a process's or a thread's); None if gone."""
    try:
        fields = Path(path).read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


@dataclass
class CpuShares:
    """CPU seconds per wall second, summed over the replies measured."""

    wall: float = 0.0
    engine: float = 0.0
    app: float = 0.0
    browser: float | None = 0.0

    def add(self, wall: float, engine: float, app: float, browser: float | None) -> None:
        self.wall += wall
        self.engine += engine
        self.app += app
        self.browser = None if browser is None or self.browser is None else self.browser + browser

    def line(self) -> str:
        if not self.wall:
            return "no replies measured"
        w = self.wall
        client = "" if self.browser is None else f", client {self.browser / w:.2f}"
        return (f"cores busy while decoding: engine thread {self.engine / w:.2f}, "
                f"app's other threads {max(self.app - self.engine, 0) / w:.2f}{client} (of {os.cpu_count()})")


class JobMeter:
    """Wraps the jobs the app hands to its model thread (a whole generation is one job) and
    measures each while it runs: wall time, the model thread's CPU, the whole app's CPU, and
    the CPU of `client_pid`'s process tree (the browser or API client then watching)."""

    def __init__(self) -> None:
        self.client_pid: int | None = None
        self.shares: CpuShares | None = None

    def _now(self, client_pid: int | None) -> tuple:
        """(wall, model thread CPU, app CPU, client tree CPU) seconds: the job runs on the calling thread."""
        return time.perf_counter(), time.thread_time(), time.process_time(), _tree(client_pid)

    def wrap(self, fn):
        def measured(*args):
            pid, shares = self.client_pid, self.shares
            start = self._now(pid)
            try:
                return fn(*args)
            finally:
                end = self._now(pid)
                if shares is not None:
                    browser = None if start[3] is None or end[3] is None else end[3] - start[3]
                    shares.add(end[0] - start[0], end[1] - start[1], end[2] - start[2], browser)
        return measured


def _tree(pid: int | None) -> float | None:
    return None if pid is None else tree_cpu_seconds(pid)


class ProcessMeter(JobMeter):
    """The same shares when the engine runs in a process of its own (the app's default): its
    model thread is that process's main thread; the app is this process and that one. Wraps
    the whole request, not a job on the model thread."""

    def __init__(self, engine_pid: int) -> None:
        super().__init__()
        self.engine_pid = engine_pid

    def _now(self, client_pid: int | None) -> tuple:
        pid = self.engine_pid
        return (time.perf_counter(), _stat_seconds(f"/proc/{pid}/task/{pid}/stat") or 0.0,
                time.process_time() + (_stat_seconds(f"/proc/{pid}/stat") or 0.0), _tree(client_pid))
