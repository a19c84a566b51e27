"""`python -m specui.train draft`: build (or go on from --init), train, evaluate and ship a
distilled draft (cmd_draft), and `measure`, the held-out quality and cost of a draft that
`draft` and `eval` report."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict

import torch

from specui.chat import stop_token_ids
from specui.errors import SpecUIError
from specui.heads.feature_draft import add_feature_input, feature_layers
from specui.train import curve
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
from specui.train.teacher import answer_sets, states
from specui.train.trainer import TrainConfig, train
from specui.weights.draft import load_draft, save_draft
from specui.weights.loading import LoadedModel


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
    torch.manual_seed(args.seed)
    draft, head, layers = start_draft(args, target, train_set)
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
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, seed=args.seed, weight_decay=args.weight_decay,
                      checkpoint=args.work / f"draft-{args.out.name}-{run_id(args, layers)}.ckpt",
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
    ship(args, target, draft, report, heldout, heldout_states)
    return report


def start_draft(args, target: LoadedModel, train_set: AnswerSet) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    """The draft training begins from, its head's tokens and its target layers: a new one (`--layers`,
    head tokens chosen from the answers), or `--init`'s (float32), grown deeper where `--layers` adds
    target layers to its own (the new ones start as no-ops: grow_draft)."""
    layers = [int(x) for x in (args.layers or "0,-1").split(",")]
    if not args.init:
        head = choose_head_tokens(train_set, args.head_size, stop_token_ids(target.tokenizer,
                                                                             target.model.generation_config))
        return build_draft(target.model, layers, head), head, layers
    draft = load_draft(args.init, target.model, target.tokenizer, kernels=False, dtype=torch.float32)
    draft.model.embed_tokens.weight.requires_grad_(False)  # the target's, shared
    head = draft.token_map.clone()
    own = draft.config.specui_draft.get("init_layers", layers)
    n = target.model.config.num_hidden_layers
    if args.layers is None or [i % n for i in layers] == [i % n for i in own]:
        return draft, head, own
    return grow_draft(draft, target.model, layers), head, layers


def run_id(args, layers: list[int]) -> str:
    """What names a training run's checkpoint: the same settings resume it, new settings start afresh."""
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
    return hashlib.sha1(recipe.encode()).hexdigest()[:10]


def ship(args, target: LoadedModel, draft, report: dict, heldout: AnswerSet, heldout_states) -> None:
    """Save the trained draft beside --out, load it back and measure it as stored (its metrics and
    learning curve written with it), then let it replace --out (whose hand-written README stays)."""
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp, target.tokenizer, layer_bits=args.layer_bits)
    shipped = load_draft(tmp, target.model, target.tokenizer)  # it must load before it replaces anything
    report.update(measure(shipped, target, heldout, heldout_states))  # figures of the stored (int8) weights
    (tmp / "metrics.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    curve.write(tmp, report["curve"], report["history"], report["train_answer_tokens"], report["agreement"])
    for kept in ("README.md",):  # hand-written notes about the draft survive a retrain (update them)
        if (args.out / kept).is_file() and not (tmp / kept).exists():
            shutil.copy2(args.out / kept, tmp / kept)
    if args.out.exists():
        shutil.rmtree(args.out)
    tmp.replace(args.out)
