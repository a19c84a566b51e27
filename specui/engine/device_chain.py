"""Greedy draft chains fed back on the device (methods/speculative.py's chains where reads wait,
and the cost profile's draft figure there: engine/measure.py).

On a GPU every read of the device's memory waits for the device, and so did drafting one token
at a time: each drafted argmax was read back before the next draft forward was queued, so the
host never ran ahead of the GPU. Here each argmax stays on the device and is fed straight back
(`ModelSession.advance_token`), and the chain's tokens are read in one go."""

from __future__ import annotations

import torch

from specui.engine.session import ModelSession

CONFIDENCE_CHUNK = 2  # a device chain that stops on the draft's confidence reads its tokens this many at a time


def greedy_chain_on_device(draft: ModelSession, ids: list[int], gamma: int, eos_ids: frozenset[int],
                           confidence: float | None = None,
                           floor: int = 0) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """`draft_chain`, greedy, where every read of the device's memory waits for it (a GPU): each
    drafted argmax stays on the device and is fed straight back (`advance_token`), and the tokens
    are read in one go at the end, so the host queues the chain's forwards without waiting for
    each (one wait a chain, not one a token; measured on an H200 before this: a captured draft
    token cost 0.56-0.6 ms against a target forward of 1.9 ms, most of it the host's). With
    `confidence` (`auto`'s chains) each token's draft probability is computed on the device with
    it and the tokens are read CONFIDENCE_CHUNK at a time, so at most that many less one drafts
    past the stop are computed for nothing (the stop comes at the `floor`-th draft at the earliest,
    as in draft_chain). The same tokens as drafting one at a time: the argmax
    of the same float32 rows (first of equal ones), the same softmax entry against `confidence`;
    drafts past an EOS or the stop are dropped, their cache entries cropped by the next `advance`
    like any rejected draft's."""
    with draft.feeding_device_tokens(ids):
        return _device_chain(draft, ids, gamma, eos_ids, confidence, floor)


def _device_chain(draft: ModelSession, ids: list[int], gamma: int, eos_ids: frozenset[int],
                  confidence: float | None, floor: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    chunk = gamma if confidence is None else CONFIDENCE_CHUNK
    rows: list[torch.Tensor] = []
    drafted: list[int] = []  # every token drafted (fed or not), read
    tokens: list[int] = []  # the chain: up to the stop
    pick = None
    while len(drafted) < gamma:
        picks, sure = [], []
        for _ in range(min(chunk, gamma - len(drafted) - len(picks))):
            row, f, pick = _next_draft(draft, ids, pick)
            rows.append(row)
            picks.append(pick)
            if confidence is not None:
                sure.append(f.softmax(-1)[pick])
        read = torch.stack([t.to(torch.float64) for t in picks + sure]).tolist()  # one read a chunk
        before = len(drafted)
        drafted += [int(t) for t in read[: len(picks)]]
        draft.settle_tokens(drafted[max(0, before - 1): -1])  # every drafted token but the last was fed
        for i, token in enumerate(drafted[before:]):
            tokens.append(token)
            unsure = confidence is not None and len(tokens) >= floor and read[len(picks) + i] < confidence
            if token in eos_ids or unsure:
                logits = torch.stack(rows[: len(tokens)])
                return tokens, logits.float(), logits
    logits = torch.stack(rows)
    return tokens, logits.float(), logits


def _next_draft(draft: ModelSession, ids: list[int], pick: torch.Tensor | None):
    """The next draft forward of a chain after the committed `ids` (the first) or after `pick`, the
    previous argmax, fed unread: (its logit row (V,), the row in float32, its argmax on the device)."""
    row = (draft.advance(ids, need=1) if pick is None else draft.advance_token(pick))[-1]
    f = row.float()
    return row, f, f.argmax()


def queue_greedy_chain(draft: ModelSession, ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n greedy draft forwards after the committed `ids`, each argmax fed straight back and none
    read: (the drafted tokens (n,), their logit rows (n, V)), on the device, so the host can queue
    the target's verification behind them (methods/device_verify.py). The first n - 1 are PENDING
    in the draft until its caller reads them and calls `settle_tokens`, inside
    `draft.feeding_device_tokens(ids)`."""
    rows, picks, pick = [], [], None
    for _ in range(n):
        row, _, pick = _next_draft(draft, ids, pick)
        rows.append(row)
        picks.append(pick)
    return torch.stack(picks), torch.stack(rows)
