"""`--capture auto` on a CPU, chosen by measurement: eager forwards against compiled padded
shapes (`--capture on`), one token at a time after a short context, per model, dtype, CPU,
thread count and torch version, cached on disk like the dtype choice. Compiling costs a minute
or more on a small CPU, so no reply waits for it: `python -m specui.bench.capture` records the
choice in the foreground, and with no record `auto` decodes eagerly while engine/calibration.py
measures in the background, while no reply decodes; `auto` then reads the record. Measured on a 2-core Zen 4
EPYC: the bundled target in bf16 on int4 blocks 16.9 ms a token eager, 12.8 compiled (on); in
float32 56.8 against 55.1 (off); the int4 draft in float32 12.5 against 2.0. Other CPUs differ
(the issue's AMX Xeon: 1.17-1.52x with inductor's freezing), hence a choice per machine."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specui.engine.attention import routed_attention
from specui.engine.measure import cache_root, cpu_signature, model_identity
from specui.engine.session import ModelSession
from specui.engine.timing import fastest_in_turns

MARGIN = 0.95  # compiled must be at least 5% faster to be chosen (and grouped attention than SDPA)
CONTEXT, TOKENS, ROUNDS = 48, 24, 3
# compiled, attention as matmuls and a softmax (engine/attention.py's `grouped`) up to this many
# queries: inductor can fuse them where SDPA stays one opaque kernel call a layer; timed beside
# compiled SDPA, recorded only where it is MARGIN faster. On a 2-core Zen 4 EPYC (bundled
# target, bf16 on int4 blocks) the two were level, taking turns over 3 rounds at 1 / 2 / 4 / 8
# tokens after 48 and 256 cached (e.g. 12.2-12.6 against 12.0-12.5 ms for one token), so there
# the record keeps the load's SDPA; eager, grouped is slower there (the load's measurement)
GROUPED = 16


def cache_file() -> Path:
    return cache_root() / "capture_choices.json"


def choice_key(model: PreTrainedModel) -> str:
    device = next(model.parameters()).device
    raw = json.dumps([model_identity(model), str(model.dtype), str(device.type), cpu_signature(),
                      torch.get_num_threads(), torch.__version__])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def read(path: Path | None = None) -> dict:
    try:
        data = json.loads((path or cache_file()).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached(model: PreTrainedModel, path: Path | None = None) -> tuple[str | None, int | None]:
    """This machine's record for `model`, read once: ("on" or "off" as measured, or None: never
    measured, or a corrupt entry; the longest query to attend with grouped matmuls when
    compiled, where that measured faster, else None: as the load chose)."""
    entry = read(path).get(choice_key(model))
    entry = entry if isinstance(entry, dict) else {}
    choice = entry.get("choice")
    return (choice if choice in ("on", "off") else None), (GROUPED if entry.get("attention") == "grouped" else None)


def forget(model: PreTrainedModel, path: Path | None = None) -> bool:
    """Drop this machine's record for `model` (it is measured again); True if there was one."""
    path = path or cache_file()
    data = read(path)
    if data.pop(choice_key(model), None) is None:
        return False
    _write(path, data)
    return True


def cached_choice(model: PreTrainedModel, path: Path | None = None) -> str | None:
    """The capture choice of cached()."""
    return cached(model, path)[0]


def cached_attention(model: PreTrainedModel, path: Path | None = None) -> int | None:
    """The attention of cached()."""
    return cached(model, path)[1]


def round_timer(model: PreTrainedModel, capture: str, grouped: int | None = None,
                check: Callable[[], None] | None = None) -> tuple[Callable[[], float], float]:
    """(a function that times one round: ms per token decoding TOKENS tokens one at a time after
    CONTEXT, the seconds the first forwards took: the compile); `grouped`: compiled with grouped
    attention; `check`: called before each forward after the first (the compile) and each timed
    token (a background measurement's: it raises to end the round when a reply starts to decode)."""
    session = ModelSession(model, capture=capture, grouped=grouped)
    vocab = model.config.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(CONTEXT)] + [5 % vocab] * 3
    with torch.inference_mode():
        t0 = time.perf_counter()
        # one token at a time from the first: one shape, compiled (or warmed) before any other
        # forward runs (a measuring thread that waits while a compile is under way then holds
        # no OpenMP team: engine/calibration.py)
        for n in range(1, len(ids) + 1):
            if check is not None and n > 1:  # compiled by now: from here on a reply ends it
                check()
            session.advance(ids[:n], 1)
        first = time.perf_counter() - t0

    def one_round() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in range(TOKENS):
                if check is not None:
                    check()
                ids.append(11 % vocab)
                session.advance(ids, 1).argmax().item()
            ms = (time.perf_counter() - t0) / TOKENS * 1000
            session.commit(ids[:CONTEXT + 3])
            del ids[CONTEXT + 3:]
        return ms

    return one_round, first


def timers(model: PreTrainedModel) -> dict[str, Callable]:
    """The kinds measure() times, each as a function of `check` that prepares it (compiles or
    warms it) and returns round_timer()'s pair: compiled, compiled with grouped attention
    (where the model attends through engine/attention.py: a compile of its own), eager."""
    kinds = {"on": lambda check: round_timer(model, "on", check=check)}
    if routed_attention(model):
        kinds["on+grouped"] = lambda check: round_timer(model, "on", GROUPED, check)
    kinds["off"] = lambda check: round_timer(model, "off", check=check)
    return kinds


def prepare(model: PreTrainedModel, check: Callable[[], None] | None = None) -> dict:
    """timers(), each prepared: {kind: (one round, the seconds its first forwards took)}."""
    return {kind: make(check) for kind, make in timers(model).items()}


def measure(model: PreTrainedModel, path: Path | None = None) -> dict:
    """Time eager and compiled forwards (prepare()) and record the choice (decide())."""
    return decide(model, prepare(model), path)


def decide(model: PreTrainedModel, kinds: dict, path: Path | None = None) -> dict:
    """Time prepare()'s kinds, their rounds taking turns (a neighbour's burst or a compile's
    leftovers then hit every kind, not one: on a 2-core Xeon VM one run timed a compiled forward
    at 32.6 ms that measured 19.2 in the next), the best round of each; record and return
    {"ms": {...}, "compile_s", "choice", "attention"}."""
    best = fastest_in_turns({kind: one_round for kind, (one_round, _) in kinds.items()}, ROUNDS)
    ms = {kind: round(value, 2) for kind, value in best.items()}
    eager, compiled, first = best["off"], best["on"], kinds["on"][1]
    attention = "as loaded"
    if "on+grouped" in best and best["on+grouped"] <= MARGIN * compiled:
        attention, compiled, first = "grouped", best["on+grouped"], kinds["on+grouped"][1]
    entry = {"ms": ms, "compile_s": round(first, 1), "choice": "on" if compiled <= MARGIN * eager else "off",
             "attention": attention, "cpu": cpu_signature(), "threads": torch.get_num_threads(),
             "dtype": str(model.dtype).removeprefix("torch.")}
    path = path or cache_file()
    data = read(path)
    data[choice_key(model)] = entry
    try:
        _write(path, data)
    except OSError as e:
        entry["note"] = f"not cached ({e})"
    return entry


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.replace(path)
