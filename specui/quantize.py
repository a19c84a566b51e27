"""Moved to specui.weights.quantize; this path keeps working for one release, with a warning."""

import warnings

from specui.weights import quantize as _moved

warnings.warn("specui.quantize moved to specui.weights.quantize; import it from there", DeprecationWarning,
              stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
