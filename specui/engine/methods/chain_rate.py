"""What a speculative chain is expected to yield and what catching its draft up costs: the
arithmetic `auto`, EMS-SD's gamma policy and the joint quantization/method choice share."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specui.engine.method import DecodeContext

HORIZON = 64  # tokens over which a draft's catch-up is expected to pay back at most (replies often end early)


def chain_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens committed by one chain step of `gamma` drafts (bonus included)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def chain_ms(profile, gamma: int, context: int) -> float:
    """Predicted ms of plain decoding (gamma 0) or of a chain of `gamma` drafts and its verification."""
    if gamma == 0:
        return profile.target(1, context)
    return gamma * (profile.draft(1, context) or 0.0) + profile.target(gamma + 1, context)


def catch_up_per_token(profile, behind: int, rows: int, room: float, ratio: float = 1.0) -> float:
    """Ms per committed token that first feeding the draft `behind` tokens it has not read
    (prompts, steps decoded without it) adds, paid once and spread over the next `room`
    tokens of each of `rows` rows (at most HORIZON)."""
    if behind <= 2 * rows:
        return 0.0
    return (profile.draft(behind) or 0.0) * ratio / (rows * max(1.0, min(HORIZON, room)))


def stop_floor(alpha: float, unsure: float, t_draft: float, target_ms, longest: int, rate: float) -> int:
    """The first draft of a chain of at most `longest` that may end it where the draft itself is
    unsure of it (below `auto`'s confidence). An unsure i-th draft is accepted at about `unsure`
    (measured), every other at alpha; drafting on from i to some L <= longest adds
    alpha^(i-1) * unsure * (alpha + ... + alpha^(L-i)) expected tokens for (L - i) drafts and the
    verification's growth, target_ms(L + 1) - target_ms(i + 1); the chain stops at i only where
    no such L adds tokens at `rate` (the step's expected tokens per ms) or better. Where
    verification is flat and a draft cheap (a 1.7b stand-in on w4a8: 4 tokens 1.13x one, a draft
    token 1.1 ms of a 21 ms step) that is late or never: auto with the stop from the first draft
    ran 1.23x autoregressive there against 1.26x without any stop and 1.28x for gamma 3. Where a
    draft costs a good part of a target forward (an eager GPU) it is the first unsure draft, as
    in transformers' assisted generation."""
    for i in range(1, longest):
        reach, gain = alpha ** (i - 1) * unsure, 0.0
        for length in range(i + 1, longest + 1):
            reach *= alpha
            gain += reach
            if gain >= rate * ((length - i) * t_draft + target_ms(length + 1) - target_ms(i + 1)):
                break  # drafting on to `length` pays
        else:
            return i
    return longest


def catch_up(ctx: DecodeContext) -> None:
    """Feed the draft what it has not read of the reply, where that is more than the step's own
    first draft forward feeds anyway (the token before the last, the last: after a chain whose
    drafts were all accepted, its last draft and the bonus token). Fed apart, those two took a
    draft forward of their own every such step (2-core Xeon, bundled pair on w4a8: 101 extra
    forwards of about 4 ms in 3 replies of 64 tokens, 15% of `auto`'s time under cProfile)."""
    if unread(ctx) > 1:
        ctx.draft.prefill(ctx.ids)


def unread(ctx: DecodeContext) -> int:
    """Tokens of the reply before its last that the draft has not read (the last is always fed
    by the step's first draft forward)."""
    return len(ctx.ids) - 1 - ctx.draft.length


def extended_length(profile, alpha: float, sure: float, context: int, gamma: int, limit: int) -> int:
    """How many drafts a chain `auto`'s profile chose at `gamma` may run to while the draft is sure
    (at most `limit`): the length of the best expected rate, the first `gamma` drafts accepted at
    `alpha`, later ones at `sure`, the rate measured for drafts past the chosen length (never taken
    below alpha: a draft sure of a token is right at least as often)."""
    alpha = min(alpha, 0.999)
    sure = min(max(sure, alpha), 0.999)
    best, best_rate, reach, tokens = gamma, -1.0, 1.0, 1.0
    for g in range(1, max(gamma, limit) + 1):
        reach *= alpha if g <= gamma else sure
        tokens += reach
        rate = tokens / chain_ms(profile, g, context)
        if g >= gamma and rate > best_rate:
            best, best_rate = g, rate
    return best
