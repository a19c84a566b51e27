"""Side-by-side throughput on held-out prompts: our methods, transformers greedy
`generate`, and transformers assisted generation (`assistant_model=`) on the same pair.

    python -m specui.bench.run --limit 10 --max-new-tokens 128 --repeats 3 \
        --methods autoregressive,auto,speculative:3,tree:eagle-25,opt-tree:25

A method spec is name[:value]: speculative:GAMMA, beam:WIDTH, dsbd:WIDTH, tree:PRESET, opt-tree:NODES,
specdec++:THRESHOLD;
speculative:GAMMA@C also ends each chain after a draft token with probability below C.

Built for a noisy machine: the CPU model and the pair's cost profile are printed first,
every row gets a warm-up, and then the rows are interleaved prompt by prompt (their order
rotating) for `--repeats` rounds, so a slow spell of the machine hits every row alike. A
row's tokens/s is the median over rounds (min-max beside it), and its speed-up is the
median of its per-round ratios to autoregressive in the same round. Each row says its
dtype, how its steps split into draft / verify / other time, and how many greedy replies
differ from autoregressive (in bfloat16/float16 a few may, at near-ties: DESIGN.md 4.3).

Its rows and their runners are in rows.py; this module runs them (bench), loads the pair and
the prompts, prints the tables and holds the command line shared by the other benches.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from specui.bench.energy import ReplyMeter
from specui.bench.prompts import HELDOUT, load_prompts
from specui.bench.rows import (
    AR,
    PARAM_OF,
    Row,
    Sample,
    assistant_schedule,
    make_rows,
    ours,
    parse_method,
    target_dtype,
    transformers_generate,
)
from specui.chat import build_prompt
from specui.engine import calibration, capture_choice
from specui.engine.capture import CAPTURES
from specui.engine.engine import unmeasured_capture
from specui.engine.profile import cpu_model
from specui.service import captured_quantization
from specui.service.pair import ModelPair, default_draft_source, load_pair, pair_with_draft
from specui.settings import ChatSettings
from specui.weights.loading import BUNDLED, ModelSpec

__all__ = [
    "AR", "PARAM_OF", "Row", "Sample", "assistant_schedule", "bench", "bench_prompts", "common_parser", "correlation",
    "load_bench", "main", "make_rows", "ours", "other_draft_rows", "out_folder", "parse_method", "table",
    "target_dtype", "to_json", "transformers_generate", "compare_quantizations_here",
]


def correlation(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


def bench(rows: list[Row], prompts: list[list[int]], n: int, repeats: int,
          say: Callable[[str], None] = print, progress: Callable[[], None] | None = None,
          meter: ReplyMeter | None = None) -> None:
    """Warm every row up, then run `repeats` rounds, interleaving rows prompt by prompt
    (`progress` is called after every reply; `meter` reads each reply's energy and peak
    memory on CUDA). Before each reply every row's engine settles, not only its own: an engine
    compiling in the background (capture auto) while another row is timed takes that row's cores
    (2-core Xeon, DSBD W = 4 beside an `auto` engine's compile: 0.6-0.7 tok/s against 3 when
    settled)."""
    warm_up(rows, prompts)
    for r in range(repeats):
        for row in rows:
            row.rounds.append([])
        for i, prompt in enumerate(prompts):
            shift = (r + i) % len(rows)  # rotate the order: no row always runs first
            for row in rows[shift:] + rows[:shift]:
                settle_all(rows)
                if meter is not None:
                    meter.start()
                sample = row.run(prompt, n)
                if meter is not None:
                    reading = meter.stop()
                    sample.joules, sample.peak_mb = reading.joules, reading.peak_mb
                row.rounds[r].append(sample)
                if progress is not None:
                    progress()
        say(f"round {r + 1}/{repeats}: " + ", ".join(f"{row.name} {row.round_rate(r):.1f}" for row in rows))


def warm_up(rows: list[Row], prompts: list[list[int]]) -> None:
    """Untimed replies before any timed one: 8 tokens to the first prompt and 2 to each other
    one, so every prompt's prefill has run once: a prompt of up to 64 tokens is a compiled
    forward of that many (`--capture on`), and the first of more than one token compiles the
    graph every count from 2 shares (2-core Xeon, w8a8 1.7b stand-in, one warm-up reply to the
    first prompt only: the first timed round ran at 3.8 tok/s against 7.1 in the second, that
    compile inside it)."""
    for row in rows:
        for i, prompt in enumerate(prompts):
            settle_all(rows)
            row.run(prompt, 2 if i else 8)


def settle_all(rows: list[Row]) -> None:
    """Wait for every row's background compiles (our rows' engines; peers have none)."""
    for row in rows:
        engine = getattr(row.run, "engine", None)
        if engine is not None:
            engine.settle()


def table(rows: list[Row], n_prompts: int) -> str:
    base = next((r for r in rows if r.name == AR), rows[0])
    lines = [f"{'method':34} {'dtype':16} {'tokens':>6} {'tok/s median (min-max)':>24} {'vs AR (min-max)':>18} "
             f"{'tok/fwd':>7} {'D/N':>5} {'V/N':>5} {'draft/verify/other ms per step':>31} {'outside fwd':>11} "
             f"{'differs from AR':>15}"]
    for row in rows:
        rates = row.rates
        ratios = [a / b for a, b in zip(rates, base.rates)]
        rate = f"{statistics.median(rates):7.2f} ({min(rates):.2f}-{max(rates):.2f})"
        ratio = f"{statistics.median(ratios):5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        per_fwd = f"{row.per_forward:7.2f}" if row.per_forward else f"{'-':>7}"
        split = row.split_ms()
        split_s = f"{split[0]:6.1f} / {split[1]:6.1f} / {split[2]:5.1f}" if split else "-"
        differs = "-" if row is base else f"{row.divergent(base)}/{n_prompts}"
        dv = row.rates_dv()
        dv_s = f"{dv[0]:5.2f} {dv[1]:5.2f}" if dv else f"{'-':>5} {'-':>5}"
        outside = "-" if row.outside_share is None else f"{100 * row.outside_share:.1f}%"
        lines.append(f"{row.name:34} {row.dtype:16} {row.tokens:6d} {rate:>24} {ratio:>18} {per_fwd} {dv_s} "
                     f"{split_s:>31} {outside:>11} {differs:>15}")
    for row in rows:
        if retimed := row.retimed_replies:
            lines.append(f"{row.name}: {retimed} of {len(row.all_samples)} timed replies met a forward still to "
                         f"compile (run eagerly) and were timed again once it had compiled")
        xs = [x for s in row.all_samples for x in s.expected]
        if xs:
            ys = [y for s in row.all_samples for y in s.achieved]
            lines.append(f"{row.name}: mean E(A) {sum(xs) / len(xs):.2f}, mean A {sum(ys) / len(ys):.2f}, "
                         f"corr(E(A), A) = {correlation(xs, ys):.3f}")
    return "\n".join(lines)


def to_json(rows: list[Row]) -> list[dict]:
    base = next((r for r in rows if r.name == AR), rows[0])
    out = []
    for row in rows:
        rates, ratios = row.rates, [a / b for a, b in zip(row.rates, base.rates)]
        split = row.split_ms()
        dv = row.rates_dv()
        out.append(dict(method=row.name, capture=row.ran_as(), stand_in=row.stand_in,
                        discard_rate=dv[0] if dv else None, verification_rate=dv[1] if dv else None,
                        dtype=row.dtype, tokens=row.tokens,
                        tokens_per_s=statistics.median(rates), tokens_per_s_min=min(rates),
                        tokens_per_s_max=max(rates), speedup=statistics.median(ratios),
                        speedup_min=min(ratios), speedup_max=max(ratios),
                        tokens_per_target_forward=row.per_forward, acceptance_rate=row.acceptance_rate,
                        draft_ms_per_step=split[0] if split else None, verify_ms_per_step=split[1] if split else None,
                        other_ms_per_step=split[2] if split else None, outside_forwards_share=row.outside_share,
                        differs_from_autoregressive=None if row is base else row.divergent(base),
                        joules_per_token=row.joules_per_token, peak_memory_mb=row.peak_mb,
                        retimed_replies=row.retimed_replies,
                        rounds=[[asdict(s) | {"output": None} for s in samples] for samples in row.rounds]))
    return out


def common_parser(description: str) -> argparse.ArgumentParser:
    """The flags every bench shares: the pair, the prompts, lengths and rounds."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--target", default=BUNDLED)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="auto", help="auto (measured on CPU), float32, bfloat16, float16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quantization", default="auto",
                    help="target: auto (the app's default), none, int8 / int4 / w8a8 / w4a8 (CPU kernels), 8bit, 4bit")
    ap.add_argument("--stand-in", default="", metavar="SIZE",
                    help="the target zero-padded to 360m / 1.7b / 7b: its own function at that size's cost")
    ap.add_argument("--capture", default="auto", type=captures,
                    help="our rows' forwards: auto (CUDA graphs on a GPU; on a CPU what this machine measured "
                         "faster: `python -m specui.bench.capture`, or in the background before the first timed "
                         "reply), on (compiled), off; several (off,on): every row once per value, side by side")
    ap.add_argument("--prompts", default=str(HELDOUT))
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="rounds over every prompt (median, min-max)")
    return ap


