"""RowSession: one model and a KV cache with several rows (beams), every row holding the
same committed length, plus per-row forests of pending nodes scored in one forward.

Why rows and not branches of one token tree (DESIGN.md 4.1): the beams of beam search and
of DSBD always have equal lengths, so a batched cache of W rows needs no padding in its
committed part, and a step's per-row forests (of different sizes) are padded only in the
new-token dimension (padding slots attend to themselves, nobody attends to them, and
`commit` drops them). The mask of a forward is (new x (committed + new)) per row. Branches
of one tree over the shared prompt would store shared prefixes once, but every forward's
mask would span every live beam's whole suffix (beams can stay apart for the whole reply)
and commit would compact arbitrary subtrees. With one row this costs what a single
sequence's tree costs. EMS-SD's ragged batches need per-row committed lengths on top of this.

`commit` is the only code here that moves cache entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specui.engine.attention import grouped_attention
from specui.engine.capture import mark_dynamic_sizes, round_up
from specui.engine.kvcache import GrowingCache, GrowingLayer, doubled
from specui.engine.masks import additive, mask_dtype
from specui.engine.static_cache import StaticKVCache
from specui.engine.timing import ForwardClock
from specui.engine.unpadded import real_tokens_only, token_modules
from specui.errors import SpecUIError

STATIC_SLOTS = 256  # a static rows cache's first capacity in slots (it doubles when a reply needs more): a
# beam cache holds every row's slots, so it starts small (4 rows of SmolLM2-1.7B in bfloat16: 100 MB per 256)


@dataclass
class PendingNode:
    token: int
    parent: int  # index in the row's pending list; -1: child of the committed prefix
    slot: int  # cache position
    depth: int  # 0 for a child of the committed prefix
    ancestors: list[int] = field(default_factory=list)  # cache slots of its pending ancestors


class RowSession:
    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None,
                 clock: ForwardClock | None = None, runner=None) -> None:
        """`clock`: where the time inside the model's forwards adds up (the model's session's);
        `runner`: the model session's StaticForward (its static caches and captured forwards):
        then the rows live in a StaticKVCache too, and forwards run the runner's compiled
        forward at padded widths where it compiles (engine/capture.py), else eagerly."""
        self.model = model
        self.vocab_size = vocab_size or model.config.vocab_size
        self.device = next(model.parameters()).device
        self.clock = clock or ForwardClock(self.device)
        self.mask_dtype = mask_dtype(model)
        self.runner = runner
        if runner is None:
            self.cache = GrowingCache(config=model.config)
            if not all(isinstance(layer, GrowingLayer) for layer in self.cache.layers):
                raise SpecUIError("beam rows need a model whose layers all use full attention")
        else:
            self.cache = StaticKVCache(model.config, STATIC_SLOTS, self.device, runner.cache.store_dtype,
                                       spare=runner.spare_rows)  # the last reply's store
        self.compiled = runner is not None and runner.compiled and runner.mode == "buckets"
        self.compile_problem = ""
        self.compiled_runs = self.eager_runs = 0  # forwards that ran compiled / eagerly (not the prefill)
        self._linears: list[torch.nn.Module] | None = None  # the per-token products (eager forwards skip padding)
        self.length = 0  # committed entries, the same in every row
        # shared[i][j]: how many of the committed entries rows i and j hold as copies of the same
        # computed ones (the same bits): a commit that moves row j into row i copies only past that
        self.shared: list[list[int]] = [[0]]
        self.pending: list[list[PendingNode]] = [[]]
        self._used = 0  # cache entries past `length` (pending nodes and padding)

    @property
    def rows(self) -> int:
        return len(self.pending)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> None:
        """Cache `ids` (one row; `commit` copies it into as many rows as beams)."""
        if self.length or self.rows != 1:
            raise RuntimeError("prefill starts a fresh session")
        if ids:
            if self.runner is not None:  # exact shapes, eager: attention reads the prompt's n slots
                self.cache.grow(room_for(len(ids)))
                self.cache.prepare(0, len(ids))
            self.clock.run(self.model, input_ids=torch.tensor([list(ids)], device=self.device),
                           past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            if self.runner is not None:
                self.cache.set_length(len(ids))
        self.length = len(ids)
        self.shared = [[self.length]]

    @torch.inference_mode()
    def forward(self, new: Sequence[Sequence[tuple[int, int]]]) -> list[torch.Tensor]:
        """Score new pending nodes, `new[r]` = [(token, parent)] for row r, where parent
        indexes the row's pending nodes (earlier new ones included) or is -1 (a child of the
        committed prefix). Each node attends to the committed prefix, its pending ancestors
        and itself, at position (committed length + depth). Returns per row the logits
        (len(new[r]), V): row i predicts the token after node i."""
        if len(new) != self.rows:
            raise ValueError(f"{len(new)} rows of nodes for {self.rows} rows")
        width = max((len(n) for n in new), default=0)
        if width == 0:
            return [torch.empty(0, self.vocab_size, device=self.device) for _ in new]
        if self.compiled:  # one dynamic compile serves every width from 2 (capture.StaticForward.width_for)
            width = self.runner.width_for(width) or width
        start = self.length + self._used
        total = start + width
        window = round_up(total) if self.compiled else total  # eager: no masked slots to read
        ids, positions, attend = self._place(new, start, width, window)
        mask = additive(attend, self.mask_dtype)
        kw = dict(input_ids=ids.to(self.device), past_key_values=self.cache, use_cache=True,
                  attention_mask=mask[:, None].to(self.device), position_ids=positions.to(self.device))
        try:
            if self.runner is not None:
                self.cache.grow(room_for(window))
                self.cache.prepare(start, window)
            real = [r * width + j for r, nodes in enumerate(new) for j in range(len(nodes))]
            out = self.clock.run(self._call, kw, real if len(real) < self.rows * width else None)
        except BaseException:
            self._drop_pending()
            raise
        self._used += width
        if self.runner is not None:
            self.cache.set_length(start + width)
        return [out.logits[r, : len(nodes), : self.vocab_size] for r, nodes in enumerate(new)]

    def _place(self, new: Sequence[Sequence[tuple[int, int]]], start: int, width: int,
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append `new`'s nodes (`forward`'s) to the rows' pending lists at slots from `start`; return
        the forward's token ids and positions (rows, width) and what each attends to (rows, width,
        window), filled entry by entry through numpy views (with a torch op an entry: 0.31 ms a
        forward of DSBD's and beam search's W = 4 rows, 0.19 ms now; 2-core Zen 3)."""
        ids_t = torch.zeros((self.rows, width), dtype=torch.long)
        positions_t = torch.full((self.rows, width), self.length, dtype=torch.long)
        attend_t = torch.zeros((self.rows, width, window), dtype=torch.bool)
        ids, positions, attend = ids_t.numpy(), positions_t.numpy(), attend_t.numpy()
        attend[:, :, : self.length] = True
        for r, nodes in enumerate(new):
            pending = self.pending[r]
            for j, (token, parent) in enumerate(nodes):
                if parent >= len(pending):
                    raise ValueError(f"row {r}: parent {parent} is not a pending node yet")
                up = pending[parent] if parent >= 0 else None
                node = PendingNode(int(token), parent, start + j, 0 if up is None else up.depth + 1,
                                   [] if up is None else [*up.ancestors, up.slot])
                pending.append(node)
                ids[r, j], positions[r, j] = node.token, self.length + node.depth
                attend[r, j, node.ancestors + [node.slot]] = True
            attend[r, range(len(nodes), width), range(start + len(nodes), start + width)] = True  # padding: itself
        return ids_t, positions_t, attend_t

    @torch.inference_mode()
    def commit(self, keep: Sequence[tuple[int, Sequence[int]]]) -> None:
        """New row i = old row keep[i][0] with the pending chain keep[i][1] (node indices,
        each the parent of the next, the first a child of the committed prefix) appended to
        its committed entries. Every chain has the same length. Rows may be copied (several
        beams from one), dropped, reordered; every other pending node and padding goes."""
        if not keep:
            raise ValueError("commit needs at least one row")
        m = len(keep[0][1])
        slots = []
        for src, chain in keep:
            if len(chain) != m:
                raise ValueError("every row must keep a chain of the same length")
            pending = self.pending[src]
            for i, k in enumerate(chain):
                if pending[k].parent != (chain[i - 1] if i else -1):
                    raise ValueError(f"row {src}: pending nodes {list(chain)} are not a chain from the prefix")
            slots.append([pending[k].slot for k in chain])
        sources = [src for src, _ in keep]
        start = copied_from(self.shared, sources)
        rows = torch.tensor(sources, device=self.device)
        tail = torch.tensor(slots, dtype=torch.long, device=self.device).view(len(keep), m)
        if self.runner is not None:  # one gather for every layer
            self.cache.keep_rows(rows, self.length, tail, start)
        else:
            for layer in self.cache.layers:
                layer.keep_rows(rows, self.length, tail, start)
        self.shared = shared_after(self.shared, sources, slots, self.length)
        self.length += m
        self.pending = [[] for _ in keep]
        self._used = 0

    def release(self) -> None:
        """The rows are done (the reply ended): a static cache's store goes to the runner's spare,
        for the next reply's rows. The session is not used after this."""
        if isinstance(self.cache, StaticKVCache):
            self.cache.release()

    def _call(self, kw: dict, real: list[int] | None = None):
        """One forward: the runner's compiled forward where it compiles (with its attention
        routing), else the model itself. Where the runner's compiles run in the background
        (its Warmup), a shape not compiled yet runs eagerly and the Warmup is asked for it
        (`compile_shape` builds it there on scratch rows), so no forward waits for a compile.
        `real`: the flat (row * width + column) indices of the real tokens where some are
        padding; an eager forward's matrix products then skip the padding (engine/unpadded.py)."""
        runner = self.runner
        if self.compiled and runner.compiled:
            mark_sizes(kw, self.cache)
            shape = (kw["input_ids"].shape[1], self.cache.window, self.cache.capacity, self.rows)
            try:
                with grouped_attention(*runner.grouped) if runner.grouped else nullcontext():
                    out = runner.compiled_call(kw, shape, compile_shape)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - the compiler fails in many types; eager from here on
                self.compile_problem = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
                self.compiled, out = False, None
            if out is not None:
                self.compiled_runs += 1
                return out
        self.eager_runs += 1
        if real is None:
            return self.model(**kw)
        if self._linears is None:
            self._linears = token_modules(self.model)
        keep = torch.tensor(real, dtype=torch.long, device=self.device)
        with real_tokens_only(self._linears, tuple(kw["input_ids"].shape), keep):
            return self.model(**kw)

    @classmethod
    def scratch(cls, runner, rows: int, length: int, capacity: int) -> RowSession:
        """A session of `rows` rows holding `length` committed entries (zeros: only the shapes
        of a forward matter) in a cache of `capacity` slots, over `runner` (a Warmup's probe)."""
        session = cls(runner.model, runner=runner)
        cache = session.cache
        cache.grow(capacity)
        cache.allocate()
        cache.keep_rows(torch.zeros(rows, dtype=torch.long, device=session.device), 0,
                        torch.zeros((rows, 0), dtype=torch.long, device=session.device))
        cache.set_length(length)
        session.length, session.pending = length, [[] for _ in range(rows)]
        session.shared = [[length] * rows for _ in range(rows)]  # every row a copy of row 0
        return session

    def _drop_pending(self) -> None:
        if self.runner is not None:
            self.cache.set_length(self.length)
        else:
            for layer in self.cache.layers:
                layer.crop(-(layer.get_seq_length() - self.length))
        self.pending = [[] for _ in self.pending]
        self._used = 0

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) of the cache (tests)."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]


