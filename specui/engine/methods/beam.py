"""Beam search and beam sampling (DESIGN.md 3.2), the baseline for DSBD.

W beams with log-likelihoods. Candidates are all (beam, token) pairs with joint score
log p(beam) + log p(x | beam). Deterministic: keep the best W; sampling: draw from
p_beam = warp(softmax(joint)) without replacement. A candidate ending in EOS becomes a
finished hypothesis. Scores are sums of log-probabilities (no length penalty), so once the
best finished hypothesis scores at least the best running beam, no beam can overtake it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.rows import RowSession
from specui.engine.sampling import warp
from specui.engine.trace import TARGET, NodeTrace
from specui.errors import SpecUIError


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float


@dataclass
class Pick:
    parent: int  # row of the joint scores
    token: int
    score: float  # joint log-likelihood


@dataclass
class Picks:
    kept: list[Pick]  # the next beams (no EOS)
    finished: list[Pick]  # EOS among the top `width`: finished hypotheses
    considered: list[Pick]  # every candidate looked at, in order


def beam_search_done(running: list, finished: list[Hypothesis], max_new_tokens: int) -> bool:
    """No beam left, the best finished hypothesis at least the best running beam (scores are
    sums of log-probabilities: no beam can overtake it), or the length reached. `running`
    holds anything with `tokens` and `score`."""
    if not running:
        return True
    if finished and max(h.score for h in finished) >= max(b.score for b in running):
        return True
    return len(running[0].tokens) >= max_new_tokens


def select_beams(joint: torch.Tensor, width: int, ctx: DecodeContext) -> Picks:
    """One beam step over joint scores (parents, V): deterministic keeps the best `width`
    (as transformers: a pool of max(2, 1 + #EOS) * width, EOS counts only within the top
    `width` ranks); sampling draws the pool from warp(joint) without replacement."""
    vocab = joint.shape[-1]
    flat = joint.reshape(-1)
    pool = min(max(2, 1 + len(ctx.eos_ids)) * width, flat.numel())
    if ctx.sampling.greedy:
        order = torch.topk(flat, pool).indices.tolist()
    else:
        p_beam = warp(flat, ctx.sampling)
        order = torch.multinomial(p_beam, min(pool, int((p_beam > 0).sum())), replacement=False,
                                  generator=ctx.generator).tolist()
    picks = Picks([], [], [])
    for rank, f in enumerate(order):
        pick = Pick(*divmod(f, vocab), float(flat[f]))
        if pick.token in ctx.eos_ids:
            if rank >= width:  # only top-W finishes count (as in transformers)
                continue
            picks.finished.append(pick)
        else:
            picks.kept.append(pick)
        picks.considered.append(pick)
        if len(picks.kept) == width:
            break
    return picks


class Beam(Method):
    name = "beam"

    def __init__(self, width: int = 4) -> None:
        if width < 1:
            raise SpecUIError(f"beam width must be >= 1, got {width}")
        self.width = width
        self.rows: RowSession | None = None
        self.running: list[Hypothesis] = []
        self.finished: list[Hypothesis] = []
        self.fresh: list[int] = []  # each row's last token, not yet in the cache

    def begin(self, ctx: DecodeContext) -> None:
        # Beams live in rows of their own cache; the shared session keeps its prefix cache.
        self.rows = RowSession(ctx.target.model, ctx.target.vocab_size, ctx.target.clock, ctx.target.runner)
        self.rows.prefill(ctx.ids[:-1])
        self.running, self.fresh = [Hypothesis([], 0.0)], [ctx.ids[-1]]

    def step(self, ctx: DecodeContext) -> StepResult:
        assert self.rows is not None
        with ctx.timer.phase("verify"):
            logits = torch.cat(self.rows.forward([[(t, -1)] for t in self.fresh]))
            logp = logits.double().log_softmax(-1)  # (B, V)
            scores = torch.tensor([h.score for h in self.running], dtype=logp.dtype, device=logp.device)
            picks = select_beams(scores[:, None] + logp, self.width, ctx)
            nodes = [NodeTrace(token_id=p.token, text="", parent=-1, depth=len(self.running[p.parent].tokens) + 1,
                               status=TARGET, p=float(logp[p.parent, p.token].exp()), beam=p.parent, score=p.score)
                     for p in picks.considered]
            self.finished += [Hypothesis(self.running[p.parent].tokens + [p.token], p.score) for p in picks.finished]
            self.running = [Hypothesis(self.running[p.parent].tokens + [p.token], p.score) for p in picks.kept]
            done = self._done(ctx)
            if not done:
                self.rows.commit([(p.parent, [0]) for p in picks.kept])
                self.fresh = [p.token for p in picks.kept]
        best = self._best(include_running=done)
        return StepResult(tokens=best.tokens, nodes=nodes, replace=True, finished=done, beam_width=len(picks.kept))

    def end(self, ctx: DecodeContext) -> None:
        if self.rows is not None:
            self.rows.release()

    def _done(self, ctx: DecodeContext) -> bool:
        return beam_search_done(self.running, self.finished, ctx.max_new_tokens)

    def _best(self, include_running: bool) -> Hypothesis:
        pool = self.finished + self.running if include_running else self.running or self.finished
        return max(pool, key=lambda h: h.score)
