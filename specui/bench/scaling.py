"""How cost grows: tokens/s, prefill time and KV-cache memory against prompt length (256 to
4k tokens, up to what the pair's context leaves for the reply), and tokens/s against the
draft length gamma and OPT-Tree's node budget; every row of a table measured side by side in
one run, autoregressive included. Batch size has its own bench (`specui.bench.batch`).

    python -m specui.bench.scaling --lengths 256,512,1024,2048,4096 \
        --methods autoregressive,speculative:2,auto,lookup --gammas 1,2,3,4,6 --nodes 5,10,25,50 \
        --max-new-tokens 48 --out assets/bench/scaling

A prompt of length L is a passage of the summary prompt set (repeated as needed, cut to L
tokens) and a request to summarise it, in the target's chat template; two such prompts per
length. Tokens/s includes the prefill (what a person waits for); decode tokens/s leaves it out.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from specui.bench.png import command_line, save_results
from specui.bench.prompts import PROMPTS_DIR, load_prompts
from specui.bench.run import AR, Row, bench, common_parser, load_bench, make_rows, out_folder, to_json
from specui.chat import build_prompt
from specui.engine.profile import cpu_model
from specui.service.pair import ModelPair

ASK = "Summarize the text above in one sentence."


def long_prompts(pair: ModelPair, length: int, count: int = 2) -> list[list[int]]:
    """`count` prompts of about `length` tokens each (different passages first)."""
    tok = pair.target.tokenizer
    passages = [p.messages[-1]["content"] for p in load_prompts(PROMPTS_DIR / "summary.jsonl")]
    out = []
    for k in range(count):
        text = ""
        i = k
        while len(tok.encode(text)) < length:
            text += passages[i % len(passages)] + "\n\n"
            i += 1
        overhead = len(build_prompt(tok, [{"role": "user", "content": ASK}], 1 << 20)[0])
        ids = tok.encode(text, add_special_tokens=False)[: max(1, length - overhead - 2)]
        content = tok.decode(ids) + "\n\n" + ASK
        out.append(build_prompt(tok, [{"role": "user", "content": content}], 1 << 20)[0])
    return out


def row_figures(row: Row, base: Row) -> dict:
    samples = row.all_samples
    seconds = sum(s.seconds for s in samples)
    prefill = sum(s.prefill_s for s in samples)
    tokens = sum(len(s.output) for s in samples)
    rate = statistics.median(row.rates)
    return dict(method=row.name, tokens_per_s=rate, speedup=rate / statistics.median(base.rates),
                decode_tokens_per_s=tokens / (seconds - prefill) if seconds > prefill else None,
                prefill_s=prefill / len(samples), cache_mb=max(s.cache_mb for s in samples),
                tokens_per_target_forward=row.per_forward,
                differs_from_autoregressive=None if row is base else row.divergent(base))


def by_length(pair: ModelPair, lengths: list[int], specs: list[str], n: int, repeats: int) -> list[dict]:
    out = []
    for length in lengths:
        prompts = long_prompts(pair, length)
        rows = make_rows(pair, specs, 2, peers=False)
        print(f"\n== prompts of {len(prompts[0])} and {len(prompts[1])} tokens ==")
        bench(rows, prompts, n, repeats)
        base = next(r for r in rows if r.name == AR)
        out += [dict(prompt_tokens=length, **row_figures(row, base)) for row in rows]
    return out


def figure(lengths: list[dict], sizes: list[dict], title: str) -> go.Figure:
    fig = make_subplots(rows=2, cols=2, subplot_titles=[
        "tokens/s vs prompt length (prefill included)", "KV cache (target + draft) vs prompt length",
        "tokens/s vs gamma (speculative)", "tokens/s vs node budget (opt-tree)"])
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    for method, color in zip(dict.fromkeys(r["method"] for r in lengths), palette * 4):
        pts = [r for r in lengths if r["method"] == method]
        xs = [r["prompt_tokens"] for r in pts]
        fig.add_scatter(x=xs, y=[r["tokens_per_s"] for r in pts], name=method, legendgroup=method,
                        mode="lines+markers", line=dict(color=color), row=1, col=1)
        fig.add_scatter(x=xs, y=[r["cache_mb"] for r in pts], name=method, legendgroup=method, showlegend=False,
                        mode="lines+markers", line=dict(color=color), row=1, col=2)
    ar = next((r["tokens_per_s"] for r in sizes if r["method"] == AR), None)
    for col, prefix, key in ((1, "speculative gamma=", "gamma"), (2, "opt-tree nodes=", "nodes")):
        pts = [r for r in sizes if r["method"].startswith(prefix)]
        xs = [int(r["method"].removeprefix(prefix)) for r in pts]
        fig.add_scatter(x=xs, y=[r["tokens_per_s"] for r in pts], name=prefix.split()[0] + f" by {key}",
                        mode="lines+markers", line=dict(color=palette[4 + col]), row=2, col=col)
        if ar and xs:
            fig.add_scatter(x=[min(xs), max(xs)], y=[ar, ar], mode="lines", line=dict(dash="dot", color="#777"),
                            name=AR, showlegend=col == 1, row=2, col=col)
    fig.update_xaxes(type="log", title_text="prompt tokens", row=1)
    fig.update_yaxes(title_text="MB", row=1, col=2)
    fig.update_layout(title=title, width=1100, height=820)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    ap.set_defaults(limit=4, max_new_tokens=48, repeats=1)
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--methods", default="autoregressive,speculative:2,auto,lookup")
    ap.add_argument("--gammas", default="1,2,3,4,6")
    ap.add_argument("--nodes", default="5,10,25,50")
    ap.add_argument("--out", type=Path, default=Path("out/bench-scaling"))
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        gammas = [int(x) for x in args.gammas.split(",")]
        nodes = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        ap.error("--lengths, --gammas and --nodes are comma lists of integers")
    if min(lengths + gammas + nodes) < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("lengths, gammas, nodes, --repeats and --max-new-tokens must be >= 1")
    out_folder(ap, args.out)
    pair, chat = load_bench(args)
    context = pair.engine().context_len
    fits = [n for n in lengths if n + args.max_new_tokens < context]
    if fits != lengths:
        print(f"prompt lengths {sorted(set(lengths) - set(fits))} do not fit the {context}-token context "
              f"with {args.max_new_tokens} new tokens: left out")
    specs = args.methods.split(",")
    if pair.draft is None:
        specs = [s for s in specs if s.split(":")[0] in (AR, "lookup")]
    length_rows = by_length(pair, fits, specs, args.max_new_tokens, args.repeats)
    size_specs = [AR] + ([f"speculative:{g}" for g in gammas] + [f"opt-tree:{n}" for n in nodes]
                         if pair.draft is not None else [])
    rows = make_rows(pair, size_specs, 2, peers=False)
    print(f"\n== gamma and node budget, {len(chat)} held-out prompts ==")
    bench(rows, chat, args.max_new_tokens, args.repeats)
    size_rows = to_json(rows)
    for r in length_rows:
        print(f"{r['prompt_tokens']:>6} {r['method']:24} {r['tokens_per_s']:7.2f} tok/s ({r['speedup']:.2f}x AR), "
              f"prefill {r['prefill_s']:.2f} s, decode {r['decode_tokens_per_s'] or 0:.2f} tok/s, "
              f"cache {r['cache_mb']:.1f} MB")
    for r in size_rows:
        print(f"{r['method']:24} {r['tokens_per_s']:7.2f} tok/s ({r['speedup']:.2f}x AR), "
              f"{r['tokens_per_target_forward'] or 0:.2f} tokens per target forward")
    meta = dict(cpu=cpu_model(), threads=torch.get_num_threads(), device=str(pair.target.device),
                target=pair.target.label, draft=pair.draft.label if pair.draft else "none",
                max_new_tokens=args.max_new_tokens, repeats=args.repeats, context=context,
                command=command_line("specui.bench.scaling", argv))
    save_results(args.out, "scaling", dict(meta=meta, by_prompt_length=length_rows, by_size=[
        {k: v for k, v in r.items() if k != "rounds"} for r in size_rows]),
        figure(length_rows, size_rows, f"Scaling, {pair.target.label} + {meta['draft']}, {cpu_model()}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
