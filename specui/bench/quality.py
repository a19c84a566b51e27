"""Quality vs throughput of beam methods (DSBD's evidence, DESIGN.md 3.7, the seed's figure 4).

    python -m specui.bench.quality --limit 4 --max-new-tokens 48 --temperature 1 --out bench-out/quality

For autoregressive sampling, speculative, beam sampling W = 1..4 and DSBD over a grid of
(gamma, W_L, W_S, t, W_min) with memory mode: tokens/s (rows interleaved prompt by prompt,
as the throughput bench) and the replies' mean log-likelihood per token under the target
(scored afterwards by one plain forward over prompt + reply; perplexity = exp(-that)).
Writes results.json, quality.html and quality.png (a plotly throughput-vs-quality plot with each
family's Pareto front) under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from specui.bench.png import save_figure
from specui.bench.prompts import HELDOUT
from specui.bench.run import (
    Row,
    bench_prompts,
    compare_quantizations_here,
    measure_capture_here,
    ours,
    out_folder,
    settle_all,
    warm_up,
)
from specui.engine import make_method
from specui.engine.capture import CAPTURES
from specui.engine.profile import cpu_model
from specui.engine.sampling import SamplingConfig
from specui.service.pair import ModelPair, default_draft_source, load_pair
from specui.settings import QUANTIZATIONS
from specui.weights.loading import BUNDLED, ModelSpec

DEFAULT_GRID = ("autoregressive;speculative:gamma=3;beam:width=1;beam:width=2;beam:width=3;beam:width=4;"
                "dsbd:width=2,gamma=2;dsbd:width=2,gamma=3;dsbd:width=3,gamma=2;dsbd:width=4,gamma=2,draft_width=6;"
                "dsbd:width=3,gamma=2,width_threshold=0.5;dsbd:width=4,gamma=3,width_threshold=0.3,min_width=2;"
                "dsbd:width=3,gamma=3,memory_mode=1;dsbd:width=2,gamma=3,memory_mode=1")


def parse_config(spec: str) -> tuple[str, dict]:
    """'dsbd:width=2,gamma=3,width_threshold=0.5' -> ('dsbd', {...})."""
    name, _, rest = spec.partition(":")
    params: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key in ("memory_mode", "adaptive_gamma"):
            params[key] = value not in ("0", "false", "")
        elif key == "width_threshold":
            params[key] = float(value)
        else:
            params[key] = int(value)
    return name.strip(), params


@torch.inference_mode()
def log_likelihood(pair: ModelPair, prompt: list[int], reply: list[int]) -> tuple[float, int]:
    """Sum of log p(token) under the target (temperature 1) over the reply, and its length."""
    if not reply:
        return 0.0, 0
    model = pair.target.model
    ids = torch.tensor([prompt + reply], device=model.device)
    logp = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float().log_softmax(-1)
    return float(logp.gather(1, torch.tensor(reply, device=model.device)[:, None]).sum()), len(reply)


@dataclass
class Point:
    name: str
    family: str
    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    loglik_per_token: float
    perplexity: float
    tokens: int


def measure(pair: ModelPair, configs: list[str], prompts: list[list[int]], n: int, repeats: int,
            sampling: SamplingConfig) -> list[Point]:
    rows = []
    for spec in configs:
        method, params = parse_config(spec)
        make_method(method, **params)  # bad settings fail before any time is spent
        run = ours(pair, method, params)
        rows.append(Row(spec, "", run))
    warm_up(rows, prompts)
    for r in range(repeats):
        for row in rows:
            row.rounds.append([])
        for i, prompt in enumerate(prompts):
            shift = (r + i) % len(rows)
            for row in rows[shift:] + rows[:shift]:
                seeded = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=1000 * r + i)
                settle_all(rows)  # another row's background compile would take this row's cores
                row.rounds[r].append(row.run(prompt, n, seeded))
        print(f"round {r + 1}/{repeats}: " + ", ".join(f"{row.name} {row.round_rate(r):.1f}" for row in rows))
    points = []
    for row in rows:
        total, count = 0.0, 0
        for samples in row.rounds:
            for prompt, s in zip(prompts, samples):
                ll, k = log_likelihood(pair, prompt, s.output)
                total, count = total + ll, count + k
        mean = total / max(1, count)
        rates = row.rates
        points.append(Point(row.name, row.name.split(":")[0] + (" memory" if "memory_mode=1" in row.name else ""),
                            statistics.median(rates), min(rates), max(rates), mean, math.exp(-mean), count))
    return points


def pareto(points: list[Point]) -> list[Point]:
    """Points no other point beats on both throughput and log-likelihood, by throughput."""
    def beats(o: Point, p: Point) -> bool:
        return (o.tokens_per_s >= p.tokens_per_s and o.loglik_per_token >= p.loglik_per_token
                and (o.tokens_per_s, o.loglik_per_token) != (p.tokens_per_s, p.loglik_per_token))

    return sorted((p for p in points if not any(beats(o, p) for o in points)), key=lambda p: p.tokens_per_s)


def figure(points: list[Point], title: str):
    import plotly.graph_objects as go

    fig = go.Figure()
    for family in sorted({p.family for p in points}):
        mine = [p for p in points if p.family == family]
        fig.add_trace(go.Scatter(
            x=[p.tokens_per_s for p in mine], y=[p.loglik_per_token for p in mine], mode="markers", name=family,
            text=[p.name for p in mine], hovertemplate="%{text}<br>%{x:.2f} tok/s, log-lik %{y:.3f}<extra></extra>",
            error_x=dict(type="data", symmetric=False, array=[p.tokens_per_s_max - p.tokens_per_s for p in mine],
                         arrayminus=[p.tokens_per_s - p.tokens_per_s_min for p in mine]),
            marker=dict(size=11)))
        front = pareto(mine)
        if len(front) > 1:
            fig.add_trace(go.Scatter(x=[p.tokens_per_s for p in front], y=[p.loglik_per_token for p in front],
                                     mode="lines", line=dict(dash="dot"), name=f"{family} Pareto front",
                                     hoverinfo="skip"))
    fig.update_layout(title=title, xaxis_title="tokens/s (median, min-max)",
                      yaxis_title="mean log-likelihood per token under the target (higher = better)",
                      height=520, width=900)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=BUNDLED)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", default=str(HELDOUT))
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--configs", default=DEFAULT_GRID,
                    help="';'-separated method:key=value,... (default: the DSBD grid and its peers)")
    ap.add_argument("--out", default="bench-out/quality")
    ap.add_argument("--stand-in", default="", metavar="SIZE", help="the target zero-padded to that size's cost")
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="the target's (default none: its dtype's weights; w8a8: int8 products that stay flat)")
    ap.add_argument("--capture", default="auto", choices=CAPTURES,
                    help="the rows' forwards: auto (compiled where this machine measured it faster, in the "
                         "background before the first timed reply), on (compiled), off (eager)")
    args = ap.parse_args(argv)
    out = out_folder(ap, Path(args.out))  # made before minutes of measuring, not found unwritable after

    target = ModelSpec(args.target, args.dtype, args.device, args.quantization, stand_in=args.stand_in)
    draft_src = default_draft_source() if args.draft == "default" else args.draft
    pair = load_pair(target, target.with_source(draft_src), capture=args.capture)
    if compare_quantizations_here(pair):
        del pair  # at most one target in memory
        pair = load_pair(target, target.with_source(draft_src), capture=args.capture)
    measure_capture_here(pair)
    prompts = bench_prompts(pair.target.tokenizer, args.prompts, args.limit)
    header = (f"cpu: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; device "
              f"{pair.target.device}; target {pair.target.label} ({pair.target.model.dtype}); draft {pair.draft.label} "
              f"({pair.draft.model.dtype}); {len(prompts)} prompts x {args.repeats} rounds, max {args.max_new_tokens} "
              f"new tokens, temperature {args.temperature}; capture {args.capture}")
    print(header)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    points = measure(pair, args.configs.split(";"), prompts, args.max_new_tokens, args.repeats, sampling)
    print(f"\n{'config':52} {'tok/s median (min-max)':>24} {'log-lik/token':>14} {'perplexity':>11}")
    for p in points:
        print(f"{p.name:52} {p.tokens_per_s:7.2f} ({p.tokens_per_s_min:.2f}-{p.tokens_per_s_max:.2f})"
              f"{'':>5} {p.loglik_per_token:14.3f} {p.perplexity:11.2f}")
    saved = {"header": header, "points": [p.__dict__ for p in points]}
    (out / "results.json").write_text(json.dumps(saved, indent=1), encoding="utf-8")
    title = "DSBD: throughput vs quality" + (f"<br><sup>A STAND-IN: {pair.target.label}</sup>" if args.stand_in else "")
    written = save_figure(figure(points, title), out, "quality")
    print(f"\nwrote {out / 'results.json'} and " + " and ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