def captures(value: str) -> str:
    """--capture: one of CAPTURES, or several separated by commas."""
    bad = [v for v in value.split(",") if v not in CAPTURES]
    if bad or not value:
        raise argparse.ArgumentTypeError(f"capture must be {', '.join(CAPTURES)} (or several, comma-separated)")
    return value


def json_file(ap: argparse.ArgumentParser, path: Path) -> Path:
    """`--json`'s file: its folder made, it (or, where it is new, its folder) writable; else the parser's error."""
    out_folder(ap, path.parent)
    if path.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
        ap.error(f"cannot write to {path}")
    return path


def out_folder(ap: argparse.ArgumentParser, out: Path) -> Path:
    """The bench's output folder, made (or the parser's error when it cannot be)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"cannot write to {out}: {e}")
    return out


def bench_prompts(tokenizer, path, limit: int | None) -> list[list[int]]:
    """The first `limit` prompts of a prompt set as token ids, in the target's chat template."""
    return [build_prompt(tokenizer, p.messages, 4096)[0] for p in load_prompts(path, limit)]


def load_bench(args: argparse.Namespace) -> tuple[ModelPair, list[list[int]]]:
    """Load the pair and the prompts, print the machine, the pair and its cost profile."""
    target = ModelSpec(args.target, args.dtype, args.device, args.quantization, stand_in=args.stand_in)
    draft_src = default_draft_source() if args.draft == "default" else args.draft
    draft = None if args.draft == "none" else ModelSpec(draft_src, args.dtype, args.device)
    capture = args.capture.split(",")[0]
    pair = load_pair(target, draft, capture=capture)
    tok = pair.target.tokenizer
    prompts = bench_prompts(tok, args.prompts, args.limit)
    device = str(pair.target.device)
    if pair.target.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name()})"
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; device {device}")
    print(f"target {pair.target.label}; draft {pair.draft.label if pair.draft else 'none'}")
    if pair.target.spec.stand_in:
        print(f"STAND-IN TARGET ({pair.target.spec.stand_in}): every figure below is at that size's cost, with the "
              "source model's replies and acceptance")
    for note in pair.notes:
        print(note)
    if pair.draft is not None and pair.head.head is None:
        print(f"specdec++: {pair.head.problem}")
    if compare_quantizations_here(pair):
        del pair  # at most one target in memory
        gc.collect()
        pair = load_pair(target, draft, capture=capture)
        print("\n".join(pair.target.notes))
    measure_capture_here(pair)
    costs = pair.engine().ensure_profile()  # cached on disk: every engine below reads it
    print(costs.note)
    if costs.profile is not None:
        print(costs.profile.table())
    print(f"\n{len(prompts)} prompts from {args.prompts}, max {args.max_new_tokens} new tokens, greedy, "
          f"{args.repeats} rounds (rows interleaved prompt by prompt)")
    return pair, prompts


