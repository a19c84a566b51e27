"""Start and stop `python app.py` on a free port (the browser, soak and screenshot scripts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from specui.bench.browser_driver import browser_problem, wait_until
from specui.bench.cpu_usage import child_pids
from specui.engine.paths import cache_root
from specui.service.process_memory import rss_bytes as process_rss

REPO = Path(__file__).resolve().parent.parent
# the bundled GGUF converted (weights/gguf_cache.py: 48 s on a 2-core Xeon) once for every test
# process and app it starts: each process's fresh cache (conftest.py) links its gguf folder here.
# Beside the virtual environment, so it goes with it (a clean clone converts once).
SHARED_GGUF = Path(sys.prefix) / "specui-test-gguf"
# SpecUI's C++ kernels: the user's own kernel cache (read before conftest.py points XDG_CACHE_HOME at a fresh
# folder), where `make run` builds them too. Each build's folder is named by a hash of its sources, this CPU and
# torch (specui/weights/native.py), so a clean clone of the same sources reuses it: the build costs about 20 s
# on 2 cores (2:40 before its files were compiled in three units without <torch/extension.h>). Beside the
# virtual environment where that cache cannot be written.
# (the first process to import this records the user's cache root; its test workers and apps inherit the record,
# not their parent's fresh folder)
USER_KERNELS = Path(os.environ.setdefault("SPECUI_TEST_USER_CACHE", str(cache_root()))) / "kernels"


def shared_gguf_cache(cache_home: Path) -> None:
    """Link `cache_home`'s converted-GGUF and kernel folders to the shared ones."""
    (cache_home / "specui").mkdir(parents=True, exist_ok=True)
    kernels = USER_KERNELS
    try:
        kernels.mkdir(parents=True, exist_ok=True)
    except OSError:
        kernels = Path(sys.prefix) / "specui-test-kernels"
    for name, shared in (("gguf", SHARED_GGUF), ("kernels", kernels)):
        shared.mkdir(exist_ok=True)
        link = cache_home / "specui" / name
        if not link.exists():
            link.symlink_to(shared, target_is_directory=True)


def bundled_converted() -> None:
    """The bundled GGUF's converted folder exists (the first process converts it; the others
    wait for it rather than converting it again beside it)."""
    import fcntl

    from specui.weights.gguf_cache import open_source
    from specui.weights.sources import bundled_gguf_path

    with open(SHARED_GGUF.with_name(SHARED_GGUF.name + ".lock"), "w") as lock:  # not in the folder: --doctor lists it
        fcntl.flock(lock, fcntl.LOCK_EX)
        open_source(bundled_gguf_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`python app.py` on a free port with the default (bundled) pair in float32 (greedy replies of
    every method then equal each other exactly; see DESIGN.md 4.3); returns once it listens."""
    if "--target" not in flags:
        bundled_converted()
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(port), "--method", "speculative", "--max-new-tokens", "32",
             "--gamma", "3", "--dtype", "float32", *flags],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the app exited:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(up, 240, "the app to listen", every=0.5)
    return proc, f"http://127.0.0.1:{port}"


def stop_app(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and every process under it (Linux /proc): the app and its
    engine's process (0 for one that ended meanwhile)."""
    return (process_rss(pid) or 0) + sum(rss_bytes(child) for child in child_pids(pid))


def needs_browser():
    """The mark that skips a browser test, with the reason, where Chromium cannot be driven here."""
    import pytest

    problem = browser_problem()  # None where Chromium and its driver run here
    return pytest.mark.skipif(problem is not None, reason=f"no usable browser: {problem}")
