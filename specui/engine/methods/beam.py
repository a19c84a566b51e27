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
from specui.engine.sampling import warp
from specui.engine.session import BeamBatch
from specui.engine.trace import TARGET, NodeTrace
from specui.errors import SpecUIError


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float


class Beam(Method):
    name = "beam"

    def __init__(self, width: int = 4) -> None:
        if width < 1:
            raise SpecUIError(f"beam width must be >= 1, got {width}")
        self.width = width
        self.batch: BeamBatch | None = None
        self.running: list[Hypothesis] = []
        self.finished: list[Hypothesis] = []
        self.logits: torch.Tensor | None = None

    def begin(self, ctx: DecodeContext) -> None:
        # Beams live in their own batched cache; the shared session keeps its prefix cache.
        self.batch = BeamBatch(ctx.target)
        self.logits = self.batch.start(ctx.ids)
        self.running = [Hypothesis([], 0.0)]

    def _candidates(self, ctx: DecodeContext, joint: torch.Tensor) -> list[int]:
        """Flat (beam * V + token) indices in the order they are considered."""
        pool = min(max(2, 1 + len(ctx.eos_ids)) * self.width, joint.numel())  # as transformers
        if ctx.sampling.greedy:
            return torch.topk(joint, pool).indices.tolist()
        p_beam = warp(joint, ctx.sampling)
        pool = min(pool, int((p_beam > 0).sum()))
        return torch.multinomial(p_beam, pool, replacement=False, generator=ctx.generator).tolist()

    def step(self, ctx: DecodeContext) -> StepResult:
        assert self.batch is not None and self.logits is not None
        vocab = self.logits.shape[-1]
        with ctx.timer.phase("verify"):
            logp = self.logits.double().log_softmax(-1)  # (B, V)
            scores = torch.tensor([h.score for h in self.running], dtype=logp.dtype, device=logp.device)
            joint = (scores[:, None] + logp).view(-1)
            kept: list[tuple[int, int, float]] = []  # (parent beam, token, score)
            nodes = []
            for rank, flat in enumerate(self._candidates(ctx, joint)):
                parent, token = divmod(flat, vocab)
                score = float(joint[flat])
                if token in ctx.eos_ids:
                    if rank >= self.width:  # only top-W finishes count (as in transformers)
                        continue
                    self.finished.append(Hypothesis(self.running[parent].tokens + [token], score))
                else:
                    kept.append((parent, token, score))
                nodes.append(NodeTrace(
                    token_id=token, text="", parent=-1, depth=len(self.running[parent].tokens) + 1,
                    status=TARGET, p=float(logp[parent, token].exp()), beam=parent, score=score,
                ))
                if len(kept) == self.width:
                    break
            self.running = [Hypothesis(self.running[b].tokens + [t], s) for b, t, s in kept]
            done = self._done(ctx)
            if not done:
                parents = torch.tensor([b for b, _, _ in kept], device=self.logits.device)
                tokens = torch.tensor([t for _, t, _ in kept], device=self.logits.device)
                self.logits = self.batch.step(parents, tokens)
        best = self._best(include_running=done)
        return StepResult(tokens=best.tokens, nodes=nodes, replace=True, finished=done, beam_width=len(kept))

    def _done(self, ctx: DecodeContext) -> bool:
        if not self.running:
            return True
        if self.finished and max(h.score for h in self.finished) >= max(h.score for h in self.running):
            return True
        return len(self.running[0].tokens) >= ctx.max_new_tokens

    def _best(self, include_running: bool) -> Hypothesis:
        pool = self.finished + self.running if include_running else self.running or self.finished
        return max(pool, key=lambda h: h.score)
