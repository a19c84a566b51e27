"""A greedy step's reading of the logits, with SpecUI's kernel and without, side by side in one run.

    python -m specui.bench.rowstats --methods autoregressive,speculative:2 --quantization w4a8

Each round decodes every prompt once with the native argmax / log-sum-exp (engine/sampling.py's
`row_stats`, specui/weights/kernels/logits.cpp) and once with numpy's argmax and torch's softmax
(SPECUI_ROW_STATS=0), alternating, on one engine (forwards as `--capture` says: compiled where
this machine measured it faster). Prints decode tokens/s (after the prefill, the same work in
both rows) and the share of the decode spent outside the models' forwards, with the CPU named.
Both rows must give the same replies (greedy)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specui.bench.prompts import HELDOUT
from specui.bench.run import bench_prompts
from specui.engine.loop import GenerationRequest
from specui.engine.methods import make_method
from specui.engine.profile import cpu_model
from specui.engine.sampling import ROW_STATS_ENV, SamplingConfig
from specui.service.pair import default_draft_source, load_pair
from specui.weights.loading import BUNDLED, ModelSpec

ROWS = {"kernel": "1", "numpy": "0"}


def parse_method(text: str) -> tuple[str, dict]:
    name, _, gamma = text.partition(":")
    return name, ({"gamma": int(gamma)} if gamma else {})


def reply(engine, prompt: list[int], n: int, method: str):
    """One greedy reply from fresh caches, once the background compiles are done."""
    name, params = parse_method(method)
    engine.settle()
    engine.target.reset()
    engine.draft.reset()
    with engine.lock:
        return engine.generate(GenerationRequest(prompt, n, SamplingConfig()), make_method(name, **params)).run()


def compare(engine, prompts: list[list[int]], n: int, method: str, rounds: int) -> tuple[list[dict], bool]:
    """The method's two rows (kernel, numpy), rounds alternating; and whether their replies agree."""
    for prompt in prompts:  # warm-up: compiles, caches
        reply(engine, prompt, n, method)
    totals = {kind: {"decode_s": 0.0, "forward_s": 0.0, "tokens": 0, "replies": []} for kind in ROWS}
    for _ in range(rounds):
        for kind, value in ROWS.items():
            os.environ[ROW_STATS_ENV] = value
            for prompt in prompts:
                gen = reply(engine, prompt, n, method)
                t = totals[kind]
                t["decode_s"] += gen.stats.decode_s
                t["forward_s"] += gen.stats.forward_s or 0.0
                t["tokens"] += len(gen.output_ids)
                t["replies"].append(gen.output_ids)
    rows = []
    for kind, t in totals.items():
        outside_s = t["decode_s"] - t["forward_s"]
        rows.append({"method": method, "rows": kind, "decode_tokens_per_s": round(t["tokens"] / t["decode_s"], 2),
                     "vs_numpy_rows": None, "outside_forwards_share": round(outside_s / t["decode_s"], 4),
                     "outside_ms_per_token": round(1000 * outside_s / t["tokens"], 3)})
    rows[0]["vs_numpy_rows"] = round(rows[0]["decode_tokens_per_s"] / rows[1]["decode_tokens_per_s"], 3)
    return rows, totals["kernel"]["replies"] == totals["numpy"]["replies"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=BUNDLED)
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--capture", default="auto")
    ap.add_argument("--methods", default="autoregressive,speculative:2")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)
    pair = load_pair(ModelSpec(args.target, "auto", "cpu", args.quantization),
                     ModelSpec(default_draft_source(), "auto", "cpu"), capture=args.capture)
    prompts = bench_prompts(pair.target.tokenizer, HELDOUT, args.limit)
    engine = pair.engine()
    print(f"cpu: {cpu_model()}; target {pair.target.label}; draft {pair.draft.label}; capture {args.capture}")
    saved = os.environ.get(ROW_STATS_ENV)
    rows, differ = [], False
    try:
        for method in args.methods.split(","):
            pair_rows, same = compare(engine, prompts, args.max_new_tokens, method, args.rounds)
            rows += pair_rows
            differ |= not same
            for row in pair_rows:
                print(f"{method:>22} {row['rows']:>6}: {row['decode_tokens_per_s']:7.1f} tok/s decode, outside "
                      f"the forwards {100 * row['outside_forwards_share']:.2f}% ({row['outside_ms_per_token']:.3f} "
                      "ms a token)")
            print(f"{method:>22} kernel / numpy: {pair_rows[0]['vs_numpy_rows']:.3f}x; replies "
                  f"{'the same' if same else 'DIFFER'}")
    finally:
        if saved is None:
            os.environ.pop(ROW_STATS_ENV, None)
        else:
            os.environ[ROW_STATS_ENV] = saved
        engine.close()
    if args.json:
        print(json.dumps(rows, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
