"""The live panels, redrawn in place while a reply streams.

Gradio's Plot component re-creates its chart whenever its value changes: a keyed block mounts a
new element, plotly builds the whole figure again, and a second `Plotly.react` follows. Counted
in headless Chromium on a 2-core CPU (opt-tree, panels once a second): 8 plotly calls a second
for the four panels, 28 ms each, and the renderer took 0.4-0.8 of a core, which the engine
lost. So while a reply streams the four figures travel as JSON in one hidden text carrier, and a
script in the page hands them to `Plotly.react` on the charts already drawn: the traces are
replaced in place and nothing is rebuilt. A draw still running when the next figures arrive
folds them into one (only the newest is drawn). The Plot components get the final figures
once, when the reply ends, so the final panels are exactly the recorded trace's."""

from __future__ import annotations

import json
from typing import Any

CARRIER_ID = "live-figures"

# Gradio marks every output of a running event "generating" and pulses its border with an endless
# CSS animation: eight boxes while a reply streams, so the browser composites frames all the time.
# Measured in headless Chromium on a 2-core CPU: its compositor thread took 0.48 of a core for as
# long as a reply streamed, panels on or off. The reply's own growing text shows progress. Passed
# to every `launch` of the page.
PAGE_CSS = ".generating { animation: none !important; }"

# `payload`: {"<elem_id of a gr.Plot>": <plotly figure JSON>, ...}. Layout as Gradio's own Plot
# sets it (autosize, margins that grow for a title), so a live chart looks like the final one.
DRAW_JS = """
(payload) => {
  const live = window.__specuiLive = window.__specuiLive || {pending: null, busy: false, draws: 0};
  live.pending = payload || null;  // "": the reply ended, its final charts replace these; drop the rest
  if (live.pending === null || live.busy || !window.Plotly) return [];
  live.busy = true;
  const drawNewest = () => {
    const text = live.pending;
    live.pending = null;
    if (text === null) { live.busy = false; return; }
    let figures = {};
    try { figures = JSON.parse(text); } catch (e) { figures = {}; }
    const draws = Object.entries(figures).map(([id, fig]) => {
      const gd = document.querySelector(`#${id} .js-plotly-plot`);
      if (!gd || !fig || !fig.layout) return null;
      const layout = fig.layout;
      layout.autosize = true;
      layout.margin = layout.margin || {};
      layout.margin.autoexpand = true;
      if (layout.title) layout.margin.t = Math.max(100, layout.margin.t || 0);
      return Plotly.react(gd, fig.data || [], layout);
    });
    live.draws += 1;
    Promise.all(draws).catch(() => null).then(() => {
      if (live.pending !== null) requestAnimationFrame(drawNewest);
      else live.busy = false;
    });
  };
  requestAnimationFrame(drawNewest);
  return [];
}
"""


def live_payload(figures: dict[str, Any]) -> str:
    """One JSON text carrying plotly figures by the elem_id of the Plot each belongs in."""
    return "{" + ",".join(f"{json.dumps(elem_id)}:{figure.to_json()}" for elem_id, figure in figures.items()) + "}"
