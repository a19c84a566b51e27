"""Replay (issue 45): the frames a replay shows, built from recorded traces of every method, and
the reader of a trace JSON loaded back into the page, which names what is wrong with a bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specui.engine.trace import traces_from_json, traces_to_json
from specui.ui.replay import MAX_TRACE_BYTES, TraceError, frames, parse_trace, read_trace

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
PREFIX_METHODS = ("autoregressive", "speculative", "speculative-sampled", "tree", "opt-tree", "mcsd-fork-w4")


def fixture_text(name: str) -> str:
    return (FIXTURES / f"{name}.json").read_text()


@pytest.mark.parametrize("name", PREFIX_METHODS)
def test_frames_advance_the_text_step_by_step_to_the_reply(name):
    steps = json.loads(fixture_text(name))["steps"]
    shown = list(frames(steps))
    assert len(shown) == len(steps) and [f.index for f in shown] == list(range(len(steps)))
    texts = [f.text for f in shown]
    assert all(b.startswith(a) and len(b) >= len(a) for a, b in zip(texts, texts[1:]))  # only grows
    assert texts[-1] == steps[-1]["text"]
    for f, step in zip(shown, steps):
        assert f"step {step['index']}" in f.tree.layout.title.text  # that step's tree
        assert f.markdown.startswith(f"▶ replay · step {f.index + 1} of {len(steps)}")
        assert f"**step {step['index']}**" in f.markdown
    assert "prov-" in shown[-1].html


def test_frames_of_a_rewriting_method_end_on_its_reply():
    steps = traces_from_json(fixture_text("dsbd"))  # StepTrace objects are read as well as dicts
    shown = list(frames(steps))
    assert len(shown) == len(steps) and shown[-1].text == steps[-1].text


@pytest.mark.parametrize("name", ("speculative", "dsbd-w4", "beam"))
def test_an_export_round_trips(name, tmp_path):
    steps = traces_from_json(fixture_text(name))
    path = tmp_path / "trace.json"
    path.write_text(traces_to_json(steps))
    loaded = read_trace(str(path))
    assert loaded == [s.to_dict() for s in steps]
    assert parse_trace(json.dumps(loaded)) == loaded  # the bare list of steps is read too


@pytest.mark.parametrize("text, says", [
    ("{not json", "not valid JSON (line 1, column 2"),
    (b"\xff\xfe\x00", "not UTF-8"),
    ('{"stats": null}', "not a SpecUI trace"),
    ('"steps"', "not a SpecUI trace"),
    ('{"steps": {"0": {}}}', "not a SpecUI trace"),
    ('{"steps": []}', "no steps"),
    ("[]", "no steps"),
    ('{"steps": [3]}', "step 0 of the trace is not an object"),
    ('{"steps": [{"index": 0, "method": "x", "text": 5}]}', "'text' should be a str"),
    ('{"steps": [{"index": "a", "method": "x"}]}', "'index' should be a number"),
    ('{"steps": [{"method": "x"}]}', "step 0 of the trace cannot be read"),  # index missing
    ('{"steps": [{"index": 0, "method": "x", "nodes": [{"token_id": 1}]}]}', "node 0: 'text' is missing"),
    ('{"steps": [{"index": 0, "method": "x", "nodes": [{"token_id": 1, "text": "a", "parent": 4, "depth": 0, '
     '"status": "accepted"}]}]}', "parent 4 is not a node"),
    ('{"steps": [{"index": 0, "method": "x", "nodes": [{"token_id": 1, "text": "a", "parent": -1, "depth": 0, '
     '"status": "maybe"}]}]}', "unknown status 'maybe'"),
    ('{"steps": [{"index": 0, "method": "x", "nodes": [{"token_id": 1, "text": "a", "parent": -1, "depth": 0, '
     '"status": "accepted", "q": "high"}]}]}', "'q' should be a number or null"),
    ('{"steps": [{"index": 0, "method": "x", "nodes": [{"token_id": 1, "text": "a", "parent": -1, "depth": 0, '
     '"status": "accepted", "colour": 1}]}]}', "cannot be read"),
])
def test_a_malformed_trace_gets_a_clear_message(text, says):
    with pytest.raises(TraceError, match=None) as caught:
        parse_trace(text)
    assert says in str(caught.value)


def test_an_unreadable_or_huge_file_gets_a_clear_message(tmp_path):
    with pytest.raises(TraceError, match="could not be read"):
        read_trace(str(tmp_path / "missing.json"))
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(MAX_TRACE_BYTES + 10)
    with pytest.raises(TraceError, match="larger than 20 MB"):
        read_trace(str(big))
