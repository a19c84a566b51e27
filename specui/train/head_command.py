"""`python -m specui.train head`: train SpecDec++'s acceptance head for a draft, choosing its
depth D, mixing fraction r, rejection weight w_rej, label kind and default threshold H by a
sweep, and ship it (config, weights, README with the sweep table, metrics, calibration plot).

Selection: every head of the grid is scored by an exact greedy replay on the target's answers
to prompts the draft never saw (assets/prompts/dev.jsonl; specui.train.acceptance), its best H
found on a grid, with the time model T = t_draft x draft forwards + sum over target calls of
t_target(call size): the pair's measured cost profile (the dtype the app picks on this
machine) scaled to what the decoding loop measures."""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

from specui.bench.prompts import DEV, load_prompts
from specui.chat import stop_token_ids
from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.profile import cpu_model
from specui.engine.profiling import get_profile
from specui.engine.session import ModelSession
from specui.heads.acceptance import draft_fingerprint, save_head, threshold_replay
from specui.train import acceptance as acc
from specui.train.data import AnswerSet, collect
from specui.weights.draft import load_draft
from specui.weights.loading import LoadedModel, ModelSpec, load_model

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99)


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    h = sub.add_parser("head", parents=[common], help="train SpecDec++'s acceptance head for a draft (with a sweep)")
    h.add_argument("--draft", type=Path, required=True, help="the SpecUI draft folder the head is for")
    h.add_argument("--out", type=Path, required=True, help="the head folder to write")
    h.add_argument("--depths", default="0,1,2", help="ResNet depths D to sweep (0 = one linear layer)")
    h.add_argument("--mixes", default="0.2,0.5", help="token-mixing fractions r (share of the target's tokens)")
    h.add_argument("--rej-weights", default="1,3,6,12", help="BCE weights w_rej of rejections")
    h.add_argument("--labels", default="soft,greedy",
                   help="label kinds: soft = min(1, p/q) (the seed's), greedy = target argmax equals the token")
    h.add_argument("--inputs", default="hidden,hidden+q",
                   help="head inputs: hidden = the draft's hidden state (the seed's); hidden+q = also the "
                        "entropy and top-8 probabilities of the q the candidate was drawn from")
    h.add_argument("--dev-prompts", default=str(DEV),
                   help="prompts the draft never saw, for choosing the head and H (empty: every 7th training answer)")
    h.add_argument("--reads", default="after,before",
                   help="after = the hidden state after the draft read the candidate (the seed's; a draft forward "
                        "more per chain); before = the one that gave q for it, with q's statistics (no extra forward)")
    h.add_argument("--gamma-max", type=int, default=16)
    h.add_argument("--epochs", type=int, default=3)
    h.add_argument("--eval-mix", type=float, default=0.5, help="r of the held-out examples the BCE is measured on")
    h.add_argument("--app-quantization", default="auto",
                   help="target quantization the time model measures (the app's default, auto: int4 for the "
                        "bundled GGUF on a CPU)")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def dev_answers_for(args, target: LoadedModel, train_set: AnswerSet) -> tuple[AnswerSet, AnswerSet]:
    """(fit, dev): the target's answers to --dev-prompts (prompts the draft was not trained
    on: on its own training prompts it agrees with the target far more often than on new
    ones, which would favour long chains), or a split of the training answers."""
    if not args.dev_prompts:
        return split(train_set)
    path = Path(args.dev_prompts)
    tok, model = target.tokenizer, target.model
    eos = stop_token_ids(tok, model.generation_config)
    dev = collect(model, tok, load_prompts(path), eos, args.work / f"{path.stem}-greedy.pt",
                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed)
    return train_set, dev


def split(answers: AnswerSet, every: int = 7) -> tuple[AnswerSet, AnswerSet]:
    """(fit, dev): every `every`-th conversation is dev."""
    fit, dev = AnswerSet(), AnswerSet()
    for i in range(len(answers)):
        part = dev if i % every == every - 1 else fit
        for name in ("ids", "prompt_ids", "answer_ids", "topk_ids", "topk_logp"):
            getattr(part, name).append(getattr(answers, name)[i])
    return fit, dev