def room_for(slots: int) -> int:
    """The capacity a rows cache grows to for `slots` slots: STATIC_SLOTS times a power of two, so the
    capacities a compiled rows forward meets (a compile each: `mark_sizes`) are few."""
    return doubled(STATIC_SLOTS, slots)


def mark_sizes(kw: dict, cache: StaticKVCache) -> None:
    """What a rows forward's compile sees as sizes: its token count and window, as the runner's own
    forward (one compile serves every width from 2); its rows and the cache's capacity are constants
    (a compile per pair). The layers' keys and values are views of one store, so where their sizes are
    symbols their storage offsets are too, and torch checks every pair of such aliased inputs for
    overlap: 120 views of the bundled target gave ~5,500 shape guards a compile, sympy's work for
    51-99 s a compile with the disk cache warm (2-core Zen 3), against 11-17 s with rows and capacity
    constant; a first beam W = 2 reply 176 -> 57 s, DSBD W = 2 151 -> 45 s (README, 2026-12-07)."""
    mark_dynamic_sizes(kw, cache)
    for name in ("input_ids", "position_ids", "attention_mask"):
        torch._dynamo.mark_static(kw[name], 0)
    torch._dynamo.mark_static(cache.offsets, 0)
    for layer in cache.layers:
        for buf in (layer._kbuf, layer._vbuf):
            torch._dynamo.mark_static(buf, 0)
            torch._dynamo.mark_static(buf, 2)


