"""ModelSession: one HF causal LM, its KV cache and the token ids the cache holds.

This is the only code that touches cache internals. Invariant kept by the engine: the
cache holds a prefix of the committed sequence; `advance` feeds whatever is missing and
returns the logits asked for, `commit` crops back to the longest prefix that is still true.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from specui.engine import sampling
from specui.engine.capture import BUCKETS, StaticForward, capture_mode, round_up
from specui.engine.hidden import capture_features, feature_sources, output_layer_inputs
from specui.engine.host_ids import HostIds
from specui.engine.kvcache import GrowingCache, GrowingLayer
from specui.engine.masks import additive, mask_dtype
from specui.engine.static_cache import StaticKVCache, activation_dtype
from specui.engine.timing import ForwardClock
from specui.engine.tree import TokenTree

PENDING = -1  # in cached_ids: a token fed as a device tensor whose id is not read yet (advance_token)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list):  # the usual case (decoding appends), compared in C
        if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):  # a copy of the longer one's start only
            return n
    elif list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


STATIC_SLOTS = 2048  # a static cache's first capacity (it grows when a reply needs more)


class ModelSession:
    """`capture` (auto / on / off, see specui.engine.capture.capture_mode): off keeps the
    growing cache and eager forwards; otherwise the cache is static and forwards run at a few
    padded shapes, replayed as CUDA graphs on a GPU. `background` (with `on`): compiles run on
    a thread of their own and a forward never waits for one (StaticForward's Warmup)."""

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, capture: str = "off",
                 background: bool = False, grouped: int | None = None) -> None:
        self.model = model
        self.vocab_size = vocab_size or model.config.vocab_size
        self.device = next(model.parameters()).device
        mode = capture_mode(capture, self.device)
        self.runner: StaticForward | None = None
        if mode is None:
            self.cache = GrowingCache(config=model.config)
        else:
            context = int(getattr(model.config, "max_position_embeddings", 0) or STATIC_SLOTS)
            self.cache = StaticKVCache(model.config, round_up(min(context, STATIC_SLOTS) + 64), self.device,
                                       activation_dtype(model))
            self.runner = StaticForward(model, self.cache, mode, compiled=capture == "on", background=background,
                                        grouped=grouped if self.device.type == "cpu" else None)
        # seconds inside the model's forward calls (CPU; None on a GPU): the step's other time is ours
        self.clock = ForwardClock(self.device) if self.runner is None else self.runner.clock
        self._hooked = 0  # forwards under way whose hidden states are read through hooks (eager)
        self._hidden: list[torch.Tensor] | None = None  # hidden states the runner returned (with_hidden, no hook)
        self.cached_ids: list[int] = []
        self._host_ids = HostIds(BUCKETS[-1])  # the new tokens' ids of a forward on a CPU
        self._tree_base = 0  # where the last scored tree's entries start in the cache
        self._tree_pending = False  # tree entries in the cache that commit_path has not settled
        # SpecDec++: the draft's acceptance head (engine-attached), its config, or why there is none
        self.acceptance_head: torch.nn.Module | None = None
        self.head_config: dict = {}
        self.head_problem = "no acceptance head is loaded for this draft"
        # MCSD: the draft's early-stop decision models by kind ("hidden", "entropy"), or why there are none
        self.decision_models: dict[str, torch.nn.Module] = {}
        self.decision_problem = "no MCSD decision models are loaded for this draft"
        self.features: torch.Tensor | None = None  # a feature draft's input: keep_features (None: not kept)
        self.feature_layers: tuple[int, ...] = ()  # () : after the final norm

    def keep_features(self, layers: Sequence[int] = ()) -> None:
        """Keep the hidden state (after the final norm, or after each of these decoder `layers`,
        concatenated) at every cached position, for a draft that reads the target's features
        (specui/engine/feature_draft.py)."""
        width = self.model.config.hidden_size * len(feature_sources(self.model, layers))
        self.feature_layers = tuple(layers)
        self.features = torch.empty((0, width), device=self.device)

    # -- cache bookkeeping -------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self.cached_ids)

    def reset(self) -> None:
        if self.runner is None:
            self.cache = GrowingCache(config=self.model.config)
        else:  # the store stays: captured forwards read it
            self.cache.set_length(0)
        self.cached_ids = []
        if self.features is not None:
            self.features = self.features[:0]
        self._tree_pending = False

    def _crop(self, keep: int) -> None:
        if keep < self.length:
            if keep == 0:
                self.reset()
                return
            self.cache.crop(keep - self.length)  # transformers 5: negative = tokens to drop
            del self.cached_ids[keep:]
            if self.features is not None:
                self.features = self.features[:keep]

    def _drop_pending_tree(self) -> None:
        """Tree entries are not a sequence: never let prefix matching reuse them."""
        if self._tree_pending:
            self._tree_pending = False
            self._crop(self._tree_base)

    def _sync(self, ids: Sequence[int], leave: int) -> int:
        """Crop the cache to the longest true prefix of `ids` that leaves at least `leave`
        of them to feed; returns that prefix length."""
        self._drop_pending_tree()
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - leave)
        self._crop(keep)
        return keep

    def commit(self, ids: Sequence[int]) -> None:
        """Drop cached entries that are not a prefix of `ids` (rejected drafts)."""
        self._drop_pending_tree()
        self._crop(common_prefix(self.cached_ids, ids))

    def stretch(self, ids: Sequence[int], room: int) -> bool:
        """Timing only (the cost profile): make the cache hold all but the last of `ids`
        without computing them, the entries it holds (a true prefix of `ids`) repeated to that
        length, with room for `room` more; a forward then costs what it costs after a real
        prefill of that length. False (nothing changed) where it cannot: no entries yet, a
        cache layer that is not a GrowingLayer, a pending tree, or states kept for a feature draft."""
        length = len(ids) - 1
        layers = self.cache.layers
        if (self.runner is not None or self.length == 0 or length <= self.length or self._tree_pending
                or self.features is not None or common_prefix(self.cached_ids, ids) < self.length
                or not all(isinstance(layer, GrowingLayer) and layer.is_initialized for layer in layers)):
            return False
        for layer in layers:
            layer.tile_to(length, length + room)
        self.cached_ids = list(ids[:length])
        return True

    # -- forwards ----------------------------------------------------------------------
    @torch.inference_mode()
    def advance(self, ids: Sequence[int], need: int = 1, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Make the cache hold all of `ids`; return the logits (need, V) at its last `need`
        positions (logits at position i predict token i + 1). The prefix is never recomputed.
        `pending` (n,): tokens still on the device (drafted, unread) fed after `ids` in the same
        forward (`need` counts them), PENDING in `cached_ids` until `settle_tokens`. The ids go up
        without waiting for the device (a GPU's queued draft forwards)."""
        n = 0 if pending is None else pending.numel()
        need = max(1, min(need, len(ids) + n))
        keep = self._sync(ids, max(1, need - n))
        fresh = list(ids[keep:])
        logits = self._forward(self._fed(fresh, pending), keep=need)
        self.cached_ids.extend(fresh + [PENDING] * n)
        if logits.shape[0] == need and logits.shape[1] == self.vocab_size:
            return logits
        return logits[-need:, : self.vocab_size]

    @property
    def feeds_device_tokens(self) -> bool:
        """Whether a drafted token should be fed back as the device tensor it is (`advance_token`)
        rather than read first: where every read of the device's memory waits for it (a GPU), for
        a plain session (a feature draft's forwards take the target's states too)."""
        return sampling.reads_wait(self.device) and type(self).advance is ModelSession.advance and self.features is None

    @torch.inference_mode()
    def advance_token(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token still on the device (a drafted argmax, unread) after the cached ones: its
        logits (1, V); PENDING in `cached_ids` (matching no prefix) until `settle_tokens`."""
        logits = self._forward(token.reshape(1, 1).to(torch.long), keep=1)
        self.cached_ids.append(PENDING)
        return logits[-1:, : self.vocab_size]

    @contextmanager
    def feeding_device_tokens(self, ids: Sequence[int]) -> Iterator[None]:
        """Around forwards that feed device tokens after the committed `ids`: a failure inside (a
        cancel, out of memory) crops the cache back to `ids`, leaving no unread id in the session."""
        try:
            yield
        except BaseException:
            self.commit(ids)
            raise

    def settle_tokens(self, ids: Sequence[int]) -> None:
        """The ids of the tokens fed unread (`advance_token`, `pending`) since the last settle, in order."""
        n, cached = len(ids), self.cached_ids
        if not n:
            return
        if n > len(cached) or any(t != PENDING for t in cached[-n:]) or (len(cached) > n and cached[-n - 1] == PENDING):
            raise RuntimeError(f"{n} ids given for tokens fed as device tensors, which the cache does not end with")
        cached[-n:] = [int(t) for t in ids]

    def with_hidden(self, forward, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(*args)` (one of this session's forwards: advance, forward_tree, extend_tree)
        and the hidden states (rows, H) its output layer read for the logit rows it returned
        (after the final norm: what SpecDec++'s head and MCSD's decision models take). Over a
        static cache the runner's forward returns them (compiled and captured like any other:
        engine/hidden.py); otherwise a hook reads them, in an eager forward at the real shapes."""
        if self.hidden_without_hooks:
            self._hidden = []
            try:
                rows = forward(*args)
                return rows, self._hidden[-1][-rows.shape[0]:]
            finally:
                self._hidden = None
        self._hooked += 1
        try:
            with output_layer_inputs(self.model) as seen:
                rows = forward(*args)
        finally:
            self._hooked -= 1
        return rows, seen[-1][0, -rows.shape[0]:]

    @property
    def hidden_without_hooks(self) -> bool:
        """Whether this session's forwards return hidden states without a hook (a static cache's
        runner with a hook-free forward for the model: engine/hidden.py)."""
        return self.runner is not None and self.runner.hidden_call is not None and self.features is None

    def advance_with_hidden(self, ids: Sequence[int], need: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`advance`, and the hidden states (need, H) at those positions."""
        return self.with_hidden(self.advance, ids, need)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> None:
        """Cache all but the last token of `ids` (the last is fed by the first step)."""
        if len(ids) > 1 and self._sync(ids, 1) < len(ids) - 1:
            self.advance(ids[:-1], need=1)

    # -- trees -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_tree(self, ids: Sequence[int], tree: TokenTree, ancestors: torch.Tensor | None = None,
                     pending: torch.Tensor | None = None) -> torch.Tensor:
        """Start a tree after the committed `ids` and score all its nodes in one forward,
        each attending to the committed prefix and its own ancestors, at position
        (prefix length - 1 + depth). Feeds the not-yet-cached committed tokens (normally
        just the last) too. Returns logits (1 + n, V): row 0 predicts the roots, row 1 + i
        the children of node i. The tree's entries stay in the cache until `commit_path`.
        `ancestors`: the tree's ancestor mask when the caller keeps one (MCSD's sliced fork
        mask); None builds it from the parent array. `pending`: the nodes' tokens still on the
        device (unread; PENDING in `cached_ids` until `commit_path` keeps the accepted ones)."""
        keep = self._sync(ids, 1)
        fresh = list(ids[keep:])
        self._tree_base = keep + len(fresh)
        return self._tree_forward(fresh, tree, 0, ancestors, pending)

    @torch.inference_mode()
    def extend_tree(self, tree: TokenTree, start: int, ancestors: torch.Tensor | None = None,
                    pending: torch.Tensor | None = None) -> torch.Tensor:
        """Continue the pending tree (drafting layer by layer): the cache holds nodes
        [0, start); feed nodes [start, n) only. Returns their logits (n - start, V)."""
        if not self._tree_pending or self.length - self._tree_base != start:
            raise RuntimeError("extend_tree needs the tree started by forward_tree with nodes [0, start) cached")
        return self._tree_forward([], tree, start, ancestors, pending)

    def _tree_forward(self, fresh: list[int], tree: TokenTree, start: int, ancestors: torch.Tensor | None = None,
                      pending: torch.Tensor | None = None) -> torch.Tensor:
        base, m, n = self._tree_base, len(fresh), len(tree)
        new = tree.tokens[start:]
        attend = torch.zeros((m + len(new), base + n), dtype=torch.bool)
        attend[:, : base - m] = True
        attend[:m, base - m:base] = torch.ones(m, m, dtype=torch.bool).tril()
        attend[m:, base - m:base] = True
        attend[m:, base:] = (tree.ancestor_mask() if ancestors is None else ancestors)[start:n, :n]
        positions = list(range(base - m, base)) + [base - 1 + d for d in tree.depths[start:]]
        fed = self._fed(fresh + (new if pending is None else []), pending)
        logits = self._forward(fed, positions=positions, attend=attend)
        self.cached_ids.extend(fresh + (new if pending is None else [PENDING] * len(new)))  # until commit_path
        self._tree_pending = True
        return logits[max(m - 1, 0):, : self.vocab_size]

    def _fed(self, tokens: list[int], pending: torch.Tensor | None) -> torch.Tensor:
        """The ids (1, m) a forward feeds: `tokens`, then `pending` (tokens still on the device); on
        a CPU without pending ones, written into a kept tensor (engine/host_ids.py)."""
        if self.device.type == "cpu" and pending is None:
            return self._host_ids.row(tokens)
        fed = torch.tensor([tokens], dtype=torch.long).to(self.device, non_blocking=True)
        return fed if pending is None else torch.cat([fed, pending.reshape(1, -1).to(torch.long)], 1)

    def _forward(self, input_ids: torch.Tensor, positions: list[int] | None = None,
                 attend: torch.Tensor | None = None, keep: int = 0, **extra) -> torch.Tensor:
        """The one place the model runs on this cache: feed input_ids (1, m) after the cached
        entries at `positions` (None: the next m), row i seeing what `attend` (bool (m, length +
        m)) allows (None: causal); returns the logits (rows, V) of the last `keep` rows (0: all).
        A failure mid-forward (out of memory, cancel) leaves no half-written cache behind."""
        try:
            if self.features is None:
                return self._logits(input_ids, positions, attend, keep, extra)
            with capture_features(self.model, self.feature_layers) as captured:
                logits = self._logits(input_ids, positions, attend, keep, extra)
            self.features = torch.cat([self.features[: self.length], captured()[0].to(self.features.dtype)])
            return logits
        except BaseException:
            self.reset()
            raise

    def _logits(self, input_ids: torch.Tensor, positions: list[int] | None, attend: torch.Tensor | None,
                keep: int, extra: dict) -> torch.Tensor:
        if self.runner is not None:  # hooks read hidden states: those forwards run eagerly
            if self._hidden is not None:
                logits, hidden = self.runner.run(input_ids[0], positions, attend, keep, hidden=True, **extra)
                self._hidden.append(hidden)
                return logits
            exact = self._hooked > 0 or self.features is not None
            return self.runner.run(input_ids[0], positions, attend, keep, exact=exact, **extra)
        if attend is not None:
            mask = additive(attend, mask_dtype(self.model))
            extra = dict(extra, attention_mask=mask[None, None].to(self.device, non_blocking=True),  # no wait
                         position_ids=torch.tensor([positions]).to(self.device, non_blocking=True))
        out = self.clock.run(self.model, input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=keep, **extra)
        return out.logits[0]

    @torch.inference_mode()
    def commit_path(self, tree: TokenTree, path: list[int]) -> None:
        """Keep the cache entries of the accepted root-to-node `path` (tree indices) that
        this session scored, moved into contiguous slots right after the committed prefix;
        drop the rest of the tree."""
        base = self._tree_base
        scored = self.length - base  # nodes [0, scored) of the tree are in the cache
        path = [i for i in path if i < scored]
        if path:
            src = torch.tensor([base + i for i in path], dtype=torch.long, device=self.device)
            if self.runner is not None:
                self.cache.move(src, base)
            for layer in self.cache.layers if self.runner is None else ():
                layer.keys[..., base:base + len(path), :] = layer.keys.index_select(-2, src)
                layer.values[..., base:base + len(path), :] = layer.values.index_select(-2, src)
            if self.features is not None:
                self.features[base:base + len(path)] = self.features.index_select(0, src)
            self.cached_ids[base:base + len(path)] = [tree.tokens[i] for i in path]
        self._tree_pending = False
        self._crop(base + len(path))

    # -- introspection (tests) ---------------------------------------------------------
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) for the cached positions."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]
