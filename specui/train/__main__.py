"""Distil a draft for a target, on the target's own answers to the project's prompts.

    python -m specui.train draft --out models/smollm2-135m-draft      # collect, train, evaluate, ship
    python -m specui.train collect --train-prompts assets/prompts/train.jsonl@1   # + 1 sampled answer each
    python -m specui.train collect                                    # only the target's answers
    python -m specui.train eval --draft models/smollm2-135m-draft     # quality + cost on held-out
    python -m specui.train questions --count 2000                     # the target writes new training prompts
    python -m specui.train head --draft models/smollm2-135m-draft --out models/smollm2-135m-specdec-head
                                                                      # SpecDec++'s acceptance head (sweep)
    python -m specui.train decision --draft models/smollm2-135m-draft --out models/smollm2-135m-mcsd-decision
                                                                      # MCSD's two early-stop decision models

Data and checkpoints go to --work (resumable: rerun the same command to continue). The
draft is written to a temporary folder and moved over --out only when everything succeeded,
so a failed run never overwrites a shipped draft.

The parser and the subcommands' dispatch are here; the target's answers and teacher passes
are in teacher.py, the draft command in draft_command.py (the head, decision and collect
commands in their own *_command.py modules).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from specui.bench.prompts import HELDOUT, PROMPTS_DIR, TRAIN, load_prompts
from specui.errors import SpecUIError
from specui.heads.feature_draft import feature_layers
from specui.train import decision_command, head_command, questions
from specui.train.collect_command import add_arguments, make_collector
from specui.train.draft_command import cmd_draft, measure
from specui.train.teacher import answer_sets, pass_model, resolve_teacher_dtype, states
from specui.weights.draft import load_draft
from specui.weights.loading import BUNDLED, LoadedModel, ModelSpec, load_model

__all__ = ["GENERATED", "PromptSource", "answer_sets", "cmd_draft", "cmd_questions", "main", "measure", "parser",
           "pass_model", "resolve_teacher_dtype", "states"]

GENERATED = PROMPTS_DIR / "generated.jsonl"


@dataclass(frozen=True)
class PromptSource:
    """FILE: the greedy answers; FILE@N: and N sampled answers per prompt; FILE@M-N: only the
    sampled answers M to N (1-based), e.g. to go on training a draft on what a collection added."""
    path: Path
    samples: int = 0  # sampled answers per prompt: the last one's number
    first: int = 0  # the first sampled answer's number; 0: the greedy answer and samples 1..samples

    @classmethod
    def parse(cls, text: str) -> PromptSource:
        path, _, n = text.partition("@")
        lo, dash, hi = n.partition("-")
        if not n:
            return cls(Path(path))
        if not dash and lo.isdigit():
            return cls(Path(path), int(lo))
        if dash and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi):
            return cls(Path(path), int(hi), int(lo))
        raise argparse.ArgumentTypeError(f"'{text}': use FILE, FILE@N (the greedy answer and N sampled ones per "
                                         "prompt) or FILE@M-N (only the sampled answers M to N, 1 <= M <= N)")

    def __str__(self) -> str:
        if self.first:
            return f"{self.path}@{self.first}-{self.samples}"
        return f"{self.path}@{self.samples}" if self.samples else str(self.path)


def _layer_list(text: str) -> list[int]:
    """'2,14,27' -> [2, 14, 27] (negative: from the last layer)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': use layer numbers separated by commas, e.g. 2,14,27") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specui.train", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=BUNDLED)
    common.add_argument("--device", default="auto")
    common.add_argument("--train-prompts", type=PromptSource.parse, nargs="+", default=[PromptSource(TRAIN)],
                        help="JSONL files; FILE@N adds N sampled answers per prompt (--temperatures) to the "
                             "greedy one; FILE@M-N: only sampled answers M to N")
    common.add_argument("--heldout-prompts", type=Path, default=HELDOUT)
    common.add_argument("--work", type=Path, default=Path("out/distill"), help="data cache and checkpoints")
    common.add_argument("--max-new-tokens", type=int, default=160, help="longest target answer collected")
    common.add_argument("--batch-size", type=int, default=32,
                        help="answers per batch: of the teacher passes, and the rows collecting starts from "
                             "(--collect-rows)")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--teacher-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="the target's passes over the training answers (soft labels' top-k, a feature draft's "
                             "states); auto: the faster batched prefill measured here (bfloat16 ran 2.5x faster "
                             "than float32 on a 2-core AMD EPYC with AVX-512, 6x slower on one without); the "
                             "held-out set's teacher stays float32")
    add_arguments(common)
    sub.add_parser("collect", parents=[common], help="collect the target's answers and top-k distributions")
    d = sub.add_parser("draft", parents=[common], help="collect, build, train, evaluate and save a draft")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--layers", default=None,
                   help="target layers the draft's layers start from (default 0,-1); with --init, a longer list "
                        "that keeps the trained draft's layers grows it (new layers start as no-ops)")
    d.add_argument("--init", type=Path, default=None,
                   help="start from this trained draft (its layers and head) instead of the target's layers")
    d.add_argument("--head-size", type=int, default=8192, help="tokens the draft can propose")
    d.add_argument("--epochs", type=int, default=6)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--batch-tokens", type=int, default=4096)
    d.add_argument("--weight-decay", type=float, default=0.0)
    d.add_argument("--features", action="store_true",
                   help="the draft also reads the target's hidden state before each position (EAGLE's idea; "
                        "a pass over every conversation in --teacher-dtype computes them)")
    d.add_argument("--feature-layers", type=_layer_list, default=[],
                   help="--features: read the states after these target decoder layers (e.g. 2,14,27: low, middle "
                        "and high, as EAGLE-3) instead of after the final norm")
    d.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                   help="stop training after this many minutes (checkpointed: the same command goes on from there), "
                        "then evaluate and save the draft as usual")
    d.add_argument("--feature-lr-scale", type=float, default=1.0,
                   help="--features: the feature mixing's learning rate over --lr (it starts at zero for the "
                        "states and has far to go)")
    d.add_argument("--unknown-state", type=float, default=0.3,
                   help="--features: share of positions trained without the target's state, as at the "
                        "draft's own proposals")
    d.add_argument("--labels", choices=["soft", "hard"], default="soft",
                   help="soft: the target's top-32 distribution (a teacher pass over every answer in --teacher-dtype); "
                        "hard: its answer tokens themselves (no teacher pass)")
    d.add_argument("--layer-bits", type=int, choices=[4, 8], default=4,
                   help="storage of the decoder layers' matrices: 4-bit groups (torch's int4 kernel on CPU) or "
                        "int8 rows; the output head stays int8")
    d.add_argument("--quant-aware", action="store_true",
                   help="train the weights as they will be stored (--layer-bits groups, int8 rows; straight-through "
                        "gradients), so the shipped draft loses nothing to rounding; probes measure the stored weights")
    d.add_argument("--curve-points", type=int, default=12,
                   help="held-out agreement probes during training (the learning curve, curve.png)")
    e = sub.add_parser("eval", parents=[common], help="held-out quality and cost of a trained draft")
    e.add_argument("--draft", type=Path, required=True)
    q = sub.add_parser("questions", parents=[common], help="the target writes new training prompts")
    q.add_argument("--count", type=int, default=2000, help="requests to ask for (usable ones are kept)")
    q.add_argument("--out", type=Path, default=GENERATED)
    head_command.add_parser(sub, common)
    decision_command.add_parser(sub, common)
    return ap


