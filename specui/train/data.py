"""Training data along the target's own answers: the target answers each prompt (batched,
left-padded generate), then one teacher-forced forward per conversation records the target's
top-k log-probabilities p at every answer position. Collected in chunks and saved as it goes,
so an interrupted run resumes where it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specui.bench.prompts import PromptItem
from specui.chat import build_prompt
from specui.errors import SpecUIError


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
        for name in ("ids", "prompt_ids", "answer_ids", "topk_ids", "topk_logp"):
            getattr(self, name).extend(getattr(other, name))


def check_chat_model(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        raise SpecUIError("the target has no chat template: distillation needs a chat (instruct) model's answers")


@torch.inference_mode()
def generate_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
    eos_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
) -> list[list[int]]:
    """Answers for a batch of prompts (left padding), each cut after its first EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(seed)
    sample = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    out = model.generate(
        ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
        do_sample=temperature > 0, eos_token_id=eos_ids, pad_token_id=pad, **sample,
    )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


@torch.inference_mode()
def teacher_topk(model: PreTrainedModel, prompt: list[int], answer: list[int], k: int):
    """The target's top-k (ids int32, log-probs float16) at each answer position."""
    seq = torch.tensor([prompt + answer], device=model.device)
    logits = model(input_ids=seq, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
    logp = logits.log_softmax(-1)
    top = logp.topk(k, dim=-1)
    return top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu()


def collect(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: list[PromptItem], eos_ids: list[int],
    path: Path, *, max_new_tokens: int = 192, temperature: float = 0.0, batch_size: int = 16, k: int = 32,
    seed: int = 0, context: int = 2048,
) -> AnswerSet:
    """Answer every prompt not yet in `path` (resuming), record the teacher top-k, save
    after every batch."""
    check_chat_model(tokenizer)
    data = AnswerSet.load(path) if path.is_file() else AnswerSet()
    done = set(data.ids)
    todo = [it for it in items if it.id not in done]
    rendered = [(it.id, build_prompt(tokenizer, it.messages, context - max_new_tokens)[0]) for it in todo]
    rendered.sort(key=lambda r: len(r[1]))  # similar lengths batch together: less padding
    bar = tqdm(total=len(items), initial=len(done), desc=f"target answers -> {path.name}", unit="prompt")
    for start in range(0, len(rendered), batch_size):
        chunk = rendered[start:start + batch_size]
        answers = generate_answers(model, tokenizer, [p for _, p in chunk], eos_ids, max_new_tokens,
                                   temperature, seed + start)
        for (pid, prompt), answer in zip(chunk, answers):
            if not answer:
                continue
            ids, logp = teacher_topk(model, prompt, answer, k)
            data.ids.append(pid)
            data.prompt_ids.append(prompt)
            data.answer_ids.append(answer)
            data.topk_ids.append(ids)
            data.topk_logp.append(logp)
        data.save(path)
        bar.update(len(chunk))
    bar.close()
    return data
