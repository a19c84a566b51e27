"""Training data along the target's own answers: the answers themselves are collected fast
and kept as token ids (answers.py); the target's top-k log-probabilities p at every answer
position are recomputed here, in batched prefill forwards, and cached under the work folder
(resumable, like everything else)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specui.bench.prompts import PromptItem
from specui.chat import build_prompt
from specui.engine import Engine
from specui.errors import SpecUIError
from specui.train.answers import Answer, AnswerStore, CollectReport, Job, answer_key, collect_answers
from specui.train.states import padded_groups
from specui.weights.draft import vocab_fingerprint


class SavedFields:
    """save / load for a dataclass of tensors and lists: its fields in one torch file,
    written to a temporary name first (an interrupted save never leaves half a file)."""

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.__dict__, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path):
        return cls(**torch.load(path, weights_only=True))


@dataclass
class AnswerSet(SavedFields):
    """Conversations the target answered, with its top-k distribution along each answer.
    topk_ids[i], topk_logp[i]: (len(answer_ids[i]), k); row t is the target's distribution
    for answer token t given the prompt and answer[:t]."""

    ids: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    answer_ids: list[list[int]] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_logp: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def answer_tokens(self) -> int:
        return sum(len(a) for a in self.answer_ids)

    def extend(self, other: AnswerSet) -> None:
        for name in FIELDS:
            getattr(self, name).extend(getattr(other, name))

    def append(self, answer: Answer, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> None:
        self.ids.append(answer.key)
        self.prompt_ids.append(list(answer.prompt_ids))
        self.answer_ids.append(list(answer.answer_ids))
        self.topk_ids.append(topk_ids)
        self.topk_logp.append(topk_logp)

    def subset(self, index: Sequence[int]) -> AnswerSet:
        return AnswerSet(*([getattr(self, name)[i] for i in index] for name in FIELDS))


FIELDS = ("ids", "prompt_ids", "answer_ids", "topk_ids", "topk_logp")


def check_chat_model(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        raise SpecUIError("the target has no chat template: distillation needs a chat (instruct) model's answers")


@torch.inference_mode()
def teacher_topk(model: PreTrainedModel, answers: Sequence[Answer], k: int, batch_tokens: int = 4096):
    """The target's top-k (ids int32, log-probs float16) at each answer position of every
    answer, in right-padded batches of about `batch_tokens` tokens (causal attention: padding
    after a sequence changes nothing before it); the output layer runs on answer positions only."""
    out: list = [None] * len(answers)
    head = model.get_output_embeddings()
    for group, ids in padded_groups([a.prompt_ids + a.answer_ids for a in answers], batch_tokens):
        hidden = model.model(input_ids=ids.to(model.device), use_cache=False).last_hidden_state
        for r, j in enumerate(group):
            start, n = len(answers[j].prompt_ids) - 1, len(answers[j].answer_ids)
            logp = head(hidden[r, start:start + n]).float().log_softmax(-1)
            top = logp.topk(k, dim=-1)
            out[j] = (top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu())
    return out


@dataclass
class Collector:
    """The target's answers to prompt sets, as AnswerSets: answers from the store (collected
    by `engine`, the precision measured fastest, where missing), the teacher's top-k from
    `teacher` (the target in float32) cached in `cache_dir`."""

    teacher: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_ids: list[int]
    store: AnswerStore
    cache_dir: Path
    make_engine: Callable[[], Engine | None] | None = None  # the collection engine (None: the teacher's)
    max_new_tokens: int = 160
    batch_size: int = 32
    k: int = 32
    context: int = 2048
    temperatures: tuple[float, ...] = (0.8,)
    collect_rows: int = 0  # rows of the collection batch (0: batch_size); make_engine may set it
    _engine: Engine | None = field(default=None, repr=False)

    def jobs(self, items: Sequence[PromptItem], set_name: str, samples: int = 0, first: int = 0) -> list[Job]:
        """Greedy answers (unless `first`) and sampled ones per prompt: numbers
        `first` (1-based; 0: from 1) to `samples`; sample s (0-based) is drawn at
        temperatures[s % len(temperatures)]."""
        check_chat_model(self.tokenizer)
        out = []
        for item in items:
            prompt = tuple(build_prompt(self.tokenizer, item.messages, self.context - self.max_new_tokens)[0])
            if not first:
                out.append(Job(answer_key(set_name, item.id, 0.0, 0), prompt))
            for s in range(max(first - 1, 0), samples):
                t = self.temperatures[s % len(self.temperatures)]
                out.append(Job(answer_key(set_name, item.id, t, s), prompt, t, s + 1))
        return sorted(out, key=lambda j: j.round)  # every prompt's greedy answer first, then round by round

    def gather(self, jobs: Sequence[Job], desc: str = "target answers", **kw) -> CollectReport:
        have = self.store.keys()
        if all(j.key in have for j in jobs):
            return CollectReport()
        if self._engine is None:  # built (precision measured) only when something is missing
            made = self.make_engine() if self.make_engine is not None else None
            self._engine = made or Engine(self.teacher, self.tokenizer, None, self.eos_ids)
        return collect_answers(self._engine, jobs, self.store, batch_size=self.collect_rows or self.batch_size,
                               max_new_tokens=self.max_new_tokens, desc=desc, **kw)

    def answer_set(self, jobs: Sequence[Job], name: str, save_every_s: float = 60.0,
                   labels: str = "soft", teacher: Callable[[], PreTrainedModel] | None = None) -> AnswerSet:
        """The stored answers of `jobs` (collected first where missing) with the top-k of the
        model `teacher()` gives (called only when some are missing; default self.teacher),
        cached in `cache_dir / name.pt` and extended (resumably) as answers are added.
        labels "hard": no teacher pass; each position's distribution is its answer token
        (one-hot: the soft cross-entropy becomes the usual one on the target's own tokens)."""
        self.gather(jobs, desc=f"target answers ({name})")
        stored = self.store.answers()
        answers = [stored[j.key] for j in jobs if j.key in stored]
        if labels == "hard":
            out = AnswerSet()
            for a in answers:
                out.append(a, torch.tensor(a.answer_ids, dtype=torch.int32)[:, None],
                           torch.zeros(len(a.answer_ids), 1, dtype=torch.float16))
            return out
        path = self.cache_dir / f"{name}.pt"
        cached = AnswerSet.load(path) if path.is_file() else AnswerSet()
        at = {key: i for i, key in enumerate(cached.ids)}
        missing = [a for a in answers if a.key not in at]
        bar = tqdm(total=sum(len(a.answer_ids) for a in missing), desc=f"teacher top-{self.k} ({name})", unit="tok")
        last = time.perf_counter()
        step = max(1, self.batch_size * 4)
        model = (teacher() if teacher is not None else self.teacher) if missing else None
        for start in range(0, len(missing), step):
            part = missing[start:start + step]
            for a, (ids, logp) in zip(part, teacher_topk(model, part, self.k)):
                at[a.key] = len(cached.ids)
                cached.append(a, ids, logp)
            bar.update(sum(len(a.answer_ids) for a in part))
            if time.perf_counter() - last >= save_every_s:
                cached.save(path)
                last = time.perf_counter()
        bar.close()
        if missing:
            cached.save(path)
        return cached.subset([at[a.key] for a in answers])


def collect(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: list[PromptItem], eos_ids: list[int],
            path: Path, *, max_new_tokens: int = 192, temperature: float = 0.0, batch_size: int = 16, k: int = 32,
            seed: int = 0, context: int = 2048, engine: Engine | None = None) -> AnswerSet:
    """One answer per prompt (greedy, or sampled at `temperature` as sample number `seed`),
    collected on `engine` (default: `model` itself) into the store next to `path`, with the
    teacher's top-k from `model` cached at `path`."""
    store = AnswerStore(path.with_name(path.stem + "-answers"), vocab_fingerprint(tokenizer))
    c = Collector(model, tokenizer, eos_ids, store, path.parent, lambda: engine, max_new_tokens, batch_size, k,
                  context, (temperature,) if temperature > 0 else (0.8,))
    jobs = c.jobs(items, "prompts")
    if temperature > 0:
        jobs = [Job(answer_key("prompts", j.key.split("/")[1], temperature, seed), j.prompt_ids, temperature)
                for j in jobs]
    return c.answer_set(jobs, path.stem)