def cmd_questions(args, target: LoadedModel) -> int:
    collector = make_collector(args, target, store=args.work / "questions")
    collector.max_new_tokens = 96
    train_items = [item for source in args.train_prompts for item in load_prompts(source.path)]
    kept = questions.generate(collector, train_items, load_prompts(args.heldout_prompts), args.out, args.count,
                              args.seed)
    print(f"{kept} of {args.count} requests kept -> {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        for path in (*(s.path for s in args.train_prompts), args.heldout_prompts):
            load_prompts(path, 1)  # fail fast on a missing prompt file
        target = load_model(ModelSpec(args.target, dtype="float32", device=args.device))
        if args.cmd == "collect":
            answer_sets(args, target)
            return 0
        if args.cmd == "questions":
            return cmd_questions(args, target)
        if args.cmd == "head":
            train_set, heldout = answer_sets(args, target)
            report = head_command.cmd_head(args, target, train_set, heldout)
        elif args.cmd == "decision":
            train_set, heldout = answer_sets(args, target)
            report = decision_command.cmd_decision(args, target, train_set, heldout)
        elif args.cmd == "eval":
            _, heldout = answer_sets(args, target)
            draft = load_draft(args.draft, target.model, target.tokenizer)
            report = measure(draft, target, heldout,
                             states(args, target, heldout, draft.feature_fc is not None, feature_layers(draft.config)))
        else:
            report = cmd_draft(args, target)
    except SpecUIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
