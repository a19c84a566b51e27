"""What the web UI costs: the same prompts answered through the service directly (the CLI's
path) and through the running Gradio app (a client streaming /respond, with the live panels
built and sent), alternating, on one loaded pair. The client runs in its own process, as a
browser would.

    python -m specui.bench.ui_overhead --limit 4 --max-new-tokens 96 --methods speculative:2,opt-tree:25
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

from specui.bench.prompts import HELDOUT, load_prompts
from specui.bench.run import parse_method
from specui.loading import BUNDLED, ModelSpec
from specui.pair import default_draft_source, load_pair
from specui.runner import MainThreadRunner
from specui.service import ChatService
from specui.settings import ChatSettings
from specui.ui.chat_ui import SETTING_FIELDS, build_ui


def settings_for(spec: str, max_new_tokens: int) -> ChatSettings:
    """A method spec as the side-by-side benchmark takes it (name[:value])."""
    name, params = parse_method(spec)
    return ChatSettings(method=name, max_new_tokens=max_new_tokens, **params)


def ui_values(settings: ChatSettings) -> list:
    values = {f: getattr(settings, f) for f in SETTING_FIELDS}
    values["seed"] = -1 if settings.seed is None else settings.seed
    return [values[f] for f in SETTING_FIELDS]


def direct(service: ChatService, prompt: str, settings: ChatSettings) -> tuple[float, str, float]:
    t0 = time.perf_counter()
    generation, _ = service.start([{"role": "user", "content": prompt}], settings)
    for _ in service.stream(generation):
        pass
    return time.perf_counter() - t0, generation.text, generation.stats.tokens_per_s


def _client_worker(url: str, conn) -> None:
    """Child process: stream /respond for each (prompt, method, values) received; send back
    (wall seconds from submit to the last update, reply text, updates seen)."""
    from gradio_client import Client

    client = Client(url, verbose=False)
    while (job_args := conn.recv()) is not None:
        prompt, method, values = job_args
        t0 = time.perf_counter()
        job = client.submit(prompt, [], method, *values, api_name="/respond")
        updates = sum(1 for _ in job)
        seconds = time.perf_counter() - t0
        final = job.outputs()[-1]
        content = final[1][-1]["content"]
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        engine_tps = float(final[6].split(" tok/s")[0].split("·")[-1])
        conn.send((seconds, text, updates, engine_tps))


def through_ui(conn, runner: MainThreadRunner, prompt: str, settings: ChatSettings) -> tuple[float, str, int, float]:
    """The app's model work runs on this (the main) thread, as in `python app.py`."""
    conn.send((prompt, settings.method, ui_values(settings)))
    runner.serve(until=conn.poll)
    return conn.recv()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="autoregressive,speculative:2,opt-tree:25")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    spec = ModelSpec(BUNDLED, dtype="float32", device="auto")
    service = ChatService(load_pair(spec, spec.with_source(default_draft_source())))
    port = _free_port()
    runner = MainThreadRunner()
    demo = build_ui(service, submit=runner.submit).queue(default_concurrency_limit=1)
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True)
    conn, child_conn = mp.get_context("spawn").Pipe()
    client = mp.get_context("spawn").Process(target=_client_worker, args=(f"http://127.0.0.1:{port}", child_conn))
    client.start()
    prompts = [p.messages[-1]["content"] for p in load_prompts(HELDOUT)[: args.limit]]
    print(f"{'method':<18}{'direct s':>10}{'UI s':>10}{'UI / direct':>13}{'updates':>9}  same text")
    for method in args.methods.split(","):
        settings = settings_for(method, args.max_new_tokens)
        direct(service, prompts[0], settings)  # warm-up
        ratios, d_total, u_total, n_updates, same = [], 0.0, 0.0, 0, True
        for prompt in prompts:
            for _ in range(args.repeats):
                d, d_text, d_tps = direct(service, prompt, settings)
                u, u_text, updates, u_tps = through_ui(conn, runner, prompt, settings)
                print(f"   engine tok/s direct {d_tps:.1f}  in the app {u_tps:.1f}")
                ratios.append(u / d)
                d_total, u_total, n_updates = d_total + d, u_total + u, n_updates + updates
                same &= d_text.strip() == u_text.strip()
        print(f"{method:<18}{d_total:>10.2f}{u_total:>10.2f}{u_total / d_total:>12.3f}x{n_updates:>9}  {same}"
              f"   (median per-prompt ratio {statistics.median(ratios):.3f})")
    conn.send(None)
    client.join(30)
    demo.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
