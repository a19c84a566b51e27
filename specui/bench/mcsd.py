"""MCSD on held-out prompts, greedy and at temperature 1, side by side: autoregressive,
speculative, the MCSD baseline (k-config tree), and the seed's forks of W chains with each
early-stop decision model and without; the seed's acceptance rate and tokens/s, a plotly chart.

    python -m specui.bench.mcsd --limit 6 --max-new-tokens 64 --repeats 2 --widths 2,4,8,12 \
        --gamma 4 --out assets/bench/mcsd

At temperature 1 each prompt is answered with the same seed by every row (rows differ in
how they decode, not in their luck); the approximate root selection (the seed's, not
lossless) is a row of its own there, labelled.
"""

from __future__ import annotations

import sys
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specui.bench.png import command_line, save_results
from specui.bench.run import AR, Row, bench, common_parser, load_bench, ours, out_folder, table, to_json
from specui.engine.profile import cpu_model
from specui.engine.sampling import SamplingConfig
from specui.service.pair import ModelPair

DECISIONS = ("none", "hidden", "entropy")


def seeded(run, temperature: float):
    """A row's run at `temperature`, one fixed seed per prompt (greedy: as is)."""
    if temperature == 0:
        return run
    return lambda prompt, n: run(prompt, n, SamplingConfig(temperature=temperature, seed=len(prompt)))


def mcsd_rows(pair: ModelPair, widths: list[int], gamma: int, k_config: str, temperature: float) -> list[Row]:
    t_dtype = str(pair.target.model.dtype).removeprefix("torch.")
    specs: list[tuple[str, str, dict]] = [(AR, AR, {}), ("speculative gamma=2", "speculative", {"gamma": 2}),
                                          (f"speculative gamma={gamma}", "speculative", {"gamma": gamma}),
                                          (f"mcsd baseline k={k_config}", "mcsd", {"k_config": k_config})]
    for w in widths:
        for d in DECISIONS:
            specs.append((f"mcsd W={w} G={gamma} decision={d}", "mcsd", dict(width=w, gamma=gamma, decision=d)))
    if temperature > 0:
        w = widths[min(1, len(widths) - 1)]
        specs.append((f"mcsd W={w} G={gamma} approximate (not lossless)", "mcsd",
                      dict(width=w, gamma=gamma, decision="none", root_selection="approximate")))
    return [Row(name, t_dtype, seeded(ours(pair, method, params), temperature)) for name, method, params in specs]


def figure(results: dict[float, list[dict]], widths: list[int], title: str) -> go.Figure:
    temps = sorted(results)
    fig = make_subplots(rows=len(temps), cols=2, subplot_titles=[
        f"{label} ({'greedy' if t == 0 else f'T={t:g}'})" for t in temps for label in ("tokens/s", "acceptance rate")])
    colors = {"none": "#1f77b4", "hidden": "#2e9e44", "entropy": "#ff7f0e"}
    for i, t in enumerate(temps, 1):
        rows = {r["method"]: r for r in results[t]}
        for d in DECISIONS:
            pts = [rows.get(next((k for k in rows if k.startswith(f"mcsd W={w} ") and k.endswith(f"decision={d}")), ""))
                   for w in widths]
            for col, key in ((1, "tokens_per_s"), (2, "acceptance_rate")):
                fig.add_scatter(x=widths, y=[p[key] if p else None for p in pts], mode="lines+markers",
                                name=f"forks, decision {d}", legendgroup=d, showlegend=i == 1 and col == 1,
                                line=dict(color=colors[d]), row=i, col=col)
        for name, dash in ((AR, "dot"), ("speculative gamma=2", "dash"), ("mcsd baseline", "dashdot")):
            ref = next((r for k, r in rows.items() if k.startswith(name)), None)
            for col, key in ((1, "tokens_per_s"), (2, "acceptance_rate")):
                if ref and ref[key] is not None:
                    fig.add_scatter(x=[widths[0], widths[-1]], y=[ref[key]] * 2, mode="lines", name=ref["method"],
                                    legendgroup=ref["method"], showlegend=i == 1 and col == 1,
                                    line=dict(dash=dash, color="#777"), row=i, col=col)
        fig.update_xaxes(title_text="chains per fork W", row=i)
    fig.update_layout(title=title, width=1100, height=420 * len(temps))
    return fig


def summary(rows: list[dict]) -> str:
    by = {r["method"]: r for r in rows}
    base = next((r for k, r in by.items() if k.startswith("mcsd baseline")), None)
    forks = [r for k, r in by.items() if k.startswith("mcsd W=") and "approximate" not in k]
    if not base or not forks:
        return ""
    best = max(forks, key=lambda r: r["tokens_per_s"])
    return (f"best fork {best['method']}: {best['tokens_per_s']:.2f} tok/s ({best['speedup']:.2f}x AR), "
            f"{best['tokens_per_s'] / base['tokens_per_s'] - 1:+.1%} tokens/s over the MCSD baseline "
            f"({base['tokens_per_s']:.2f}); acceptance rate {best['acceptance_rate']:.3f} vs "
            f"{base['acceptance_rate']:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    ap.add_argument("--widths", default="2,4,8,12", help="chains per fork W")
    ap.add_argument("--gamma", type=int, default=4, help="fork chain length G (and a speculative row at it)")
    ap.add_argument("--k-config", default="4,2,2,1,1", help="the MCSD baseline's tree")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--out", type=Path, default=Path("out/bench-mcsd"))
    args = ap.parse_args(argv)
    out_folder(ap, args.out)
    pair, prompts = load_bench(args)
    if pair.draft is None:
        print("error: mcsd needs a draft", file=sys.stderr)
        return 2
    print(f"decision models: {pair.decision.problem or 'loaded'}")
    widths = [int(w) for w in args.widths.split(",")]
    results, lines = {}, []
    for t in (float(x) for x in args.temperatures.split(",")):
        print(f"\n== temperature {t:g} ==")
        rows = mcsd_rows(pair, widths, args.gamma, args.k_config, t)
        bench(rows, prompts, args.max_new_tokens, args.repeats)
        print("\n" + table(rows, len(prompts)))
        results[t] = to_json(rows)
        for r in results[t]:
            print(f"{r['method']:50} acceptance rate {r['acceptance_rate'] or 0:.3f}")
        lines.append(f"T={t:g}: {summary(results[t])}")
        print(lines[-1])
    meta = dict(cpu=cpu_model(), prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
                repeats=args.repeats, summary=lines,
                command=command_line("specui.bench.mcsd", argv))
    save_results(args.out, "mcsd", dict(meta=meta, rows={str(t): r for t, r in results.items()}),
                 figure(results, widths, f"MCSD forks vs baseline: {len(prompts)} held-out prompts, {cpu_model()}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
