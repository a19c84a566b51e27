"""Load target and draft models (the entry point of model preparation): `load_model(spec)`
loads with the spec's quantization, or for `auto` with the fastest of the candidates as
measured on this machine (quant_choice.py). The types and helpers it takes and returns are
defined in sources.py (where a model comes from) and concrete.py (loading with one
quantization) and are importable from here, the path callers use."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specui.errors import SpecUIError
from specui.settings import QUANTIZATIONS
from specui.weights.concrete import Progress, load_concrete
from specui.weights.gguf_whole import gguf_problem
from specui.weights.native import build_in_background
from specui.weights.quant_choice import choose_quantization
from specui.weights.sources import (
    BUNDLED,
    BUNDLED_GGUF,
    CPU_KERNELS,
    DTYPES,
    LoadedModel,
    ModelSpec,
    auto_candidates,
    bundled_gguf_path,
    check_same_tokenizer,
    gguf_path,
    gguf_source,
    load_tokenizer,
    locate,
    measures_dtype,
    resolve_device,
    resolve_dtype,
)
from specui.weights.threads import threads_within_quota

__all__ = [
    "BUNDLED", "BUNDLED_GGUF", "CPU_KERNELS", "DTYPES", "QUANTIZATIONS", "LoadedModel", "ModelSpec",
    "auto_candidates", "bundled_gguf_path", "check_same_tokenizer", "gguf_path", "gguf_source", "load_concrete",
    "load_model", "load_tokenizer", "locate", "measures_dtype", "resolve_device", "resolve_dtype",
]


def load_model(spec: ModelSpec, role: str = "model", progress: Progress | None = None,
               capture: str = "auto") -> LoadedModel:
    """Load one model and its tokenizer as `spec` says (`role` names it in notes).
    Quantization `auto` becomes the one candidate there is, or the fastest of several as
    measured on this machine (specui.weights.quant_choice; cached; `capture`, the forwards the
    engines will run, auto / on / off: as those run, where that was measured).
    `progress(fraction, what)` hears the slow parts of the load. On a CPU, torch's threads are first
    cut to what a CPU quota allows (specui.weights.threads.threads_within_quota)."""
    device = resolve_device(spec.device)
    threads_note = threads_within_quota() if device.type == "cpu" else None
    loaded = _load_model(spec, device, role, progress, capture)
    if threads_note:
        loaded.notes = (threads_note, *loaded.notes)
    return loaded


def _load_model(spec: ModelSpec, device, role: str, progress: Progress | None, capture: str) -> LoadedModel:
    where, gguf, local = locate(spec.source)
    if gguf and local and (problem := gguf_problem(Path(where) / gguf)):  # a download cut short, said as such
        raise SpecUIError(f"{role}: {problem}")
    if device.type == "cpu":
        build_in_background()  # SpecUI's kernels build beside the reading of the model, not after it
    if spec.quantization != "auto":
        return load_concrete(spec, role, progress=progress)
    source = gguf_source(spec)
    types = source.types if source is not None and source.types else None
    candidates, note = auto_candidates(spec, device, types, role)
    if len(candidates) > 1:
        return choose_quantization(spec, candidates, note or "", role, source=source, progress=progress,
                                   capture=capture)
    return load_concrete(replace(spec, quantization=candidates[0]), role, (note,) if note else (), source, progress)