def compile_shape(probe, shape: tuple[int, int, int, int]) -> str:
    """A Warmup's run for a rows shape (bucket, window, capacity, rows): one forward of that
    shape on scratch rows over `probe` (compiling it where it must); returns what failed."""
    bucket, window, capacity, rows = shape
    session = RowSession.scratch(probe, rows, window - bucket, capacity)
    chain = [(0, j - 1) for j in range(bucket)]  # a chain fills the bucket exactly
    try:
        session.forward([chain] * rows)
    finally:  # the scratch rows' store goes to the probe's spare (a Warmup's probe: its runner's) at once,
        session.release()  # not when the garbage collector gets to the cache's cycle
    return session.compile_problem


def copied_from(shared: Sequence[Sequence[int]], sources: Sequence[int]) -> int:
    """The first committed entry a commit must copy: new row i takes old row sources[i], and a row
    that takes another's already holds the same bits up to shared[source][i] (beams share their
    prompt and most of the reply), so the rows moved copy only from the least of those. Rows past
    the old ones (more beams than before) hold nothing yet."""
    moved = [shared[src][i] if i < len(shared) else 0 for i, src in enumerate(sources) if src != i]
    return min(moved, default=0)


def shared_after(shared: Sequence[Sequence[int]], sources: Sequence[int], slots: Sequence[Sequence[int]],
                 prefix: int) -> list[list[int]]:
    """`shared` after a commit of `prefix` committed entries and the chains at `slots`: two rows
    from one source share its prefix and then their chains while these read the same slots; rows
    from two sources share what the sources did."""
    out = []
    for i, a in enumerate(sources):
        line = []
        for j, b in enumerate(sources):
            if a != b:
                line.append(min(shared[a][b], prefix))
                continue
            same = 0
            while same < len(slots[i]) and slots[i][same] == slots[j][same]:
                same += 1
            line.append(prefix + same)
        out.append(line)
    return out
