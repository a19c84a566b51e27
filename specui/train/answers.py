"""The target's answers, collected fast and kept as token ids (issue 18).

Collection runs the engine's own batched decoding (EMS-SD's ragged rows with no draft:
every row decodes autoregressively, greedy or sampled with its own seeded generator) with
continuous refill: a row that ends leaves between two steps and waiting prompts join, so the
batch stays full and no forward computes padding. The precision it runs in is chosen by
measuring a few batched steps of each candidate loading (`fastest_loading`).

An AnswerStore is a folder of compressed chunks holding only token ids (prompt and answer)
under a key per answer ("<set>/<prompt id>/<greedy | tT-sN>"). Finished answers are written
every few minutes, atomically; an interrupted run loses only the answers in flight, and the
next run (any later day) collects exactly the keys the store lacks. The teacher's top-k
log-probabilities are not stored: training recomputes them in one batched prefill pass
(data.py). `manifest.json` names the target's vocabulary, so answers from another target are
refused."""

from __future__ import annotations

import json
import time
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.sampling import SamplingConfig
from specui.errors import SpecUIError

FORMAT = 1


@dataclass(frozen=True)
class Job:
    """One answer to collect."""

    key: str
    prompt_ids: tuple[int, ...]
    temperature: float = 0.0
    round: int = 0  # 0: the greedy answer, s + 1: sampled answer s (collected round by round)

    @property
    def seed(self) -> int:  # a sampled answer's own seed: the same key samples the same way on any day
        return zlib.crc32(self.key.encode())


@dataclass(frozen=True)
class Answer:
    key: str
    prompt_ids: list[int]
    answer_ids: list[int]
    ended: bool  # the answer ended with an EOS (else it was cut at max new tokens)


def answer_key(set_name: str, prompt_id: str, temperature: float, sample: int) -> str:
    tag = "greedy" if temperature == 0 else f"t{temperature:g}-s{sample}"
    return f"{set_name}/{prompt_id}/{tag}"


class AnswerStore:
    """Append-only chunks of token ids; reading dedupes by key (the first copy wins), so a
    crash between writing a merged chunk and deleting its parts loses and doubles nothing."""

    def __init__(self, folder: Path, fingerprint: str, target_label: str = "") -> None:
        self.folder = Path(folder)
        manifest = self.folder / "manifest.json"
        if manifest.is_file():
            meta = json.loads(manifest.read_text(encoding="utf-8"))
            if meta.get("vocab_fingerprint") != fingerprint:
                raise SpecUIError(
                    f"{self.folder} holds answers of another target (vocabulary {meta.get('vocab_fingerprint')}, "
                    f"this target's {fingerprint}: {meta.get('target', '?')}); pass another --data folder")
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            manifest.write_text(json.dumps({"format": FORMAT, "vocab_fingerprint": fingerprint,
                                            "target": target_label}, indent=1) + "\n", encoding="utf-8")
        self._answers: dict[str, Answer] | None = None

    def chunks(self) -> list[Path]:
        return sorted(self.folder.glob("chunk-*.npz"))

    def answers(self) -> dict[str, Answer]:
        if self._answers is None:
            self._answers = {}
            for path in self.chunks():
                for answer in _read_chunk(path):
                    self._answers.setdefault(answer.key, answer)
        return self._answers

    def keys(self) -> set[str]:
        return set(self.answers())

    def append(self, answers: Sequence[Answer]) -> Path | None:
        if not answers:
            return None
        numbers = [int(p.stem.split("-")[1]) for p in self.chunks()]
        path = self.folder / f"chunk-{max(numbers, default=-1) + 1:06d}.npz"
        _write_chunk(path, answers)
        for answer in answers:
            self.answers().setdefault(answer.key, answer)
        return path

    def compact(self, most_tokens: int = 2_000_000) -> None:
        """Merge the chunks into as few as hold `most_tokens` each (fewer files to commit)."""
        parts = self.chunks()
        if len(parts) < 2:
            return
        merged, group, tokens = [], [], 0
        for answer in self.answers().values():
            group.append(answer)
            tokens += len(answer.prompt_ids) + len(answer.answer_ids)
            if tokens >= most_tokens:
                merged.append(group)
                group, tokens = [], 0
        if group:
            merged.append(group)
        written = [self.append(g) for g in merged]
        for path in parts:
            if path not in written:
                path.unlink()


def _write_chunk(path: Path, answers: Sequence[Answer]) -> None:
    flat = [t for a in answers for t in (*a.prompt_ids, *a.answer_ids)]
    dtype = np.uint16 if max(flat, default=0) < 1 << 16 else np.uint32
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f, keys=np.array([a.key for a in answers]), tokens=np.array(flat, dtype=dtype),
            prompt_len=np.array([len(a.prompt_ids) for a in answers], dtype=np.int32),
            answer_len=np.array([len(a.answer_ids) for a in answers], dtype=np.int32),
            ended=np.array([a.ended for a in answers], dtype=bool))
    tmp.replace(path)


