"""Load the pair from flags, build the page, launch it: the owner's own app on loopback, or
shared (--share, another --host) where its users are visitors (specui.service.sharing) and
take fair turns at the engine (specui.service.fair)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

from specui.cli import load_from_args, settings_from_args
from specui.errors import SpecUIError
from specui.service.fair import FairGate
from specui.service.remote import RemoteService
from specui.service.runner import MainThreadRunner, run_in_new_thread
from specui.service.sharing import Access, Credentials, parse_credentials
from specui.settings import RANGES

if TYPE_CHECKING:  # the engine's side: imported where the engine runs (this process only with --no-engine-process)
    from specui.service.chat_service import ChatService
    from specui.service.pair import ModelPair
    from specui.weights.threads import ThreadChoice

RESTART_WAIT_S = 30  # between tries to start a failed engine process again
PORTS = (7860, 7959)  # without --port: the first free one of these (Gradio's own range)
SHARED_THREADS = 100  # Gradio's worker threads on a shared app: every waiting turn holds one


def parse_auth(value: str | None) -> list[tuple[str, str]] | None:
    """'user:pass', or a file with one user:pass per line ('admin user:pass' too): the pairs."""
    credentials = parse_credentials(value)
    return None if credentials is None else credentials.pairs


def access_from_args(args: argparse.Namespace, credentials: Credentials | None) -> Access:
    """Who may do what, from how the app is launched; refuses a public link nobody asked for."""
    if args.share and credentials is None and not args.public:
        raise SpecUIError("--share without --auth would let anyone with the link use your machine; add --auth "
                          "user:pass (or a file of user:pass lines), or --public to share it openly on purpose")
    cap = RANGES["max_new_tokens"]
    if not cap.lo <= args.visitor_max_new_tokens <= cap.hi:
        raise SpecUIError(f"--visitor-max-new-tokens must be {cap.describe()}, got {args.visitor_max_new_tokens}")
    access = Access.for_launch(args.host, args.share, credentials.admins if credentials else (),
                               args.allow_remote_admin, args.visitor_max_new_tokens)
    if not access.shared:
        return access
    who = "anyone with the link" if args.share else f"anyone who can reach {args.host}"
    print(f"shared app: {'its --auth users' if credentials else who} chat as visitors (no model loading, no "
          f"measuring, replies up to {args.visitor_max_new_tokens:,} new tokens, fair turns)", file=sys.stderr)
    if args.allow_remote_admin:
        print("warning: --allow-remote-admin: every user can load models and measure, as the owner", file=sys.stderr)
    elif access.admins:
        print(f"owners (admin users of --auth): {', '.join(sorted(access.admins))}", file=sys.stderr)
    if credentials is None:
        print(f"warning: no --auth: {who} can use this app", file=sys.stderr)
    return access


def choose_port(host: str, port: int | None, ports: tuple[int, int] = PORTS) -> int:
    """The port to serve on, checked before any model loads (a taken port used to end the start in
    a traceback after the load): `port` if given and free on `host`, else the first free one of
    `ports` (said where it is not the first: another SpecUI may be running)."""
    if port is not None:
        if not 0 < port < 65536:
            raise SpecUIError(f"--port must be in [1, 65535], got {port}")
        if (problem := _bind_problem(host, port)) is not None:
            raise SpecUIError(f"cannot serve on {host}:{port} ({problem}): another SpecUI or program may be using "
                              "it; choose another with --port N, or leave --port out for the first free one from "
                              f"{ports[0]}")
        return port
    problems = {}
    for candidate in range(ports[0], ports[1] + 1):
        if (problem := _bind_problem(host, candidate)) is None:
            if candidate != ports[0]:
                print(f"port {ports[0]} is taken ({problems[ports[0]]}): serving on {candidate}", file=sys.stderr)
            return candidate
        problems[candidate] = problem
        if "in use" not in problem.lower():  # not a taken port (a --host this machine does not have): say so now
            break
    raise SpecUIError(f"cannot serve on {host}: {problems[ports[0]]} (ports {ports[0]}-{candidate} tried); "
                      "check --host, or name a free --port")


def _launch_local(demo, kwargs: dict, host: str, named_port: bool) -> None:
    """demo.launch on the port chosen before the load; where another program took it meanwhile (two
    SpecUIs started together), the next free one, unless the port was named."""
    try:
        demo.launch(**kwargs)
    except OSError as e:
        demo.close()
        if named_port:
            raise SpecUIError(f"cannot serve on {host}:{kwargs['server_port']} ({e})") from None
        kwargs["server_port"] = choose_port(host, None)
        demo.launch(**kwargs)


def _bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (as uvicorn binds: SO_REUSEADDR), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def _log_to_stderr() -> None:
    """The app's own log lines (replies started, failures) on stderr; libraries stay quiet."""
    logger = logging.getLogger("specui")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def serve_pair(pair: ModelPair, local_browser: bool, requested: int = 0) -> tuple[ChatService, ThreadChoice]:
    """The service on `pair` with the app's thread count (specui.weights.threads), chosen before
    the engine is made: `--capture auto` reads the choice recorded for that count and compiles
    kernels for it (kernels built for every core would take the browser's too); long inputs get
    their own count. The app and the web UI bench both start this way."""
    from specui.service.chat_service import ChatService
    from specui.weights.threads import choose_threads

    threads = choose_threads(pair.target.model, local_browser=local_browser, requested=requested)
    service = ChatService(pair)
    service.use_long_threads(threads.long_threads)
    return service, threads


