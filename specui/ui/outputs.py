"""What one update of the chat page carries, and the stats line under the reply."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import gradio as gr


def stats_line(stats: dict, notes: list[str] = ()) -> str:
    extra = "".join(f"\n\nℹ️ {n}" for n in dict.fromkeys(notes))
    return extra.lstrip() + "\n\n" + (
        f"**{stats['method']}** · {stats['new_tokens']} tokens · {stats['target_forwards']} target forwards · "
        f"mean accepted length {stats['mean_accepted_length']:.2f} · acceptance {stats['acceptance_rate']:.0%} · "
        f"{stats['tokens_per_s']:.1f} tok/s · {stats['finish_reason'] or 'running'}"
    )


@dataclass
class Outputs:
    """What one update of the page carries, in the order of build_ui's `outputs`; None = unchanged."""

    history: list
    tree: Any = None
    accept: Any = None
    choices: Any = None
    timing: Any = None
    stats: Any = None
    provenance: Any = None
    steps: Any = None
    slider: Any = None
    export: Any = None
    live: Any = None  # the live panels' figures as JSON (specui/ui/live_panels.py); "" once the reply ends

    def as_tuple(self) -> tuple:
        return tuple(gr.skip() if getattr(self, f.name) is None else getattr(self, f.name) for f in fields(self))
