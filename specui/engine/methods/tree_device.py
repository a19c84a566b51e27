"""A static tree's greedy step with one read of the device (methods/tree.py's `tree` method where
every read of the device's memory waits for it: a GPU).

Drafting a static tree read the device at every node that has children (its top-k tokens, two
reads each), then the target's rows and the trace's entries once or twice more, so the device sat
idle through the host's work after each read. A static tree's shape does not depend on what the
draft proposes (greedy: each node's children are its draft's top-k, none skipped), so the whole
step can be queued before anything is read: each layer's tokens are picked from the top-k of its
parents' rows on the device and fed straight into the next draft forward and, at the end, into the
target's forward over the whole tree (`forward_tree` / `extend_tree` with `pending=`); then one read
brings every token, its draft probability, and the target's argmax, log-sum-exp and top logit per
row and its logit at each node (the trace's p). The same tree, verdict, trace and caches as the
host's way of drafting it (tests/test_read_entries.py), except where the draft's float32 softmax
underflows to 0 at a child (the host drops such a child and its subtree; here it stays, a node the
target never accepts) or where tied probabilities leave one top-k a layer in another order than
one top-k a node: the tree then differs in those nodes; the reply does not (greedy verification
follows the target's argmax, whatever the tree holds)."""

from __future__ import annotations

import torch

from specui.engine.method import DecodeContext
from specui.engine.sampling import SoftmaxEntries, read_together, row_stat_tensors
from specui.engine.tree import TokenTree


def plan_static_tree(shape: TokenTree, max_depth: int) -> tuple[TokenTree, list[int], list[int]]:
    """The tree StaticTree.draft_tree grows from `shape` when no child is skipped, in its node
    order, its tokens unknown (0): (that skeleton, each node's rank among its parent's children,
    where each layer starts, its end last)."""
    skeleton, ranks, starts = TokenTree(), [], []
    depths = shape.depths
    where = {-1: -1}  # shape node -> tree node
    for depth in range(1, min(max_depth, max(depths, default=0)) + 1):
        starts.append(len(skeleton))
        for s_parent in sorted({shape.parents[i] for i in range(len(shape)) if depths[i] == depth}):
            if s_parent not in where:
                continue
            for rank, s_kid in enumerate(shape.children(s_parent)):
                where[s_kid] = skeleton.add(0, where[s_parent])
                ranks.append(rank)
    starts.append(len(skeleton))
    return skeleton, ranks, starts


def draft_static_tree_on_device(ctx: DecodeContext, skeleton: TokenTree, ranks: list[int], starts: list[int]):
    """Draft the skeleton's tokens layer by layer with none read: (tokens (n,), their draft
    probabilities (n,)) on the device. Each node's children are the top-k tokens of the draft's
    softmax at it (k: its child count), in rank order; every layer but the last is fed to the
    draft unread (its ids PENDING until the step commits the tree's path)."""
    draft, device = ctx.draft, ctx.draft.device
    rows = draft.forward_tree(ctx.ids, TokenTree())[:1]  # the row that predicts the roots
    tokens, probs = [], []
    for layer, (start, end) in enumerate(zip(starts, starts[1:])):
        parents = [p - starts[layer - 1] if layer else 0 for p in skeleton.parents[start:end]]  # their rows
        k = max(ranks[start:end]) + 1
        top = torch.topk(rows.float().softmax(-1), k, dim=-1)
        at = torch.tensor([parents, ranks[start:end]], dtype=torch.long).to(device, non_blocking=True)
        picked = top.indices[at[0], at[1]]
        tokens.append(picked)
        probs.append(top.values[at[0], at[1]])
        if end < starts[-1]:  # the last layer's rows are never needed
            rows = draft.extend_tree(skeleton.subtree(list(range(end))), start, pending=picked)
    return torch.cat(tokens), torch.cat(probs)


class TreeStats:
    """What a greedy static tree's step reads of the device, in one read: the drafted tokens and
    their draft probabilities (n,), and from the target's rows (n + 1, V) in float32: each row's
    argmax (first maximum), log-sum-exp and top logit, and each node's logit in its parent's row."""

    def __init__(self, skeleton: TokenTree, tokens: torch.Tensor, q: torch.Tensor, p_logits: torch.Tensor) -> None:
        p = p_logits.float()
        best, top, lse = row_stat_tensors(p)
        rows = torch.tensor([parent + 1 for parent in skeleton.parents], dtype=torch.long).to(p.device,
                                                                                               non_blocking=True)
        out = read_together([tokens, q, best, top, lse, p[rows, tokens]])
        self.tree = TokenTree()
        for token, parent, prob in zip(out[0], skeleton.parents, out[1]):
            self.tree.add(int(token), parent, prob)
        self.best = [int(b) for b in out[2]]
        known = {(parent + 1, token): logit for parent, token, logit in zip(skeleton.parents, self.tree.tokens, out[5])}
        self.p_shown = SoftmaxEntries(p, out[4], self.best, out[3], known)
