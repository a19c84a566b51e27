"""Where SpecUI keeps what it measured, converted and compiled (no torch: every module may read it)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where SpecUI caches what it measured and converted: $XDG_CACHE_HOME/specui, else
    ~/.cache/specui; read when called."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specui"
