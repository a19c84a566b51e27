"""The tree panel: one step's draft tree (chain, tree, beam layer, DSBD forest, MCSD fork) drawn
from its trace, laid out tidily (specui/ui/tree_layout.py) so no two token labels overlap.

Geometry in pixels: each row is PITCH px tall and each column as wide as its longest label in a
monospace font. The x-axis always spans VIEW_W units, the narrowest plotting area the panel is
drawn for, so one unit is at least one pixel and labels keep their room; a wider tree pans.
Edges leave a node after its label and turn in the gap between columns, so no line crosses a
label. The committed path is one bold line; rejected branches and what hangs under them fade."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from specui.engine.trace import StepTrace
from specui.ui.palette import NEUTRAL, STATUS_COLORS, legend_above, panel_title, plain_figure, top_margin
from specui.ui.tree_layout import TreeLayout, depths, layout_tree, text_cells, token_label

PITCH = 20  # px per row
FONT = 12  # label size (px)
CELL = 7.3  # px per monospace cell at FONT (DejaVu Sans Mono, Menlo, Courier: 7.22; Consolas: 6.6)
MARKER = 10  # node diameter (px)
TEXT_DX = MARKER / 2 / 0.8 + 1  # where plotly puts a 'middle right' label after a marker's centre
GAP = 20  # px between a column's longest label and the next column's nodes (the edges turn here)
VIEW_W = 520  # px of tree shown at first: the narrowest plotting area the panel is drawn for
MAX_DEPTH = 16  # deeper nodes fold into a count on their ancestor at this depth
MAX_NODES, MAX_ROWS = 600, 150  # drawn nodes or rows beyond these: counts per depth instead of the tree
MAX_LAID_OUT = 50_000  # nodes beyond this are not even laid out
MARGIN = dict(l=12, r=12, b=36)  # the top margin holds the title and the legend: palette.top_margin
CHART_MIN_W = VIEW_W + MARGIN["l"] + MARGIN["r"]  # px: the chart's width where the x-axis is one unit a pixel
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
COMMITTED = {"accepted", "resampled", "bonus", "target", "filled"}
OPACITY = {"rejected": 0.75, "dropped": 0.75, "unverified": 0.4}  # the rest: 1


def hover(node) -> str:
    parts = [f"<b>{node.text!r}</b> ({node.token_id})", f"status: {node.status}"]
    for label, value in (("q", node.q), ("p", node.p), ("p^", node.p_hat), ("min(1,p/q)", node.accept_ratio)):
        if value is not None:
            parts.append(f"{label} = {value:.4f}")
    if node.beam is not None:
        parts.append(f"beam {node.beam}")
    if node.score is not None:
        parts.append(f"beam log-lik = {node.score:.3f}")
    if node.draft_score is not None:
        parts.append(f"draft log-lik = {node.draft_score:.3f}")
    if node.accept_pred is not None:  # SpecDec++'s head, MCSD's decision model
        parts.append(f"predicted a_t = {node.accept_pred:.3f}")
    if node.reject_pred is not None:
        parts.append(f"P(some rejected) = {node.reject_pred:.3f}")
    if node.status == "target" and node.parent == -1:
        parts.append("drawn from the target's own distribution")
    return "<br>".join(parts)


def is_forest(step: StepTrace) -> bool:
    """Several roots, each a beam (beam search's layer, DSBD's input beams)."""
    roots = [n for n in step.nodes if n.parent == -1]
    return len(roots) > 1 and all(n.beam is not None for n in roots)


def lane_starts(step: StepTrace) -> list[int]:
    """The nodes that start a lane: a forest's roots (every root a beam), an MCSD fork's
    chains (the first `chains` children where the trunk branches); none for other trees."""
    if is_forest(step):
        return [i for i, n in enumerate(step.nodes) if n.parent == -1]
    if not step.chains or step.chains < 2:
        return []
    children: dict[int, list[int]] = {}
    for i, n in enumerate(step.nodes):
        children.setdefault(n.parent, []).append(i)
    node = -1
    while len(children.get(node, [])) == 1:  # down the trunk (the target's root) to the fork
        node = children[node][0]
    kids = children.get(node, [])
    return kids[: step.chains] if len(kids) >= step.chains else []


def _tail(text: str, limit: int = 24) -> str:
    text = text.replace("\n", "↵")
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def lane_label(step: StepTrace, node: int, lane: int, beams_before: Sequence[dict] | None) -> str:
    """A lane's header: the input beam's text tail and score, or the chain's size."""
    n = step.nodes[node]
    if n.parent == -1 and n.beam is not None:
        before = beams_before[n.beam] if beams_before and 0 <= n.beam < len(beams_before) else None
        same = before is not None and n.score is not None and abs(before.get("score", 1e9) - n.score) < 1e-6
        text = _tail(before["text"]) if same else f"…{token_label(n.text)}"
        score = "" if n.score is None else f" · log-lik {n.score:.2f}"
        return f"beam {n.beam}: {text}{score}"
    members = _subtree(step, node)
    accepted = sum(step.nodes[i].status == "accepted" for i in members)
    return f"chain {lane + 1}: {len(members)} drafted, {accepted} accepted"