def shortest_near_best(scored: list[tuple[float, float]], within: float = 0.01) -> tuple[float, float]:
    """(model tok/s, H) of the smallest H within `within` of the best model tok/s: the model's
    optimum is flat (the replay cannot see everything a longer draft costs in the loop), and
    a smaller H drafts less, so it loses least where the model is wrong."""
    top = max(v for v, _ in scored)
    return min(((v, h) for v, h in scored if v >= top * (1 - within)), key=lambda vh: vh[1])


def app_costs(args, draft, prompts: list[list[int]]) -> tuple[float, object, str]:
    """Draft ms per token and target ms(k) for the pair as the app runs it (target in dtype
    auto beside this draft): the cost profile, scaled to what the decoding loop measures
    (speculative decoding of a few dev prompts at gamma 1, 3 and 6: the loop's draft forward
    per token and target call of k tokens cost more than the profile's isolated forwards)."""
    target = load_model(ModelSpec(args.target, dtype="auto", device=args.device, quantization=args.app_quantization))
    profile, note = get_profile(ModelSession(target.model), ModelSession(draft))
    engine = Engine(target.model, target.tokenizer, draft=draft,
                    eos_ids=stop_token_ids(target.tokenizer, target.model.generation_config))
    draft_ms = drafted = 0.0
    seen: list[tuple[int, float]] = []  # (call size k, measured ms)
    for gamma in (1, 3, 6):
        for prompt in prompts:
            gen = engine.generate(GenerationRequest(list(prompt), 48), make_method("speculative", gamma=gamma)).run()
            for step in gen.steps[1:]:  # the first step feeds the prompt's last token too
                draft_ms, drafted = draft_ms + step.draft_ms, drafted + step.drafted
                seen.append((step.drafted + 1, step.verify_ms))
    d_scale = (draft_ms / max(1.0, drafted)) / profile.draft(1)
    t_scale = sum(ms for _, ms in seen) / sum(profile.target(k) for k, _ in seen)
    desc = (f"{cpu_model()}, target {str(target.model.dtype).replace('torch.', '')} (quantization "
            f"{target.spec.quantization}); {note}; scaled to the loop: "
            f"draft x{d_scale:.2f} ({profile.draft(1) * d_scale:.1f} ms per token), target x{t_scale:.2f} "
            f"({profile.target(1) * t_scale:.1f} ms for 1 token, {profile.target(7) * t_scale:.1f} ms for 7)")
    return profile.draft(1) * d_scale, lambda k: profile.target(k) * t_scale, desc


def sweep(args, draft, target: LoadedModel, fit: AnswerSet, heldout_feats: acc.Features, dev_answers,
          costs) -> list[dict]:
    draft_ms, target_ms, _ = costs
    rows = []
    for mix in _floats(args.mixes):
        feats = acc.build_features(draft, target.model, fit, mix, args.seed,
                                   acc.draft_cache(args.work, f"head-fit-r{mix}-v2", draft))
        for depth, w_rej, labels, inputs, reads in itertools.product(
                [int(d) for d in _floats(args.depths)], _floats(args.rej_weights), args.labels.split(","),
                args.inputs.split(","), args.reads.split(",")):
            if reads == "before" and inputs == "hidden":
                continue  # a head that reads before the candidate always reads q's statistics too
            head = acc.train_head(feats, depth, w_rej, labels, inputs == "hidden+q", reads, epochs=args.epochs,
                                  seed=args.seed)
            quality = acc.head_quality(head, heldout_feats, "soft")
            values = acc.head_values(head, dev_answers)
            extra = reads == "after"
            best = shortest_near_best([(acc.tokens_per_s(acc.replay_all(dev_answers, values, h, args.gamma_max, extra),
                                                         draft_ms, target_ms), h) for h in THRESHOLDS])
            rep = acc.replay_all(dev_answers, values, best[1], args.gamma_max, extra)
            rows.append(dict(mix=mix, depth=depth, w_rej=w_rej, labels=labels, inputs=inputs, reads=reads,
                             examples=len(feats),
                             heldout_bce=round(quality.bce, 4), heldout_kl=round(quality.kl, 4),
                             threshold=best[1], dev_model_tokens_per_s=round(best[0], 2),
                             dev_discard_rate=round(rep.discard_rate, 3),
                             dev_verification_rate=round(rep.verification_rate, 3), head=head))
            print(f"r={mix} D={depth} w_rej={w_rej} {labels} {inputs} {reads}: BCE {quality.bce:.4f}, "
                  f"best H {best[1]}, {best[0]:.2f} tok/s (model)", file=sys.stderr)
    return rows


