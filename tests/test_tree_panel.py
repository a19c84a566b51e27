"""The tree panel's tidy layout and the panels' legibility (issue 45), without a browser: labels,
rows and lanes from recorded traces, folds and the summary of trees too large to draw, legends
outside the plot, one y-scale per quantity, one colour per status. tests/test_tree_labels_browser.py
checks the drawn SVG in Chromium."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from figure_page import overlaps

from specui.engine.trace import NodeTrace, StepTrace, traces_from_json
from specui.ui import tree_figure as tf
from specui.ui.compare import timeline_figure
from specui.ui.figures import acceptance_figure, choices_figure, provenance_html, timing_figure, tree_figure
from specui.ui.palette import PROVENANCE_COLORS, SERIES_COLORS, STATUS_COLORS, tint
from specui.ui.reply_panels import beams_before
from specui.ui.tree_layout import layout_tree, text_cells, token_label

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
TREES = ("mcsd-baseline", "opt-tree-25", "dsbd-w4", "mcsd-fork-w4")
ALL = TREES + ("autoregressive", "beam", "speculative", "speculative-sampled", "tree", "opt-tree", "dsbd",
               "dsbd-sampled")


def steps_of(name: str) -> list[StepTrace]:
    return traces_from_json((FIXTURES / f"{name}.json").read_text())


def label_boxes(fig) -> list[list]:
    """Every text label's box in px as the layout means it (x units are px at VIEW_W; a row is
    PITCH px; a glyph cell CELL px, FONT px tall)."""
    boxes = []
    for t in fig.data:
        if t.text is None or "text" not in (t.mode or ""):
            continue
        dx = tf.TEXT_DX if "markers" in t.mode else 0.0
        size = t.textfont.size or tf.FONT
        for x, y, text in zip(t.x, t.y, t.text):
            left = x + dx
            boxes.append([text, left, y * tf.PITCH - size * 0.6, left + text_cells(text) * tf.CELL * size / tf.FONT,
                          y * tf.PITCH + size * 0.6])
    return boxes


def chain(n: int, status: str = "unverified") -> StepTrace:
    nodes = [NodeTrace(token_id=i, text=f"t{i}", parent=i - 1, depth=i, status=status) for i in range(n)]
    return StepTrace(index=1, method="speculative", nodes=nodes, drafted=n)


def test_token_labels_show_whitespace():
    assert token_label(" rainbow") == "␣rainbow"
    assert token_label("\n\n") == "↵↵" and token_label("\t") == "⇥" and token_label("") == "∅"
    assert token_label("\x00\x1b") == "␀␛"  # control characters as their control pictures
    assert token_label(" a very long token") == "␣a␣very␣l…" and len(token_label("x" * 40)) == 10
    assert text_cells("ab") == 2 and text_cells("中文") == 4  # wide characters take two cells


def test_layout_hand_drawn():
    #   ctx -> 0 -> 1 (rejected), 0 -> 2 (accepted) -> 4 ; ctx -> 3
    lay = layout_tree([-1, 0, 0, -1, 2], first=[True, False, True, False, True])
    assert lay.depth == [1, 2, 2, 1, 3]
    assert lay.row == [0, 1, 0, 2, 0]  # the committed child first: the accepted path is row 0
    assert lay.rows == 3 and lay.root_row == 0 and lay.headers == [] and lay.folded == {}
    lanes = layout_tree([-1, 0, 0, -1, 2], lanes=[0, 3])  # each root its own lane, under a header
    assert lanes.headers == [(0, 0), (3, 3)] and lanes.row == [1, 1, 2, 4, 2]
    folded = layout_tree([-1, 0, 1, 2, 1], max_depth=2)  # nodes past depth 2 fold into their ancestor
    assert folded.row == [0, 0, None, None, None] and folded.folded == {1: 3}


def cpu_seconds(fn) -> float:
    """This process's CPU time for fn() (not the wall clock: a neighbour on a busy machine, a
    test worker beside this one, does not count)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def test_layout_is_linear_and_survives_malformed_parents():
    fig = tree_figure(chain(5000))  # 5000 deep: no recursion, folded past MAX_DEPTH
    # within 1 s of CPU, and linear: 10x the nodes within 30x the time (a quadratic layout takes
    # ~100x), fastest of 3 each
    small = min(cpu_seconds(lambda: tree_figure(chain(500))) for _ in range(3))
    large = min(cpu_seconds(lambda: tree_figure(chain(5000))) for _ in range(3))
    assert large < min(1.0, 30 * small + 0.05), (small, large)
    fold = next(t for t in fig.data if t.name == "folded")
    assert list(fold.text) == [f"… +{5000 - tf.MAX_DEPTH}"] and "folded" in fig.layout.title.text
    lay = layout_tree([1, 0, 5, -7, 2])  # parents after their child, or out of range: under the context
    assert lay.row == [0, 0, 1, 2, 1] and lay.depth == [1, 2, 1, 1, 2]


