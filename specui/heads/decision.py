"""MCSD's early-stop decision models (DESIGN.md 3.5; seed 001): predict whether the draft's
next candidate will be accepted, from what the draft knew when it drew it.

- "hidden": a 3-layer MLP on the draft's hidden state that gave q~ (the input of its output
  layer at the position the candidate is drawn for);
- "entropy": a 2-layer MLP on the entropy and the top-8 probabilities of q~ (heads.q_stats).

Both read the state *before* the candidate is fed back to the draft, so asking them costs no
draft forward. They are siblings of SpecDec++'s acceptance head and learn from the same
examples and labels (specui.train.acceptance). One folder holds both, made for one draft:
config.json (the draft's fingerprint, sizes, held-out quality) and <kind>.safetensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specui.errors import SpecUIError
from specui.heads.acceptance import Q_STATS, draft_fingerprint, q_stats, read_marked_config

KINDS = ("hidden", "entropy")
DECISIONS = ("hidden", "entropy", "none")
TRAIN_COMMAND = "python -m specui.train decision --draft DRAFT --out DECISION_FOLDER"
MARKER = "specui_mcsd_decision_models"


class DecisionModel(torch.nn.Module):
    """hidden: H -> width -> width -> 1 (3 layers); entropy: Q_STATS -> width -> 1 (2 layers).
    SiLU between layers; the output is the logit of P(the candidate is accepted)."""

    def __init__(self, kind: str, hidden_size: int, width: int) -> None:
        super().__init__()
        if kind not in KINDS:
            raise SpecUIError(f"a decision model reads 'hidden' or 'entropy', got {kind!r}")
        self.kind, self.hidden_size, self.width = kind, hidden_size, width
        sizes = [hidden_size, width, width, 1] if kind == "hidden" else [Q_STATS, width, 1]
        layers: list[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layers.append(torch.nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(torch.nn.SiLU())
        self.mlp = torch.nn.Sequential(*layers)

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        """(..., H) hidden states or (..., Q_STATS) q statistics -> (...)."""
        return self.mlp(features.to(self.mlp[0].weight.dtype)).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(features))

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor, draft_logits: torch.Tensor) -> list[float]:
        """P(accepted) for candidates drawn from each row of the raw draft logits (n, V),
        whose hidden states (n, H) gave those logits."""
        return self(hidden if self.kind == "hidden" else q_stats(draft_logits)).tolist()


@dataclass
class DecisionModels:
    """The loaded pair of models for one draft, or why there is none."""

    models: dict[str, DecisionModel] = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    problem: str = "no MCSD decision models are loaded for this draft"

    def get(self, kind: str) -> DecisionModel | None:
        return self.models.get(kind)


def save_decision_models(models: dict[str, DecisionModel], folder: Path, draft_print: str, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = {MARKER: 1, "draft_fingerprint": draft_print,
              "models": {k: {"hidden_size": m.hidden_size, "width": m.width} for k, m in models.items()}, **meta}
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    for kind, model in models.items():
        state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(folder / f"{kind}.safetensors"), metadata={"format": "pt"})


def _config(folder: Path) -> dict:
    config = read_marked_config(folder, MARKER, "MCSD decision models", TRAIN_COMMAND)
    if not isinstance(config.get("models"), dict):
        raise SpecUIError(f"{folder} is not a folder of MCSD decision models; train one with: {TRAIN_COMMAND}")
    return config


def load_decision_models(folder: str | Path, draft: torch.nn.Module) -> DecisionModels:
    """Both models in `folder` for this draft (float32, on its device). Raises SpecUIError
    naming the training command when they are missing, corrupt or made for another draft."""
    folder = Path(folder)
    config = _config(folder)
    made_for, this = config.get("draft_fingerprint"), draft_fingerprint(draft)
    if made_for != this:
        raise SpecUIError(f"the MCSD decision models in {folder} were trained for another draft (fingerprint "
                          f"{made_for}, this draft {this}); retrain them with: {TRAIN_COMMAND}")
    device = next(draft.parameters()).device
    models = {}
    for kind, sizes in config["models"].items():
        try:
            model = DecisionModel(kind, int(sizes["hidden_size"]), int(sizes["width"]))
            if kind == "hidden" and model.hidden_size != int(draft.config.hidden_size):
                raise ValueError(f"hidden size {model.hidden_size}, the draft has {draft.config.hidden_size}")
            model.load_state_dict(load_file(str(folder / f"{kind}.safetensors")))
        except Exception as e:  # noqa: BLE001 - any failure to read the weights (safetensors' own errors too)
            raise SpecUIError(f"the MCSD decision model {kind!r} in {folder} is unusable ({type(e).__name__}: "
                              f"{str(e)[:200]}); retrain them with: {TRAIN_COMMAND}") from None
        models[kind] = model.to(device=device, dtype=torch.float32).eval()
    return DecisionModels(models, config, "")