def compare_quantizations_here(pair: ModelPair) -> bool:
    """With `--quantization auto` among several options and `--capture auto`, and no record of
    the options as captured forwards run them: each compiled and timed here, side by side, the
    winner recorded (specui.service.captured_quantization). True where that winner is not the
    loaded option: the caller loads the pair again (dropping this one first), and gets it."""
    if not calibration.enabled() or not captured_quantization.pending(pair.target, pair.capture):
        return False
    print("target: quantization auto has no record of its options as captured forwards run; compiling and "
          "timing each here (a minute or more each)", flush=True)
    chosen = captured_quantization.measure(pair.target, lambda line: print(line, flush=True))
    return chosen is not None and chosen != pair.target.spec.quantization


def measure_capture_here(pair: ModelPair) -> None:
    """`--capture auto` (the pair's) and no record on this machine for a model: measured here, on the thread
    the rows decode on, before any row's engine would measure it in the background. A measuring
    thread's forwards run beside this thread's OpenMP team, and with more libgomp threads than
    cores libgomp all but stops spinning its workers between parallel regions: on a 2-core Zen 4
    EPYC the int4 target's eager token took 35-40 ms on a fresh thread against 17-20 on the one
    that had decoded (compiled 26-28 against 10.8), so a record made in the background says less
    about the rows than one made here (`python -m specui.bench.capture` does the same)."""
    if not calibration.enabled():
        return
    for role, loaded in (("target", pair.target), ("draft", pair.draft)):
        model = None if loaded is None else loaded.model
        if model is None or not unmeasured_capture(pair.capture, model):
            continue
        print(f"{role}: no capture record on this machine; measuring eager against compiled forwards here "
              "(a minute or more)", flush=True)
        entry = capture_choice.measure(model)
        print(f"{role}: eager {entry['ms']['off']:.2f} ms a token, compiled {entry['ms']['on']:.2f} "
              f"({entry['compile_s']:.0f} s to compile): `--capture auto` runs {entry['choice']}", flush=True)


