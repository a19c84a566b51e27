"""Where the target's answers come from: the answer store (committed token ids for the bundled
target, under assets/distill/), and the precision they are generated in, measured.

    python -m specui.train collect --train-prompts assets/prompts/train.jsonl@3 --temperatures 0.7,0.9,1.0
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from specui.bench.prompts import PROMPTS_DIR, load_prompts
from specui.chat import build_prompt, stop_token_ids
from specui.engine import Engine
from specui.errors import SpecUIError
from specui.train.answers import AnswerStore, batched_tokens_per_s
from specui.train.data import Collector
from specui.weights.draft import vocab_fingerprint
from specui.weights.loading import BUNDLED, LoadedModel, load_model

BUNDLED_DATA = PROMPTS_DIR.parent / "distill" / "smollm2-135m"
MOST_ROWS, ROWS_GAIN = 128, 0.1  # --collect-rows auto: largest batch tried, gain a doubling must bring
PRECISIONS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "float16": ("float16", "none"),
              "int8": ("auto", "int8"), "int4": ("auto", "int4")}


def add_arguments(common: argparse.ArgumentParser) -> None:
    common.add_argument("--data", type=Path, default=None,
                        help=f"answer store (token ids); default {BUNDLED_DATA} for the bundled target, "
                             "else WORK/answers")
    common.add_argument("--temperatures", default="0.8",
                        help="sampled answer s of a prompt is drawn at temperature number s (mod their count)")
    common.add_argument("--collect-with", default="auto", choices=["auto", *PRECISIONS],
                        help="precision the answers are generated in; auto: the fastest batched decoding measured")
    common.add_argument("--collect-rows", default="auto", type=rows_arg,
                        help="answers generated together when collecting; auto: from --batch-size, doubled (up to "
                             f"{MOST_ROWS}) while the measured answer tokens/s grow by {ROWS_GAIN * 100:.0f}%% or more")


def rows_arg(text: str) -> int:
    """--collect-rows: a positive count, or auto (0)."""
    if text == "auto":
        return 0
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': give a positive number of rows, or auto")
    return int(text)


def temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        values = ()
    if not values or any(t <= 0 for t in values):
        raise SpecUIError(f"--temperatures '{text}': give positive numbers, e.g. 0.7,0.9,1.0")
    return values


def candidates(args, target: LoadedModel) -> list[str]:
    if args.collect_with != "auto":
        return [args.collect_with]
    if target.device.type == "cuda":
        return ["bfloat16", "float32"]
    return ["float32", "bfloat16", "int4"]


def collection_engine(args, target: LoadedModel, eos: list[int]) -> tuple[Engine | None, int]:
    """The engine answers are generated on and its rows: each candidate precision prefills and
    decodes a few batched steps of the first training prompts with --batch-size rows, and the
    fastest (answer tokens/s, prefills included) wins (None: the float32 target itself); with
    --collect-rows auto the rows then double while that gains (a CPU's matrix kernels may
    only reach full speed on larger batches)."""
    names = candidates(args, target)
    rows = args.collect_rows or args.batch_size
    if names == ["float32"] and target.model.dtype == torch.float32 and args.collect_rows:
        return None, rows
    items = load_prompts(args.train_prompts[0].path, 8)
    prompts = [build_prompt(target.tokenizer, it.messages, 1024)[0] for it in items]
    best, best_rate, lines = None, 0.0, []
    answer_len = args.max_new_tokens * 2 // 3
    for name in names:
        dtype, quantization = PRECISIONS[name]
        if name == "float32" and target.model.dtype == torch.float32:
            engine = Engine(target.model, target.tokenizer, None, eos)
        else:
            try:
                loaded = load_model(replace(target.spec, dtype=dtype, quantization=quantization), role="collection")
            except SpecUIError as e:
                lines.append(f"{name}: not loadable ({e})")
                continue
            engine = Engine(loaded.model, loaded.tokenizer, None, eos)
        measured = len(names) > 1 or not args.collect_rows
        rate = batched_tokens_per_s(engine, prompts, rows, answer_len) if measured else 1.0
        lines.append(f"{name}: {rate:.0f} tok/s" if measured else f"{name}: as asked")
        if rate > best_rate:
            best, best_rate = (name, engine), rate
    if best is None:
        raise SpecUIError("no precision could generate the answers: " + "; ".join(lines))
    print(f"answers generated in {best[0]} ({rows} rows): " + ", ".join(lines), file=sys.stderr)
    if not args.collect_rows:
        rows = more_rows(best[1], prompts, rows, best_rate, answer_len)
    return (None if best[0] == "float32" and best[1].target.model is target.model else best[1]), rows


def more_rows(engine: Engine, prompts: list[list[int]], rows: int, rate: float, answer_len: int) -> int:
    """Double the rows while answer tokens/s grow by ROWS_GAIN or more, up to MOST_ROWS."""
    lines = [f"{rows} rows {rate:.0f}"]
    while rows * 2 <= MOST_ROWS:
        try:
            doubled = batched_tokens_per_s(engine, prompts, rows * 2, answer_len)
        except (RuntimeError, MemoryError) as e:  # out of memory (torch's is a RuntimeError): stay below
            lines.append(f"{rows * 2} rows did not fit ({type(e).__name__})")
            break
        lines.append(f"{rows * 2} rows {doubled:.0f}")
        if doubled < (1 + ROWS_GAIN) * rate:
            break
        rows, rate = rows * 2, doubled
    print(f"collecting with {rows} rows (answer tokens/s: {', '.join(lines)}; --collect-rows to fix it)",
          file=sys.stderr)
    return rows


def make_collector(args, target: LoadedModel, store: Path | None = None) -> Collector:
    """A collector on the answer store (`store` overrides --data)."""
    tok, model = target.tokenizer, target.model
    eos = stop_token_ids(tok, model.generation_config)
    data = store or args.data or (BUNDLED_DATA if args.target == BUNDLED else args.work / "answers")
    store = AnswerStore(data, vocab_fingerprint(tok), target.label)
    collector = Collector(model, tok, eos, store, args.work, None, args.max_new_tokens, args.batch_size,
                          temperatures=temperatures(args.temperatures))

    def make_engine() -> Engine | None:
        engine, collector.collect_rows = collection_engine(args, target, eos)
        return engine

    collector.make_engine = make_engine
    return collector