def _read_chunk(path: Path) -> Iterable[Answer]:
    try:
        with np.load(path, allow_pickle=False) as z:
            keys, tokens = z["keys"].tolist(), z["tokens"].astype(np.int64).tolist()
            prompt_len, answer_len, ended = z["prompt_len"].tolist(), z["answer_len"].tolist(), z["ended"].tolist()
    except (OSError, ValueError, KeyError, zlib.error) as e:
        raise SpecUIError(f"{path} is not an answer chunk ({e}); delete it to collect its answers again") from None
    at = 0
    for key, p, a, end in zip(keys, prompt_len, answer_len, ended):
        yield Answer(key, tokens[at:at + p], tokens[at + p:at + p + a], bool(end))
        at += p + a


@dataclass
class CollectReport:
    answers: int = 0
    tokens: int = 0
    seconds: float = 0.0
    join_seconds: float = 0.0  # prefilling joining prompts
    steps: int = 0
    rows: int = 0  # summed over steps (mean batch = rows / steps)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def collect_answers(engine: Engine, jobs: Sequence[Job], store: AnswerStore, *, batch_size: int = 32,
                    max_new_tokens: int = 160, save_every_s: float = 120.0, desc: str = "target answers",
                    stop_after: int | None = None) -> CollectReport:
    """Answer every job whose key the store lacks, `batch_size` rows at a time with continuous
    refill; finished answers are saved every `save_every_s` seconds and at the end.
    `stop_after` (tests: an interruption) stops after that many answers, unsaved ones lost."""
    have = store.keys()
    todo = deque(j for j in dict.fromkeys(jobs) if j.key not in have)
    report = CollectReport()
    if not todo:
        return report
    method = make_method("ems-sd", gamma=0)
    batch = engine.batch(method)
    job_of: dict[int, Job] = {}
    unsaved: list[Answer] = []
    bar = tqdm(total=len(todo), desc=desc, unit="answer", dynamic_ncols=True)
    t0 = last_save = time.perf_counter()
    try:
        while todo or batch.running:
            free = batch_size - len(batch.running)
            # refill when a few rows are free (their prompts prefill together), or when the batch ran dry
            if todo and (free >= max(1, batch_size // 8) or not batch.running):
                joining = [todo.popleft() for _ in range(min(free, len(todo)))]
                gens = [engine.generate(GenerationRequest(list(j.prompt_ids), max_new_tokens,
                                                          SamplingConfig(temperature=j.temperature, seed=j.seed)),
                                        make_method("ems-sd", gamma=0)) for j in joining]
                job_of.update({id(g): j for g, j in zip(gens, joining)})
                t_join = time.perf_counter()
                batch.join(gens)
                report.join_seconds += time.perf_counter() - t_join
            report.steps += 1
            report.rows += len(batch.running)
            batch.step()
            for g in batch.drain_left():
                job = job_of.pop(id(g))
                if g.stats.finish_reason not in ("eos", "length") or not g.output_ids:
                    continue
                unsaved.append(Answer(job.key, list(job.prompt_ids), list(g.output_ids),
                                      g.stats.finish_reason == "eos"))
                report.answers += 1
                report.tokens += len(g.output_ids)
                report.seconds = time.perf_counter() - t0
                bar.update(1)
                bar.set_postfix_str(f"{report.tokens_per_s:.0f} tok/s, {report.tokens} tokens")
                if stop_after is not None and report.answers >= stop_after:
                    return report
            if unsaved and time.perf_counter() - last_save >= save_every_s:
                store.append(unsaved)
                unsaved, last_save = [], time.perf_counter()
        store.append(unsaved)
    finally:
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report


@torch.inference_mode()
def batched_tokens_per_s(engine: Engine, prompts: Sequence[Sequence[int]], batch_size: int, answer_len: int,
                         steps: int = 6) -> float:
    """Answer tokens/s of collecting with `batch_size` rows: each answer costs its prompt's
    prefill (a quarter of the batch joining at once, as refills do) and `answer_len` decode
    steps shared by the batch (timed after two warm-up steps)."""
    rows = [list(prompts[i % len(prompts)]) for i in range(batch_size)]
    make = lambda p, n: engine.generate(GenerationRequest(p, n), make_method("ems-sd", gamma=0))  # noqa: E731
    batch = engine.batch(make_method("ems-sd", gamma=0))
    quarter = max(1, batch_size // 4)
    batch.join([make(p, steps + 2) for p in rows[: batch_size - quarter]])
    t0 = time.perf_counter()
    batch.join([make(p, steps + 2) for p in rows[batch_size - quarter:]])
    prefill_s = (time.perf_counter() - t0) / quarter  # per joining prompt
    batch.step(), batch.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        batch.step()
    step_s = (time.perf_counter() - t0) / steps
    return answer_len / (prefill_s + answer_len * step_s / batch_size)
