"""Every lossless method against autoregressive decoding, token for token, on prompts chosen to
find what the held-out set does not: emoji and mixed scripts, code, a sentence repeated 40 times
(prompt lookup's long matches), a blank message, JSON, chat-template tokens typed as text, and
raw token ids outside any template, each at a few reply lengths (1 and 2 tokens: steps with no room
to draft). DSBD is compared with beam search (greedy, both are beam search).

    python -m specui.bench.odd_prompts [--target ...] [--quantization w4a8] [--dtype float32]
        [--capture off|on] [--lengths 1,2,48] [--methods speculative:1,opt-tree:25,...]

Greedy. Where every logit of a token is the same scored alone or with others (float32 or float64,
w8a8 / w4a8 on SpecUI's row-exact attention) every difference is a bug; in bfloat16 and on other
quantized kernels a near-tie may differ (DESIGN.md 4.3). Prints each difference and a count;
exit status 1 where any reply differs. Found on 2026-12-07: mcsd's forks crashed on one-token
replies (tests/test_short_replies.py since)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
           "opt-tree:8@adaptive,mcsd,mcsd:4,2,2,1,1,dsbd:2")


def parse_methods(text: str) -> list[tuple[str, dict]]:
    """'speculative:3,tree:eagle-25,opt-tree:8@adaptive,mcsd:4,2,1,dsbd:2' -> [(name, params)]: a bare
    number after mcsd's colon continues its k-config."""
    out: list[tuple[str, dict]] = []
    for item in text.split(","):
        name, _, arg = item.strip().partition(":")
        if not name:
            continue
        if name.isdigit() and out and out[-1][0] == "mcsd":  # 4,2,2,1,1: one k-config
            out[-1][1]["k_config"] += f",{name}"
            continue
        arg, _, flag = arg.partition("@")
        out.append((name, _params(name, arg, flag)))
    return out


def _params(name: str, arg: str, flag: str) -> dict:
    if name == "speculative":
        return {"gamma": int(arg or 3)}
    if name == "tree":
        return {"preset": arg or "eagle-25"}
    if name == "opt-tree":
        return {"nodes": int(arg or 25), "adaptive_nodes": flag == "adaptive"}
    if name == "mcsd":
        return {"k_config": arg}
    return {"width": int(arg or 2)} if name == "dsbd" else {}


def prompts(tokenizer) -> dict[str, list[int]]:
    """Each odd message in the chat template, plus raw ids: a single token and a run of 40."""
    def chat(text: str) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):  # a base model's tokenizer: the text alone
            return list(tokenizer(text)["input_ids"]) or [1 % len(tokenizer)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    vocab = len(tokenizer)
    return {name: chat(text) for name, text in ODD.items()} | {
        "one raw token": [1 % vocab], "raw ids": [(100 + i) % vocab for i in range(40)]}


def compare(engine: Engine, cases: dict[str, list[int]], methods: Sequence[tuple[str, dict]],
            lengths: Sequence[int]) -> list[str]:
    """Each difference from the reference reply (autoregressive; beam search for DSBD), as a line."""
    found = []
    for case, ids in cases.items():
        for n in lengths:
            refs = {}
            for name, params in methods:
                ref_name, ref_params = ("beam", {"width": params["width"]}) if name == "dsbd" else (
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
    cases, methods = prompts(pair.target.tokenizer), parse_methods(args.methods)
    print(f"target {pair.target.label}; draft {pair.draft.label}; capture {args.capture}; "
          f"{len(cases)} prompts x {len(lengths)} lengths x {len(methods)} methods, greedy")
    found = compare(engine, cases, methods, lengths)
    for line in found:
        print(line)
    print(f"{len(found)} of {len(cases) * len(lengths) * len(methods)} replies differ or failed")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
