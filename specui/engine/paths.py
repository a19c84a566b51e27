"""Where SpecUI keeps what it measured, converted and compiled (no torch: every module may read it)."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path

CACHE_VARIABLE = "SPECUI_CACHE_DIR"  # SpecUI's cache folder itself, where set (by the user, or by the fallback)
# the fallback is chosen once a process (the kernels' build asks from its own thread while the load asks)
_FALLBACK = threading.Lock()


def cache_root() -> Path:
    """Where SpecUI caches what it measured and converted: $SPECUI_CACHE_DIR, else
    $XDG_CACHE_HOME/specui, else ~/.cache/specui; read when called. Where that folder cannot be
    made or written to (a read-only home, a container user without one, a path through a file), a
    folder of this user's own under the system's temporary directory instead, for this process and
    those it starts (SPECUI_CACHE_DIR is set to it; XDG_CACHE_HOME, which other libraries read, is
    left as it is), said once: the app runs, and what it caches lasts until that folder is cleared."""
    try:
        root = Path(os.environ.get(CACHE_VARIABLE) or
                    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specui")
    except (RuntimeError, KeyError) as e:  # Path.home() without a home (a container's user)
        root, problem = None, f"no home folder ({e})"
    else:
        if (problem := _unusable(root)) is None:
            return root
    with _FALLBACK:
        chosen = os.environ.get(CACHE_VARIABLE)
        if chosen and Path(chosen) != root and _unusable(Path(chosen)) is None:  # another thread chose it
            return Path(chosen)
        fallback = _own_temporary_folder() / "specui"
        fallback.mkdir(exist_ok=True)
        os.environ[CACHE_VARIABLE] = str(fallback)
    logging.getLogger("specui").warning(
        "SpecUI's cache folder cannot be used (%s): caching under %s instead (set %s or XDG_CACHE_HOME to a "
        "writable folder to keep what is measured, converted and compiled across restarts)",
        problem, fallback, CACHE_VARIABLE)
    return fallback


def _unusable(root: Path) -> str | None:
    """Why `root` could not be made and written to (its nearest existing folder decides: nothing is
    made here), or None."""
    existing = root
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def _own_temporary_folder() -> Path:
    """specui-cache-<uid> in the temporary directory, made private to this user; where another user
    holds that name (or it is open to others: what is cached there includes compiled code this process
    loads), a fresh private folder."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    folder = Path(tempfile.gettempdir()) / f"specui-cache-{uid if uid is not None else 'user'}"
    with contextlib.suppress(OSError):
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if stat.S_ISDIR(info.st_mode) and (uid is None or info.st_uid == uid) and not info.st_mode & 0o022:
            return folder
    return Path(tempfile.mkdtemp(prefix="specui-cache-"))