def _subtree(step: StepTrace, node: int) -> list[int]:
    inside, out = {node}, [node]
    for i in range(node + 1, len(step.nodes)):
        if step.nodes[i].parent in inside:
            inside.add(i)
            out.append(i)
    return out


class TreeDrawing:
    """One step's tree in pixels: columns, the traces of edges, nodes, lane headers and folds."""

    def __init__(self, step: StepTrace, lay: TreeLayout, beams_before) -> None:
        self.step, self.lay = step, lay
        self.context = not is_forest(step)  # a forest's beams have no one context to hang from
        self.labels = [token_label(n.text) for n in step.nodes]
        self.headers = [(lane_label(step, node, k, beams_before), node, r) for k, (node, r) in enumerate(lay.headers)]
        self.x = self._columns()

    def col(self, node: int) -> int:
        return self.lay.depth[node] - (0 if self.context else 1)

    def _columns(self) -> list[float]:
        widths: dict[int, float] = {0: text_cells("context") * CELL} if self.context else {}
        for i in self.lay.shown:
            c = self.col(i)
            widths[c] = max(widths.get(c, 0.0), text_cells(self.labels[i]) * CELL)
            if i in self.lay.folded:
                widths[c + 1] = max(widths.get(c + 1, 0.0), text_cells(self.fold_label(i)) * CELL)
        x = [0.0]
        for c in range(max(widths) if widths else 0):
            x.append(x[-1] + TEXT_DX + widths.get(c, 0.0) + GAP + MARKER / 2)
        return x

    def fold_label(self, node: int) -> str:
        return f"… +{self.lay.folded[node]}"

    def label_end(self, node: int) -> float:
        return self.x[self.col(node)] + TEXT_DX + text_cells(self.labels[node]) * CELL

    def right(self) -> float:
        ends = [self.label_end(i) for i in self.lay.shown]
        ends += [self.x[self.col(i) + 1] + TEXT_DX + text_cells(self.fold_label(i)) * CELL for i in self.lay.folded]
        ends += [self.x[self.col(node)] + text_cells(text) * CELL * 11 / FONT for text, node, _ in self.headers]
        return max(ends, default=0.0) + 6

    def edges(self) -> list[dict]:
        """Thin grey edges, and the committed path bold: elbows that turn between columns."""
        lines = {True: ([], []), False: ([], [])}
        nodes = self.step.nodes
        for i in self.lay.shown:
            p = nodes[i].parent if 0 <= nodes[i].parent < i else -1
            if p == -1 and not self.context:
                continue
            start, y0 = (TEXT_DX + text_cells("context") * CELL, self.lay.root_row) if p == -1 else \
                (self.label_end(p), self.lay.row[p])
            end, y1 = self.x[self.col(i)] - MARKER / 2, self.lay.row[i]
            turn = end - GAP / 2
            bold = nodes[i].status in COMMITTED and (p == -1 or nodes[p].status in COMMITTED)
            xs, ys = lines[bold]
            xs += [start + 2, turn, turn, end, None]
            ys += [y0, y0, y1, y1, None]
        thin, bold = lines[False], lines[True]
        return [
            dict(type="scatter", x=thin[0], y=thin[1], mode="lines", name="edges", line=dict(color="#c4c4c4", width=1),
                 hoverinfo="skip", showlegend=False),
            dict(type="scatter", x=bold[0], y=bold[1], mode="lines", name="accepted path",
                 line=dict(color=NEUTRAL, width=3), hoverinfo="skip", showlegend=bool(bold[0])),
        ]

    def nodes(self) -> list[dict]:
        data = []
        for status, color in STATUS_COLORS.items():
            idx = [i for i in self.lay.shown if self.step.nodes[i].status == status]
            if not idx:
                continue
            faded = status not in COMMITTED
            data.append(dict(
                type="scatter", x=[self.x[self.col(i)] for i in idx], y=[self.lay.row[i] for i in idx],
                mode="markers+text", name=status, text=[self.labels[i] for i in idx], textposition="middle right",
                textfont=dict(family=MONO, size=FONT, color="#8a8a8a" if faded else "#222"),
                marker=dict(size=MARKER, color=color, opacity=OPACITY.get(status, 1.0),
                            line=dict(color="white", width=1)),
                hovertext=[hover(self.step.nodes[i]) for i in idx], hoverinfo="text",
            ))
        return data

    def extras(self) -> list[dict]:
        """The context node, the lane headers and the folded tails' counts."""
        data = []
        if self.context:
            data.append(dict(type="scatter", x=[0.0], y=[self.lay.root_row], mode="markers+text", name="context",
                             text=["context"], textposition="middle right", textfont=dict(family=MONO, size=FONT),
                             marker=dict(size=MARKER + 2, color="#444"), hoverinfo="skip", showlegend=False))
        if self.headers:
            data.append(dict(type="scatter", mode="text", name="lanes", showlegend=False, textposition="middle right",
                             x=[self.x[self.col(node)] - MARKER / 2 for _, node, _ in self.headers],
                             y=[r for _, _, r in self.headers], text=[t for t, _, _ in self.headers],
                             textfont=dict(family=MONO, size=11, color="#555"), hoverinfo="text",
                             hovertext=[t for t, _, _ in self.headers]))
        if self.lay.folded:
            folded = sorted(self.lay.folded)
            data.append(dict(type="scatter", mode="markers+text", name="folded", showlegend=False,
                             x=[self.x[self.col(i) + 1] for i in folded], y=[self.lay.row[i] for i in folded],
                             text=[self.fold_label(i) for i in folded], textposition="middle right",
                             textfont=dict(family=MONO, size=FONT, color="#8a8a8a"),
                             marker=dict(size=MARKER, symbol="circle-open", color="#8a8a8a"),
                             hovertext=[f"{self.lay.folded[i]} deeper nodes folded" for i in folded],
                             hoverinfo="text"))
        return data

    def lane_bands(self) -> list[dict]:
        """Every other lane on a light band, so a branch's beam or chain reads at a glance."""
        bounds = [r for _, _, r in self.headers] + [self.lay.rows]
        return [dict(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=bounds[k] - 0.5, y1=bounds[k + 1] - 0.5,
                     fillcolor="#f3f3f6", line=dict(width=0), layer="below")
                for k in range(0, len(bounds) - 1, 2)]

    def figure(self) -> go.Figure:
        step, lay = self.step, self.lay
        right, left = self.right(), -MARKER
        notes = []
        if lay.folded:
            notes.append(f"{sum(lay.folded.values())} nodes past depth {MAX_DEPTH} folded")
        if right - left > VIEW_W:
            notes.append("drag to pan")
        cols = range(len(self.x))
        first = 0 if self.context else 1  # the depth of column 0
        data = self.edges() + self.nodes() + self.extras()
        top = top_margin([d["name"] for d in data if d.get("showlegend", True)], title=True)
        return plain_figure(data, dict(
            title=panel_title(f"step {step.index}: {step.accepted}/{step.drafted} drafts accepted, "
                              f"+{len(step.new_token_ids)} tokens" + "".join(f" · {n}" for n in notes)),
            height=top + MARGIN["b"] + PITCH * lay.rows, margin=dict(MARGIN, t=top),
            legend=legend_above(), dragmode="pan", shapes=self.lane_bands(), plot_bgcolor="white",
            xaxis=dict(range=[left, left + VIEW_W], zeroline=False, showgrid=False,
                       tickvals=[self.x[c] for c in cols], tickfont=dict(size=10),
                       ticktext=["" if c + first == 0 else f"d{c + first}" for c in cols]),
            yaxis=dict(range=[lay.rows - 0.5, -0.5], visible=False),
        ))


