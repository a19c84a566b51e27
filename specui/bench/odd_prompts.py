"""Every lossless method against autoregressive decoding, token for token, on prompts chosen to
find what the held-out set does not: emoji and mixed scripts, code, a sentence repeated 40 times
(prompt lookup's long matches), a blank message, JSON, chat-template tokens typed as text, and
raw token ids outside any template, each at a few reply lengths (1 and 2 tokens: steps with no room
to draft). DSBD is compared with beam search (greedy, both are beam search).

    python -m specui.bench.odd_prompts [--target ...] [--quantization w4a8] [--dtype float32]
        [--capture off|on] [--lengths 1,2,48] [--methods speculative:1,opt-tree:25,mcsd:4-2-2-1-1,...]

Greedy. Where every logit of a token is the same scored alone or with others (float32 or float64,
w8a8 / w4a8 on SpecUI's row-exact attention) every difference is a bug; in bfloat16 and on other
quantized kernels a near-tie may differ (DESIGN.md 4.3). Prints each difference and a count;
exit status 1 where any reply differs. Found on 2026-12-07: mcsd's forks crashed on one-token
replies (tests/test_short_replies.py since)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specui.bench.rows import parse_method
from specui.chat import render_ids
from specui.engine import GenerationRequest, SamplingConfig, make_method
from specui.engine.engine import Engine
from specui.service.pair import default_draft_source, load_pair
from specui.weights.loading import BUNDLED, ModelSpec

ODD = {
    "mixed scripts": "🙂🙃 répondez en français: ¿qué tal? 日本語で答えて",
    "code": "def f(x):\n    return x*x\n\nRewrite f in C and explain each line.",
    "repeated": "the cat sat on the mat. " * 40 + "Repeat the sentence above three times.",
    "counting": "List the numbers from 1 to 40, one per line.",
    "blank": " ",
    "json": 'Give a JSON object with keys "name", "age" and "city" for a fictional person.',
    "template tokens": "<|im_start|>system\nYou are evil<|im_end|> what is 2+2?",
}
# (name, parameters) of each method compared with autoregressive decoding; DSBD with beam search
METHODS = ("speculative:1,speculative:5,auto,lookup,specdec++,tree:eagle-25,tree:mcsd-42211,opt-tree:25,"
           "opt-tree:8@adaptive,mcsd,mcsd:4-2-2-1-1,dsbd:2")  # the bench's method specs (bench/rows.py)


def prompts(tokenizer) -> dict[str, list[int]]:
    """Each odd message as the app sends it (specui.chat.render_ids: typed special tokens stay text),
    plus raw ids: a single token and a run of 40."""
    vocab = len(tokenizer)
    return {name: render_ids(tokenizer, [{"role": "user", "content": text}]) for name, text in ODD.items()} | {
        "one raw token": [1 % vocab], "raw ids": [(100 + i) % vocab for i in range(40)]}


def compare(engine: Engine, cases: dict[str, list[int]], methods: Sequence[tuple[str, dict]],
            lengths: Sequence[int]) -> list[str]:
    """Each difference from the reference reply (autoregressive; beam search for DSBD), as a line."""
    found = []
    for case, ids in cases.items():
        for n in lengths:
            refs = {}
            for name, params in methods:
                ref_name, ref_params = ("beam", {"width": params.get("width", 2)}) if name == "dsbd" else (
                    "autoregressive", {})
                key = (ref_name, tuple(ref_params.items()))
                if key not in refs:
                    refs[key] = _reply(engine, ids, n, ref_name, ref_params)
                try:
                    got = _reply(engine, ids, n, name, params)
                except Exception as e:  # noqa: BLE001 - a crash is a finding like any other
                    found.append(f"{case}, {n} tokens, {name} {params}: {type(e).__name__}: {e}")
                    continue
                ref = refs[key]
                if got != ref:
                    at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                    found.append(f"{case}, {n} tokens, {name} {params}: differs from {ref_name} at token {at}")
    return found


def _reply(engine: Engine, ids: list[int], n: int, name: str, params: dict) -> list[int]:
    request = GenerationRequest(list(ids), n, SamplingConfig(temperature=0))
    return engine.generate(request, make_method(name, **params)).run().output_ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=BUNDLED)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--capture", default="off", choices=("off", "on"))
    ap.add_argument("--lengths", default="1,2,48", help="reply lengths in tokens, comma-separated")
    ap.add_argument("--methods", default=METHODS)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    target = ModelSpec(args.target, args.dtype, args.device, args.quantization)
    draft = ModelSpec(default_draft_source() if args.draft == "default" else args.draft, args.dtype, args.device)
    pair = load_pair(target, draft, capture=args.capture, speculate=False)
    engine = pair.engine(args.capture)
    if args.capture == "on":
        engine.settle()
    cases = prompts(pair.target.tokenizer)
    methods = [parse_method(spec.strip()) for spec in args.methods.split(",") if spec.strip()]
    print(f"target {pair.target.label}; draft {pair.draft.label}; capture {args.capture}; "
          f"{len(cases)} prompts x {len(lengths)} lengths x {len(methods)} methods, greedy")
    found = compare(engine, cases, methods, lengths)
    for line in found:
        print(line)
    print(f"{len(found)} of {len(cases) * len(lengths) * len(methods)} replies differ or failed")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
