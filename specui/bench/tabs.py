"""Several chats at once through the running app: N API clients (each its own process, as
browser tabs are) send a message at the same moment; aggregate tokens/s = all replies' new
tokens over the wall time from the sends to the last reply. With ems-sd the chats decode in
one batch (continuous batching); with another method they take turns on the model thread.

    python -m specui.bench.tabs --tabs 1,2,4,8 --methods ems-sd,speculative --max-new-tokens 64 \
        --out assets/bench/tabs
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

import plotly.graph_objects as go
import torch

from specui.bench.png import command_line, save_results
from specui.bench.prompts import HELDOUT, load_prompts
from specui.engine.profile import cpu_model
from specui.service.chat_service import ChatService
from specui.service.pair import default_draft_source, load_pair
from specui.service.runner import MainThreadRunner
from specui.settings import ChatSettings
from specui.ui.chat_ui import build_ui
from specui.ui.live_panels import PAGE_CSS
from specui.weights.loading import BUNDLED, ModelSpec


def _client(url: str, conn) -> None:
    """Child process: answer each (prompt, method, max new tokens) with (new tokens, reply)."""
    from gradio_client import Client

    client = Client(url, verbose=False)
    while (job := conn.recv()) is not None:
        prompt, method, n = job
        out = client.predict(prompt, method=method, max_new_tokens=n, temperature=0, api_name="/chat")
        conn.send((out["stats"]["new_tokens"], out["reply"], out["stats"].get("mean_batch_size", 0.0)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def round_of(conns: list, runner: MainThreadRunner, prompts: list[str], method: str, n: int) -> dict:
    """Every client sends at once; the model thread (this one) serves until all replied."""
    t0 = time.perf_counter()
    for conn, prompt in zip(conns, prompts):
        conn.send((prompt, method, n))
    runner.serve(until=lambda: all(c.poll() for c in conns))
    wall = time.perf_counter() - t0
    answers = [c.recv() for c in conns]
    tokens = sum(a[0] for a in answers)
    return dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, replies=[a[1] for a in answers],
                mean_batch_size=max(a[2] for a in answers))


def figure(rows: list[dict], title: str) -> go.Figure:
    fig = go.Figure()
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == method]
        fig.add_scatter(x=[r["tabs"] for r in pts], y=[r["tokens_per_s"] for r in pts], mode="lines+markers",
                        name=method)
    fig.update_layout(title=title, xaxis_title="chats sending at once", yaxis_title="aggregate tokens/s",
                      width=900, height=440)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tabs", default="1,2,4,8")
    ap.add_argument("--methods", default="ems-sd,speculative")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("out/bench-tabs"))
    args = ap.parse_args(argv)
    try:
        tabs = [int(t) for t in args.tabs.split(",")]
    except ValueError:
        ap.error(f"--tabs must be integers such as 1,2,4,8, got {args.tabs!r}")
    if min(tabs) < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--tabs, --repeats and --max-new-tokens must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec(BUNDLED, dtype=args.dtype, device="auto")
    service = ChatService(load_pair(spec, spec.with_source(default_draft_source())))
    service.engine.ensure_profile()
    port = _free_port()
    runner = MainThreadRunner()
    demo = build_ui(service, ChatSettings(), submit=runner.submit).queue(default_concurrency_limit=1)
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True, css=PAGE_CSS)
    url = f"http://127.0.0.1:{port}"
    spawn = mp.get_context("spawn")
    pipes = [spawn.Pipe() for _ in range(max(tabs))]
    workers = [spawn.Process(target=_client, args=(url, child)) for _, child in pipes]
    for worker in workers:
        worker.start()
    prompts = [p.messages[-1]["content"] for p in load_prompts(HELDOUT)]
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; target "
          f"{service.target_label}, draft {service.draft_label}; {args.max_new_tokens} new tokens, greedy")
    conns = [c for c, _ in pipes]
    rows = []
    try:
        round_of(conns[:1], runner, prompts[:1], "autoregressive", 8)  # warm-up (clients connected)
        for n in tabs:
            for method in args.methods.split(","):
                rounds = [round_of(conns[:n], runner, [prompts[(n + i) % len(prompts)] for i in range(n)], method,
                                   args.max_new_tokens) for _ in range(args.repeats)]
                rate = statistics.median(r["tokens_per_s"] for r in rounds)
                rows.append(dict(tabs=n, method=method, tokens_per_s=rate,
                                 tokens_per_s_all=[r["tokens_per_s"] for r in rounds],
                                 mean_batch_size=max(r["mean_batch_size"] for r in rounds),
                                 same_replies_each_round=all(r["replies"] == rounds[0]["replies"] for r in rounds)))
                print(f"{n} chats, {method}: {rate:.1f} tokens/s aggregate", flush=True)
    finally:
        for conn in conns:
            conn.send(None)
        for worker in workers:
            worker.join(30)
        demo.close()
    lines = []
    for method in args.methods.split(","):
        one = next((r["tokens_per_s"] for r in rows if r["method"] == method and r["tabs"] == 1), None)
        for r in rows:
            if r["method"] == method and one:
                r["vs_one_chat"] = r["tokens_per_s"] / one
        lines.append(f"{method}: " + ", ".join(f"{r['tabs']} chats {r['tokens_per_s']:.1f} tok/s "
                                               f"({r.get('vs_one_chat', 0):.2f}x one)"
                                               for r in rows if r["method"] == method))
    print("\n".join(lines))
    meta = dict(cpu=cpu_model(), threads=torch.get_num_threads(), target=service.target_label,
                draft=service.draft_label, max_new_tokens=args.max_new_tokens, repeats=args.repeats, summary=lines,
                command=command_line("specui.bench.tabs", argv))
    save_results(args.out, "tabs", dict(meta=meta, rows=rows),
                 figure(rows, f"Chats at once through the app, {cpu_model()}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
