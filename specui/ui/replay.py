"""Replay of a reply, step by step (issue 45): the frames a replay shows (each step's tree, its
numbers and the reply's text up to that step) and the reader of a trace JSON loaded back into
the page (the page's and the CLI's --trace export), which says plainly what is wrong with a
file it cannot replay. Plain data only; never imports torch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from specui.engine.trace import STATUSES, StepTrace
from specui.ui.figures import provenance_html, step_markdown, tree_figure

MAX_TRACE_BYTES = 20 * 1024 * 1024  # a loaded trace larger than this is refused (a long reply's is a few MB)
SPEEDS = (0.5, 20.0, 2.0)  # steps per second: the speed slider's ends and its default
NODE_FIELDS = {"token_id": int, "text": str, "parent": int, "depth": int, "status": str}
NODE_NUMBERS = ("q", "p", "p_hat", "score", "draft_score", "accept_pred", "reject_pred")  # or null
STEP_NUMBERS = ("index", "drafted", "accepted", "draft_ms", "verify_ms", "step_ms")


class TraceError(ValueError):
    """A trace JSON that cannot be replayed; the message says why, for the page to show."""


@dataclass
class Frame:
    """What one step of a replay shows."""

    index: int  # the step's position in the replayed trace (0-based)
    total: int
    tree: go.Figure
    markdown: str  # the step's numbers, headed by where the replay is
    text: str  # the reply after this step
    html: str  # the same text coloured by provenance (accepted draft / target)


def frames(steps: list[dict] | list[StepTrace]) -> Iterator[Frame]:
    """One frame per step, in order: the tree growing, its verification colouring, the text advancing."""
    traces = [s if isinstance(s, StepTrace) else StepTrace.from_dict(s) for s in steps]
    for i, step in enumerate(traces):
        before = traces[i - 1].beams if i > 0 else None
        head = f"▶ replay · step {i + 1} of {len(traces)}\n\n"
        yield Frame(i, len(traces), tree_figure(step, before), head + step_markdown(step), step.text,
                    provenance_html(traces[: i + 1]))


def parse_trace(text: str | bytes) -> list[dict]:
    """The steps of an exported trace JSON (`{"stats": ..., "steps": [...]}`, or the bare list of
    steps), checked so every step can be drawn; a TraceError says what is wrong otherwise."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError("The file is not a trace JSON: it is not UTF-8 text.") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"The file is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}).") from e
    steps = data.get("steps") if isinstance(data, dict) else data
    if not isinstance(steps, list):
        raise TraceError('The JSON is not a SpecUI trace: expected {"stats": ..., "steps": [...]} '
                         "as Export trace (JSON) writes it.")
    if not steps:
        raise TraceError("The trace has no steps: there is nothing to replay.")
    return [_checked(i, s) for i, s in enumerate(steps)]


def _checked(i: int, step: Any) -> dict:
    """One step, as StepTrace.from_dict reads it, with the fields the drawing uses of the right types."""
    where = f"step {i} of the trace"
    if not isinstance(step, dict):
        raise TraceError(f"{where} is not an object ({type(step).__name__}).")
    for name, kind in (("text", str), ("new_text", str), ("nodes", list), ("new_token_ids", list)):
        if name in step and not isinstance(step[name], kind):
            raise TraceError(f"{where}: '{name}' should be a {kind.__name__}.")
    for name in STEP_NUMBERS:
        if name in step and not _number(step[name]):
            raise TraceError(f"{where}: '{name}' should be a number.")
    nodes = step.get("nodes", [])
    for j, node in enumerate(nodes):
        _check_node(f"{where}, node {j}", node, len(nodes))
    try:
        StepTrace.from_dict(step)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{where} cannot be read ({e}).") from e
    return step


def _check_node(where: str, node: Any, count: int) -> None:
    if not isinstance(node, dict):
        raise TraceError(f"{where} is not an object.")
    for name, kind in NODE_FIELDS.items():
        if not isinstance(node.get(name), kind) or isinstance(node.get(name), bool):
            raise TraceError(f"{where}: '{name}' is missing or not a {kind.__name__}.")
    for name in NODE_NUMBERS:
        if node.get(name) is not None and not _number(node[name]):
            raise TraceError(f"{where}: '{name}' should be a number or null.")
    if node["status"] not in STATUSES:
        raise TraceError(f"{where}: unknown status '{node['status']}' (known: {', '.join(STATUSES)}).")
    if not -1 <= node["parent"] < count:
        raise TraceError(f"{where}: parent {node['parent']} is not a node of its step.")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_trace(path: str) -> list[dict]:
    """parse_trace of a file (an upload on the page), refused past MAX_TRACE_BYTES."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TRACE_BYTES + 1)
    except OSError as e:
        raise TraceError(f"The file could not be read ({e.strerror or type(e).__name__}).") from e
    if len(data) > MAX_TRACE_BYTES:
        raise TraceError(f"The file is larger than {MAX_TRACE_BYTES // (1024 * 1024)} MB: not a trace the page "
                         "replays.")
    return parse_trace(data)
