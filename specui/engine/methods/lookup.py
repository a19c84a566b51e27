"""Prompt lookup: speculative decoding whose draft is the conversation itself (n-gram
matching, as transformers' `prompt_lookup_num_tokens`; no draft model).

Each step finds the first earlier occurrence of the last n tokens (n = ngram down to 1) in
the prompt and the reply so far and proposes the up to `lookup_tokens` tokens that followed
it. The proposal is a point mass q = 1 on each token, so verification is `speculative`'s with
one-hot q: accept x with probability p~(x), on reject draw from res(p~, q) = p~ without x,
bonus from p~ when all pass: lossless. Greedy: accept while the target's argmax agrees. With
no match the step is a plain autoregressive one. It pays where answers copy their prompt
(summaries, rewrites, code edits). `auto` weighs such a step against its chains each step
(auto_lookup.py)."""

from __future__ import annotations

import torch

from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.methods.speculative import chain_nodes, verify_chain
from specui.engine.sampling import shown_probs, warp
from specui.errors import SpecUIError


class NgramIndex:
    """The first occurrence of every n-gram (n <= `ngram`) of a token list that only grows (a
    reply's prompt and tokens so far), updated with the tokens added since the last call: a
    match costs a few dictionary reads a step instead of a scan of the whole context (at 2,000
    tokens the scan took milliseconds in Python, a tenth of a 1.7B model's step)."""

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram
        self.first: dict[tuple[int, ...], int] = {}
        self.seen: list[int] = []

    def extend(self, ids: list[int]) -> None:
        if ids[:len(self.seen)] != self.seen:  # another list (not this one grown): start again
            self.first, self.seen = {}, []
        for end in range(len(self.seen) + 1, len(ids) + 1):
            for n in range(1, min(self.ngram, end) + 1):
                self.first.setdefault(tuple(ids[end - n:end]), end - n)
        self.seen += ids[len(self.seen):]  # only what was added (not a copy of the whole context each step)

    def continuation(self, ids: list[int], limit: int) -> tuple[int, list[int]]:
        """(n, the up to `limit` tokens after the first earlier occurrence of ids' last n tokens),
        for the longest n <= ngram that occurs before them; (0, []) when none does."""
        self.extend(ids)
        for n in range(min(self.ngram, len(ids) - 1), 0, -1):
            start = self.first.get(tuple(ids[-n:]))
            if start is not None and start < len(ids) - n:  # never the tail itself
                return n, ids[start + n:start + n + limit]
        return 0, []


def find_continuation(ids: list[int], ngram: int, limit: int) -> list[int]:
    """The tokens after the first earlier occurrence of ids' last n tokens (the longest n
    <= ngram that occurs), at most `limit` of them; [] when nothing matches. The first
    occurrence (as transformers' prompt lookup) is usually in the prompt, which is what an
    answer copies: measured 2.05 tokens per target forward against 1.95 for the latest, on
    the bundled pair's answers to the code and summary prompt sets."""
    return NgramIndex(ngram).continuation(ids, limit)[1] if limit > 0 else []


def lookup_step(ctx: DecodeContext, drafts: list[int]) -> StepResult:
    """One step that verifies `drafts` (tokens the conversation proposes, q = 1 on each) against
    the target: speculative verification with one-hot q; no drafts: an autoregressive step."""
    cfg = ctx.sampling
    with ctx.timer.phase("verify"):
        p_logits = ctx.target.advance(ctx.ids + drafts, need=len(drafts) + 1)
        p = warp(p_logits, cfg)
        # q, the point masses, as rows only where sampling reads them (greedy compares argmaxes: at 64 tokens
        # of a 150k vocabulary the rows would be 78 MB a step)
        q = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), p.shape[-1]).to(p) \
            if drafts and not cfg.greedy else None
        verdict = verify_chain(drafts, q, p, cfg, ctx.generator)
    p_shown = shown_probs(p_logits, p, cfg)
    return StepResult(
        tokens=drafts[: verdict.accepted] + [verdict.next_token],
        from_draft=[True] * verdict.accepted + [False],
        nodes=chain_nodes(drafts, verdict, None if drafts else p_shown, p_shown),
        drafted=len(drafts), accepted=verdict.accepted, gamma=len(drafts),
    )


class PromptLookup(Method):
    name = "lookup"

    def __init__(self, lookup_tokens: int = 10, ngram: int = 3) -> None:
        if not 1 <= lookup_tokens <= 64:
            raise SpecUIError(f"lookup tokens must be 1 to 64, got {lookup_tokens}")
        if not 1 <= ngram <= 8:
            raise SpecUIError(f"lookup n-gram must be 1 to 8, got {ngram}")
        self.lookup_tokens, self.ngram = lookup_tokens, ngram
        self.index = NgramIndex(ngram)

    def step(self, ctx: DecodeContext) -> StepResult:
        limit = max(0, min(self.lookup_tokens, ctx.remaining - 1, ctx.room))
        with ctx.timer.phase("draft"):
            drafts = self.index.continuation(ctx.ids, limit)[1] if limit else []
        return lookup_step(ctx, drafts)