def test_a_tree_too_large_to_draw_is_summarised():
    nodes = [NodeTrace(token_id=i, text="x", parent=-1 if i < 40 else i % 40, depth=0, status="unverified")
             for i in range(3000)]
    fig = tree_figure(StepTrace(index=2, method="mcsd", nodes=nodes, drafted=3000))
    assert cpu_seconds(lambda: tree_figure(StepTrace(index=2, method="mcsd", nodes=nodes, drafted=3000))) < 1.0
    assert "too many to draw" in fig.layout.title.text and fig.data[0].type == "bar"
    assert sum(sum(t.y) for t in fig.data) == 3000 and len(fig.to_json()) < 20_000
    wide = [NodeTrace(token_id=i, text="x", parent=-1, depth=0, status="unverified") for i in range(200)]
    assert "too many" in tree_figure(StepTrace(index=0, method="tree", nodes=wide)).layout.title.text  # rows


@pytest.mark.parametrize("name", ALL)
def test_no_two_labels_overlap_as_laid_out(name):
    steps = steps_of(name)
    for step in steps:
        fig = tree_figure(step, beams_before(steps, step))
        boxes = label_boxes(fig)
        assert len(boxes) >= len(step.nodes) and overlaps(boxes) == [], (step.index, overlaps(boxes)[:3])
        assert fig.layout.xaxis.range[1] - fig.layout.xaxis.range[0] == tf.VIEW_W  # >= 1 px per unit


def test_dsbd_forest_one_lane_per_input_beam():
    steps = steps_of("dsbd-w4")
    step = steps[3]
    fig = tree_figure(step, beams_before(steps, step))
    lanes = next(t for t in fig.data if t.name == "lanes")
    roots = [n for n in step.nodes if n.parent == -1]
    assert len(lanes.text) == len(roots) == 4 and "context" not in {t.name for t in fig.data}
    for root, header in zip(roots, lanes.text):
        before = steps[2].beams[root.beam]
        assert header.startswith(f"beam {root.beam}: ") and before["text"][-12:] in header
        assert f"log-lik {root.score:.2f}" in header
    bands = list(lanes.y) + [1e9]
    rows = {(t.name, x, y) for t in fig.data if t.name in STATUS_COLORS for x, y in zip(t.x, t.y)}
    assert len(rows) == len(step.nodes)
    lay = layout_tree([n.parent for n in step.nodes], lanes=[i for i, n in enumerate(step.nodes) if n.parent == -1])
    for i, n in enumerate(step.nodes):  # every node in its beam's band: the trees one under the other
        assert bands[n.beam] < lay.row[i] < bands[n.beam + 1]
    assert len(fig.layout.shapes) == 2  # every other lane shaded


def test_mcsd_fork_one_lane_per_chain():
    steps = steps_of("mcsd-fork-w4")
    step = steps[1]
    fig = tree_figure(step)
    lanes = next(t for t in fig.data if t.name == "lanes")
    assert [h.split(":")[0] for h in lanes.text] == ["chain 1", "chain 2", "chain 3", "chain 4"]
    assert "context" in {t.name for t in fig.data}  # the fork hangs under the committed context
    assert tf.lane_starts(step) == [1, 2, 3, 4] and step.nodes[0].status == "target"
    correction = next(t for t in fig.data if t.name == "resampled")  # not a chain: on the trunk's row
    assert list(correction.y) == [next(t for t in fig.data if t.name == "target").y[0]]


