"""A target + draft pair ready to decode: loading both, checking they fit, building the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specui.chat import stop_token_ids
from specui.engine import Engine
from specui.errors import SpecUIError
from specui.loading import BUNDLED, LoadedModel, ModelSpec, check_same_tokenizer, load_model

REPO = Path(__file__).resolve().parent.parent
PLACEHOLDER_DRAFT = REPO / "models" / "smollm2-135m-draft-placeholder"
DEFAULT_TARGET = BUNDLED


def default_draft_source() -> str:
    """The default draft: the placeholder built by `make setup` from the bundled target
    (its first 3 and last layer, untrained), until a trained draft ships under models/."""
    if not (PLACEHOLDER_DRAFT / "config.json").is_file():
        raise SpecUIError(
            f"the default draft is missing ({PLACEHOLDER_DRAFT}); build it with "
            "'make setup' or 'python -m specui.placeholder', or pass --draft none"
        )
    return str(PLACEHOLDER_DRAFT)


@dataclass
class ModelPair:
    target: LoadedModel
    draft: LoadedModel | None

    def engine(self) -> Engine:
        t = self.target
        return Engine(
            t.model, t.tokenizer, draft=self.draft.model if self.draft else None,
            eos_ids=stop_token_ids(t.tokenizer, t.model.generation_config),
        )


def load_pair(target: ModelSpec, draft: ModelSpec | None) -> ModelPair:
    """Load the target, then the draft on the same device; the draft must share the
    target's tokenizer. Raises SpecUIError (and loads nothing) on any problem."""
    loaded_target = load_model(target)
    loaded_draft = None
    if draft is not None:
        loaded_draft = load_model(draft)
        check_same_tokenizer(loaded_target.tokenizer, loaded_draft.tokenizer)
    return ModelPair(loaded_target, loaded_draft)
