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
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specui.bench.prompts import HELDOUT, PROMPTS_DIR, TRAIN, load_prompts
from specui.chat import stop_token_ids
from specui.engine.timing import median_ms
from specui.errors import SpecUIError
from specui.heads.feature_draft import add_feature_input, feature_layers
from specui.train import curve, decision_command, head_command, questions
from specui.train.collect_command import add_arguments, make_collector
from specui.train.cost import decode_ms
from specui.train.data import AnswerSet
from specui.train.distill import (
    build_draft,
    choose_head_tokens,
    distill_loss,
    evaluate,
    grow_draft,
    make_batches,
    quantization_aware,
)
from specui.train.states import states_for
from specui.train.trainer import TrainConfig, train
from specui.weights.draft import load_draft, save_draft
from specui.weights.dtypes import choice_key, choose_dtype, dtype_name
from specui.weights.loading import BUNDLED, LoadedModel, ModelSpec, load_model

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


def answer_sets(args, target: LoadedModel) -> tuple[AnswerSet, AnswerSet]:
    """The training and held-out answers with the teacher's top-k: every missing answer is
    collected first, all sets in one continuous batch."""
    collector = make_collector(args, target)
    heldout_items = load_prompts(args.heldout_prompts)
    heldout_texts = {_user_text(i) for i in heldout_items}
    train_jobs = {}
    for source in args.train_prompts:
        path = source.path
        items = load_prompts(path)
        leaked = [i.id for i in items if _user_text(i) in heldout_texts or i.id in {h.id for h in heldout_items}]
        if leaked:
            raise SpecUIError(f"{path} holds held-out prompts ({', '.join(leaked[:5])}); they are never trained on")
        train_jobs[path.stem] = collector.jobs(items, path.stem, source.samples, first=source.first)
    heldout_jobs = collector.jobs(heldout_items, "heldout")
    # held-out first, then round by round over every file: a collection stopped early still covers every prompt
    report = collector.gather(heldout_jobs + sorted((j for jobs in train_jobs.values() for j in jobs),
                                                    key=lambda j: j.round))
    if report.answers:
        print(f"collected {report.answers} answers, {report.tokens} tokens, {report.tokens_per_s:.0f} tok/s",
              file=sys.stderr)
    if args.cmd == "collect":
        return AnswerSet(), AnswerSet()
    train_set = AnswerSet()
    labels = getattr(args, "labels", "soft")
    if labels != "hard":  # soft, or the head's own label kinds: a teacher pass
        resolve_teacher_dtype(args, target)
    teacher = pass_model(target, args.teacher_dtype)
    suffix = "" if args.teacher_dtype == "float32" else f"-{args.teacher_dtype}"
    for stem, jobs in train_jobs.items():
        train_set.extend(collector.answer_set(jobs, f"teacher-{stem}{suffix}", labels=labels, teacher=teacher))
    return train_set, collector.answer_set(heldout_jobs, "teacher-heldout")


def _user_text(item) -> str:
    return "\n".join(m["content"].strip() for m in item.messages if m["role"] == "user")


def states(args, target: LoadedModel, data: AnswerSet, wanted: bool,
           layers: list[int] | None = None) -> list[torch.Tensor] | None:
    """The target's states (after the final norm, or after decoder `layers`) along `data` for a
    feature draft (cached under --work), else None."""
    if not wanted:
        return None
    seqs = [p + a for p, a in zip(data.prompt_ids, data.answer_ids)]
    resolve_teacher_dtype(args, target)
    dtype = args.teacher_dtype
    n = target.model.config.num_hidden_layers
    where = "".join(f"-L{i % n}" for i in layers or ())
    return states_for(pass_model(target, dtype), data.ids, seqs, args.work / f"states-{dtype}{where}",
                      layers=layers or ())


