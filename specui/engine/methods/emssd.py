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

The per-step draft length (`GammaPolicy`) and the row record it reads (`BatchRow`) live in
emssd_policy.py (importable from here too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from specui.engine.costs import EngineCosts
from specui.engine.host_memory import free_memory
from specui.engine.method import DecodeContext, Method, StepResult, StepTimer
from specui.engine.methods.emssd_policy import BatchRow, GammaPolicy
from specui.engine.methods.speculative import chain_step
from specui.engine.ragged import RaggedSession
from specui.engine.sampling import argmax_tokens, sample, warp
from specui.engine.trace import StepTrace
from specui.errors import SpecUIError
from specui.settings import PADDINGS


@dataclass
class Chain:
    """One row's draft this step: its tokens, their warped q rows and raw logits."""

    gamma: int  # the most tokens it may have (cut to its length after an EOS)
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class BatchDecoder:
    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None, vocab_size: int,
                 padding: str = "unpad", policy: GammaPolicy | None = None) -> None:
        self.target = RaggedSession(target, vocab_size, padding)
        self.draft = RaggedSession(draft, vocab_size, padding) if draft is not None else None
        self.rows: list[BatchRow] = []
        self.timer = StepTimer(self.target.device)
        self.policy = policy  # None: every row drafts its own gamma each step

    @property
    def padding(self) -> str:
        return self.target.padding

    def add(self, ctx: DecodeContext, gamma: int) -> BatchRow:
        """A new row for `ctx`; its sessions become the row's (the Generation commits through them)."""
        row = BatchRow(ctx, gamma if self.draft is not None else 0, self.target.add_row(),
                       self.draft.add_row() if self.draft is not None else None)
        if ctx.costs is not None:  # start from what this pair's chats have shown
            row.acceptance = replace(ctx.costs.acceptance)
        ctx.target, ctx.draft = row.target, row.draft
        self.rows.append(row)
        return row

    def remove(self, rows: Sequence[BatchRow]) -> None:
        self.target.remove_rows([r.target for r in rows])
        if self.draft is not None:
            self.draft.remove_rows([r.draft for r in rows])
        self.rows = [r for r in self.rows if r not in rows]

    def check_fits(self) -> None:
        """Raise MemoryError when the caches of the batch as it now stands (every row at its
        longest: prompt + reply + drafts) would not fit in free memory. A join reallocates every
        buffer (the old ones live until the copy is done), so the whole need must be free."""
        longest = max(len(r.ctx.ids) + r.ctx.remaining + r.gamma + 1 for r in self.rows)
        sessions = [self.target] + ([self.draft] if self.draft is not None else [])
        need = sum(s.cache_bytes(len(self.rows), longest) for s in sessions)
        free = free_memory(self.target.device)
        if free is not None and need > 0.9 * free:
            mb = 1 << 20
            raise MemoryError(f"the batch's cache would need {need / mb:,.0f} MB with this request, "
                              f"{free / mb:,.0f} MB are free")

    def prefill(self, rows: Sequence[BatchRow]) -> None:
        """Cache every prompt but its last token (fed by the row's first step), in one forward per model."""
        rows = [r for r in rows if len(r.ctx.ids) > 1]
        if not rows:
            return
        self.target.advance([(r.target, r.ctx.ids[:-1], 1) for r in rows])
        if self.draft is not None and self.policy is None:  # adaptive: when the first chain is chosen
            self.draft.advance([(r.draft, r.ctx.ids[:-1], 1) for r in rows if r.gamma])

    def catch_up(self, rows: Sequence[BatchRow]) -> None:
        """Feed the draft what it lacks of each row (its prompt, steps decoded without it) in
        one forward, so a step's timing measures drafting, not catching up."""
        behind = [r for r in rows if r.draft is not None and len(r.draft.cached) < len(r.ctx.ids) - 2]
        if behind:
            self.draft.advance([(r.draft, r.ctx.ids[:-1], 1) for r in behind])

    def step(self) -> list[StepResult]:
        """One step for every row (results in row order); timings go to each row's timer."""
        self.timer.reset()
        rows = self.rows
        gammas = [max(0, min(r.gamma, r.ctx.remaining - 1)) for r in rows]
        choice, why = None, ""
        if self.policy is not None and any(gammas):
            choice, why = self.policy.choose(rows, gammas)
            gammas = [min(g, choice) for g in gammas]
            if choice:
                with self.timer.phase("draft"):
                    self.catch_up([r for r, g in zip(rows, gammas) if g])
        context = sum(len(r.ctx.ids) for r in rows) // max(1, len(rows))
        t0 = time.perf_counter()
        with self.timer.phase("draft"):
            chains = self._draft(rows, gammas)
        with self.timer.phase("verify"):
            results = self._verify(rows, chains)
        notes = self.target.notes + (self.draft.notes if self.draft is not None else [])
        for session in (self.target, self.draft):
            if session is not None:
                session.notes = []
        for r, result in zip(rows, results):
            result.notes += notes
            if choice is not None:
                result.choice = f"speculative:{result.gamma}" if result.gamma else "autoregressive"
                result.stop_reason = why  # why the batch drafted this many (the trace shows it)
            if result.drafted:
                r.acceptance.observe(result.drafted, result.accepted)
                if r.ctx.costs is not None:
                    r.ctx.costs.acceptance.observe(result.drafted, result.accepted)
            r.ctx.timer.ms = dict(self.timer.ms)
        if choice is not None:
            self.policy.observe([c.gamma for c in chains], context, (time.perf_counter() - t0) * 1000.0)
        return results

    def _draft(self, rows: list[BatchRow], gammas: list[int]) -> list[Chain]:
        """Each row's chain of up to gammas[i] draft tokens (it ends early after an EOS): one
        batched draft forward per position, rows that are done feed nothing."""
        chains = [Chain(g) for g in gammas]
        while active := [i for i, c in enumerate(chains) if len(c.tokens) < c.gamma]:
            logits = self.draft.advance([(rows[i].draft, rows[i].ctx.ids + chains[i].tokens, 1) for i in active])
            for i, out in zip(active, logits):
                ctx, out, chain = rows[i].ctx, out[-1], chains[i]
                q = warp(out, ctx.sampling)
                chain.tokens.append(argmax_tokens(out)[0] if ctx.sampling.greedy else sample(q, ctx.generator))
                chain.q.append(q)
                chain.logits.append(out)
                if chain.tokens[-1] in ctx.eos_ids:
                    chain.gamma = len(chain.tokens)
        return chains

    def _verify(self, rows: list[BatchRow], chains: list[Chain]) -> list[StepResult]:
        """Every row's chain scored in one batched target forward, then verified with the row's
        own sampling settings and generator."""
        p_logits = self.target.advance([(r.target, r.ctx.ids + c.tokens, len(c.tokens) + 1)
                                        for r, c in zip(rows, chains)])
        return [chain_step(c.tokens, torch.stack(c.q) if c.tokens else None,
                           torch.stack(c.logits) if c.tokens else None, p, r.ctx.sampling, r.ctx.generator, c.gamma)
                for r, c, p in zip(rows, chains, p_logits)]

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
        self.left: list = []  # generations that left since `drain_left` was last called
        self.sizes: list[int] = []  # batch size at each step

    def join(self, generations: Sequence, on_error: Callable[[object, BaseException], None] | None = None) -> None:
        """Add generations and prefill them together. A prefill that fails (out of memory)
        fails only the joining generations: each is handed to `on_error` (or the error is
        raised when no handler is given) and the batch goes on without them."""
        rows = [self.decoder.add(g.ctx, g.method.gamma) for g in generations]
        t0 = time.perf_counter()
        try:
            self.decoder.check_fits()
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

    def leave(self, *generations) -> None:
        """Drop these generations' rows (all in one cache copy)."""
        going = {id(g) for g in generations}
        self.decoder.remove([r.row for r in self.running if id(r.generation) in going])
        self.running = [r for r in self.running if id(r.generation) not in going]
        self.left.extend(generations)

    def drain_left(self) -> list:
        """The generations that left (finished, stopped or dropped) since the last call."""
        left, self.left = self.left, []
        return left

    def step(self) -> list[tuple[object, StepTrace]]:
        """Drop finished / cancelled generations, run one batched step, commit each row's
        result through its own Generation (stops, text, stats)."""
        stopped = []
        for g in self.generations:
            reason = g.stop_reason()
            if reason:
                g.stats.finish_reason = reason
                stopped.append(g)
        if stopped:
            self.leave(*stopped)
        if not self.running:
            return []
        self.sizes.append(len(self.running))
        t0 = time.perf_counter()
        results = self.decoder.step()
        step_ms = (time.perf_counter() - t0) * 1000.0
        out = []
        accepted = [r.accepted for r in results]
        for i, (running, result) in enumerate(zip(list(self.running), results)):
            g = running.generation
            steps_before = g.stats.target_forwards
            trace = g.commit_step(result, step_ms)
            trace.batch_size, trace.batch_accepted, trace.batch_row = len(results), accepted, i
            g.stats.mean_batch_size += (len(results) - g.stats.mean_batch_size) / (steps_before + 1)
            g.stats.decode_s = time.perf_counter() - running.started
            out.append((g, trace))
        finished = [g for g, _ in out if g.stats.finish_reason]
        if finished:
            self.leave(*finished)
        return out

    def run(self) -> None:
        """Step until every generation has finished."""
        while self.running:
            self.step()


