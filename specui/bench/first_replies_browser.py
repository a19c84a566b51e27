"""A new user's first replies in a real browser: the app started on an empty cache (every choice
measured at load, the pair measured and compiled in the background), then the page driven in
headless Chromium, one reply at a reader's pace, each reply's wall seconds and the tokens/s the
page shows. `first_replies` drives the engine as the chat service does; this is what a person sees.

    python -m specui.bench.first_replies_browser [--replies 8] [--gap 12] [--method autoregressive]
                                                 [--max-new-tokens 128] [--port 7911] [--keep-cache]

The app's own log goes to --app-log. Needs `make setup-test` (selenium, Debian's chromium)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from specui.bench.browser_driver import PageDriver, wait_until

PROMPT = "Write a long story about the sea."


def wait_for_page(url: str, app: subprocess.Popen, timeout: float) -> float:
    """Seconds until the page answers; raises if the app exits or the timeout passes first."""
    t0 = time.monotonic()

    def up() -> bool:
        if app.poll() is not None:
            raise RuntimeError(f"the app exited ({app.returncode}) before its page was up")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except OSError:
            return False

    wait_until(up, timeout, "the app's page", every=1.0)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=8)
    ap.add_argument("--gap", type=float, default=12.0, help="seconds between replies (a reader's pace)")
    ap.add_argument("--method", default="autoregressive")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--port", type=int, default=7911)
    ap.add_argument("--keep-cache", action="store_true", help="the user's own cache instead of an empty one")
    ap.add_argument("--app-log", type=Path, default=Path(tempfile.gettempdir()) / "specui-first-replies-app.log")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    if not args.keep_cache:  # a new user's first run: no recorded choice, no compiled code
        env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="specui-cache-")
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    url = f"http://127.0.0.1:{args.port}/"
    root = Path(__file__).resolve().parents[2]
    with open(args.app_log, "w", encoding="utf-8") as log:
        app = subprocess.Popen([sys.executable, str(root / "app.py"), "--port", str(args.port)], env=env,
                               stdout=log, stderr=subprocess.STDOUT, cwd=root)
    t0 = time.monotonic()
    try:
        print(f"page up after {wait_for_page(url, app, 900):.0f} s (app log: {args.app_log})", flush=True)
        page = PageDriver(url)
        try:
            for i in range(args.replies):
                time.sleep(args.gap)
                seconds, text, tokens_per_s = page.ask(args.prompt, args.method, args.max_new_tokens)
                print(f"[{time.monotonic() - t0:6.1f} s] reply {i + 1:2}: {seconds:6.2f} s, the page says "
                      f"{tokens_per_s:5.1f} tok/s ({len(text)} characters)", flush=True)
        finally:
            page.close()
    finally:
        app.terminate()
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:
            app.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
