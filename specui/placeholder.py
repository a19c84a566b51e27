"""Build the placeholder draft: the bundled target's layers (0, 1, 2, last) and its
embeddings and head, untrained. Clearly a stand-in until a distilled draft ships.

    python -m specui.placeholder [--out models/smollm2-135m-draft-placeholder]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel

from specui.loading import BUNDLED, ModelSpec, load_model
from specui.pair import PLACEHOLDER_DRAFT

KEEP_LAYERS = (0, 1, 2, -1)


def truncate_layers(model: PreTrainedModel, keep: tuple[int, ...]) -> PreTrainedModel:
    """A fresh plain model (no GGUF quantizer attached, so it can be saved) holding the
    embeddings, head and the given decoder layers of `model`."""
    n = model.config.num_hidden_layers
    keep = tuple(i % n for i in keep)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    small = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers."):].split(".", 1)
            if int(idx) not in keep:
                continue
            name = f"model.layers.{keep.index(int(idx))}.{rest}"
        state[name] = tensor
    small.load_state_dict(state, strict=True)
    return small.eval()


def build(out: Path) -> Path:
    target = load_model(ModelSpec(BUNDLED, dtype="float32", device="cpu"))
    draft = truncate_layers(target.model, KEEP_LAYERS)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    (out / "README.md").write_text(
        "Placeholder draft (untrained): SmolLM2-135M-Instruct layers 0, 1, 2, 29 + its\n"
        "embeddings and head, built by `python -m specui.placeholder`. Not committed.\n"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PLACEHOLDER_DRAFT)
    args = ap.parse_args()
    print(f"placeholder draft written to {build(args.out)}")


if __name__ == "__main__":
    main()
