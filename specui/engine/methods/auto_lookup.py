"""`auto`'s prompt-lookup candidate: where a reply copies its prompt (summaries, rewrites, code
edits) the conversation itself proposes the next tokens, with no draft forward at all, and one
such step can commit many tokens. On a 1.7b stand-in (2-core Zen 5, w4a8) `lookup` alone ran
2.11x autoregressive on summaries where `auto`'s chains ran 1.27x, and 1.02x on chat where they
ran 1.35x: neither wins everywhere, so `auto` weighs it step by step.

Each step the n-gram index proposes the tokens after the first earlier occurrence of the reply's
last n tokens (n = 3, 2, 1: lookup.NgramIndex). How often such proposals are right is measured per
n on every step, whatever ran: the proposal's leading tokens that equal the tokens the step
committed (a lookup step's own verdict; after a chain or a plain step, the target's tokens:
under sampling a committed token is x with probability p~(x), which is the chance a one-hot
proposal of x is accepted, so the estimate is the same in expectation; the comparison stops at
the first token that differs, and a proposal longer than what was committed counts no miss).
A lookup step of k tokens is then expected to commit (1 - beta^(k+1)) / (1 - beta) tokens for
one target forward of k + 1 tokens (the profile's t(k + 1), corrected by the running ratio of
measured to predicted lookup steps), and it runs where that rate beats the best chain and plain
decoding by `auto`'s margin. The step itself is `lookup`'s (lossless for greedy and sampling)."""

from __future__ import annotations

import time

from specui.engine.costs import AcceptanceEstimate, EngineCosts
from specui.engine.method import DecodeContext, StepResult
from specui.engine.methods.chain_rate import chain_tokens
from specui.engine.methods.lookup import NgramIndex, lookup_step
from specui.errors import SpecUIError

NGRAM = 3  # the longest n-gram matched (as `lookup`'s default)
TOKENS = 10  # the most tokens one step proposes (as `lookup`'s default; the user's --lookup-tokens)


def _prior() -> AcceptanceEstimate:
    """A proposal's token is right 3 times in 10 until measured (the weight of two tokens)."""
    return AcceptanceEstimate(0.6, 1.4, long_accepted=0.6, long_rejected=1.4)


class LookupChoice:
    """The proposal for the current step, and how often proposals of each match length were right."""

    def __init__(self, ngram: int = NGRAM, tokens: int = TOKENS) -> None:
        if not 1 <= tokens <= 64:
            raise SpecUIError(f"lookup tokens must be 1 to 64, got {tokens}")
        self.index = NgramIndex(ngram)
        self.tokens = tokens
        self.right = {n: _prior() for n in range(1, ngram + 1)}  # the engine's (EngineCosts.lookup) once shared
        self.n, self.drafts = 0, []  # this step's proposal (its match length, its tokens)
        self.k = 0  # how many of them a lookup step chosen on it verifies

    def share(self, costs: EngineCosts) -> None:
        """Measure in the engine's estimates, kept across replies (a conversation that copies its
        prompt once tends to again); a match length not measured yet starts from the prior."""
        for n, estimate in self.right.items():
            costs.lookup.setdefault(n, estimate)
        self.right = costs.lookup

    def propose(self, ids: list[int], limit: int) -> list[int]:
        """This step's proposal: at most `limit` (and TOKENS) tokens, [] where nothing matches."""
        self.n, self.drafts = self.index.continuation(ids, min(self.tokens, limit)) if limit > 0 else (0, [])
        return self.drafts

    def best(self, costs: EngineCosts, context: int, ratio: float) -> tuple[float, int]:
        """(expected tokens per ms, tokens to propose) of the best lookup step on this proposal:
        its first k tokens for the k of the best rate; (0.0, 0) where there is no proposal."""
        if not self.drafts or costs.profile is None:
            return 0.0, 0
        beta = min(self.right[self.n].alpha, 0.999)
        rates = {k: chain_tokens(beta, k) / (costs.profile.target(k + 1, context) * ratio)
                 for k in range(1, len(self.drafts) + 1)}
        k = max(rates, key=rates.__getitem__)
        return rates[k], k

    def choice(self, ctx: DecodeContext, others: float, margin: float) -> str | None:
        """Why this step verifies the conversation's continuation, or None; `others`: the best rate
        (tokens per ms) of chains and plain decoding, which a lookup step must beat by `margin`."""
        if not self.propose(ctx.ids, min(ctx.remaining - 1, ctx.room)):
            return None
        ratio = ctx.costs.ratio("lookup")
        ratio = ratio if ratio.seen else ctx.costs.ratio("autoregressive")  # until a lookup step is timed
        rate, self.k = self.best(ctx.costs, len(ctx.ids), ratio.value)
        if rate <= others * (1.0 + margin):
            return None
        return (f"the conversation's continuation after a {self.n}-gram, right {self.right[self.n].alpha:.2f} a "
                f"token: {rate / others:.2f}x the best chain or plain decoding expected")

    def step(self, ctx: DecodeContext, calibrate: bool) -> StepResult:
        """The lookup step chosen: the proposal's first k tokens verified (its time against the
        profile's prediction kept as the running ratio of lookup steps)."""
        drafts, context = self.drafts[:self.k], len(ctx.ids)
        t0 = time.perf_counter()
        result = lookup_step(ctx, drafts)
        if calibrate:
            ctx.costs.ratio("lookup").observe((time.perf_counter() - t0) * 1000.0,
                                              ctx.costs.profile.target(len(drafts) + 1, context))
        return result

    def observe(self, committed: list[int]) -> None:
        """What this step's proposal would have yielded, from the tokens the step committed."""
        if self.drafts:
            seen = min(len(self.drafts), len(committed))
            agreed = next((i for i in range(seen) if self.drafts[i] != committed[i]), seen)
            self.right[self.n].observe(seen, agreed)
        self.n, self.drafts = 0, []