def pareto_points(answers, values, gamma_max: int, costs, extra_forward: bool) -> list[dict]:
    draft_ms, target_ms, _ = costs
    points = []
    for g in range(1, 9):
        rep = acc.replay_all(answers, None, 0.0, g)
        points.append(dict(method="speculative", setting=f"gamma {g}", discard_rate=rep.discard_rate,
                           verification_rate=rep.verification_rate,
                           model_tokens_per_s=acc.tokens_per_s(rep, draft_ms, target_ms)))
    for h in THRESHOLDS:
        rep = acc.replay_all(answers, values, h, gamma_max, extra_forward)
        points.append(dict(method="specdec++", setting=f"H {h}", discard_rate=rep.discard_rate,
                           verification_rate=rep.verification_rate,
                           model_tokens_per_s=acc.tokens_per_s(rep, draft_ms, target_ms)))
    ar = acc.Replay(generated=1, verified=1, call_sizes=[1])
    for p in points:
        p["model_speedup"] = round(p["model_tokens_per_s"] / acc.tokens_per_s(ar, draft_ms, target_ms), 3)
        p["discard_rate"], p["verification_rate"] = round(p["discard_rate"], 4), round(p["verification_rate"], 4)
        p["model_tokens_per_s"] = round(p["model_tokens_per_s"], 2)
    return points


def figures(folder: Path, quality: acc.HeadQuality, points: list[dict]) -> None:
    import plotly.graph_objects as go  # here: the other commands of `python -m specui.train` run without plotly

    cal = go.Figure()
    cal.add_scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(dash="dot", color="grey"), name="perfect")
    cal.add_scatter(x=[c[0] for c in quality.calibration], y=[c[1] for c in quality.calibration],
                    mode="lines+markers", name="head", text=[f"{c[2]} examples" for c in quality.calibration])
    cal.update_layout(title="Acceptance head calibration (held-out)", xaxis_title="predicted a_t",
                      yaxis_title="mean label min(1, p/q)", width=640, height=480)
    from specui.bench.png import save_figure

    save_figure(cal, folder, "calibration")
    pareto = go.Figure()
    for method in ("speculative", "specdec++"):
        pts = [p for p in points if p["method"] == method]
        pareto.add_scatter(x=[p["discard_rate"] for p in pts], y=[p["verification_rate"] for p in pts],
                           mode="lines+markers+text", name=method, text=[p["setting"] for p in pts],
                           textposition="top right")
    pareto.update_layout(title="Held-out greedy replay: discard rate vs verification rate",
                         xaxis_title="discard rate D/N", yaxis_title="verification rate V/N", width=720, height=520)
    save_figure(pareto, folder, "pareto")


