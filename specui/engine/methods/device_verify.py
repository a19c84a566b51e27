"""A greedy speculative step with one read of the device (`Speculative.step_on_device`, and SpecDec++'s
verification, where every read of the device's memory waits for it: a GPU).

Drafting a chain on a GPU (engine/device_chain.py) reads its tokens once, and verifying it read
three more times: the target's argmax and log-sum-exp rows, the draft's rows for the trace's q, and
the target's probability at a rejected draft; the device idled through the host's work after each.
Here a fixed-length chain's tokens stay on the device and are fed straight into the target's
verification forward (`ModelSession.advance(..., pending=)`), and everything the step needs (the
drafted tokens, both models' argmax, log-sum-exp and top logit per row, the target's logit at each
draft) comes back in one read, so the host queues the draft's forwards and the target's behind them
and waits once. A chain that stops on the draft's confidence (`auto`'s) reads its tokens as it drafts
(two at a time) and keeps the one read after verification. Where reads wait, a step's draft time
is the host's queueing and its verification time includes the draft's forwards.

The same step as `speculative`'s one-token-at-a-time greedy path: the same tokens (drafts past an
EOS are dropped as that chain stops there), verdict and trace probabilities."""

from __future__ import annotations

import torch

from specui.engine.method import DecodeContext
from specui.engine.sampling import SoftmaxEntries, read_together, row_stat_tensors


def verified_once(ctx: DecodeContext, drafts: list[int], q_logits: torch.Tensor) -> ChainStats:
    """The target's verification forward over drafts already read (their draft logit rows (n, V) on
    the device), and what the step needs of it in one read."""
    picks = torch.tensor(drafts, dtype=torch.long).to(ctx.target.device, non_blocking=True)
    return ChainStats(picks, q_logits, ctx.target.advance(ctx.ids + drafts, need=len(drafts) + 1))


def through_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    """The chain up to and with its first EOS (the draft stops there)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return tokens[:end]


class ChainStats:
    """What a greedy chain's step reads of the device, in one read: the drafted tokens (n,) and,
    from the draft's logit rows (n, V) and the target's (n + 1, V), in float32 as the one-token path
    scores them: each row's argmax (the first maximum), log-sum-exp and top logit, and the target's
    logit at each drafted token (the trace's p where the target disagreed)."""

    def __init__(self, picks: torch.Tensor, q_logits: torch.Tensor, p_logits: torch.Tensor) -> None:
        q, p = q_logits.float(), p_logits.float()
        n = picks.numel()
        best, p_top, p_lse = row_stat_tensors(p)
        cols = picks.reshape(n, 1).to(torch.long)
        out = read_together([picks, best, p_top, p_lse, q.gather(1, cols)[:, 0], torch.logsumexp(q, -1),
                             p[:n].gather(1, cols)[:, 0]])
        self.tokens = [int(t) for t in out[0]]
        self.best = [int(t) for t in out[1]]
        self.p_top, self.p_lse, self.q_top, self.q_lse, self.p_at = out[2:]
        self.p, self.q = p, q

    def shown(self, k: int) -> tuple[SoftmaxEntries, SoftmaxEntries]:
        """The probabilities the trace shows for the first k drafts (target rows k + 1, draft rows
        k), every entry it reads known from the one read: (p_shown, q_shown); p_shown.best is the
        target's argmax at each row, all greedy verification reads."""
        drafts = self.tokens[:k]
        known = {(t, x): self.p_at[t] for t, x in enumerate(drafts)}
        p_shown = SoftmaxEntries(self.p[: k + 1], self.p_lse[: k + 1], self.best[: k + 1], self.p_top[: k + 1], known)
        q_shown = SoftmaxEntries(self.q[:k], self.q_lse[:k], drafts, self.q_top[:k])  # drafts are the draft's argmax
        return p_shown, q_shown
