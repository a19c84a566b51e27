"""The target's answers and the passes over them that the subcommands of `python -m specui.train`
train on: answer_sets (every missing answer collected, then the teacher's top-k along them),
the target's states along answers for a feature draft, and the dtype of the teacher passes
(--teacher-dtype auto: measured here)."""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from specui.bench.prompts import load_prompts
from specui.engine.timing import median_ms
from specui.errors import SpecUIError
from specui.train.collect_command import make_collector
from specui.train.data import AnswerSet
from specui.train.states import states_for
from specui.weights.dtypes import choice_key, choose_dtype, dtype_name
from specui.weights.loading import LoadedModel


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
    key = choice_key(target.model, "teacher prefill", with_code=False)  # stable: a resumed run's id reads it
    choice = choose_dtype(lambda d: pass_model(target, dtype_name(d))(), key, path, timer=prefill_ms, recheck=False)
    args.teacher_dtype = dtype_name(choice.dtype)
    rates = ", ".join(f"{n} {batch.numel() / ms * 1000:.0f}" for n, ms in choice.ms.items())
    where = f" (chosen earlier on this machine: {path})" if choice.cached else ""
    print(f"teacher passes in {args.teacher_dtype}{where}: {rates} prefill tokens/s (--teacher-dtype to fix it)",
          file=sys.stderr)

