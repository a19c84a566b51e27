"""What the web UI costs: the same prompts answered, interleaved, on one loaded pair,
(1) through the service directly (the CLI's path), (2) through the running Gradio app by an API
client streaming /respond (the live panels built and sent, not drawn), and with --browser
(3) by the page itself in headless Chromium on the same machine (panels drawn), reading the
tokens/s the page shows. Clients run in their own processes, as a browser would.

    python -m specui.bench.ui_overhead --limit 4 --max-new-tokens 96 --methods speculative:2,opt-tree:25 --browser
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from functools import partial

from specui.bench.cpu_usage import CpuShares, JobMeter, ProcessMeter
from specui.bench.prompts import HELDOUT, load_prompts
from specui.bench.run import parse_method
from specui.service.chat_service import ChatService
from specui.service.pair import default_draft_source, load_pair
from specui.service.remote import RemoteService
from specui.service.reports import capture_line
from specui.service.runner import MainThreadRunner, run_in_new_thread
from specui.settings import ChatSettings
from specui.ui.chat_ui import SETTING_FIELDS, build_ui
from specui.ui.live_panels import PAGE_CSS
from specui.webapp import serve_pair
from specui.weights.loading import BUNDLED, ModelSpec


def settings_for(spec: str, max_new_tokens: int) -> ChatSettings:
    """A method spec as the side-by-side benchmark takes it (name[:value])."""
    name, params = parse_method(spec)
    return ChatSettings(method=name, max_new_tokens=max_new_tokens, **params)


def ui_values(settings: ChatSettings) -> list:
    values = {f: getattr(settings, f) for f in SETTING_FIELDS}
    values["seed"] = -1 if settings.seed is None else settings.seed
    return [values[f] for f in SETTING_FIELDS]


def direct(service, prompt: str, settings: ChatSettings) -> tuple[float, str, float]:
    """The CLI's path: one reply run to its end where the engine runs, no page or server in it."""
    t0 = time.perf_counter()
    text, tps = service.complete([{"role": "user", "content": prompt}], settings)
    return time.perf_counter() - t0, text, tps


def bench_service(spec: ModelSpec, capture: str, threads: str) -> ChatService:
    """The engine's ChatService as the app makes it (with --threads auto) or on torch's default
    thread count; picklable, so the engine's own process can make it."""
    pair = load_pair(spec, spec.with_source(default_draft_source()), capture=capture)
    if threads == "0":  # torch's default
        return ChatService(pair)
    service, choice = serve_pair(pair, True, 0 if threads == "auto" else int(threads))
    service.threads_note = f"torch threads: {choice.reason}"
    print(service.threads_note, flush=True)
    return service


def _client_worker(url: str, conn) -> None:
    """Child process: stream /respond for each (prompt, method, values) received; send back
    (wall seconds from submit to the last update, reply text, updates seen)."""
    from gradio_client import Client

    client = Client(url, verbose=False)
    while (job_args := conn.recv()) is not None:
        prompt, method, values = job_args
        t0 = time.perf_counter()
        job = client.submit(prompt, [], method, *values, None, api_name="/respond")  # None: no clock stamp
        updates = sum(1 for _ in job)
        seconds = time.perf_counter() - t0
        final = job.outputs()[-1]
        content = final[1][-1]["content"]
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        engine_tps = float(final[6].split(" tok/s")[0].split("·")[-1])
        conn.send((seconds, text, updates, engine_tps))


def _browser_worker(url: str, conn, live_panels: bool) -> None:
    """Child process: a headless Chromium on the page; answers (prompt, method, max new tokens)
    with (wall seconds, reply text, 0, the engine tokens/s the page shows)."""
    from specui.bench.browser_driver import PageDriver

    page = PageDriver(url)
    try:
        page.set_checkbox("live-panels", live_panels)
        while (job_args := conn.recv()) is not None:
            prompt, method, max_new_tokens = job_args
            seconds, text, tps = page.ask(prompt, method, max_new_tokens)
            conn.send((seconds, text, 0, tps))
    finally:
        page.close()


def through_ui(conn, runner: MainThreadRunner | None, prompt: str, settings: ChatSettings) -> tuple:
    """(wall s, text, updates, engine tok/s) as an API client saw it. With one process the app's
    model work runs on this (the main) thread (`runner`), as in `python app.py --no-engine-process`."""
    return _answered(conn, runner, (prompt, settings.method, ui_values(settings)))


def through_browser(conn, runner: MainThreadRunner | None, prompt: str, settings: ChatSettings) -> tuple:
    return _answered(conn, runner, (prompt, settings.method, settings.max_new_tokens))