def _service(args: argparse.Namespace) -> tuple[ChatService, ThreadChoice]:
    """serve_pair on the pair `args` name. No caller keeps the pair: a reload must be able to
    free it."""
    return serve_pair(load_from_args(args), local_browser=not args.share, requested=args.threads)


def engine_service(args: argparse.Namespace) -> ChatService:
    """The app's ChatService, made where the engine runs (this process, or the engine's own:
    specui.service.engine_process), with its thread count said (launch has checked the flags), and
    its log lines on stderr (the engine's own process logs too: e.g. the quantization options compared)."""
    _log_to_stderr()
    service, threads = _service(args)
    service.threads_note = f"torch threads: {threads.reason}"
    print(service.threads_note, file=sys.stderr)
    return service


def _serve_engine_process(service: RemoteService) -> None:
    """The app's main thread while the engine runs in its own process: wait, and start the
    engine again (on the launch's models) if its process ends under the app."""
    while True:
        code = service.engine_process.wait(1.0)
        if code is None:
            continue
        print(f"warning: the engine process ended (exit code {code}); "
              "starting it again with the launch's models", file=sys.stderr, flush=True)
        try:
            service.restart()
        except SpecUIError as e:  # the page stays up and says the engine is gone; try again later
            print(f"warning: could not start the engine again ({e}); retrying in {RESTART_WAIT_S} s",
                  file=sys.stderr, flush=True)
            time.sleep(RESTART_WAIT_S)


def launch(args: argparse.Namespace) -> int:
    from specui.ui.chat_ui import build_ui
    from specui.ui.live_panels import PAGE_CSS

    _log_to_stderr()
    credentials = parse_credentials(args.auth)
    auth = credentials.pairs if credentials else None
    access = access_from_args(args, credentials)  # before loading anything: a refusal is at once
    if args.threads < 0:
        raise SpecUIError(f"--threads must be >= 0 (0: measured), got {args.threads}")
    port = choose_port(args.host, args.port)
    print("loading models…", file=sys.stderr)
    runner = MainThreadRunner()  # model work stays on this (the main) thread: see specui/service/runner.py
    if args.engine_process:
        service, submit = RemoteService(partial(engine_service, args)), run_in_new_thread
    else:
        service, submit = engine_service(args), runner.submit
        service.use_model_thread(runner)
    if access.shared:
        service.gate = FairGate()
    demo = build_ui(service, settings_from_args(args), submit=submit, access=access).queue(
        max_size=args.queue, default_concurrency_limit=1)
    kwargs = dict(server_name=args.host, server_port=port, auth=auth, prevent_thread_lock=True, css=PAGE_CSS)
    if access.shared:
        kwargs["max_threads"] = SHARED_THREADS
    if not args.share:
        _launch_local(demo, kwargs, args.host, named_port=args.port is not None)
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
        _serve_engine_process(service) if args.engine_process else runner.serve()
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr)
    finally:
        with _no_interrupts():  # a second Ctrl+C while closing (bounded: joins with timeouts) prints no traceback
            demo.close()
            if args.engine_process:
                service.close()
    return 0


@contextlib.contextmanager
def _no_interrupts():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
