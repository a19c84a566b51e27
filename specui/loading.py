"""Moved to specui.weights.loading; this path keeps working for one release, with a warning."""

import warnings

from specui.weights import loading as _moved

warnings.warn("specui.loading moved to specui.weights.loading; import it from there", DeprecationWarning,
              stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