def _answered(conn, runner: MainThreadRunner | None, job: tuple) -> tuple:
    conn.send(job)
    if runner is not None:
        runner.serve(until=conn.poll)
    return conn.recv()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="autoregressive,speculative:2,opt-tree:25")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", default="0", help="torch CPU threads (0: torch default; auto: as the app measures)")
    ap.add_argument("--browser", action="store_true", help="also drive the page in headless Chromium")
    ap.add_argument("--dtype", default="float32", help="the bundled target's dtype (auto: as the app's default)")
    ap.add_argument("--quantization", default="auto", help="auto (the app's default), none, int8, int4")
    ap.add_argument("--no-live-panels", action="store_true", help="browser: panels drawn once at the end")
    ap.add_argument("--capture", default="auto", help="the forwards: auto (the app's default), on, off")
    ap.add_argument("--engine", default="process", choices=("process", "thread"),
                    help="the engine in a process of its own (the app's default) or in the app's (--no-engine-process)")
    return ap


def start_service(args: argparse.Namespace) -> tuple:
    """(service, the main thread's runner of model work or None, the CPU meter, the page's submit):
    the engine in a process of its own, or on this process's main thread (--engine thread)."""
    spec = ModelSpec(BUNDLED, dtype=args.dtype, device="auto", quantization=args.quantization)
    make = partial(bench_service, spec, args.capture, args.threads)
    if args.engine == "process":
        service = RemoteService(make)
        return service, None, ProcessMeter(service.engine_process.process.pid), run_in_new_thread
    service, runner, meter = make(), MainThreadRunner(), JobMeter()
    return service, runner, meter, lambda fn, *a: runner.submit(meter.wrap(fn), *a)


def start_page(service, submit, browser: bool, live_panels: bool) -> tuple:
    """The app's page on a free port, and its clients in processes of their own: (the page, [pipe to
    the API client, pipe to the browser or None], the client processes)."""
    port = _free_port()
    demo = build_ui(service, submit=submit).queue(default_concurrency_limit=1)
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True, css=PAGE_CSS)
    url = f"http://127.0.0.1:{port}"
    spawn = mp.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    workers, bconn = [spawn.Process(target=_client_worker, args=(url, child_conn))], None
    if browser:
        bconn, bchild = spawn.Pipe()
        workers.append(spawn.Process(target=_browser_worker, args=(url, bchild, live_panels)))
    for worker in workers:
        worker.start()
    return demo, [conn, bconn], workers


def bench_method(method: str, prompts: list[str], args: argparse.Namespace, service, runner, meter, conns: list,
                 workers: list) -> None:
    """One method's row: each prompt answered by the CLI's path, the API client and (--browser) the
    page, in turn, `--repeats` times; prints engine tokens/s (medians) and each channel's CPU shares."""
    # the shares while a reply decodes: measured around the job on the model thread (one process),
    # or around the whole request (the engine's own process)
    outside = meter.wrap if runner is None else (lambda fn: fn)
    settings = settings_for(method, args.max_new_tokens)
    direct(service, prompts[0], settings)  # warm-up
    channels = ("cli", "api", "browser") if args.browser else ("cli", "api")
    tps: dict[str, list[float]] = {c: [] for c in channels}
    cpu = {c: CpuShares() for c in channels}
    same = True
    for prompt in prompts:
        for _ in range(args.repeats):
            service.settle()  # background compiles (capture auto) done before timing
            meter.client_pid, meter.shares = None, cpu["cli"]
            _, d_text, d_tps = meter.wrap(direct)(service, prompt, settings)
            meter.client_pid, meter.shares = workers[0].pid, cpu["api"]
            _, u_text, _, u_tps = outside(through_ui)(conns[0], runner, prompt, settings)
            tps["cli"].append(d_tps)
            tps["api"].append(u_tps)
            same &= d_text.strip() == u_text.strip()
            if args.browser:
                meter.client_pid, meter.shares = workers[1].pid, cpu["browser"]
                _, b_text, _, b_tps = outside(through_browser)(conns[1], runner, prompt, settings)
                tps["browser"].append(b_tps)
    cli = statistics.median(tps["cli"])
    cols = [f"{cli:>8.1f}"] + [f"{statistics.median(tps[c]):>12.1f} ({statistics.median(tps[c]) / cli:.2f}x)"
                               for c in channels[1:]]
    print(f"{method:<18}{''.join(cols)}  {same}", flush=True)
    for channel in channels:
        print(f"{'':<18}{channel}: {cpu[channel].line()}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    service, runner, meter, submit = start_service(args)
    demo, conns, workers = start_page(service, submit, args.browser, not args.no_live_panels)
    prompts = [p.messages[-1]["content"] for p in load_prompts(HELDOUT)[: args.limit]]
    print(f"engine tok/s (median over {args.limit} prompts x {args.repeats}); ratio to the CLI path in brackets")
    print(f"{'method':<18}{'CLI':>8}{'API client':>20}" + (f"{'browser':>20}" if args.browser else "") + "  same text")
    for method in args.methods.split(","):
        bench_method(method, prompts, args, service, runner, meter, conns, workers)
    print(f"capture {args.capture}: {capture_line(service.capture_report())}")
    for conn in conns:
        if conn is not None:
            conn.send(None)
    for worker in workers:
        worker.join(30)
    demo.close()
    if args.engine == "process":
        service.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