class EmsSd(Method):
    name = "ems-sd"
    uses_draft = True
    draft_optional = True
    needs_profile = True

    def __init__(self, gamma: int = 2, padding: str = "unpad", adaptive_gamma: bool = True) -> None:
        if gamma < 0:
            raise SpecUIError(f"gamma (draft length) must be >= 0, got {gamma}")
        if padding not in PADDINGS:
            raise SpecUIError(f"unknown padding '{padding}'; choose one of: {', '.join(PADDINGS)}")
        self.gamma = gamma  # adaptive: the most draft tokens per step; else exactly this many
        self.padding = padding
        self.adaptive_gamma = adaptive_gamma
        self._decoder: BatchDecoder | None = None

    def decoder(self, target: PreTrainedModel, draft: PreTrainedModel | None, vocab_size: int,
                costs: EngineCosts | None = None) -> BatchDecoder:
        """A fresh batch decoder with this method's padding (no draft when gamma is 0), its
        draft length chosen per step from the cost profile in `costs` when adaptive."""
        policy = None
        if self.adaptive_gamma and costs is not None and costs.profile is not None and costs.profile.has_draft:
            policy = GammaPolicy(costs)
        return BatchDecoder(target, draft if self.gamma else None, vocab_size, self.padding, policy)

    def begin(self, ctx: DecodeContext) -> None:
        self._decoder = self.decoder(ctx.target.model, ctx.draft.model if ctx.draft is not None else None,
                                     ctx.target.vocab_size, ctx.costs)
        self._decoder.prefill([self._decoder.add(ctx, self.gamma)])

    def step(self, ctx: DecodeContext) -> StepResult:
        assert self._decoder is not None, "begin() first"
        return self._decoder.step()[0]
