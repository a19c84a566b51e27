"""A feature draft: a token draft that also reads the target's hidden states (EAGLE's idea).

The learned part is one matrix, `feature_fc`, that mixes each token's embedding with the
target's state before it; the draft's config (its `specui_draft` marker) says whether it reads
states and after which target decoder layers. The engine reads only these two facts
(`reads_features`, `feature_layers`) to give such a draft a session that passes states on;
the draft model class itself is in weights/draft.py."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

MARKER = "specui_draft"  # config.json key that marks a SpecUI draft folder


def add_feature_input(draft: PreTrainedModel, scale: float = 1.0,
                      layers: list[int] | None = None) -> PreTrainedModel:
    """Make a token draft read the target's features too: a new feature_fc that starts as
    [I | 0], so the draft begins exactly as it was and training learns what the features add.
    `scale` multiplies the states first (training sets it to bring their size to the
    embeddings': the target's final states are about 14x larger for SmolLM2). `layers`: read
    the states after these target decoder layers instead of after the final norm."""
    h = draft.config.hidden_size
    extra = {"feature_layers": list(layers)} if layers else {}
    draft.config.specui_draft = {**draft.config.specui_draft, "features": True, "feature_scale": scale, **extra}
    weight = draft.model.norm.weight
    width = (1 + max(1, len(layers or ()))) * h
    draft.feature_fc = torch.nn.Linear(width, h, bias=False).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        draft.feature_fc.weight.zero_()
        draft.feature_fc.weight[:, :h].copy_(torch.eye(h))
    return draft


def reads_features(config) -> bool:
    """Whether a draft's config says it reads the target's features."""
    return bool(getattr(config, MARKER, None) and getattr(config, MARKER).get("features"))


def feature_layers(config) -> list[int]:
    """The target decoder layers a feature draft reads the states after ([]: the final norm's)."""
    marker = getattr(config, MARKER, None) or {}
    return [int(i) for i in marker.get("feature_layers", [])]
