"""TokenTree: draft tokens with a parent array (-1 = child of the last committed token;
several roots allowed, so a beam forest is the same type). Depths, the ancestor mask, the
positions and root-to-node paths are all derived from the parent array."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # parents[i] < i, or -1
    q: list[float] = field(default_factory=list)  # draft probability of each token (given its parent)
    p_hat: list[float] = field(default_factory=list)  # product of draft probabilities along the path

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError("tokens and parents must have the same length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be -1 or an earlier node")
        if not self.q:
            self.q = [1.0] * len(self.tokens)
        if not self.p_hat:
            for q, p in zip(self.q, self.parents):
                self.p_hat.append(q * (self.p_hat[p] if p >= 0 else 1.0))

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, q: float = 1.0) -> int:
        """Append a node; returns its index."""
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} does not exist")
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.q.append(float(q))
        self.p_hat.append(float(q) * (self.p_hat[parent] if parent >= 0 else 1.0))
        return len(self.tokens) - 1

    @property
    def depths(self) -> list[int]:
        """Depth 1 for roots."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1: the roots), in insertion order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Node indices from a root down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """(n, n) bool: [i, j] is True when j is i or an ancestor of i."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def dfs_order(self) -> list[int]:
        order: list[int] = []
        stack = list(reversed(self.children(-1)))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.children(node)))
        return order

    def subtree(self, keep: list[int]) -> TokenTree:
        """The tree restricted to `keep` (must be closed under parents), reindexed in order."""
        keep = sorted(keep)
        index = {old: new for new, old in enumerate(keep)}
        out = TokenTree()
        for old in keep:
            parent = self.parents[old]
            out.tokens.append(self.tokens[old])
            out.parents.append(index[parent] if parent >= 0 else -1)
            out.q.append(self.q[old])
            out.p_hat.append(self.p_hat[old])
        return out

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> TokenTree:
        """A tree shape from Medusa-style literal paths: [[0], [0, 0], [1], ...] where each
        entry is the child rank at each depth. Tokens are filled in later (all 0 here)."""
        tree, where = cls(), {(): -1}
        for path in sorted(paths, key=lambda p: (len(p), p)):
            parent = where.get(tuple(path[:-1]))
            if parent is None:
                raise ValueError(f"path {path} has no parent path {path[:-1]}")
            where[tuple(path)] = tree.add(0, parent)
        return tree
