"""Figure builders on real traces; the UI modules import no torch."""

import json
import subprocess
import sys

from conftest import EOS, TinyTokenizer

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.trace import StepTrace, traces_from_json, traces_to_json
from specui.ui.figures import STATUS_COLORS, acceptance_figure, tree_figure, tree_layout


def traces(tiny_target, tiny_draft, method, **params):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    gen = engine.generate(GenerationRequest([1, 9, 4], 16, SamplingConfig(temperature=1.0, seed=2)),
                          make_method(method, **params)).run()
    return gen


def test_trace_json_round_trip(tiny_target, tiny_draft):
    gen = traces(tiny_target, tiny_draft, "speculative", gamma=4)
    restored = traces_from_json(traces_to_json(gen.steps, gen.stats))
    assert restored == gen.steps
    assert json.loads(traces_to_json(gen.steps, gen.stats))["stats"]["new_tokens"] == len(gen.output_ids)


def test_speculative_chain_statuses(tiny_target, tiny_draft):
    for step in traces(tiny_target, tiny_draft, "speculative", gamma=4).steps:
        statuses = [n.status for n in step.nodes]
        assert statuses[-1] in ("resampled", "bonus")
        drafts = statuses[:-1]
        a = step.accepted
        assert drafts[:a] == ["accepted"] * a
        if statuses[-1] == "resampled":
            assert drafts[a] == "rejected" and set(drafts[a + 1:]) <= {"unverified"}
        assert step.nodes[-1].parent == a - 1
        assert len(step.new_token_ids) <= a + 1


def test_tree_figure_nodes_colours_and_labels(tiny_target, tiny_draft):
    step = traces(tiny_target, tiny_draft, "speculative", gamma=4).steps[0]
    fig = tree_figure(step)
    node_traces = [t for t in fig.data if t.name in STATUS_COLORS]
    assert sum(len(t.x) for t in node_traces) == len(step.nodes)
    for t in node_traces:
        assert t.marker.color == STATUS_COLORS[t.name]
        assert all(label.startswith("t") for label in t.text)  # (the tiny tokenizer's tokens: no spaces)
    assert "step 0" in fig.layout.title.text


def test_beam_and_autoregressive_figures(tiny_target, tiny_draft):
    for method, params in (("beam", {"width": 3}), ("autoregressive", {})):
        gen = traces(tiny_target, tiny_draft, method, **params)
        fig = tree_figure(gen.steps[1])
        assert sum(len(t.x) for t in fig.data if t.name in STATUS_COLORS) == len(gen.steps[1].nodes)
        acc = acceptance_figure(gen.steps)
        assert list(acc.data[0].x) == [s.index for s in gen.steps]


def test_tree_layout_hand_drawn():
    #   root -> 0 -> 1 ; 0 -> 2 ; root -> 3
    xy = tree_layout([-1, 0, 0, -1])
    assert [x for x, _ in xy] == [1, 2, 2, 1]
    assert xy[1][1] < xy[2][1] < xy[3][1]  # one row per leaf, subtrees one under the other
    assert xy[0][1] == xy[1][1]  # a parent on its first child's row: a path reads along one line


def test_empty_figures():
    assert "no step" in tree_figure(None).layout.title.text
    assert len(acceptance_figure([]).data) == 3
    assert StepTrace(index=0, method="x").to_dict()["nodes"] == []


def test_ui_modules_do_not_import_torch():
    code = "import sys, specui.ui.chat_ui, specui.ui.figures; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tree_and_choices_figures_for_opt_tree(tiny_target):
    from test_greedy_equivalence import near_copy

    from specui.ui.figures import choices_figure

    engine = Engine(tiny_target, TinyTokenizer(), draft=near_copy(tiny_target, 0.003, 3), eos_ids=[EOS])
    gen = engine.generate(GenerationRequest([1, 9, 4], 20), make_method("opt-tree", nodes=8, delta=0.05)).run()
    step = gen.steps[0]
    fig = tree_figure(step)
    assert sum(len(t.x) for t in fig.data if t.name in STATUS_COLORS) == len(step.nodes)
    assert any("p^ = " in h for t in fig.data if t.name in STATUS_COLORS for h in t.hovertext)
    names = {t.name for t in choices_figure(gen.steps).data}
    assert {"tree nodes", "tree depth", "E(A) expected", "A achieved"} <= names
    assert "gamma (candidate length)" not in names


def test_profile_figure_and_auto_choices():
    import json

    from test_profile import synthetic

    from specui.ui.figures import choices_figure, profile_figure

    fig = profile_figure(json.loads(json.dumps(synthetic().to_dict())))
    assert [t.name for t in fig.data] == ["target, context 64", "target, context 512", "draft, one layer of width w"]
    assert profile_figure(None).layout.title.text == "no cost profile measured yet"
    steps = [StepTrace(index=0, method="auto", drafted=3, choice="speculative:3"),
             StepTrace(index=1, method="auto", drafted=0, choice="autoregressive")]
    fig = choices_figure(steps)
    assert list(fig.data[-1].y) == [3, 0] and list(fig.data[-1].text) == ["speculative:3", "autoregressive"]
