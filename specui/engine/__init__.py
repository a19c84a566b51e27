"""The decoding engine: one loop, pluggable methods, plain-data step traces.

Exports resolve lazily, so `specui.engine.trace` (plain data, read by the UI) can be
imported without importing torch."""

from importlib import import_module

_EXPORTS = {
    "Engine": "specui.engine.engine",
    "Generation": "specui.engine.loop",
    "GenerationRequest": "specui.engine.loop",
    "METHODS": "specui.engine.methods",
    "make_method": "specui.engine.methods",
    "SamplingConfig": "specui.engine.sampling",
    "GenerationStats": "specui.engine.trace",
    "NodeTrace": "specui.engine.trace",
    "StepTrace": "specui.engine.trace",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specui.engine' has no attribute {name!r}")
