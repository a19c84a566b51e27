"""`python -m specui.train decision`: train MCSD's two early-stop decision models for a draft
(specui.heads.decision) and ship them in one folder with their held-out quality.

Data: the examples of SpecDec++'s acceptance head (specui.train.acceptance; the same cache
under --work, so a draft whose head was trained reuses them): at each draft position of the
target's answers (token-mixed with fraction r), the draft's hidden state that gave q~ for the
candidate, q~'s entropy and top probabilities, and the soft label min(1, p/q).
- hidden: a 3-layer MLP on that hidden state, trained on the soft label (the seed's);
- entropy: a 2-layer MLP on (entropy, top-8 probabilities), trained on the 0/1 outcome of
  verification, drawn with probability min(1, p/q) (the seed's; the same target in expectation)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from specui.heads.acceptance import draft_fingerprint
from specui.heads.decision import KINDS, DecisionModel, save_decision_models
from specui.train import acceptance as acc
from specui.train.data import AnswerSet
from specui.train.trainer import TrainConfig, train
from specui.weights.draft import load_draft
from specui.weights.loading import LoadedModel

WIDTHS = {"hidden": 256, "entropy": 64}


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    d = sub.add_parser("decision", parents=[common], help="train MCSD's early-stop decision models for a draft")
    d.add_argument("--draft", type=Path, required=True, help="the SpecUI draft folder the models are for")
    d.add_argument("--out", type=Path, required=True, help="the folder to write (both models)")
    d.add_argument("--mix", type=float, default=0.5, help="token-mixing fraction r of the training examples")
    d.add_argument("--epochs", type=int, default=3)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--threshold", type=float, default=0.4, help="the stop threshold the held-out table is read at")


def model_inputs(feats: acc.Features, kind: str) -> torch.Tensor:
    return feats.hidden_before if kind == "hidden" else feats.stats


def model_labels(feats: acc.Features, kind: str, seed: int) -> torch.Tensor:
    """hidden: min(1, p/q); entropy: a verification outcome drawn with that probability."""
    if kind == "hidden":
        return feats.soft
    return (torch.rand(len(feats), generator=torch.Generator().manual_seed(seed)) < feats.soft).float()


def train_decision(feats: acc.Features, kind: str, epochs: int = 3, lr: float = 1e-3, seed: int = 0,
                   batch_size: int = 512) -> DecisionModel:
    torch.manual_seed(seed)
    x, y = model_inputs(feats, kind), model_labels(feats, kind, seed)
    model = DecisionModel(kind, int(feats.hidden.shape[1]), WIDTHS[kind])
    order = torch.randperm(len(feats), generator=torch.Generator().manual_seed(seed))
    batches = [(x[idx], y[idx]) for idx in order.split(batch_size)]
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    train(model, batches, lambda b: bce(model.logit(b[0].float()), b[1].float()),
          TrainConfig(epochs=epochs, lr=lr, seed=seed, warmup_steps=min(20, len(batches))), desc=f"decision {kind}")
    return model.eval()


@torch.no_grad()
def quality(model: DecisionModel, feats: acc.Features, threshold: float, bins: int = 10) -> dict:
    """Held-out BCE against the soft label, calibration, AUC against the greedy label (does the
    target's argmax equal the candidate), and what the stop rule sees at `threshold`."""
    a = model(model_inputs(feats, model.kind).float()).double().clamp(1e-7, 1 - 1e-7)
    y = feats.soft.double()
    fit = acc.prediction_quality(a, y, bins)
    low = a < threshold
    return dict(heldout_bce=round(fit.bce, 4), auc_greedy=round(auc(a, feats.greedy), 4), calibration=fit.calibration,
                below_threshold=round(float(low.double().mean()), 4),
                label_below=round(float(y[low].mean()), 4) if low.any() else None,
                label_above=round(float(y[~low].mean()), 4) if (~low).any() else None)


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counted half (rank formula)."""
    pos = label > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return float("nan")
    order = score.argsort()
    ranks = torch.empty_like(score, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def readme(metrics: dict, command: str, draft: str) -> str:
    lines = [f"# MCSD early-stop decision models for `{draft}`", "",
             f"Trained by `{command}` (examples shared with SpecDec++'s acceptance head, cached under --work).", "",
             "Both predict whether the draft's next candidate is accepted from the state that drew it (before the "
             "candidate is fed back, so asking costs no draft forward). MCSD stops drafting after a layer where "
             f"every chain's prediction is below the threshold (default {metrics['threshold']}).", "",
             f"Held-out examples: {metrics['heldout_examples']}; training examples: {metrics['train_examples']} "
             f"(r = {metrics['mix']}).", "",
             "| model | inputs | layers | held-out BCE (soft label) | AUC vs target argmax = candidate "
             f"| share predicted < {metrics['threshold']} | mean min(1,p/q) below / above |",
             "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        m = metrics[kind]
        inputs = "draft hidden state (576)" if kind == "hidden" else "entropy + top-8 probabilities of q"
        lines.append(f"| {kind} | {inputs} | {3 if kind == 'hidden' else 2} | {m['heldout_bce']} | {m['auc_greedy']} "
                     f"| {m['below_threshold']} | {m['label_below']} / {m['label_above']} |")
    return "\n".join(lines + [""])


def cmd_decision(args, target: LoadedModel, train_set: AnswerSet, heldout: AnswerSet) -> dict:
    t0 = time.time()
    draft = load_draft(args.draft, target.model, target.tokenizer)
    feats = acc.build_features(draft, target.model, train_set, args.mix, args.seed,
                               acc.draft_cache(args.work, f"head-fit-r{args.mix}-v2", draft))
    held = acc.build_features(draft, target.model, heldout, 0.5, args.seed + 7,
                              acc.draft_cache(args.work, "head-heldout-r0.5-v2", draft))
    models = {kind: train_decision(feats, kind, args.epochs, args.lr, args.seed) for kind in KINDS}
    command = "python -m specui.train " + " ".join(sys.argv[1:])
    metrics = {kind: quality(models[kind], held, args.threshold) for kind in KINDS}
    metrics.update(threshold=args.threshold, mix=args.mix, train_examples=len(feats), heldout_examples=len(held),
                   command=command, train_minutes=round((time.time() - t0) / 60, 2))
    for kind in KINDS:
        print(f"{kind}: held-out BCE {metrics[kind]['heldout_bce']}, AUC {metrics[kind]['auc_greedy']}",
              file=sys.stderr)
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_decision_models(models, tmp, draft_fingerprint(draft), {"threshold": args.threshold, "draft": args.draft.name})
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
    (tmp / "README.md").write_text(readme(metrics, command, args.draft.name), encoding="utf-8")
    if args.out.exists():
        shutil.rmtree(args.out)
    tmp.replace(args.out)
    return {k: v for k, v in metrics.items() if k not in KINDS} | {
        kind: {k: v for k, v in metrics[kind].items() if k != "calibration"} for kind in KINDS}
