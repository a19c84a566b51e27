"""One benchmark for every method and peer on the loaded pair, per workload, with figures.

    python -m specui.bench --methods all --workloads chat,code,summary --limit 6 \
        --max-new-tokens 64 --repeats 2 --out out/bench

Rows: our methods (name[:value] specs, as `specui.bench.run`; `all` = every method with
its usual setting) and the peers on the same pair and prompts: transformers greedy
`generate`, assisted generation (`assistant_model=`) with its default dynamic schedule and
with a constant one, prompt-lookup decoding (`prompt_lookup_num_tokens`), and llama.cpp on
the same GGUF when it is installed (specui/bench/llamacpp.py). Workloads are prompt sets:
chat (the held-out prompts), code (complete / fix a given snippet) and summary (summarize /
rewrite a given text): the last two copy from the prompt, which drafts love.
`--quantizations none,int4,...` repeats every row on each quantized target (a backend that
cannot run here is skipped with its reason); "differs from AR" compares with autoregressive
decoding of the same quantized target. `--quality` adds DSBD's throughput-vs-quality grid
(temperature 1, specui.bench.quality) on the chat prompts.

Writes DIR/results.json (one row per quantization x workload x method) and plotly figures
(HTML, and PNG where a Chromium is found): speed-up bars, tokens/s bars, accepted-length
histograms, time split per step, SpecDec++'s discard-vs-verification Pareto plot (from the
speculative and specdec++ rows) and, with --quality, DSBD's quality-vs-throughput plot.
Ctrl-C keeps what was measured (the rounds finished so far, marked interrupted). An unknown
method, workload or quantization, or an output folder that cannot be written, is refused
before any model loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specui.bench import quality
from specui.bench.energy import ReplyMeter
from specui.bench.llamacpp import LLAMA_CPP, llama_cpp_runner, unavailable
from specui.bench.png import save_figure
from specui.bench.prompts import HELDOUT, PROMPTS_DIR, load_prompts
from specui.bench.run import (
    AR,
    Row,
    Sample,
    bench,
    bench_prompts,
    common_parser,
    load_bench,
    make_rows,
    parse_method,
    target_dtype,
    to_json,
    transformers_generate,
)
from specui.bench.specdec import pareto_figure
from specui.bench.suite_figures import write_figures
from specui.engine import METHODS
from specui.engine.costs import EngineCosts
from specui.engine.profile import cpu_model
from specui.engine.sampling import SamplingConfig
from specui.errors import SpecUIError
from specui.weights.loading import DTYPES, QUANTIZATIONS, gguf_path

ALL = ["autoregressive", "auto", "speculative:2", "speculative:4", "specdec++", "tree:eagle-25", "opt-tree:25",
       "mcsd", "lookup", "dsbd:2", "beam:2"]
WORKLOADS = {"chat": HELDOUT, "code": PROMPTS_DIR / "code.jsonl", "summary": PROMPTS_DIR / "summary.jsonl"}
PEERS = ("transformers greedy", "transformers assisted", "transformers assisted constant",
         "transformers prompt lookup")
QUALITY_GRID = ("autoregressive;beam:width=2;dsbd:width=2,gamma=2;dsbd:width=2,gamma=3,memory_mode=1;"
                "speculative:gamma=3")


def parser() -> argparse.ArgumentParser:
    ap = common_parser(__doc__.splitlines()[0])
    ap.add_argument("--methods", default="all", help=f"'all' ({','.join(ALL)}) or a comma list of method specs")
    ap.add_argument("--workloads", default="chat,code,summary", help=f"comma list of: {', '.join(WORKLOADS)}")
    ap.add_argument("--no-peers", action="store_true", help="skip the peers' rows (transformers, llama.cpp)")
    ap.add_argument("--quantizations", default=None,
                    help=f"comma list of target quantizations, each a set of rows ({', '.join(QUANTIZATIONS)}), "
                         "each optionally @DTYPE (e.g. none@float32); default: --quantization")
    ap.add_argument("--quality", action="store_true",
                    help="also DSBD's throughput-vs-quality grid (temperature 1) on the chat prompts")
    ap.add_argument("--quality-configs", default=QUALITY_GRID, help="';'-separated grid for --quality")
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    return ap


def check_args(args: argparse.Namespace) -> tuple[list[str], dict[str, Path], list[str]]:
    """Method specs, workload files and quantizations, refused with a clear message before
    any model loads."""
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
    quants = [q.strip() for q in (args.quantizations or args.quantization).split(",") if q.strip()]
    for quant in quants:
        name, _, dtype = quant.partition("@")
        if name not in QUANTIZATIONS:
            raise SpecUIError(f"unknown quantization {name!r}; choose from: {', '.join(QUANTIZATIONS)}")
        if dtype and dtype not in DTYPES:
            raise SpecUIError(f"unknown dtype {dtype!r} in {quant!r}; choose from: {', '.join(DTYPES)}")
    if args.quality:
        for config in args.quality_configs.split(";"):
            name, params = quality.parse_config(config)
            if name not in METHODS:
                raise SpecUIError(f"unknown method {name!r} in --quality-configs")
    if args.repeats < 1 or args.max_new_tokens < 1 or args.limit < 1:
        raise SpecUIError("--repeats, --max-new-tokens and --limit must be >= 1")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("ok", encoding="utf-8")
        probe.unlink()
    except OSError as e:
        raise SpecUIError(f"cannot write to {args.out}: {e}") from None
    return specs, workloads, quants or ["none"]


def peer_rows(pair, gamma: int) -> list[Row]:
    """The four transformers rows on the same pair (greedy)."""
    t_dtype = target_dtype(pair)
    rows = [Row(PEERS[0], t_dtype, transformers_generate(pair))]
    if pair.draft is not None:
        rows.append(Row(PEERS[1], t_dtype, transformers_generate(pair, assistant_model=pair.draft.model)))
        rows.append(Row(f"{PEERS[2]} {gamma}", t_dtype,
                        transformers_generate(pair, constant_tokens=gamma, assistant_model=pair.draft.model)))
    rows.append(Row(PEERS[3], t_dtype, transformers_generate(pair, prompt_lookup_num_tokens=10)))
    return rows


def llama_cpp_runners(pair) -> tuple[list[tuple[str, object]], str | None]:
    """llama.cpp's greedy and prompt-lookup runners on the target's GGUF, or why there are none."""
    if pair.target.spec.stand_in:  # llama.cpp would run the source file at its own size, not at the stand-in's
        return [], f"llama.cpp: no stand-in there (it would time the {pair.target.spec.source} file itself)"
    gguf = gguf_path(pair.target.spec)
    why = unavailable(gguf, pair.target.device)
    if why:
        return [], why
    eos, threads = set(pair.engine().eos_ids), torch.get_num_threads()
    return [(LLAMA_CPP, llama_cpp_runner(gguf, eos, threads)),
            (f"{LLAMA_CPP} prompt lookup", llama_cpp_runner(gguf, eos, threads, lookup=True))], None


def runner_row(name: str, runner) -> Row:
    return Row(name, "gguf", lambda prompt, n: Sample(*runner(prompt, n)))


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def all_rows(pair, specs: list[str], args, runners: list[tuple[str, object]]) -> list[Row]:
    """Every row of a quantization: made once and reused for each workload (`fresh`), since each of
    ours holds its own engine: made again per workload, a 1.7b stand-in's rows held 24 GB of caches
    and compiled forwards when the second workload began, and the kernel ended the process."""
    usable = [s for s in specs if not (parse_method(s)[0] == "specdec++" and pair.head.head is None)]
    rows = make_rows(pair, usable, 2, False) + ([] if args.no_peers else peer_rows(pair, 4))
    return rows + [runner_row(name, runner) for name, runner in runners]


def fresh(rows: list[Row]) -> list[Row]:
    """The same rows (their runners and engines) with no rounds measured yet, each engine's running
    estimates (alpha, time ratios, probe waits, DSBD's depths) back to what a new engine knows: its
    cost profile, so no workload's figures depend on the workloads measured before it."""
    for row in rows:
        engine = getattr(row.run, "engine", None)
        if engine is not None:
            engine.costs = EngineCosts(profile=engine.costs.profile, note=engine.costs.note)
    return [dataclasses.replace(row, rounds=[]) for row in rows]


def run_workload(rows: list[Row], prompts: list[list[int]], args, bar: tqdm, device) -> tuple[list[Row], bool]:
    """Bench the rows on one workload; (rows, interrupted)."""
    try:
        bench(rows, prompts, args.max_new_tokens, args.repeats, say=bar.write, progress=lambda: bar.update(1),
              meter=ReplyMeter(device))
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


def run_quantization(args, specs: list[str], workloads: dict[str, Path], first: bool, base_dtype: str):
    """Every workload's rows on the target quantized as args.quantization; with `first` (the
    first target that loads), llama.cpp's rows and the --quality grid too.
    -> (result rows, skipped, interrupted, quality points)."""
    quant, skipped = args.quantization, []
    args.quantization, _, dtype = quant.partition("@")
    args.dtype = dtype or base_dtype
    args.prompts = str(next(iter(workloads.values())))
    try:
        pair, prompts = load_bench(args)
    except SpecUIError as e:
        return [], [f"quantization {quant}: {e}"], False, []
    if pair.head.head is None and "specdec++" in [parse_method(s)[0] for s in specs]:
        skipped.append(f"specdec++: {pair.head.problem}")
    runners, why = llama_cpp_runners(pair) if first and not args.no_peers else ([], None)
    skipped += [why] if why else []
    results, interrupted, chat = [], False, prompts  # chat: the first workload's prompts (--quality)
    made = all_rows(pair, specs, args, runners)
    for i, (workload, path) in enumerate(workloads.items()):
        if i:
            prompts = bench_prompts(pair.target.tokenizer, path, args.limit)
        total = len(made) * len(prompts) * args.repeats
        with tqdm(total=total, desc=f"bench {workload} ({quant})", unit="reply") as bar:
            rows, interrupted = run_workload(fresh(made), prompts, args, bar, pair.target.device)
        rows = complete_rounds(rows, len(prompts)) if interrupted else rows
        if rows and any(r.name == AR for r in rows):
            results += [dict(row, workload=workload, quantization=quant, settings=settings_of(row["method"]),
                             process_peak_rss_mb=round(peak_rss_mb())) for row in to_json(rows)]
        if interrupted:
            return results, skipped, True, []
    points = []
    if first and args.quality:
        points = quality.measure(pair, args.quality_configs.split(";"), chat, args.max_new_tokens, args.repeats,
                                 SamplingConfig(1.0))
    return results, skipped, False, points


def write_pareto_figures(results: list[dict], points: list, out: Path, subtitle: str) -> None:
    """SpecDec++'s D/N vs V/N plot from the first workload's rows, and DSBD's quality plot."""
    first = [r for r in results if (r["workload"], r["quantization"]) == (results[0]["workload"],
                                                                         results[0]["quantization"])] if results else []
    if sum(r["method"].startswith(("speculative", "specdec++")) for r in first) >= 2:
        save_figure(pareto_figure(first, f"SpecDec++ vs fixed gamma ({first[0]['workload']}): {subtitle}"),
                    out, "specdec-pareto")
    if points:
        save_figure(quality.figure(points, f"DSBD: throughput vs quality (temperature 1): {subtitle}"), out, "quality")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        specs, workloads, quants = check_args(args)
    except SpecUIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results, skipped, interrupted, points = [], [], False, []
    base_dtype = args.dtype
    for quant in quants:
        args.quantization = quant
        first = not results  # llama.cpp and the quality grid: with the first target that loads
        rows, skipped_here, interrupted, found = run_quantization(args, specs, workloads, first, base_dtype)
        results, skipped, points = results + rows, skipped + skipped_here, points or found
        for line in skipped_here:
            print(f"skipped: {line}", file=sys.stderr)
        if interrupted:
            break
    meta_device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    gpu = f" ({torch.cuda.get_device_name()})" if meta_device == "cuda" else ""
    meta = dict(cpu=cpu_model(), device=meta_device + gpu,
                date=time.strftime("%Y-%m-%d"), max_new_tokens=args.max_new_tokens, limit=args.limit,
                repeats=args.repeats, quantizations=quants, interrupted=interrupted, skipped=skipped,
                threads=torch.get_num_threads(),
                joules_per_token=ReplyMeter(torch.device(meta_device)).note,
                command="python -m specui.bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    quality_rows = [p.__dict__ for p in points]
    saved = dict(meta=meta, rows=results, quality=quality_rows)
    (args.out / "results.json").write_text(json.dumps(saved, indent=1), encoding="utf-8")
    subtitle = f"{cpu_model()}, {meta['date']}"
    write_figures(results, args.out, subtitle)
    write_pareto_figures(results, points, args.out, subtitle)
    print(f"wrote {args.out}/results.json and figures ({len(results)} rows){' [interrupted]' if interrupted else ''}")
    return 130 if interrupted else 0
