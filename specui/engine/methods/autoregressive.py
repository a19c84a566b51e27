"""Autoregressive decoding (DESIGN.md 3.1): one target forward per token, with KV cache."""

from __future__ import annotations

from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.sampling import sample, warp
from specui.engine.trace import TARGET, NodeTrace


class Autoregressive(Method):
    name = "autoregressive"

    def step(self, ctx: DecodeContext) -> StepResult:
        with ctx.timer.phase("verify"):
            logits = ctx.target.advance(ctx.ids, need=1)[-1]
            if ctx.sampling.greedy:  # the argmax and its softmax probability (for the trace), no one-hot row:
                row = logits.float()  # float32 first: argmax over bfloat16 took twice as long (CPU, 49k vocabulary)
                token = int(row.argmax())
                p = float(row.softmax(-1)[token])  # a third of logsumexp's time here
            else:
                probs = warp(logits, ctx.sampling)
                token = sample(probs, ctx.generator)
                p = float(probs[token])
        node = NodeTrace(token_id=token, text="", parent=-1, depth=1, status=TARGET, p=p)
        return StepResult(tokens=[token], nodes=[node])
