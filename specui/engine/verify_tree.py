"""Lossless verification of a token tree against the target's distributions (DESIGN 3.5, 3.6).

rows[0] is the target's warped distribution for the roots, rows[1 + i] for the children
of node i (the layout ModelSession.forward_tree returns).
- greedy: follow the child equal to the target's argmax; emit the argmax where none is.
- deterministic children (static trees, OPT-Tree): draw x ~ p~ at each node and descend if x
  is a child; otherwise x is the (resampled) token. Each emitted token is an honest draw.
- i.i.d. children (MCSD): multi-candidate recursive rejection: p' = p~; for each child c in
  order accept with min(1, p'(c) / q~(c)), else p' = res(p', q~); all rejected: draw from p'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specui.engine.sampling import SamplingConfig, argmax_tokens, residual, sample, uniform
from specui.engine.tree import TokenTree


@dataclass
class TreeVerdict:
    path: list[int]  # accepted nodes, root to leaf
    next_token: int  # the target's own token after the path (resampled or bonus)
    bonus: bool  # True when the path ends at a leaf (nothing was rejected below it)
    rejected: list[int] = field(default_factory=list)  # children checked and turned down


def verify_tree(
    tree: TokenTree, rows: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
    draft_rows: dict[int, torch.Tensor] | None = None, best: list[int] | None = None,
) -> TreeVerdict:
    """draft_rows: q~ used to draw each node's children i.i.d. (MCSD); None means the
    children were chosen deterministically. Greedy: the rows' argmax is all that counts (the
    logits themselves will do; `best`: their argmax where the caller has it already)."""
    path: list[int] = []
    rejected: list[int] = []
    node = -1
    if not cfg.greedy:
        best = None
    elif best is None:
        best = argmax_tokens(rows)  # one call for every row
    while True:
        kids = tree.children(node)
        p = rows[node + 1]
        if cfg.greedy or draft_rows is None:
            # the target's own token (argmax, or one honest draw from p~); descend if it is a child
            x = best[node + 1] if best is not None else sample(p, generator)
            match = next((c for c in kids if tree.tokens[c] == x), None)
            if match is None:
                rejected += kids
                return TreeVerdict(path, x, bonus=not kids, rejected=rejected)
            path.append(match)
            node = match
        else:
            q = draft_rows.get(node)
            p_res = p
            match = None
            for c in kids:
                x = tree.tokens[c]
                if uniform(generator) < min(1.0, float(p_res[x]) / float(q[x])):
                    match = c
                    break
                rejected.append(c)
                p_res = residual(p_res, q)
            if match is None:
                return TreeVerdict(path, sample(p_res, generator), bonus=not kids, rejected=rejected)
            path.append(match)
            node = match