def pass_model(target: LoadedModel, dtype: str) -> Callable[[], PreTrainedModel]:
    """What gives the target in `dtype` for a pass over training data: the loaded model, or a copy
    in that dtype made at the first call (only where a pass has something to compute)."""
    @functools.cache
    def make() -> PreTrainedModel:
        if target.model.dtype == getattr(torch, dtype):
            return target.model
        return copy.deepcopy(target.model).to(getattr(torch, dtype))
    return make


def resolve_teacher_dtype(args, target: LoadedModel, tokens: int = 512) -> None:
    """--teacher-dtype auto -> the dtype whose batched prefill of training-sized sequences is
    faster here (bfloat16 on a GPU), chosen as `--dtype auto` chooses (dtypes.choose_dtype:
    interleaved timings, bfloat16 only where 5% faster, kept in --work per model, CPU, torch and
    threads, so the teacher caches and a resumed run's id do not flip), said on stderr."""
    if args.teacher_dtype != "auto":
        return
    if target.device.type == "cuda":
        args.teacher_dtype = "bfloat16"
        return
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, target.model.config.vocab_size, (4, tokens // 4), generator=gen).to(target.device)

    def prefill_ms(model) -> float:
        with torch.inference_mode():
            return median_ms(lambda: model(input_ids=batch, logits_to_keep=1), target.device, 3)

    path = args.work / "teacher-dtype.json"
    choice = choose_dtype(lambda d: pass_model(target, dtype_name(d))(), choice_key(target.model, "teacher prefill"),
                          path, timer=prefill_ms)
    args.teacher_dtype = dtype_name(choice.dtype)
    rates = ", ".join(f"{n} {batch.numel() / ms * 1000:.0f}" for n, ms in choice.ms.items())
    where = f" (chosen earlier on this machine: {path})" if choice.cached else ""
    print(f"teacher passes in {args.teacher_dtype}{where}: {rates} prefill tokens/s (--teacher-dtype to fix it)",
          file=sys.stderr)


def rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


def size_ratio(embeddings: torch.Tensor, states: list[torch.Tensor]) -> float:
    """RMS of the input embeddings over RMS of the target's states (a sample of them)."""
    sample = torch.cat([s.float() for s in states[:: max(1, len(states) // 200)]])
    return rms(embeddings) / max(rms(sample), 1e-12)


def measure(draft, target: LoadedModel, heldout: AnswerSet, heldout_states=None) -> dict:
    quality = evaluate(draft, heldout, states=heldout_states)
    prompt = heldout.prompt_ids[0]
    t_ms, d_ms = decode_ms(target.model, prompt), decode_ms(draft, prompt)
    return {**asdict(quality), "target_ms_per_token": t_ms, "draft_ms_per_token": d_ms, "cost_ratio": d_ms / t_ms}


def cmd_draft(args, target: LoadedModel) -> dict:
    if args.feature_layers and not args.features:
        raise SpecUIError("--feature-layers says which target states a feature draft reads: add --features")
    train_set, heldout = answer_sets(args, target)
    eos = stop_token_ids(target.tokenizer, target.model.generation_config)
    layers = [int(x) for x in (args.layers or "0,-1").split(",")]
    torch.manual_seed(args.seed)
    if args.init:  # go on from a trained draft: its layers, head tokens and weights (float32)
        draft = load_draft(args.init, target.model, target.tokenizer, kernels=False, dtype=torch.float32)
        draft.model.embed_tokens.weight.requires_grad_(False)  # the target's, shared
        head = draft.token_map.clone()
        own = draft.config.specui_draft.get("init_layers", layers)
        n = target.model.config.num_hidden_layers
        if args.layers is None or [i % n for i in layers] == [i % n for i in own]:
            layers = own
        else:  # deeper: the new target layers start as no-ops (grow_draft)
            draft = grow_draft(draft, target.model, layers)
    else:
        head = choose_head_tokens(train_set, args.head_size, eos)
        draft = build_draft(target.model, layers, head)
    reads = args.features or draft.feature_fc is not None
    read_layers = feature_layers(draft.config) if draft.feature_fc is not None else args.feature_layers
    train_states = states(args, target, train_set, reads, read_layers)
    heldout_states = states(args, target, heldout, reads, read_layers)
    if args.features and draft.feature_fc is None:
        emb = draft.model.embed_tokens.weight
        scale = rms(emb) if read_layers else size_ratio(emb, train_states)  # layer states: normalised per vector
        add_feature_input(draft, scale, read_layers)
    batches = make_batches(train_set, head, draft.config.vocab_size, args.batch_tokens, train_states)
    print(f"train: {len(train_set)} answers, {train_set.answer_tokens} tokens, {len(batches)} batches; "
          f"held-out: {len(heldout)} answers, {heldout.answer_tokens} tokens", file=sys.stderr)
    recipe = "|".join(str(v) for v in (args.target, layers, args.head_size, args.epochs, args.lr, args.weight_decay,
                                         args.batch_tokens, args.seed, *map(str, args.train_prompts), args.labels,
                                         args.temperatures, args.init, args.features, args.unknown_state,
                                         args.teacher_dtype))
    if args.feature_layers:
        recipe += f"|feature layers {args.feature_layers}"
    if args.feature_lr_scale != 1.0:
        recipe += f"|feature lr x{args.feature_lr_scale}"
    if args.quant_aware:
        recipe += f"|as stored, {args.layer_bits}-bit layers"
    run_id = hashlib.sha1(recipe.encode()).hexdigest()[:10]  # same settings resume, new settings start fresh
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, seed=args.seed, weight_decay=args.weight_decay,
                      checkpoint=args.work / f"draft-{args.out.name}-{run_id}.ckpt",
                      probe_every=max(1, args.epochs * len(batches) // max(1, args.curve_points)),
                      lr_scale={"feature_fc.": args.feature_lr_scale},
                      time_limit_s=None if args.time_limit is None else args.time_limit * 60)
    t0 = time.time()
    # --quant-aware: trained and probed as stored; after the block, save_draft rounds the float weights the same way
    with quantization_aware(draft, args.layer_bits, on=args.quant_aware):
        before = evaluate(draft, heldout, states=heldout_states)
        print(f"before training: agreement {before.agreement:.3f}", file=sys.stderr)
        log = train(draft, batches, lambda b: distill_loss(draft, b, args.unknown_state), cfg, desc="distil draft",
                    probe=lambda: evaluate(draft, heldout, gammas=(), states=heldout_states).agreement,
                    probed_before=before.agreement)
    losses = log.losses
    report = {}
    if log.stopped_at is not None:
        print(f"--time-limit: training stopped at step {log.stopped_at} of {args.epochs * len(batches)}",
              file=sys.stderr)
        report["stopped_at_step"] = log.stopped_at
    report.update(train_minutes=(time.time() - t0) / 60, final_loss=sum(losses[-20:]) / len(losses[-20:]),
                  agreement_before_training=before.agreement, train_answer_tokens=train_set.answer_tokens,
                  heldout_answer_tokens=heldout.answer_tokens,
                  command="python -m specui.train " + " ".join(sys.argv[1:]),
                  curve=curve.run_points(log.probes, train_set.answer_tokens, len(batches)),
                  history=curve.history(args.init, before.agreement))
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp, target.tokenizer, layer_bits=args.layer_bits)
    shipped = load_draft(tmp, target.model, target.tokenizer)  # it must load before it replaces anything
    report.update(measure(shipped, target, heldout, heldout_states))  # figures of the stored (int8) weights
    (tmp / "metrics.json").write_text(json.dumps(report, indent=1))
    curve.write(tmp, report["curve"], report["history"], train_set.answer_tokens, report["agreement"])
    for kept in ("README.md",):  # hand-written notes about the draft survive a retrain (update them)
        if (args.out / kept).is_file() and not (tmp / kept).exists():
            shutil.copy2(args.out / kept, tmp / kept)
    if args.out.exists():
        shutil.rmtree(args.out)
    tmp.replace(args.out)
    return report


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
