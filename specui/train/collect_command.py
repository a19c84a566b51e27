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
from specui.draft_model import vocab_fingerprint
from specui.engine import Engine
from specui.errors import SpecUIError
from specui.loading import BUNDLED, LoadedModel, load_model
from specui.train.answers import AnswerStore, batched_tokens_per_s
from specui.train.data import Collector

BUNDLED_DATA = PROMPTS_DIR.parent / "distill" / "smollm2-135m"
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


def collection_engine(args, target: LoadedModel, eos: list[int]) -> Engine | None:
    """The engine answers are generated on: each candidate precision prefills and decodes a
    few batched steps of the first training prompts with --batch-size rows, and the fastest
    (answer tokens/s, prefills included) wins (None: the float32 target itself)."""
    names = candidates(args, target)
    if names == ["float32"] and target.model.dtype == torch.float32:
        return None
    items = load_prompts(args.train_prompts[0].path, 8)
    prompts = [build_prompt(target.tokenizer, it.messages, 1024)[0] for it in items]
    best, best_rate, lines = None, 0.0, []
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
        rate = batched_tokens_per_s(engine, prompts, args.batch_size, args.max_new_tokens * 2 // 3) \
            if len(names) > 1 else 1.0
        lines.append(f"{name}: {rate:.0f} tok/s" if len(names) > 1 else f"{name}: as asked")
        if rate > best_rate:
            best, best_rate = (name, engine), rate
    if best is None:
        raise SpecUIError("no precision could generate the answers: " + "; ".join(lines))
    print(f"answers generated in {best[0]} ({args.batch_size} rows): " + ", ".join(lines), file=sys.stderr)
    return None if best[0] == "float32" and best[1].target.model is target.model else best[1]


def make_collector(args, target: LoadedModel, store: Path | None = None) -> Collector:
    """A collector on the answer store (`store` overrides --data)."""
    tok, model = target.tokenizer, target.model
    eos = stop_token_ids(tok, model.generation_config)
    data = store or args.data or (BUNDLED_DATA if args.target == BUNDLED else args.work / "answers")
    store = AnswerStore(data, vocab_fingerprint(tok), target.label)
    return Collector(model, tok, eos, store, args.work, lambda: collection_engine(args, target, eos),
                     args.max_new_tokens, args.batch_size, temperatures=temperatures(args.temperatures))
