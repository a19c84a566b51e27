"""DSBD's forest: the beam prefixes of one step (input beams as roots, the draft's nodes
under them), its layers, the beams carried between steps, the output beams a step ends
with, and the trace a step shows of them (one tree per input beam).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specui.engine.trace import ACCEPTED, REJECTED, TARGET, UNVERIFIED, NodeTrace


@dataclass(eq=False)
class Node:
    """A beam prefix in this step: an input beam (root, parent None) or a forest node."""

    row: int
    token: int
    parent: Node | None
    layer: int
    draft_score: float  # log of the draft's joint weight (input beams: their target score)
    t_idx: int = -1  # pending index in the target's row
    d_idx: int = -1  # pending index in the draft's row (-1: not fed to the draft)
    q_logits: torch.Tensor | None = None
    p_logits: torch.Tensor | None = None
    score: float = 0.0  # target log-likelihood of the beam ending here (once verified)
    status: str = UNVERIFIED
    q: float | None = None  # q_beam of this candidate
    p: float | None = None  # p_beam of this candidate

    def path(self) -> list[Node]:
        """Forest nodes from the input beam down to this node (the root excluded)."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass
class Layer:
    parents: list[Node]
    q_beam: torch.Tensor  # (len(parents) * V) the draft's beam-sampling distribution
    nodes: list[Node]


@dataclass
class Beam:
    tokens: list[int]
    score: float
    t_fresh: list[int]  # committed tokens the target's row has not cached yet
    d_fresh: list[int]  # ... the draft's row


@dataclass
class Output:
    parent: Node
    token: int
    score: float
    status: str


def forest_trace(roots: list[Node], layers: list[Layer], outputs: list[Output]) -> list[NodeTrace]:
    """The forest: one tree per input beam (its root is the beam's last token), then the
    beams drawn from the target hanging under their parents."""
    index: dict[int, int] = {}
    nodes = []
    for n in roots + [n for layer in layers for n in layer.nodes]:
        index[id(n)] = len(nodes)
        nodes.append(NodeTrace(
            token_id=n.token, text="", parent=index[id(n.parent)] if n.parent is not None else -1,
            depth=n.layer, status=TARGET if n.parent is None else n.status, q=n.q, p=n.p, beam=n.row,
            score=n.score if n.parent is None or n.status in (ACCEPTED, REJECTED) else None,
            draft_score=n.draft_score,
        ))
    for o in outputs:
        if o.status != ACCEPTED:
            nodes.append(NodeTrace(token_id=o.token, text="", parent=index[id(o.parent)], depth=o.parent.layer + 1,
                                   status=o.status, beam=o.parent.row, score=o.score))
    return nodes
