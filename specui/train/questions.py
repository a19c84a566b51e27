"""New training prompts written by the target itself (issue 18: more, and more varied, data
than hand-written prompt sets give).

Each request shows the target three single-turn prompts of one category from the training
files and asks for one new request of the same kind about another subject; it is answered
sampled (T = 1.0) on the same continuous batch as the answers. A reply becomes a prompt when
it is one plausible request: 15-400 characters, not a copy of its examples, and not close to
any held-out prompt (word-set Jaccard <= 0.5, the rule the hand-written sets follow). Kept
prompts go to a JSONL prompt file like the hand-written ones; rerunning adds more."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

from specui.bench.prompts import PromptItem
from specui.chat import build_prompt
from specui.train.answers import Job, answer_key
from specui.train.data import Collector

INSTRUCTION = ("Here are three requests that people sent to an AI assistant:\n\n{examples}\n\n"
               "Write one new request of the same kind ({category}) about a different subject. "
               "Reply with the new request only.")
MAX_EXAMPLE_CHARS = 400


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / max(1, len(a | b))


def single_turn(items: Sequence[PromptItem]) -> dict[str, list[str]]:
    """User texts of one-message prompts per category, short enough to show as examples."""
    out: dict[str, list[str]] = {}
    for item in items:
        if len(item.messages) == 1 and len(item.messages[0]["content"]) <= MAX_EXAMPLE_CHARS:
            out.setdefault(item.category, []).append(item.messages[0]["content"].strip())
    return out


def requests(examples: dict[str, list[str]], count: int, seed: int, start: int = 0) -> list[tuple[str, str, list[str]]]:
    """(id, category, the three examples shown) for requests start .. start + count - 1
    (request n always shows the same examples, so reruns continue the same series)."""
    cats = sorted(c for c, texts in examples.items() if len(texts) >= 3)
    out = []
    for n in range(start, start + count):
        rng = random.Random(seed * 1_000_003 + n)
        cat = cats[n % len(cats)]
        out.append((f"gen-{n:05d}", cat, rng.sample(examples[cat], 3)))
    return out


def question_jobs(collector: Collector, plan: list[tuple[str, str, list[str]]], series: str) -> list[Job]:
    """One sampled reply per planned request, keyed by `series` (the output file and seed: the
    same request number of another series is another request, never a cached reply)."""
    jobs = []
    for qid, cat, shown in plan:
        text = INSTRUCTION.format(examples="\n\n".join(f"{i + 1}. {e}" for i, e in enumerate(shown)), category=cat)
        prompt = build_prompt(collector.tokenizer, [{"role": "user", "content": text}], collector.context)[0]
        jobs.append(Job(answer_key(f"questions-{series}", qid, 1.0, 0), tuple(prompt), 1.0, 1))
    return jobs


def clean(reply: str, shown: list[str], heldout: list[set[str]], ended: bool = True) -> str | None:
    """The request in a reply, or None when it is not one usable request (a reply cut at the
    token limit, `ended` False, is not)."""
    if not ended:
        return None
    text = reply.strip().strip('"').strip()
    text = re.sub(r"^(new request|request|\d+[.)])\s*:?\s*", "", text, flags=re.IGNORECASE).strip().strip('"')
    if not 15 <= len(text) <= 400 or "\n\n" in text:
        return None
    mine = words(text)
    if len(mine) < 3 or any(jaccard(mine, words(e)) > 0.6 for e in shown):
        return None
    if any(jaccard(mine, h) > 0.5 for h in heldout):
        return None
    return text


def generate(collector: Collector, train_items: Sequence[PromptItem], heldout_items: Sequence[PromptItem],
             out: Path, count: int, seed: int = 0) -> int:
    """Ask for `count` more requests (after those asked for before, counted from `out`'s
    `asked` marker), append the usable ones to `out`; returns how many were kept."""
    out.parent.mkdir(parents=True, exist_ok=True)
    state = out.with_suffix(".state.json")
    asked = json.loads(state.read_text(encoding="utf-8"))["asked"] if state.is_file() else 0
    plan = requests(single_turn(train_items), count, seed, start=asked)
    jobs = question_jobs(collector, plan, f"{out.stem}-s{seed}")
    collector.gather(jobs, desc="target-written requests")
    answers = collector.store.answers()
    heldout = [words(m["content"]) for it in heldout_items for m in it.messages if m["role"] == "user"]
    lines = out.read_text(encoding="utf-8").splitlines() if out.is_file() else []
    seen = {json.loads(line)["messages"][0]["content"].lower() for line in lines if line.strip()}
    kept = []
    for (qid, cat, shown), job in zip(plan, jobs):
        answer = answers.get(job.key)
        text = None if answer is None else clean(
            collector.tokenizer.decode(answer.answer_ids, skip_special_tokens=True), shown, heldout, answer.ended)
        if text is None or text.lower() in seen:
            continue
        seen.add(text.lower())
        kept.append({"id": qid, "category": cat, "messages": [{"role": "user", "content": text}]})
    with out.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in kept)
    state.write_text(json.dumps({"asked": asked + count, "seed": seed}) + "\n", encoding="utf-8")
    return len(kept)
