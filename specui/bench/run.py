"""Side-by-side throughput on held-out prompts: our methods, transformers greedy
`generate`, and transformers assisted generation (`assistant_model=`) on the same pair.

    python -m specui.bench.run --limit 10 --max-new-tokens 96 \
        --methods autoregressive,speculative:3,speculative:5,tree:eagle-25,opt-tree:25

A method spec is name[:value]: speculative:GAMMA, beam:WIDTH, tree:PRESET, opt-tree:NODES.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from specui.bench.prompts import HELDOUT, load_prompts
from specui.chat import build_prompt
from specui.engine import GenerationRequest, make_method
from specui.engine.profile import cpu_model
from specui.loading import BUNDLED, ModelSpec
from specui.pair import ModelPair, default_draft_source, load_pair
from specui.settings import ChatSettings


@dataclass
class Row:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    expected: list[float] = field(default_factory=list, repr=False)  # OPT-Tree E(A) per step
    achieved: list[int] = field(default_factory=list, repr=False)  # A per step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.forwards if self.forwards else float("nan")


def run_ours(pair: ModelPair, prompts: list[list[int]], n: int, method: str, params: dict) -> Row:
    engine = pair.engine()
    row = Row(method + "".join(f" {k}={v}" for k, v in params.items()))
    for prompt in prompts:
        engine.target.reset()  # no cross-prompt cache reuse: same work as the peers
        if engine.draft is not None:
            engine.draft.reset()
        t0 = time.perf_counter()
        gen = engine.generate(GenerationRequest(prompt, n), make_method(method, **params)).run()
        row.seconds += time.perf_counter() - t0
        row.tokens += len(gen.output_ids)
        row.forwards += gen.stats.target_forwards
        row.outputs.append(gen.output_ids)
        for step in gen.steps:
            if step.expected_accept is not None:
                row.expected.append(step.expected_accept)
                row.achieved.append(step.accepted + 1)
    return row


PARAM_OF = {"speculative": ("gamma", int), "beam": ("width", int), "tree": ("preset", str), "opt-tree": ("nodes", int)}


def parse_method(spec: str) -> tuple[str, dict]:
    name, _, value = spec.partition(":")
    if value and name in PARAM_OF:
        key, kind = PARAM_OF[name]
        return name, {key: kind(value)}
    return name, {}


def correlation(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


@torch.inference_mode()
def run_transformers(pair: ModelPair, prompts: list[list[int]], n: int, assisted: bool) -> Row:
    model = pair.target.model
    eos = sorted(pair.engine().eos_ids)
    row = Row("transformers assisted" if assisted else "transformers greedy")
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        if assisted:
            kw.update(assistant_model=pair.draft.model, tokenizer=None)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        row.seconds += time.perf_counter() - t0
        new = out[0, len(prompt):].tolist()
        if eos and any(t in eos for t in new):
            new = new[: next(i for i, t in enumerate(new) if t in eos) + 1]
        row.tokens += len(new)
        row.outputs.append(new)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=BUNDLED)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", default=str(HELDOUT))
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="autoregressive,speculative")
    ap.add_argument("--gamma", type=int, default=ChatSettings().gamma, help="gamma of a bare 'speculative'")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers' generate")
    ap.add_argument("--json", help="also write the table to this JSON file")
    args = ap.parse_args()

    torch.set_num_threads(torch.get_num_threads())
    target = ModelSpec(args.target, args.dtype, args.device)
    draft_src = default_draft_source() if args.draft == "default" else args.draft
    pair = load_pair(target, None if args.draft == "none" else target.with_source(draft_src))
    tok = pair.target.tokenizer
    prompts = [build_prompt(tok, p.messages, 4096)[0] for p in load_prompts(args.prompts, args.limit)]
    n = args.max_new_tokens

    print(f"cpu: {cpu_model()}; torch threads {torch.get_num_threads()}; dtype {pair.target.model.dtype}")
    costs = pair.engine().ensure_profile()  # cached on disk: every engine below reads it
    print(costs.note)
    if costs.profile is not None:
        print(costs.profile.table() + "\n")
    run_ours(pair, prompts[:1], 8, "autoregressive", {})  # warm-up
    rows = []
    for spec in args.methods.split(","):
        method, params = parse_method(spec)
        if method == "speculative" and not params:
            params = {"gamma": args.gamma}
        rows.append(run_ours(pair, prompts, n, method, params))
    if not args.no_peers:
        rows.append(run_transformers(pair, prompts, n, assisted=False))
        if pair.draft is not None:
            rows.append(run_transformers(pair, prompts, n, assisted=True))

    base = next((r for r in rows if r.name == "autoregressive"), rows[0])
    device = str(pair.target.device)
    if pair.target.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name()})"
    print(f"device: {device}; target {pair.target.label}; draft {pair.draft.label if pair.draft else 'none'}")
    print(f"{len(prompts)} prompts from {args.prompts}, max {n} new tokens, greedy\n")
    print(f"{'method':28} {'tokens':>7} {'tok/s':>8} {'vs AR':>7} {'tok/fwd':>8} {'same as AR':>11}")
    for r in rows:
        same = sum(a == b for a, b in zip(r.outputs, base.outputs))
        per_forward = f"{r.mean_accepted_length:8.2f}" if r.forwards else f"{'-':>8}"
        print(f"{r.name:28} {r.tokens:7d} {r.tokens_per_s:8.2f} {r.tokens_per_s / base.tokens_per_s:6.2f}x "
              f"{per_forward} {same:>5}/{len(prompts)}")
    for r in rows:
        if r.expected:
            print(f"{r.name}: mean E(A) {sum(r.expected) / len(r.expected):.2f}, mean A "
                  f"{sum(r.achieved) / len(r.achieved):.2f}, corr(E(A), A) = {correlation(r.expected, r.achieved):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(asdict(r), outputs=None, expected=None, achieved=None, tokens_per_s=r.tokens_per_s)
                       for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
