"""The panels as drawn (issue 45): each recorded tree rendered by plotly in headless Chromium, every
token label's SVG text box read back, and no two may intersect; legends sit outside the plotting
area. A static page (tests/figure_page.py), not the app: no model, no timing, a few seconds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from app_process import needs_browser
from figure_page import FigurePage, covered, disjoint, overlaps

from specui.engine.trace import NodeTrace, StepTrace, traces_from_json
from specui.ui import tree_figure as tf
from specui.ui.figures import acceptance_figure, choices_figure, timing_figure, tree_figure
from specui.ui.palette import plain_figure
from specui.ui.reply_panels import beams_before

pytest.importorskip("selenium.webdriver")
pytestmark = needs_browser()

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
TREES = ("mcsd-baseline", "opt-tree-25", "dsbd-w4", "mcsd-fork-w4")
NARROWEST = tf.CHART_MIN_W  # the chart's width in px where the tree's x-axis is one unit a pixel
PANEL = 598  # the tree panel's width on the app's page in a 1500 px window (the inspector's: 1188)


def steps_of(name: str) -> list[StepTrace]:
    return traces_from_json((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def page():
    p = FigurePage()
    yield p
    p.close()


@pytest.mark.parametrize("name", TREES)
def test_no_two_token_labels_overlap_in_the_browser(page, name):
    steps = steps_of(name)
    for step in steps:
        fig = tree_figure(step, beams_before(steps, step))
        expected = sum(len(t.text) for t in fig.data if t.text is not None)
        for width in (NARROWEST, PANEL, 1188):
            drawn = page.draw(fig, width)
            assert len(drawn["texts"]) == expected >= len(step.nodes)  # every label drawn, read back
            assert overlaps(drawn["texts"]) == [], f"step {step.index} at {width} px: {overlaps(drawn['texts'])[:3]}"
            assert covered(drawn["texts"], drawn["markers"]) == []  # nor does a label lie over a node
            assert drawn["size"][1] == fig.layout.height  # drawn at the height the rows were given


def recorded(name: str) -> list[StepTrace]:
    """A fixture's steps, or steps with every choice a method records (the longest legends)."""
    if name == "mcsd-decision":
        return [StepTrace(index=i, method="mcsd", tree_nodes=12, tree_depth=3, expected_accept=2.0, chains=4,
                          threshold=0.4, stop_value=0.3, stop_reason="decision", accepted=1) for i in range(8)]
    if name == "ems-sd":
        return [StepTrace(index=i, method="ems-sd", gamma=3, drafted=3 * (i % 2), choice="speculative:3",
                          batch_size=3, batch_accepted=[1, 2, 0], batch_row=1, accepted=2) for i in range(8)]
    return steps_of(name)


@pytest.mark.parametrize("name", TREES + ("dsbd-sampled", "mcsd-decision", "ems-sd"))
def test_legends_sit_outside_the_plotting_area(page, name):
    steps = recorded(name)
    trees = [tree_figure(steps[0])] if steps[0].nodes else []
    for fig in [acceptance_figure(steps), choices_figure(steps), timing_figure(steps)] + trees:
        drawn = page.draw(fig, PANEL)
        assert drawn["legend"] and drawn["plots"]
        assert drawn["legend"][1] - drawn["frame"][1] >= 28  # clear of Gradio's label and the mode bar
        for plot in drawn["plots"]:
            assert disjoint(drawn["legend"], plot, slack=1), (name, drawn["legend"], plot)
        if drawn["title"]:
            assert disjoint(drawn["legend"], drawn["title"]), (name, drawn["legend"], drawn["title"])


def test_a_huge_trace_draws_a_summary_and_stays_responsive(page):
    nodes = [NodeTrace(token_id=i, text=" tok", parent=-1 if i < 50 else i - 50, depth=0,
                       status="unverified" if i % 7 else "rejected") for i in range(5000)]
    t0 = time.perf_counter()
    fig = tree_figure(StepTrace(index=4, method="mcsd", nodes=nodes, drafted=5000))
    drawn = page.draw(fig, PANEL)
    assert time.perf_counter() - t0 < 5.0
    assert "too many to draw" in fig.layout.title.text and drawn["texts"] == []  # bars, not 5000 labels
    assert page.driver.execute_script("return 1 + 1") == 2  # the page still answers


def test_the_check_sees_labels_on_top_of_each_other(page):
    """Not vacuous: two labels at one point, and a label over a node, are caught."""
    fig = plain_figure([dict(type="scatter", x=[0, 0, 1], y=[0, 0, 0], mode="markers+text",
                             text=["which", "where", "x"], textposition="middle center", marker=dict(size=10))],
                       dict(height=300))
    drawn = page.draw(fig, PANEL)
    assert len(overlaps(drawn["texts"])) == 1 and covered(drawn["texts"], drawn["markers"])
