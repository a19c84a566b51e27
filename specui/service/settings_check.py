"""The one check of chat settings (UI, CLI and API) and what a method and the sampler take
from them."""

from __future__ import annotations

import inspect
from dataclasses import asdict

from specui.engine import METHODS, SamplingConfig, make_method
from specui.settings import ChatSettings, check_settings


def method_params(settings: ChatSettings) -> dict:
    """The settings a method's constructor names (gamma=..., width=...)."""
    if settings.method not in METHODS:
        return {}
    wanted = inspect.signature(METHODS[settings.method].__init__).parameters
    return {k: v for k, v in asdict(settings).items() if k in wanted and k != "self"}


def sampling_config(settings: ChatSettings) -> SamplingConfig:
    return SamplingConfig(settings.temperature, settings.top_k, settings.top_p, settings.seed)


def validate_settings(settings: ChatSettings, context_len: int | None = None) -> ChatSettings:
    """The one validation of settings (UI, CLI and API): every field's type and range
    (specui.settings.check_settings), then the method's own constructor. Returns the
    normalised settings; raises SpecUIError naming the bad field."""
    from specui.engine.methods.tree import STATIC_TREES

    settings = check_settings(settings, METHODS, STATIC_TREES, context_len)
    make_method(settings.method, **method_params(settings))
    sampling_config(settings).validate()
    return settings
