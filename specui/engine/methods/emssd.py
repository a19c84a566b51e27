"""EMS-SD (DESIGN.md 3.8, seed 003): speculative decoding of several sequences in one
batch without padding. The batch itself lives in engine/batching.py; this Method is what
the one generate loop runs when a generation decodes alone (a batch of one row, the same
ragged sessions and step), and what a shared Batch reads a joining generation's settings
from. Without a draft model every row decodes autoregressively (batched greedy / sampled)."""

from __future__ import annotations

from specui.engine.batching import BatchDecoder
from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.ragged import PADDINGS
from specui.errors import SpecUIError


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

    def decoder(self, ctx: DecodeContext) -> BatchDecoder:
        """A fresh batch decoder over the models of `ctx`'s sessions."""
        draft = ctx.draft.model if ctx.draft is not None and self.gamma else None
        return BatchDecoder(ctx.target.model, draft, ctx.target.vocab_size, self.padding)

    def begin(self, ctx: DecodeContext) -> None:
        self._decoder = self.decoder(ctx)
        self._decoder.prefill([self._decoder.add(ctx, self.gamma)])

    def step(self, ctx: DecodeContext) -> StepResult:
        assert self._decoder is not None, "begin() first"
        return self._decoder.step()[0]