def readme(rows: list[dict], best: dict, points: list[dict], costs_desc: str, command: str) -> str:
    lines = ["# SpecDec++ acceptance head for `smollm2-135m-draft`", "",
             "Trained by `" + command + "` (resumable; data under --work).", "",
             f"Chosen: D = {best['depth']}, r = {best['mix']}, w_rej = {best['w_rej']}, labels {best['labels']}, "
             f"inputs {best['inputs']}, reads the hidden state {best['reads']} the candidate, "
             f"default threshold H = {best['threshold']} (the smallest within 1% of the best modelled tok/s on "
             "the dev prompts).", "",
             f"Time model from the cost profile: {costs_desc}.", "",
             "## Sweep (dev prompts: greedy replay; BCE on held-out examples)", "",
             "| r | D | w_rej | labels | inputs | reads | examples | held-out BCE | KL | best H | model tok/s "
             "| D/N | V/N |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["dev_model_tokens_per_s"]):
        lines.append(f"| {r['mix']} | {r['depth']} | {r['w_rej']} | {r['labels']} | {r['inputs']} | "
                     f"{r.get('reads', 'after')} | {r['examples']} | "
                     f"{r['heldout_bce']} | {r['heldout_kl']} | {r['threshold']} | {r['dev_model_tokens_per_s']} | "
                     f"{r['dev_discard_rate']} | {r['dev_verification_rate']} |")
    lines += ["", "## Held-out greedy replay (the chosen head vs fixed gamma)", "",
              "| method | setting | D/N | V/N | model speed-up over AR |", "|---|---|---|---|---|"]
    lines += [f"| {p['method']} | {p['setting']} | {p['discard_rate']} | {p['verification_rate']} | "
              f"{p['model_speedup']} |" for p in points]
    lines += ["", "![calibration](calibration.png) ![pareto](pareto.png)", ""]
    return "\n".join(lines)


def cmd_head(args, target: LoadedModel, train_set: AnswerSet, heldout: AnswerSet) -> dict:
    t0 = time.time()
    draft = load_draft(args.draft, target.model, target.tokenizer)  # as the app runs it (float32, on its kernels)
    fit, dev = dev_answers_for(args, target, train_set)
    costs = app_costs(args, draft, dev.prompt_ids[:3])
    print(f"time model: {costs[2]}", file=sys.stderr)
    dev_answers = [acc.greedy_answer(draft, p, a) for p, a in zip(dev.prompt_ids, dev.answer_ids)]
    heldout_feats = acc.build_features(draft, target.model, heldout, args.eval_mix, args.seed + 7,
                                       acc.draft_cache(args.work, f"head-heldout-r{args.eval_mix}-v2", draft))
    rows = sweep(args, draft, target, fit, heldout_feats, dev_answers, costs)
    best = max(rows, key=lambda r: r["dev_model_tokens_per_s"])
    quality = acc.head_quality(best["head"], heldout_feats, "soft")
    held_answers = [acc.greedy_answer(draft, p, a) for p, a in zip(heldout.prompt_ids, heldout.answer_ids)]
    points = pareto_points(held_answers, acc.head_values(best["head"], held_answers), args.gamma_max, costs,
                           best["reads"] == "after")
    command = "python -m specui.train " + " ".join(sys.argv[1:])
    meta = {k: best[k] for k in ("depth", "mix", "w_rej", "labels", "inputs", "reads", "threshold")}
    meta.update(gamma_max=args.gamma_max, draft=args.draft.name, threshold_replay=threshold_replay(points))
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(best["head"], tmp, draft_fingerprint(draft), meta)
    plain_rows = [{k: v for k, v in r.items() if k != "head"} for r in rows]
    metrics = dict(heldout_bce=quality.bce, heldout_kl=quality.kl, calibration=quality.calibration,
                   heldout_replay=points, sweep=plain_rows, costs=costs[2], command=command,
                   train_minutes=(time.time() - t0) / 60)
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
    (tmp / "README.md").write_text(readme(plain_rows, best, points, costs[2], command), encoding="utf-8")
    figures(tmp, quality, points)
    if args.out.exists():
        shutil.rmtree(args.out)
    tmp.replace(args.out)
    return {k: v for k, v in metrics.items() if k not in ("sweep", "calibration", "heldout_replay")} | meta
