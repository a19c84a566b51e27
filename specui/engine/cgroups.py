"""This process's control groups (a container's limits): the folders, from its own group up to the
hierarchy's root, where a controller's limit files are read. cgroup v2 (one unified hierarchy) and
v1 (a hierarchy per controller). Imports no torch (the web server's process reads them too)."""

from __future__ import annotations

from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def membership() -> str:
    """/proc/self/cgroup's text ('' where there is none: not Linux)."""
    try:
        return Path("/proc/self/cgroup").read_text(encoding="utf-8")
    except OSError:
        return ""


def group_folders(root: Path, membership: str, controller: str) -> list[tuple[Path, int]]:
    """(folder, cgroup version) of each group whose `controller` limits apply to this process:
    its own group, then each ancestor up to the hierarchy's root (a container sees its own group as
    the root). `membership`: /proc/self/cgroup's text; without one, the hierarchies' roots."""
    found = []
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            base, version = root, 2
        elif controller in parts[1].split(","):
            base, version = root / controller, 1
        else:
            continue
        folder = base / parts[2].strip("/")
        while True:
            found.append((folder, version))
            if folder == base:
                break
            folder = folder.parent
    return found or [(root, 2), (root / controller, 1)]


def control_file(path: Path) -> str | None:
    """A control file's text, stripped; None where it cannot be read."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
