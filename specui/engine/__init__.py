"""The decoding engine: one loop, pluggable methods, plain-data step traces."""

from specui.engine.engine import Engine
from specui.engine.loop import Generation, GenerationRequest
from specui.engine.methods import METHODS, make_method
from specui.engine.sampling import SamplingConfig
from specui.engine.trace import GenerationStats, NodeTrace, StepTrace

__all__ = [
    "Engine", "Generation", "GenerationRequest", "METHODS", "make_method", "SamplingConfig",
    "GenerationStats", "NodeTrace", "StepTrace",
]
