"""Load the pair from flags, build the page, launch it (local, or shared with auth)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from specui.cli import load_from_args, settings_from_args
from specui.errors import SpecUIError
from specui.service.chat_service import ChatService
from specui.service.runner import MainThreadRunner
from specui.weights.threads import choose_threads


def parse_auth(value: str | None) -> list[tuple[str, str]] | None:
    """'user:pass', or a file with one user:pass per line."""
    if not value:
        return None
    path = Path(value)
    lines = path.read_text().splitlines() if path.is_file() else [value]
    pairs = [tuple(line.split(":", 1)) for line in lines if line.strip() and not line.startswith("#")]
    if not pairs or any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise SpecUIError("--auth needs user:pass (or a file of user:pass lines)")
    return [(u.strip(), p.strip()) for u, p in pairs]


def _log_to_stderr() -> None:
    """The app's own log lines (replies started, failures) on stderr; libraries stay quiet."""
    logger = logging.getLogger("specui")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def launch(args: argparse.Namespace) -> int:
    from specui.ui.chat_ui import build_ui
    from specui.ui.live_panels import PAGE_CSS

    _log_to_stderr()
    auth = parse_auth(args.auth)
    if args.share and not auth:
        print("warning: --share without --auth makes your model public to anyone with the link", file=sys.stderr)
    print("loading models…", file=sys.stderr)
    service = ChatService(load_from_args(args))
    if args.threads < 0:
        raise SpecUIError(f"--threads must be >= 0 (0: measured), got {args.threads}")
    threads = choose_threads(service.pair.target.model, local_browser=not args.share, requested=args.threads)
    service.threads_note = f"torch threads: {threads.reason}"
    service.use_long_threads(threads.long_threads)
    print(service.threads_note, file=sys.stderr)
    runner = MainThreadRunner()  # model work stays on this (the main) thread: see specui/service/runner.py
    demo = build_ui(service, settings_from_args(args), submit=runner.submit).queue(
        max_size=args.queue, default_concurrency_limit=1)
    kwargs = dict(server_name=args.host, server_port=args.port, auth=auth, prevent_thread_lock=True, css=PAGE_CSS)
    if not args.share:
        demo.launch(**kwargs)
    else:
        try:
            demo.launch(share=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - the share tunnel is optional; the local app must stay up
            print(f"warning: could not open a public share link ({e}); serving locally only", file=sys.stderr)
            demo.close()
            demo.launch(**kwargs)
        if not demo.share_url:
            print(f"warning: could not open a public share link (see the reason above: usually no internet, "
                  f"or a firewall blocking Gradio's tunnel); the app is running locally at {demo.local_url}",
                  file=sys.stderr, flush=True)
    try:
        runner.serve()
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr)
    finally:
        demo.close()
    return 0
