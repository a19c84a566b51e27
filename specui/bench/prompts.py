"""The project's prompt sets (assets/prompts/*.jsonl)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specui.errors import SpecUIError

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "prompts"
HELDOUT = PROMPTS_DIR / "heldout.jsonl"
TRAIN = PROMPTS_DIR / "train.jsonl"
DEV = PROMPTS_DIR / "dev.jsonl"  # for choosing settings (SpecDec++'s head and H); never trained on


@dataclass
class PromptItem:
    id: str
    category: str
    messages: list[dict[str, str]]


def load_prompts(path: Path, limit: int | None = None) -> list[PromptItem]:
    if not Path(path).is_file():
        raise SpecUIError(f"prompt file '{path}' does not exist")
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append(PromptItem(row["id"], row.get("category", ""), row["messages"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpecUIError(f"{path}:{n}: not a prompt record ({e})") from None
    return items[:limit] if limit else items
