"""What a speculative chain is expected to yield and what catching its draft up costs: the
arithmetic `auto`, EMS-SD's gamma policy and the joint quantization/method choice share."""

from __future__ import annotations

HORIZON = 64  # tokens over which a draft's catch-up is expected to pay back at most (replies often end early)


def chain_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens committed by one chain step of `gamma` drafts (bonus included)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def catch_up_per_token(profile, behind: int, rows: int, room: float, ratio: float = 1.0) -> float:
    """Ms per committed token that first feeding the draft `behind` tokens it has not read
    (prompts, steps decoded without it) adds, paid once and spread over the next `room`
    tokens of each of `rows` rows (at most HORIZON)."""
    if behind <= 2 * rows:
        return 0.0
    return (profile.draft(behind) or 0.0) * ratio / (rows * max(1.0, min(HORIZON, room)))
