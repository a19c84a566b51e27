"""The tidy layout of a step's draft tree (plain data in, rows and columns out; no plotly, no torch).

Leaf-count spacing: every leaf owns one row and a parent sits on the row of its first child,
so a subtree fills a contiguous band of rows and no two nodes of a column share a row. The
committed child goes first, so the accepted path runs along one row. Lanes: chosen children of
one node (a DSBD forest's input beams under the context, an MCSD fork's chains under its root)
each get a header row and their own band, one under the other, after that node's other
children. Nodes deeper than `max_depth` are folded into a count on their ancestor at that
depth. Iterative throughout: a chain thousands of tokens deep neither recurses nor costs more
than linear time."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

# A token's text as a label: whitespace and control characters made visible.
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
LABEL_CHARS = 10  # longer tokens are cut with an ellipsis (the hover has the whole text)


def token_label(text: str, limit: int = LABEL_CHARS) -> str:
    """`text` with spaces as ␣, newlines as ↵, other control characters as their control
    pictures; an empty token as ∅; cut to `limit` characters."""
    shown = "".join(VISIBLE.get(c) or (chr(0x2400 + ord(c)) if ord(c) < 0x20 else "␡" if c == "\x7f" else c)
                    for c in text) or "∅"
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def text_cells(text: str) -> int:
    """Monospace cells `text` takes: East Asian wide and full-width characters take two,
    combining marks none."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
               for c in text)


@dataclass
class TreeLayout:
    """Where each node goes. depth: 1 for roots (the committed context is depth 0); row: None
    for nodes folded away; folded[i]: how many descendants node i stands for."""

    depth: list[int]
    row: list[int | None]
    rows: int
    root_row: int
    headers: list[tuple[int, int]] = field(default_factory=list)  # (lane's first node, its header row)
    folded: dict[int, int] = field(default_factory=dict)

    @property
    def shown(self) -> list[int]:
        return [i for i, r in enumerate(self.row) if r is not None]


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Child lists in node order; a parent that does not come before its child (a malformed
    trace) hangs the child under the context instead, so the walk always ends."""
    children: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents):
        children.setdefault(p if 0 <= p < i else -1, []).append(i)
    return children


def depths(parents: Sequence[int]) -> list[int]:
    """1 for roots (and for nodes whose parent does not come before them), parent's + 1 below."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if 0 <= p < i else 1
    return depth


def layout_tree(parents: Sequence[int], first: Sequence[bool] | None = None, lanes: Sequence[int] = (),
                max_depth: int = 1 << 30) -> TreeLayout:
    """Rows and depths for the tree given by `parents` (-1: under the context). `first`:
    nodes to put before their siblings (the committed path); `lanes`: siblings that each start
    a lane, kept in their own order after their other siblings."""
    n = len(parents)
    children = _children(parents)
    depth = depths(parents)
    lane = set(lanes)
    size = [1] * n
    for i in range(n - 1, -1, -1):
        if 0 <= parents[i] < i:
            size[parents[i]] += size[i]
    folded = {i: size[i] - 1 for i in range(n) if depth[i] == max_depth and size[i] > 1}

    def kids(node: int) -> list[int]:
        if node >= 0 and depth[node] >= max_depth:
            return []
        ks = children.get(node, [])
        if first is not None:
            ks = sorted(ks, key=lambda k: not first[k])  # stable: committed first, then as drafted
        return [k for k in ks if k not in lane] + [k for k in children.get(node, []) if k in lane]

    row: list[int | None] = [None] * n
    headers: list[tuple[int, int]] = []
    leading: dict[int, int] = {}  # internal node -> its first child
    next_row = 0
    stack: list[tuple[bool, int]] = [(False, -1)]  # (is a lane header, node)
    while stack:
        header, node = stack.pop()
        if header:
            headers.append((node, next_row))
            next_row += 1
            continue
        ks = kids(node)
        if not ks:
            if node >= 0:
                row[node] = next_row
                next_row += 1
            continue
        leading[node] = ks[0]
        items = [item for k in ks for item in (((True, k), (False, k)) if k in lane else ((False, k),))]
        stack.extend(reversed(items))
    for node in sorted(leading, reverse=True):  # children come after their parents: one pass up
        if node >= 0:
            row[node] = row[leading[node]]
    root_row = row[leading[-1]] if -1 in leading else 0
    return TreeLayout(depth, row, max(next_row, 1), root_row if root_row is not None else 0, headers, folded)


def tree_layout(parents: Sequence[int]) -> list[tuple[float, float]]:
    """(x = depth, y = row) of each node, every node shown (the plain tidy layout)."""
    lay = layout_tree(parents)
    return [(float(d), float(r)) for d, r in zip(lay.depth, lay.row)]
