"""MCSD baseline (DESIGN.md 3.5; Yang et al., seed 001): the draft samples k_i candidates
i.i.d. from q~ under every node at depth i (k-config such as 4,2,2,1,1), the target scores
the whole tree in one forward (tree mask), and multi-candidate verification walks it: at a
node, p' = p~; each candidate c in drawing order is accepted with min(1, p'(c) / q~(c)),
else p' = res(p', q~); when all are rejected the correction is drawn from p'. Lossless.

Greedy (temperature 0): i.i.d. draws from a point mass would all be the same token, so the
children are the draft's top-k_i distinct tokens and the target's argmax picks among them
(as `tree` does); the reply equals autoregressive decoding."""

from __future__ import annotations

import torch

from specui.engine.method import DecodeContext
from specui.engine.methods.tree import DraftedTree, TreeMethod, draft_probs, expected_accept, top_tokens
from specui.engine.sampling import warp
from specui.engine.tree import TokenTree
from specui.errors import SpecUIError


def parse_k_config(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
    except ValueError:
        ks = ()
    if not ks or any(k < 1 for k in ks) or len(ks) > 16:
        raise SpecUIError(f"k-config must be 1 to 16 positive integers separated by commas (e.g. 4,2,2,1,1), "
                          f"got {text!r}")
    nodes, width = 0, 1
    for k in ks:
        width *= k
        nodes += width
    if nodes > 512:
        raise SpecUIError(f"k-config {text!r} makes a tree of {nodes} nodes; keep it at most 512")
    return ks


class MCSD(TreeMethod):
    name = "mcsd"

    def __init__(self, k_config: str = "4,2,2,1,1") -> None:
        self.ks = parse_k_config(k_config)
        self.iid_rows: dict[int, torch.Tensor] | None = None  # node -> q~ its children were drawn from

    def draft_tree(self, ctx: DecodeContext, max_depth: int) -> DraftedTree:
        draft, cfg = ctx.draft, ctx.sampling
        tree = TokenTree()
        logits = {-1: draft.forward_tree(ctx.ids, tree)[0]}
        self.iid_rows = None if cfg.greedy else {}
        depth_cap = min(max_depth, len(self.ks))
        parents = [-1]
        for depth in range(1, depth_cap + 1):
            start, k = len(tree), self.ks[depth - 1]
            for parent in parents:
                if cfg.greedy:
                    for q_tok, tok in top_tokens(draft_probs(logits[parent], cfg), k):
                        tree.add(tok, parent, q_tok)
                else:
                    q = warp(logits[parent], cfg)
                    self.iid_rows[parent] = q
                    draws = torch.multinomial(q.float(), k, replacement=True, generator=ctx.generator).tolist()
                    for tok in draws:
                        tree.add(tok, parent, float(q[tok]))
            parents = list(range(start, len(tree)))
            if depth == depth_cap or not parents:
                break
            rows = draft.extend_tree(tree, start)
            for row, node in zip(rows, parents):
                logits[node] = row
        everything = list(range(len(tree)))
        return DraftedTree(tree, tree, everything, expected_accept(tree.p_hat, everything))

    def verify_rows(self) -> dict[int, torch.Tensor] | None:
        return self.iid_rows
