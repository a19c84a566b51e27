"""Autoregressive decoding (DESIGN.md 3.1): one target forward per token, with KV cache."""

from __future__ import annotations

from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.sampling import greedy_tokens, sample, scored
from specui.engine.trace import TARGET, NodeTrace


class Autoregressive(Method):
    name = "autoregressive"

    def step(self, ctx: DecodeContext) -> StepResult:
        with ctx.timer.phase("verify"):
            logits = ctx.target.advance(ctx.ids, need=1)  # (1, V)
            if ctx.sampling.greedy:  # the row as it is (a view of one row and its copy cost more than the read)
                rows, shown = scored(logits, ctx.sampling)
                token = greedy_tokens(rows, shown)[0]
                p = float(shown[0, token])
            else:
                rows, shown = scored(logits[-1], ctx.sampling)
                token = sample(rows, ctx.generator)
                p = float(shown[token])
        node = NodeTrace(token_id=token, text="", parent=-1, depth=1, status=TARGET, p=p)
        return StepResult(tokens=[token], nodes=[node])