def summary_figure(step: StepTrace) -> go.Figure:
    """A tree too large to draw node by node: how many nodes of each status at each depth."""
    depth = depths([n.parent for n in step.nodes])
    data = []
    for status, color in STATUS_COLORS.items():
        per: dict[int, int] = {}
        for d, n in zip(depth, step.nodes):
            if n.status == status:
                per[d] = per.get(d, 0) + 1
        if per:
            data.append(dict(type="bar", x=sorted(per), y=[per[d] for d in sorted(per)], name=status,
                             marker=dict(color=color)))
    top = top_margin([d["name"] for d in data], title=True)
    return plain_figure(data, dict(
        title=panel_title(f"step {step.index}: {len(step.nodes)} nodes, too many to draw: nodes per depth"),
        barmode="stack", height=top + 260, margin=dict(MARGIN, t=top, b=70), legend=legend_above(),
        xaxis=dict(title=dict(text="depth")), yaxis=dict(title=dict(text="nodes")),
        annotations=[dict(text=f"{step.accepted}/{step.drafted} drafts accepted; the step inspector's table and "
                               "the JSON export list every node", xref="paper", yref="paper", x=0, y=-0.3,
                          showarrow=False, xanchor="left", font=dict(size=11, color="#555"))],
    ))


def tree_figure(step: StepTrace | None, beams_before: Sequence[dict] | None = None) -> go.Figure:
    """The step's draft tree: nodes coloured by status and labelled with their tokens.
    `beams_before`: the previous step's beams (a DSBD forest's input beams, for the lanes' text)."""
    if step is None or not step.nodes:
        return plain_figure([], dict(title=panel_title("draft tree: no step yet"), height=320))
    if len(step.nodes) > MAX_LAID_OUT:
        return summary_figure(step)
    lay = layout_tree([n.parent for n in step.nodes], [n.status in COMMITTED for n in step.nodes],
                      lane_starts(step), MAX_DEPTH)
    if len(lay.shown) > MAX_NODES or lay.rows > MAX_ROWS:
        return summary_figure(step)
    return TreeDrawing(step, lay, beams_before).figure()
