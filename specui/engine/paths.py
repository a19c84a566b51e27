"""Where SpecUI keeps what it measured, converted and compiled (no torch: every module may read it)."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """Where SpecUI caches what it measured and converted: $XDG_CACHE_HOME/specui, else
    ~/.cache/specui; read when called. Where that folder cannot be made or written to (a read-only
    home, a container user without one, a path through a file), a folder of this user's own under
    the system's temporary directory instead, for this process and those it starts (XDG_CACHE_HOME
    is set to it), said once: the app runs, and what it caches lasts until that folder is cleared."""
    try:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specui"
    except (RuntimeError, KeyError) as e:  # Path.home() without a home (a container's user)
        problem = f"no home folder ({e})"
    else:
        if (problem := _unusable(root)) is None:
            return root
    fallback = _own_temporary_folder()
    os.environ["XDG_CACHE_HOME"] = str(fallback)
    logging.getLogger("specui").warning(
        "SpecUI's cache folder cannot be used (%s): caching under %s instead (set XDG_CACHE_HOME to a writable "
        "folder to keep what is measured, converted and compiled across restarts)", problem, fallback)
    (fallback / "specui").mkdir(exist_ok=True)
    return fallback / "specui"


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
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if stat.S_ISDIR(info.st_mode) and (uid is None or info.st_uid == uid) and not info.st_mode & 0o022:
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="specui-cache-"))
