"""SpecDec++ next to fixed-length speculative decoding, measured side by side on held-out
prompts: tokens/s, the seed's discard rate D/N and verification rate V/N, and the Pareto plot
of the two (plotly HTML + PNG).

    python -m specui.bench.specdec --limit 10 --max-new-tokens 128 --repeats 2 \
        --gammas 1,2,3,4,5,6,8 --thresholds 0.3,0.5,0.7,0.8,0.9 --out assets/bench/specdec
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import plotly.graph_objects as go

from specui.bench.png import command_line, save_results
from specui.bench.run import AR, bench, common_parser, load_bench, make_rows, out_folder, table, to_json
from specui.engine.profile import cpu_model


def pareto_figure(results: list[dict], title: str) -> go.Figure:
    fig = go.Figure()
    for prefix in ("speculative", "specdec++"):
        pts = sorted((r for r in results if r["method"].startswith(prefix) and r["discard_rate"] is not None),
                     key=lambda r: r["discard_rate"])
        fig.add_scatter(x=[p["discard_rate"] for p in pts], y=[p["verification_rate"] for p in pts],
                        mode="lines+markers+text", name=prefix, textposition="top right",
                        text=[p["method"].removeprefix(prefix).strip() or "H by costs" for p in pts],
                        customdata=[round(p["tokens_per_s"], 2) for p in pts],
                        hovertemplate="D/N %{x:.3f}, V/N %{y:.3f}: %{customdata} tok/s<extra>%{text}</extra>")
    fig.update_layout(title=title, xaxis_title="discard rate D/N (drafted tokens thrown away per token)",
                      yaxis_title="verification rate V/N (target calls per token)", width=760, height=520)
    return fig


def summary(results: list[dict]) -> str:
    spec = [r for r in results if r["method"].startswith("speculative")]
    ours = [r for r in results if r["method"].startswith("specdec++")]
    if not spec or not ours:
        return ""
    best_g = max(spec, key=lambda r: r["tokens_per_s"])
    best_h = max(ours, key=lambda r: r["tokens_per_s"])
    ratio = best_h["tokens_per_s"] / best_g["tokens_per_s"]
    return (f"best fixed gamma: {best_g['method']} {best_g['tokens_per_s']:.2f} tok/s; best SpecDec++: "
            f"{best_h['method']} {best_h['tokens_per_s']:.2f} tok/s = {ratio:.3f}x")


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    ap.add_argument("--gammas", default="1,2,3,4,5,6,8")
    ap.add_argument("--thresholds", default="0.3,0.5,0.7,0.8,0.9",
                    help="SpecDec++ thresholds H (and a bare 'specdec++' row: H chosen by the measured costs)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers' generate")
    ap.add_argument("--out", type=Path, default=Path("out/bench-specdec"))
    args = ap.parse_args(argv)
    out_folder(ap, args.out)
    pair, prompts = load_bench(args)
    if pair.head.head is None:
        print(f"error: {pair.head.problem}", file=sys.stderr)
        return 2
    specs = ([AR] + [f"speculative:{g}" for g in args.gammas.split(",")] + ["specdec++"]
             + [f"specdec++:{h}" for h in args.thresholds.split(",")])
    rows = make_rows(pair, specs, 2, not args.no_peers)
    bench(rows, prompts, args.max_new_tokens, args.repeats)
    print("\n" + table(rows, len(prompts)))
    results = to_json(rows)
    line = summary(results)
    print(line)
    meta = dict(cpu=cpu_model(), prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
                repeats=args.repeats, tuned_threshold=pair.head.config.get("threshold"),
                command=command_line("specui.bench.specdec", argv), summary=line)
    save_results(args.out, "pareto", dict(meta=meta, rows=results),
                 pareto_figure(results, f"SpecDec++ vs fixed gamma: {len(prompts)} held-out prompts, {cpu_model()}"))
    speedups = [r["speedup"] for r in results if r["method"].startswith("specdec++")]
    print(f"specdec++ speed-ups over AR: median {statistics.median(speedups):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
