"""Batches of B chats decoded together (EMS-SD, seed 003): tokens/s of batched greedy
autoregressive decoding, vanilla padded speculative decoding, speculative decoding with an
unpadded cache only, and EMS-SD (unpadded cache and inputs) at a fixed gamma, and EMS-SD
with its draft length chosen per step from the cost profile (the default), for B = 1..16, with
the padding each computed and stored, and transformers' own batched greedy `generate`
(left-padded) as the peer. Greedy; every row is checked against batched autoregressive.

    python -m specui.bench.batch --batch-sizes 1,2,4,8,16 --max-new-tokens 64 --gamma 2 \
        --out assets/bench/batch

Each batch's B prompts are the prompt set's first B (different lengths); its aggregate
tokens/s is all rows' new tokens over the batch's wall time (prefill included, what the
people waiting see), the median of --repeats rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from specui.bench.png import command_line, save_results
from specui.bench.prompts import HELDOUT, PROMPTS_DIR, load_prompts
from specui.bench.run import common_parser, load_bench, out_folder
from specui.chat import build_prompt
from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.profile import cpu_model
from specui.service.pair import ModelPair

AR_BATCH = "batched autoregressive"
VANILLA = "vanilla speculative (padded)"
EMS_FIXED = "ems-sd (fixed gamma)"
KINDS = {  # name -> ems-sd parameters (gamma filled in from --gamma where it is not 0)
    AR_BATCH: dict(gamma=0, padding="unpad"),
    VANILLA: dict(padding="vanilla", adaptive_gamma=False),
    "unpad-kv speculative (fixed gamma)": dict(padding="unpad-kv", adaptive_gamma=False),
    EMS_FIXED: dict(padding="unpad", adaptive_gamma=False),
    "ems-sd": dict(padding="unpad"),  # the default: gamma chosen per step from the cost profile
}
PEER = "transformers batched greedy (left-padded)"


@dataclass
class Cell:
    """One kind at one batch size over the rounds."""

    rates: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    padding_ratio: float | None = None
    input_padding: float | None = None
    tokens: int = 0

    def to_dict(self) -> dict:
        return dict(tokens_per_s=statistics.median(self.rates), tokens_per_s_min=min(self.rates),
                    tokens_per_s_max=max(self.rates), tokens=self.tokens, padding_ratio=self.padding_ratio,
                    input_padding_ratio=self.input_padding)


def run_ours(engine: Engine, prompts: list[list[int]], n: int, params: dict) -> tuple[float, list[list[int]], dict]:
    """One batch of `prompts` decoded to the end; the engine is the bench's one (as the app keeps
    one: its running acceptance and time ratios carry over from batch to batch)."""
    method = make_method("ems-sd", **params)
    gens = [engine.generate(GenerationRequest(list(p), n), make_method("ems-sd", **params)) for p in prompts]
    t0 = time.perf_counter()
    batch = engine.batch(method)
    batch.join(gens)
    batch.run()
    wall = time.perf_counter() - t0
    return wall, [g.output_ids for g in gens], batch.decoder.target.stats.to_dict()


def run_peer(pair: ModelPair, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    model = pair.target.model
    eos = set(pair.engine().eos_ids)
    width = max(len(p) for p in prompts)
    pad = int(getattr(pair.target.tokenizer, "pad_token_id", None) or 0)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                             eos_token_id=sorted(eos) or None)
    wall = time.perf_counter() - t0
    outputs = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        outputs.append(row[:cut])
    return wall, outputs


def with_history(pair: ModelPair, limit: int, turns: int) -> list[list[int]]:
    """Chats that carry history: the held-out questions, every second one after `turns` earlier
    user / assistant exchanges (the summary set's passages and the requests to summarise
    them), so a batch mixes fresh chats with long ones (what several tabs look like)."""
    passages = [p.messages[-1]["content"] for p in load_prompts(PROMPTS_DIR / "summary.jsonl")]
    out = []
    for i, item in enumerate(load_prompts(HELDOUT, limit)):
        history = []
        if i % 2:
            for k in range(turns):
                history += [{"role": "user", "content": passages[(i + k) % len(passages)]},
                            {"role": "assistant", "content": passages[(i + k + 1) % len(passages)]}]
        out.append(build_prompt(pair.target.tokenizer, history + item.messages, 4096)[0])
    return out


def bench_batches(pair: ModelPair, prompts: list[list[int]], sizes: list[int], n: int, gamma: int,
                  repeats: int) -> dict[int, dict[str, Cell]]:
    results: dict[int, dict[str, Cell]] = {}
    engine = pair.engine()
    run_ours(engine, prompts[:2], 16, dict(gamma=gamma))  # warm-up: the policy's first timings
    for b in sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
        cells = {name: Cell() for name in [*KINDS, PEER]}
        for _ in range(repeats):
            for name, params in KINDS.items():  # interleaved round by round
                params = {"gamma": gamma, **params}
                wall, outputs, stats = run_ours(engine, batch_prompts, n, params)
                cell = cells[name]
                cell.tokens = sum(len(o) for o in outputs)
                cell.rates.append(cell.tokens / wall)
                cell.outputs = outputs
                cell.padding_ratio = stats["padding_ratio"]
                cell.input_padding = round(stats["input_padding"] / max(1, stats["input_tokens"]), 4)
            wall, outputs = run_peer(pair, batch_prompts, n)
            cells[PEER].tokens = sum(len(o) for o in outputs)
            cells[PEER].rates.append(cells[PEER].tokens / wall)
            cells[PEER].outputs = outputs
        results[b] = cells
        print(f"\nB={b}: " + "; ".join(describe(name, c, cells[AR_BATCH]) for name, c in cells.items()), flush=True)
    return results


def differing(base: Cell, cell: Cell) -> int:
    return sum(a != o for a, o in zip(base.outputs, cell.outputs))


def describe(name: str, cell: Cell, base: Cell) -> str:
    rate = statistics.median(cell.rates)
    padding = "" if cell.padding_ratio is None else f", padding {cell.padding_ratio:.1%}"
    differ = f", {differing(base, cell)} rows differ" if differing(base, cell) else ""
    return f"{name} {rate:.1f} tok/s ({rate / statistics.median(base.rates):.2f}x{padding}{differ})"


def to_rows(results: dict[int, dict[str, Cell]]) -> list[dict]:
    rows = []
    for b, cells in results.items():
        base = cells[AR_BATCH]
        for name, cell in cells.items():
            rows.append(dict(batch_size=b, method=name, **cell.to_dict(),
                             vs_batched_autoregressive=statistics.median(cell.rates) / statistics.median(base.rates),
                             rows_differing_from_autoregressive=differing(base, cell)))
    return rows


def figure(rows: list[dict], title: str) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, subplot_titles=["aggregate tokens/s", "padding share (target)"])
    colors = ["#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#7f7f7f"]
    for name, color in zip([*KINDS, PEER], colors):
        pts = [r for r in rows if r["method"] == name]
        line = dict(color=color, dash="dot" if name == PEER else "solid")
        fig.add_scatter(x=[r["batch_size"] for r in pts], y=[r["tokens_per_s"] for r in pts], mode="lines+markers",
                        name=name, legendgroup=name, line=line, row=1, col=1)
        if pts and pts[0]["padding_ratio"] is not None:
            fig.add_scatter(x=[r["batch_size"] for r in pts], y=[r["padding_ratio"] for r in pts], line=line,
                            mode="lines+markers", name=name, legendgroup=name, showlegend=False, row=1, col=2)
    fig.update_xaxes(title_text="batch size B", type="log", dtick=0.30103)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    fig.update_layout(title=title, width=1100, height=460, legend=dict(orientation="h", y=-0.2))
    return fig


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for b in sorted({r["batch_size"] for r in rows}):
        at = {r["method"]: r for r in rows if r["batch_size"] == b}
        ems, fixed, van = at["ems-sd"], at[EMS_FIXED], at[VANILLA]
        lines.append(f"B={b}: ems-sd (fixed gamma) {fixed['tokens_per_s'] / van['tokens_per_s']:.2f}x vanilla padded "
                     f"(padding {van['padding_ratio']:.1%}); ems-sd {ems['tokens_per_s']:.1f} tok/s = "
                     f"{ems['vs_batched_autoregressive']:.2f}x batched autoregressive")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    ap.set_defaults(limit=16, max_new_tokens=64, repeats=1)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--gamma", type=int, default=2, help="draft tokens per step of the speculative rows")
    ap.add_argument("--history-turns", type=int, default=0,
                    help="every second chat carries this many earlier exchanges (long and short rows mixed)")
    ap.add_argument("--out", type=Path, default=Path("out/bench-batch"))
    args = ap.parse_args(argv)
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes must be integers such as 1,2,4,8,16, got {args.batch_sizes!r}")
    if any(b < 1 for b in sizes) or args.gamma < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--batch-sizes, --gamma, --repeats and --max-new-tokens must be >= 1")
    out_folder(ap, args.out)
    pair, prompts = load_bench(args)
    if pair.draft is None:
        print("error: the speculative rows need a draft", file=sys.stderr)
        return 2
    if args.history_turns:
        prompts = with_history(pair, args.limit, args.history_turns)
        lengths = sorted(len(p) for p in prompts)
        print(f"chats with history: prompt lengths {lengths[0]}..{lengths[-1]} tokens")
    results = bench_batches(pair, prompts, sizes, args.max_new_tokens, args.gamma, args.repeats)
    rows = to_rows(results)
    lines = summary(rows)
    print("\n" + "\n".join(lines))
    meta = dict(cpu=cpu_model(), threads=torch.get_num_threads(), device=str(pair.target.device),
                target=pair.target.label, draft=pair.draft.label, prompts=args.prompts,
                max_new_tokens=args.max_new_tokens, gamma=args.gamma, repeats=args.repeats, summary=lines,
                history_turns=args.history_turns, prompt_tokens=[len(p) for p in prompts],
                command=command_line("specui.bench.batch", argv))
    save_results(args.out, "batch", dict(meta=meta, rows=rows),
                 figure(rows, f"Batched decoding, {pair.target.label} + {pair.draft.label}, {cpu_model()}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