def other_draft_rows(args: argparse.Namespace, pair: ModelPair) -> list[Row]:
    """Rows of the drafting methods with another draft for the same target (an old and a new
    draft side by side in one run)."""
    other = pair_with_draft(pair.target, ModelSpec(args.other_draft, args.dtype, args.device))  # same target
    print(f"other draft: {other.draft.label}")
    drafting = [m for m in args.methods.split(",") if parse_method(m)[0] != AR]
    rows = make_rows(other, drafting, args.gamma, False)
    for row in rows:
        row.name += " [other draft]"
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    ap.add_argument("--methods", default="autoregressive,auto,speculative")
    ap.add_argument("--gamma", type=int, default=ChatSettings().gamma, help="gamma of a bare 'speculative'")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers' generate")
    ap.add_argument("--json", help="also write the rows (per-round samples included) to this JSON file")
    ap.add_argument("--other-draft", help="also run the methods that draft with this draft (same target), "
                                          "interleaved with the rest; rows marked [other draft]")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--repeats and --max-new-tokens must be >= 1")
    if args.json:  # its folder made and the file writable before minutes of measuring, not after
        json_file(ap, Path(args.json))

    pair, prompts = load_bench(args)
    rows = []
    for i, capture in enumerate(args.capture.split(",")):  # the first value's rows are the base
        pair.capture = capture
        more = make_rows(pair, args.methods.split(","), args.gamma, not args.no_peers and i == 0)
        if "," in args.capture:
            for row in more:
                row.name += "" if row.name.startswith("transformers") or i == 0 else f" [capture {capture}]"
        rows += more
    if args.other_draft:
        rows += other_draft_rows(args, pair)
    bench(rows, prompts, args.max_new_tokens, args.repeats)
    print("\n" + table(rows, len(prompts)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(to_json(rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
