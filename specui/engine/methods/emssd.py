"""EMS-SD (DESIGN.md 3.8, seed 003): several generations decoded speculatively in lockstep,
each accepting its own number of tokens per step, over ragged sessions (engine/ragged.py).

`BatchDecoder` is the step: one batched draft forward per draft position (rows that drafted
enough, or drafted an EOS, feed nothing), one batched target forward that verifies every
row's chain, and per-row verification with the row's own sampling settings and generator
(the chain rule of speculative decoding, so each row keeps its own target distribution).
`Batch` runs Generations on one decoder: they join (prefilled together) and leave (finished,
cancelled, failed) between steps, and each step's trace goes to its own Generation, which
applies stops and keeps its text exactly as the one generate loop does (`commit_step`).

Without a draft model (or gamma 0) every row decodes autoregressively: batched greedy or
sampled decoding, the batch benchmark's baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specui.engine.method import DecodeContext, Method, StepResult, StepTimer
from specui.engine.methods.speculative import chain_step
from specui.engine.ragged import RaggedSession, SessionRow
from specui.engine.sampling import sample, warp
from specui.engine.trace import StepTrace
from specui.errors import SpecUIError
from specui.settings import PADDINGS


@dataclass
class BatchRow:
    ctx: DecodeContext
    gamma: int
    target: SessionRow
    draft: SessionRow | None


class BatchDecoder:
    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None, vocab_size: int,
                 padding: str = "unpad") -> None:
        self.target = RaggedSession(target, vocab_size, padding)
        self.draft = RaggedSession(draft, vocab_size, padding) if draft is not None else None
        self.rows: list[BatchRow] = []
        self.timer = StepTimer(self.target.device)

    @property
    def padding(self) -> str:
        return self.target.padding

    def add(self, ctx: DecodeContext, gamma: int) -> BatchRow:
        """A new row for `ctx`; its sessions become the row's (the Generation commits through them)."""
        row = BatchRow(ctx, gamma if self.draft is not None else 0, self.target.add_row(),
                       self.draft.add_row() if self.draft is not None else None)
        ctx.target, ctx.draft = row.target, row.draft
        self.rows.append(row)
        return row

    def remove(self, rows: Sequence[BatchRow]) -> None:
        self.target.remove_rows([r.target for r in rows])
        if self.draft is not None:
            self.draft.remove_rows([r.draft for r in rows])
        self.rows = [r for r in self.rows if r not in rows]

    def prefill(self, rows: Sequence[BatchRow]) -> None:
        """Cache every prompt but its last token (fed by the row's first step), in one forward per model."""
        rows = [r for r in rows if len(r.ctx.ids) > 1]
        if not rows:
            return
        self.target.advance([(r.target, r.ctx.ids[:-1], 1) for r in rows])
        if self.draft is not None:
            self.draft.advance([(r.draft, r.ctx.ids[:-1], 1) for r in rows if r.gamma])

    def step(self) -> list[StepResult]:
        """One step for every row (results in row order); timings go to each row's timer."""
        self.timer.reset()
        rows = self.rows
        gammas = [max(0, min(r.gamma, r.ctx.remaining - 1)) for r in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        q_rows: list[list[torch.Tensor]] = [[] for _ in rows]
        logit_rows: list[list[torch.Tensor]] = [[] for _ in rows]
        with self.timer.phase("draft"):
            while True:
                active = [i for i, r in enumerate(rows) if len(drafts[i]) < gammas[i]]
                if not active:
                    break
                logits = self.draft.advance([(rows[i].draft, rows[i].ctx.ids + drafts[i], 1) for i in active])
                for i, out in zip(active, logits):
                    ctx, out = rows[i].ctx, out[-1]
                    q = warp(out, ctx.sampling)
                    token = int(out.argmax()) if ctx.sampling.greedy else sample(q, ctx.generator)
                    drafts[i].append(token)
                    q_rows[i].append(q)
                    logit_rows[i].append(out)
                    if token in ctx.eos_ids:
                        gammas[i] = len(drafts[i])
        results = []
        with self.timer.phase("verify"):
            p_logits = self.target.advance([(r.target, r.ctx.ids + drafts[i], len(drafts[i]) + 1)
                                            for i, r in enumerate(rows)])
            for i, r in enumerate(rows):
                q = torch.stack(q_rows[i]) if drafts[i] else None
                q_logits = torch.stack(logit_rows[i]) if drafts[i] else None
                result = chain_step(drafts[i], q, q_logits, p_logits[i], r.ctx.sampling, r.ctx.generator,
                                    gammas[i])
                results.append(result)
        for r in rows:
            r.ctx.timer.ms = dict(self.timer.ms)
        return results

    def padding_stats(self) -> dict:
        """Padding computed and stored so far, per model."""
        out = {"target": self.target.stats.to_dict()}
        if self.draft is not None:
            out["draft"] = self.draft.stats.to_dict()
        return out


@dataclass
class Running:
    generation: object  # a Generation (engine/loop.py) whose method is EMS-SD
    row: BatchRow
    started: float  # perf_counter at the end of its prefill


class Batch:
    """Generations (method ems-sd) decoded together on one BatchDecoder, joining and leaving
    between steps. `step()` returns each running generation's new trace."""

    def __init__(self, decoder: BatchDecoder) -> None:
        self.decoder = decoder
        self.running: list[Running] = []
        self.sizes: list[int] = []  # batch size at each step

    def join(self, generations: Sequence, on_error: Callable[[object, BaseException], None] | None = None) -> None:
        """Add generations and prefill them together. A prefill that fails (out of memory)
        fails only the joining generations: each is handed to `on_error` (or the error is
        raised when no handler is given) and the batch goes on without them."""
        rows = [self.decoder.add(g.ctx, g.method.gamma) for g in generations]
        t0 = time.perf_counter()
        try:
            self.decoder.prefill(rows)
        except (RuntimeError, MemoryError) as e:
            self.decoder.remove(rows)
            if on_error is None:
                raise
            for g in generations:
                on_error(g, e)
            return
        for g, row in zip(generations, rows):
            g.stats.prefill_s = time.perf_counter() - t0
            self.running.append(Running(g, row, time.perf_counter()))

    @property
    def generations(self) -> list:
        return [r.generation for r in self.running]

    def leave(self, generation) -> None:
        self.decoder.remove([r.row for r in self.running if r.generation is generation])
        self.running = [r for r in self.running if r.generation is not generation]

    def step(self) -> list[tuple[object, StepTrace]]:
        """Drop finished / cancelled generations, run one batched step, commit each row's
        result through its own Generation (stops, text, stats)."""
        for g in self.generations:
            reason = g.stop_reason()
            if reason:
                g.stats.finish_reason = reason
                self.leave(g)
        if not self.running:
            return []
        self.sizes.append(len(self.running))
        t0 = time.perf_counter()
        results = self.decoder.step()
        step_ms = (time.perf_counter() - t0) * 1000.0
        out = []
        for running, result in zip(list(self.running), results):
            g = running.generation
            trace = g.commit_step(result, step_ms)
            trace.batch_size = len(results)
            g.stats.decode_s = time.perf_counter() - running.started
            out.append((g, trace))
            if g.stats.finish_reason:
                self.leave(g)
        return out

    def run(self) -> None:
        """Step until every generation has finished."""
        while self.running:
            self.step()


class EmsSd(Method):
    name = "ems-sd"
    uses_draft = True
    draft_optional = True

    def __init__(self, gamma: int = 2, padding: str = "unpad") -> None:
        if gamma < 0:
            raise SpecUIError(f"gamma (draft length) must be >= 0, got {gamma}")
        if padding not in PADDINGS:
            raise SpecUIError(f"unknown padding '{padding}'; choose one of: {', '.join(PADDINGS)}")
        self.gamma = gamma
        self.padding = padding
        self._decoder: BatchDecoder | None = None

    def decoder(self, target: PreTrainedModel, draft: PreTrainedModel | None, vocab_size: int) -> BatchDecoder:
        """A fresh batch decoder with this method's padding (no draft when gamma is 0)."""
        return BatchDecoder(target, draft if self.gamma else None, vocab_size, self.padding)

    def begin(self, ctx: DecodeContext) -> None:
        self._decoder = self.decoder(ctx.target.model, ctx.draft.model if ctx.draft is not None else None,
                                     ctx.target.vocab_size)
        self._decoder.prefill([self._decoder.add(ctx, self.gamma)])

    def step(self, ctx: DecodeContext) -> StepResult:
        assert self._decoder is not None, "begin() first"
        return self._decoder.step()[0]
