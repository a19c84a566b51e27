"""How much memory this process may still take: free GPU memory on a GPU; on a CPU the system's
MemAvailable, or less where the process runs in a control group with a memory limit (a container:
/proc/meminfo shows the host's memory there, and the group's limit is what the kernel kills at).
Imports no torch (the web server's process hands its heap back too: trim_heap)."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

from specui.engine import cgroups
from specui.engine.cgroups import CGROUP, control_file, group_folders

if TYPE_CHECKING:
    import torch

LOAD_SHARE = 0.9  # of the memory free, the most a load (a model, a stand-in, a GGUF's conversion) may plan to take
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63


def free_memory(device: torch.device, cgroup: Path = CGROUP) -> int | None:
    """Bytes that may still be allocated on `device` (None where it cannot be read)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="utf-8") as info:
            available = next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    room = cgroup_room(cgroup)
    return available if room is None else min(available, room)


def cgroup_room(root: Path = CGROUP, membership: str | None = None) -> int | None:
    """The least room left under a memory limit of this process's control group or its ancestors
    (the limit less what the group uses, its file cache counted as free: the kernel reclaims that
    before it kills); None without a limit. `membership`: /proc/self/cgroup's text. cgroup v2
    (memory.max, memory.current) and v1 (memory/memory.limit_in_bytes, memory.usage_in_bytes)."""
    groups = group_folders(root, cgroups.membership() if membership is None else membership, "memory")
    rooms = [room for folder, version in groups if (room := _room(folder, *_MEMORY_FILES[version])) is not None]
    return min(rooms) if rooms else None


_MEMORY_FILES = {2: ("memory.max", "memory.current", "file"),  # limit, usage, the file cache's key in memory.stat
                 1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")}


def _room(folder: Path, limit_name: str, usage_name: str, cached: str) -> int | None:
    text = control_file(folder / limit_name)
    if text is None or not text.isdigit() or int(text) >= UNLIMITED:  # "max": no limit
        return None
    try:
        usage = int(control_file(folder / usage_name) or "")
    except ValueError:
        return None
    try:
        stat = dict(line.split()[:2] for line in (folder / "memory.stat").read_text(encoding="utf-8").splitlines()
                    if len(line.split()) >= 2)
        cache = int(stat.get(cached, 0))
    except (OSError, ValueError):
        cache = 0  # no statistics: the limit still holds, with nothing counted as reclaimable
    return max(0, int(text) - usage + cache)


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing to
    do). Freed memory otherwise stays resident: a load that packs matrix after matrix leaves each
    one's transients as holes between the packed weights it keeps."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS, musl, Windows): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
