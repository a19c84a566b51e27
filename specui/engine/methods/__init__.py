"""Decoding methods by name. Each name maps to a Method class; `make_method` builds a
fresh instance (methods hold per-generation state)."""

from __future__ import annotations

from typing import Any

from specui.engine.method import Method
from specui.engine.methods.auto import Auto
from specui.engine.methods.autoregressive import Autoregressive
from specui.engine.methods.beam import Beam
from specui.engine.methods.dsbd import DSBD
from specui.engine.methods.emssd import EmsSd
from specui.engine.methods.lookup import PromptLookup
from specui.engine.methods.mcsd import MCSD
from specui.engine.methods.specdec import SpecDecPP
from specui.engine.methods.speculative import Speculative
from specui.engine.methods.tree import OptTree, StaticTree
from specui.errors import SpecUIError

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (Auto, Autoregressive, Beam, DSBD, EmsSd, MCSD, PromptLookup, SpecDecPP, Speculative,
                              StaticTree, OptTree)
}


def make_method(name: str, **params: Any) -> Method:
    """Build a method by name with its own parameters (gamma=..., width=...)."""
    try:
        cls = METHODS[name]
    except KeyError:
        raise SpecUIError(
            f"unknown decoding method '{name}'; choose one of: {', '.join(sorted(METHODS))}"
        ) from None
    try:
        return cls(**params)
    except TypeError as e:
        raise SpecUIError(f"bad parameters for method '{name}': {e}") from None
