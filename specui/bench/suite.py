"""One benchmark for every method and peer on the loaded pair, per workload, with figures.

    python -m specui.bench --methods all --workloads chat,code,summary --limit 6 \
        --max-new-tokens 64 --repeats 2 --out out/bench

Rows: our methods (name[:value] specs, as `specui.bench.run`; `all` = every method with
its usual setting) and the peers on the same pair and prompts: transformers greedy
`generate`, assisted generation (`assistant_model=`) with its default dynamic schedule and
with a constant one, and prompt-lookup decoding (`prompt_lookup_num_tokens`). Workloads are
prompt sets: chat (the held-out prompts), code (complete / fix a given snippet) and summary
(summarize / rewrite a given text): the last two copy from the prompt, which drafts love.

Writes DIR/results.json (one row per workload x method) and plotly figures (HTML, and PNG
where a Chromium is found): speed-up bars, accepted-length histograms, time split per step.
Ctrl-C keeps what was measured (the rounds finished so far, marked interrupted). An unknown
method or workload, or an output folder that cannot be written, is refused before any model
loads."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specui.bench.prompts import HELDOUT, PROMPTS_DIR, load_prompts
from specui.bench.run import (
    AR,
    Row,
    bench,
    bench_prompts,
    common_parser,
    load_bench,
    make_rows,
    parse_method,
    to_json,
    transformers_generate,
)
from specui.bench.suite_figures import write_figures
from specui.engine import METHODS
from specui.engine.profile import cpu_model
from specui.errors import SpecUIError

ALL = ["autoregressive", "auto", "speculative:2", "speculative:4", "specdec++", "tree:eagle-25", "opt-tree:25",
       "mcsd", "lookup", "dsbd:2", "beam:2"]
WORKLOADS = {"chat": HELDOUT, "code": PROMPTS_DIR / "code.jsonl", "summary": PROMPTS_DIR / "summary.jsonl"}
PEERS = ("transformers greedy", "transformers assisted", "transformers assisted constant",
         "transformers prompt lookup")


def parser() -> argparse.ArgumentParser:
    ap = common_parser(__doc__.splitlines()[0])
    ap.add_argument("--methods", default="all", help=f"'all' ({','.join(ALL)}) or a comma list of method specs")
    ap.add_argument("--workloads", default="chat,code,summary", help=f"comma list of: {', '.join(WORKLOADS)}")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers' generate rows")
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    return ap


def check_args(args: argparse.Namespace) -> tuple[list[str], dict[str, Path]]:
    """Method specs and workload files, refused with a clear message before any model loads."""
    specs = ALL if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for spec in specs:
        name, _ = parse_method(spec)
        if name not in METHODS:
            raise SpecUIError(f"unknown method {spec!r} in --methods; choose from: {', '.join(sorted(METHODS))}")
    workloads = {}
    for name in (w.strip() for w in args.workloads.split(",") if w.strip()):
        if name not in WORKLOADS:
            raise SpecUIError(f"unknown workload {name!r}; choose from: {', '.join(WORKLOADS)}")
        load_prompts(WORKLOADS[name], 1)  # exists and parses
        workloads[name] = WORKLOADS[name]
    if args.prompts != str(HELDOUT):  # an explicit prompt file is the chat workload
        load_prompts(Path(args.prompts), 1)
        workloads = {"custom": Path(args.prompts)}
    if args.repeats < 1 or args.max_new_tokens < 1 or args.limit < 1:
        raise SpecUIError("--repeats, --max-new-tokens and --limit must be >= 1")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SpecUIError(f"cannot write to {args.out}: {e}") from None
    return specs, workloads


def peer_rows(pair, gamma: int) -> list[Row]:
    """The four transformers rows on the same pair (greedy)."""
    t_dtype = str(pair.target.model.dtype).removeprefix("torch.")
    rows = [Row(PEERS[0], t_dtype, transformers_generate(pair))]
    if pair.draft is not None:
        rows.append(Row(PEERS[1], t_dtype, transformers_generate(pair, assistant_model=pair.draft.model)))
        rows.append(Row(f"{PEERS[2]} {gamma}", t_dtype,
                        transformers_generate(pair, constant_tokens=gamma, assistant_model=pair.draft.model)))
    rows.append(Row(PEERS[3], t_dtype, transformers_generate(pair, prompt_lookup_num_tokens=10)))
    return rows


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_workload(pair, specs: list[str], prompts: list[list[int]], args, bar: tqdm) -> tuple[list[Row], bool]:
    """Bench the rows on one workload; (rows, interrupted)."""
    usable = [s for s in specs if not (parse_method(s)[0] == "specdec++" and pair.head.head is None)]
    rows = make_rows(pair, usable, 2, False) + ([] if args.no_peers else peer_rows(pair, 4))
    try:
        bench(rows, prompts, args.max_new_tokens, args.repeats, say=bar.write, progress=lambda: bar.update(1))
        return rows, False
    except KeyboardInterrupt:
        bar.write("interrupted: keeping the rounds measured so far")
        return rows, True


def complete_rounds(rows: list[Row], n_prompts: int) -> list[Row]:
    """After an interrupt: every row keeps only the rounds every row finished."""
    done = min((sum(len(r) == n_prompts for r in row.rounds) for row in rows), default=0)
    for row in rows:
        row.rounds = row.rounds[:done]
    return [row for row in rows if row.rounds]


def settings_of(name: str) -> dict:
    """A row's settings from its name ('speculative gamma=2' -> {'gamma': '2'}); peers: {}."""
    parts = name.split(" ")
    if parts[0] not in METHODS:
        return {}
    return dict(p.split("=", 1) for p in parts[1:] if "=" in p)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        specs, workloads = check_args(args)
    except SpecUIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results, skipped, interrupted = [], [], False
    pair = None
    for workload, path in workloads.items():
        args.prompts = str(path)
        if pair is None:
            pair, prompts = load_bench(args)
            if pair.head.head is None and "specdec++" in [parse_method(s)[0] for s in specs]:
                skipped.append(f"specdec++: {pair.head.problem}")
        else:
            prompts = bench_prompts(pair.target.tokenizer, path, args.limit)
        n_rows = len(specs) + (0 if args.no_peers else len(PEERS))
        with tqdm(total=n_rows * len(prompts) * args.repeats, desc=f"bench {workload}", unit="reply") as bar:
            rows, interrupted = run_workload(pair, specs, prompts, args, bar)
        rows = complete_rounds(rows, len(prompts)) if interrupted else rows
        if rows and any(r.name == AR for r in rows):
            results += [dict(row, workload=workload, settings=settings_of(row["method"]),
                             process_peak_rss_mb=round(peak_rss_mb())) for row in to_json(rows)]
        if interrupted:
            break
    meta = dict(cpu=cpu_model(), device=str(pair.target.device) if pair else None, date=time.strftime("%Y-%m-%d"),
                max_new_tokens=args.max_new_tokens, limit=args.limit, repeats=args.repeats, interrupted=interrupted,
                skipped=skipped, joules_per_token="not measured (CPU)" if not torch.cuda.is_available() else None,
                command="python -m specui.bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    (args.out / "results.json").write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    write_figures(results, args.out, f"{cpu_model()}, {meta['date']}")
    print(f"wrote {args.out}/results.json and figures ({len(results)} rows){' [interrupted]' if interrupted else ''}")
    return 130 if interrupted else 0
