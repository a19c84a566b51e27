"""User-facing generation settings (plain data; shared by the CLI and the UI, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChatSettings:
    """Every knob a user can turn; each method takes the ones its constructor names."""

    method: str = "auto"
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    gamma: int = 2  # speculative: draft tokens per step (fastest measured on CPU)
    width: int = 4  # beam: number of beams
    preset: str = "eagle-25"  # tree: static tree shape
    nodes: int = 25  # opt-tree: node budget n
    delta: float | None = None  # opt-tree: stop threshold on E(A) gain (None: max(mu, 0.05))
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class PairChoice:
    """What the model panel asks for: target and draft sources (hub id, folder, .gguf,
    'bundled:smollm2'; the draft also 'default' or 'none'), quantization, device."""

    target: str
    draft: str = "default"
    quantization: str = "none"
    device: str = "auto"
    dtype: str = "auto"
    draft_quantization: str = "none"
    trust_remote_code: bool = False
