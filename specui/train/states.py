"""The target's hidden states (after its final norm, or after some of its decoder layers) along
every training conversation, for a draft that reads them (a feature draft,
specui/engine/feature_draft.py). Computed in right-padded batched prefills and cached as
bfloat16 chunks under the work folder, keyed by answer, so an interrupted pass goes on where
it stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from specui.engine.hidden import capture_features

CHUNK_ANSWERS = 256  # answers per saved chunk


def padded_groups(seqs: Sequence[Sequence[int]], batch_tokens: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Sequences grouped by length into right-padded (B, T) id batches of about
    `batch_tokens` tokens (causal attention: padding after a sequence changes nothing before
    it); yields (indices into seqs, ids)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    group: list[int] = []
    for i in order + [None]:
        width = max((len(seqs[j]) for j in group), default=0)
        if i is None or (group and max(width, len(seqs[i])) * (len(group) + 1) > batch_tokens):
            if group:
                ids = torch.zeros((len(group), max(len(seqs[j]) for j in group)), dtype=torch.long)
                for r, j in enumerate(group):
                    ids[r, :len(seqs[j])] = torch.tensor(list(seqs[j]))
                yield group, ids
            group = []
        if i is not None:
            group.append(i)


class _Enough(Exception):
    """Raised by a hook once the deepest layer a pass needs has run."""


def _stop_after(model: PreTrainedModel, layers: Sequence[int]):
    """A hook handle that ends a forward after the deepest of `layers` (None: the pass needs the
    final norm, so it runs to the end)."""
    if not layers:
        return None
    blocks = model.get_decoder().layers
    deepest = max(i % len(blocks) for i in layers)

    def stop(_m, _a, _out):
        raise _Enough
    return blocks[deepest].register_forward_hook(stop)


@torch.inference_mode()
def target_states(model: PreTrainedModel, seqs: Sequence[Sequence[int]],
                  batch_tokens: int = 4096, layers: Sequence[int] = ()) -> list[torch.Tensor]:
    """The model's hidden states after the final norm (or after each of the decoder `layers`,
    concatenated, as the engine's target session keeps them) at every position of each
    sequence, as bfloat16 (len, H * sources) tensors. A pass for layers stops after the deepest."""
    out: list = [None] * len(seqs)
    for group, ids in padded_groups(seqs, batch_tokens):
        with capture_features(model, layers) as captured:
            stop = _stop_after(model, layers)
            try:
                model.get_decoder()(input_ids=ids.to(model.device), use_cache=False)
            except _Enough:
                pass
            finally:
                if stop is not None:
                    stop.remove()
            hidden = captured()
        for r, j in enumerate(group):
            out[j] = hidden[r, :len(seqs[j])].to(torch.bfloat16).cpu()
    return out


class StateCache:
    """Chunks `chunk-NNNNN.pt` of {"keys": [...], "states": [...]}, written atomically."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def load(self) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for path in sorted(self.folder.glob("chunk-*.pt")):
            chunk = torch.load(path, weights_only=True)
            found.update(zip(chunk["keys"], chunk["states"]))
        return found

    def add(self, keys: list[str], states: list[torch.Tensor]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        n = len(list(self.folder.glob("chunk-*.pt")))
        path = self.folder / f"chunk-{n:05d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"keys": keys, "states": states}, tmp)
        tmp.replace(path)


def states_for(make_model: Callable[[], PreTrainedModel], keys: Sequence[str], seqs: Sequence[Sequence[int]],
               folder: Path, desc: str = "target states", layers: Sequence[int] = ()) -> list[torch.Tensor]:
    """The target's states for each (key, sequence), from the cache in `folder` where present,
    computed (by the model `make_model()` gives, called only then) and cached chunk by chunk
    where not. Aligned with `keys`."""
    cache = StateCache(folder)
    have = cache.load()
    missing = [i for i, k in enumerate(keys) if k not in have or len(have[k]) != len(seqs[i])]
    model = make_model() if missing else None
    bar = tqdm(total=sum(len(seqs[i]) for i in missing), desc=desc, unit="tok")
    for start in range(0, len(missing), CHUNK_ANSWERS):
        part = missing[start:start + CHUNK_ANSWERS]
        states = target_states(model, [seqs[i] for i in part], layers=layers)
        cache.add([keys[i] for i in part], states)
        have.update((keys[i], s) for i, s in zip(part, states))
        bar.update(sum(len(seqs[i]) for i in part))
    bar.close()
    return [have[k] for k in keys]
