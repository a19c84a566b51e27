"""A draft session that reads the target's features (EAGLE's idea, kept lossless by design).

A feature draft's input at position i is its token x_i together with the target's hidden
state at position i - 1 (after the final norm, or after the decoder layers its config names):
the state that produced the target's distribution for x_i, which the draft can only guess at
from tokens. Where the target has not computed that state (the draft's own proposals), the
draft gets zeros there, as it did for a share of positions in training; it never feeds itself
its own guesses. The feature is an input like any other, so verification is unchanged and
stays lossless.

Cache rule on top of ModelSession's: a cached draft position that was fed zeros is dropped
(and fed again) once the target has computed the state it should have had, i.e. after the
target verified the tokens before it. Only this session reads the target session's
`features`; the target keeps them while a feature draft is attached (keep_features)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specui.engine.session import ModelSession, common_prefix
from specui.heads.feature_draft import feature_layers


class FeatureDraftSession(ModelSession):
    def __init__(self, model: PreTrainedModel, vocab_size: int | None, target: ModelSession) -> None:
        super().__init__(model, vocab_size)
        self.target = target
        target.keep_features(feature_layers(model.config))
        self.true_len = 0  # cached positions [0, true_len) were fed the target's state before them
        self._sequence: list[int] = []  # the committed ids of the forward under way

    def known(self, ids: Sequence[int]) -> int:
        """How many leading positions of `ids` the target holds its state for (same prefix)."""
        t = self.target
        held = t._tree_base if t._tree_pending else t.length
        held = min(held, 0 if t.features is None else len(t.features))
        return common_prefix(t.cached_ids[:held], ids)

    def _crop(self, keep: int) -> None:
        super()._crop(keep)
        self.true_len = min(self.true_len, self.length)

    def reset(self) -> None:
        super().reset()
        self.true_len = 0

    def stretch(self, ids: Sequence[int], room: int) -> bool:
        return False  # which positions had their state is bookkept per position: prefill for real

    def _sync(self, ids: Sequence[int], leave: int) -> int:
        keep = super()._sync(ids, leave)
        if self.true_len < keep and self.true_len - 1 < self.known(ids):
            self._crop(self.true_len)  # fed zeros where the target's state is known now: feed it again
            keep = self.true_len
        return keep

    @torch.inference_mode()
    def advance(self, ids: Sequence[int], need: int = 1) -> torch.Tensor:
        self._sequence = list(ids)
        return super().advance(ids, need)

    def _tree_forward(self, fresh: list[int], tree, start: int, ancestors=None, pending=None) -> torch.Tensor:
        self._sequence = self.cached_ids + fresh  # the tree's nodes themselves get zeros
        return super()._tree_forward(fresh, tree, start, ancestors, pending)

    def _forward(self, input_ids: torch.Tensor, **kwargs):
        start, n = self.length, input_ids.shape[1]
        slots = torch.arange(start, start + n)
        known = self.known(self._sequence)
        # slot s (a committed token whose predecessor's state the target holds) reads row s - 1
        has = (slots < len(self._sequence)) & (slots - 1 < known) & (slots >= 1)
        source = self.target.features
        feats = torch.zeros((n, source.shape[-1]), dtype=source.dtype, device=source.device)
        if bool(has.any()):
            feats[has] = source[(slots[has] - 1).to(source.device)]
        true_now = (has | (slots == 0)).tolist()
        out = super()._forward(input_ids, features=self._narrowed(feats)[None], **kwargs)
        if start == self.true_len:
            self.true_len += next((i for i, t in enumerate(true_now) if not t), n)
        return out

    def _narrowed(self, feats: torch.Tensor) -> torch.Tensor:
        """Each target state cut to the draft's width: a target wider than the model the draft was
        made for (a stand-in, zero-padded) holds that model's state in its first entries."""
        width = self.model.config.hidden_size
        sources = max(1, len(self.target.feature_layers))
        if feats.shape[-1] == width * sources:
            return feats
        return feats.unflatten(-1, (sources, -1))[..., :width].flatten(-2)