def test_accepted_path_is_one_bold_line_and_rejected_branches_fade():
    steps = steps_of("opt-tree-25")
    fig = tree_figure(steps[0])
    bold = next(t for t in fig.data if t.name == "accepted path")
    committed = [n for n in steps[0].nodes if n.status in tf.COMMITTED]
    assert list(bold.x).count(None) == len(committed) and bold.line.width > 1
    assert len({y for y in bold.y if y is not None}) == 1  # the committed path runs along one row
    opacity = {t.name: t.marker.opacity for t in fig.data if t.name in STATUS_COLORS}
    assert opacity["accepted"] == 1 and opacity["unverified"] < 1
    sampled = tree_figure(steps_of("speculative-sampled")[1])
    faded = {t.name: t.marker.opacity for t in sampled.data if t.name in STATUS_COLORS}
    assert faded.get("rejected", 0.75) < 1 and faded.get("unverified", 0.4) < faded.get("rejected", 0.75)


@pytest.mark.parametrize("name", ALL)
def test_panels_keep_legends_outside_and_one_scale_per_quantity(name):
    steps = steps_of(name)
    for fig in (acceptance_figure(steps), choices_figure(steps), timing_figure(steps), tree_figure(steps[-1])):
        legend = fig.layout.legend
        assert legend.y >= 1 and legend.yanchor == "bottom"  # in the top margin, over nothing
        axes = json.loads(fig.to_json())["layout"]
        assert not any("overlaying" in v for k, v in axes.items() if k.startswith("yaxis"))
    choices = choices_figure(steps)
    axis_of = {t.name: t.yaxis or "y" for t in choices.data}
    if "tree nodes" in axis_of and "beam width" in axis_of:  # nodes in the tens, widths of 1-4: apart
        assert axis_of["tree nodes"] != axis_of["beam width"]
    if "tree nodes" in axis_of and "tree depth" in axis_of:
        assert axis_of["tree nodes"] != axis_of["tree depth"]


def test_one_colour_per_status_across_panels():
    steps = steps_of("dsbd-sampled")
    status_of = {c: s for s, c in STATUS_COLORS.items()}
    allowed = {"verify ms": "target", "this chat: accepted": "accepted", "accepted": "accepted",
               "rejected / unverified": "rejected"}  # series that stand for a status
    for fig in (acceptance_figure(steps), choices_figure(steps), timing_figure(steps), tree_figure(steps[2])):
        for t in fig.data:
            line = getattr(t, "line", None)  # (bars have none)
            colors = [getattr(t.marker, "color", None) if t.marker else None, line.color if line else None]
            for c in colors:
                if isinstance(c, str) and c in status_of and t.name not in STATUS_COLORS:
                    assert allowed.get(t.name) == status_of[c], (t.name, c)
    assert not set(SERIES_COLORS) & set(STATUS_COLORS.values())
    assert not set(timeline_figure([]).layout.colorway) & set(STATUS_COLORS.values())
    assert PROVENANCE_COLORS == {"draft": tint(STATUS_COLORS["accepted"], 0.28),
                                 "target": tint(STATUS_COLORS["target"], 0.2)}
    html = provenance_html(steps_of("speculative"))
    assert PROVENANCE_COLORS["draft"] in html and PROVENANCE_COLORS["target"] in html


def test_the_step_inspector_shows_whitespace_tokens_as_the_tree_does():
    from specui.engine.trace import NodeTrace, StepTrace
    from specui.ui.figures import step_markdown

    nodes = [NodeTrace(token_id=1, text=" the", parent=-1, depth=1, status="accepted"),
             NodeTrace(token_id=2, text="\n", parent=0, depth=2, status="rejected")]
    step = StepTrace(index=0, method="speculative", nodes=nodes, drafted=2, accepted=1, new_token_ids=[1],
                     new_from_draft=[True], new_text=" the", text=" the")
    table = step_markdown(step)
    assert "`␣the`" in table and "`↵`" in table


def test_the_page_keeps_the_tree_charts_as_wide_as_their_layout():
    """The page's CSS floor for the tree charts is the width the labels are laid out for
    (VIEW_W of axis plus the margins), so the two cannot drift apart."""
    from specui.ui import tree_figure
    from specui.ui.live_panels import PAGE_CSS

    assert tree_figure.CHART_MIN_W >= tree_figure.VIEW_W + 24 and f"min-width: {tree_figure.CHART_MIN_W}px" in PAGE_CSS
