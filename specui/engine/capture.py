"""Forwards over a static cache at a few shapes, and their captured forms (DESIGN.md 4.5).

A method's forward here is: pick the bucket (the fewest of BUCKETS tokens that hold the new
ones) and the window (the cache slots attention reads, a multiple of WINDOW), fill the bucket's
inputs (tokens, positions, the tree mask; padded rows are a causal continuation whose entries
land past the valid length and are never read), run, read the real rows' logits.

How it runs is the mode:
- "exact": eager at the real shapes (no padding): a feature draft, a forward whose hidden
  states are read through hooks (a model engine/hidden.py has no hook-free forward for),
  anything longer than the biggest bucket.
- "buckets": eager at the padded shapes, exactly as a captured forward runs them; on a CPU
  this is what `--capture on` runs today, and it is how the padding and masks are tested
  without a GPU.
- "graphs": one CUDA graph per (bucket, window), captured on first use, replayed after. A
  capture that fails leaves that shape eager, with a note; never a crash.
`compiled` (what `--capture on` asks for): the shapes run through torch.compile (inductor:
fused kernels; inside the CUDA graphs on a GPU). Sizes are seen as tensor sizes, so two
compiles (one token; any other count) serve every size and window (automatic dynamic shapes),
and outside CUDA graphs a forward runs its own token count, unpadded (`width_for`); beam rows
(engine/rows.py) compile per rows count and capacity (`rows.mark_sizes`); a compile that fails
leaves the model eager, with a note. With `background` (what `--capture auto` runs on a CPU
that measured compiled forwards faster) no forward waits for a compile: a Warmup compiles each
shape on a scratch cache of the same size, one thread per shape, at the lowest CPU priority,
while no reply decodes (a reply pauses the compile under way; it goes on once the reply is
done); meanwhile a forward runs compiled where a call finds its shape compiled already
(torch.compile's "fail_on_recompile" stance) and eagerly otherwise, asking the Warmup for that
shape. Measured on a 2-core EPYC (bundled pair, bf16 on int4 blocks): a compile beside a
decoding thread cost that thread 2-8x per token (each op waits to take the GIL back; a second
OpenMP team makes libgomp stop spinning its workers), hence the pause. Compiled code is
cached on disk by inductor, under ~/.cache/specui/inductor unless TORCHINDUCTOR_CACHE_DIR
was set first; a failure that a stale cache may explain is retried once on a fresh one.
Measured on an H100 (random weights, the bundled target's shape, bf16): one replayed graph
costs 3.0 ms unfused and 1.4 ms compiled (about 1000 small kernels become a few hundred).
A forward asked for its hidden states too (`run(..., hidden=True)`: SpecDec++'s and MCSD's
drafts) runs engine/hidden.py's forward, which returns them beside the logits, in the same mode:
its own compile (a variant of the model's), its own graphs and Warmup shapes (keys ending in
HIDDEN), so a compile that fails there leaves only those forwards eager.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from transformers import PreTrainedModel

from specui.engine.attention import grouped_attention, routed_attention
from specui.engine.compiled import compile_model
from specui.engine.giving_way import DYNAMO
from specui.engine.graphs import CudaGraphs, Graph
from specui.engine.hidden import logits_and_hidden
from specui.engine.host_ids import HostIds
from specui.engine.masks import StaticMasks, mask_dtype
from specui.engine.static_cache import SpareStore, StaticKVCache
from specui.engine.timing import ForwardClock
from specui.engine.warmup import HIDDEN, RECOMPILE, Warmup
from specui.errors import SpecUIError
from specui.settings import CAPTURES

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WINDOW = 256  # attention windows are multiples of this many slots
MODES = ("exact", "buckets", "graphs")


def bucket_for(m: int) -> int | None:
    """The smallest bucket that holds m tokens (None: more than the biggest)."""
    return next((b for b in BUCKETS if b >= m), None)


def round_up(n: int, step: int | None = None) -> int:
    """n rounded up to a multiple of `step` (default WINDOW)."""
    step = step or WINDOW
    return -(-n // step) * step


def capture_mode(capture: str, device: torch.device) -> str | None:
    """The forward mode for a `--capture` value on a device (None: today's eager cache).
    `on`: the padded shapes compiled (inside CUDA graphs on a GPU), waiting for each compile;
    `auto`: CUDA graphs of the eager shapes on a GPU (no compile to wait for; 7x eager on an
    H100); on a CPU the eager path here, which the engine turns into `on` for a model whose
    compiled forwards measured faster on this machine (engine/capture_choice.py)."""
    if capture not in CAPTURES:
        raise SpecUIError(f"capture must be one of {', '.join(CAPTURES)}, not '{capture}'")
    if capture == "off" or (capture == "auto" and device.type != "cuda"):
        return None
    return "graphs" if device.type == "cuda" else "buckets"


class StaticForward:
    """Runs one model over its StaticKVCache; `notes` says what happened to captures."""

    def __init__(self, model: PreTrainedModel, cache: StaticKVCache, mode: str, graphs=None,
                 compiled: bool = False, background: bool = False, grouped: int | None = None) -> None:
        """`graphs`: what captures a forward (CudaGraphs on a GPU; a test passes a stand-in
        whose replay re-runs the forward on the same static inputs); `compiled`: the padded
        shapes run through torch.compile; `background` (with `compiled`, outside CUDA graphs):
        compiles happen on a Warmup thread, never in a forward; `grouped`: compiled forwards
        attend with grouped matmuls up to that many queries (engine/capture_choice.py measured
        it faster here), eager ones as the load chose."""
        if mode not in MODES:
            raise SpecUIError(f"forward mode must be one of {', '.join(MODES)}")
        if mode == "graphs" and graphs is None:
            if cache.device.type != "cuda":
                raise SpecUIError("CUDA graphs need a model on a CUDA device")
            graphs = CudaGraphs()
        self.model, self.cache, self.mode, self.backend = model, cache, mode, graphs
        self.mask_dtype = mask_dtype(model)
        self.graphs: dict[tuple, Graph] = {}  # (bucket, window), or (bucket, window, HIDDEN)
        self.failed: dict[tuple, str] = {}
        self.grouped = (routed_attention(model), grouped) if compiled and grouped else None
        # what the padded shapes run; the attention's routing is traced, not guarded: its own compile
        variant = grouped if self.grouped else None
        self.fn = compile_model(model, variant) if compiled else model
        # (logits, hidden) without hooks (None: this model's hidden states need hooks, "exact"), and its compile
        self.hidden_call = logits_and_hidden(model)
        self.hidden_fn = self.hidden_call
        if compiled and self.hidden_call is not None:
            self.hidden_fn = compile_model(model, (HIDDEN, variant), self.hidden_call)
        self.compile_problem = ""
        self.hidden_problem = ""  # why the hidden-state forwards run eagerly (their compile failed)
        self._generation = cache.generation
        self.clock = ForwardClock(cache.device)  # time inside the forwards (the session reads it)
        self.masks = StaticMasks(cache, self.mask_dtype, BUCKETS[-1])  # every forward's additive mask
        self.host_ids = HostIds(BUCKETS[-1])  # every forward's positions on a CPU
        self.replays = 0  # forwards that ran as a replayed graph
        self.eager = 0  # forwards that ran eagerly (a graph's capture counts as one)
        self.spare_rows = SpareStore()  # a finished beam rows cache's store, for the next (engine/rows.py)
        self.compiled_runs = 0  # padded forwards that ran compiled
        first = [(b, WINDOW) for b in BUCKETS] + [(1, 2 * WINDOW), (2, 2 * WINDOW)]  # what a reply meets first
        self.warmup = Warmup(self, first) if compiled and background and mode == "buckets" else None
        self.blocking = False  # with a Warmup: compile in the forward anyway (a cost profile's timings)

    @property
    def notes(self) -> list[str]:
        notes = [f"{key[0]} tokens over {key[1]} slots{' (with hidden states)' if key[-1] == HIDDEN else ''}: eager "
                 f"({why})" for key, why in sorted(self.failed.items())]
        if self.warmup is not None and self.warmup.note:
            notes.append(self.warmup.note)
        if self.grouped and self.fn is not self.model:
            notes.append(f"compiled attention: grouped matmuls for up to {self.grouped[1]} queries (measured faster "
                         "here than SDPA compiled; python -m specui.bench.capture)")
        if self.hidden_problem:
            notes.append(f"hidden-state forwards not compiled: {self.hidden_problem}")
        return notes + ([f"not compiled: {self.compile_problem}"] if self.compile_problem else [])

    @property
    def settled(self) -> bool:
        """No compile is under way or waiting for this model (always, without a Warmup)."""
        return self.warmup is None or self.warmup.settled

    @property
    def compiled(self) -> bool:
        return self.fn is not self.model

    def width_for(self, m: int) -> int | None:
        """The rows a forward of m new tokens runs at; None: more than the biggest bucket (exact,
        eager). A CUDA graph, or an eager forward at the padded shapes, runs the bucket. Compiled
        outside CUDA graphs every size from 2 on is one dynamic compile (size 1 its own: see
        `_padded`), so it runs m rows: padding was arithmetic for nothing, and on a CPU each row of
        a product costs (a gamma-4 chain's 5 rows padded to 8, an 8-node tree's 9 to 16; the
        bundled target's int4 forward of 9 tokens 49 ms padded, 39 exact, 2-core Xeon)."""
        if m > BUCKETS[-1]:
            return None
        return m if self.compiled and self.mode == "buckets" else bucket_for(m)

    def captured(self) -> list[tuple]:
        """The (bucket, window) shapes held as graphs ((bucket, window, HIDDEN) for those that
        return hidden states too)."""
        return sorted(k for k, g in self.graphs.items() if g.replay is not None)

    # -- one forward -------------------------------------------------------------------
    def run(self, ids: torch.Tensor, positions: list[int] | None, attend: torch.Tensor | None, keep: int = 0,
            exact: bool = False, hidden: bool = False, **extra):
        """Feed `ids` (m,) after the cache's valid length at `positions` (None: the next m),
        row i attending to what `attend` (bool (m, length + m)) allows (None: causal). Returns
        the logits (keep or m, V) of the last `keep` rows (0: all); the valid length grows by m.
        `hidden` (where `hidden_call` is not None): (logits, the hidden states (rows, H) the
        output layer read for those rows)."""
        if hidden and self.hidden_call is None:
            raise SpecUIError("this model's hidden states are read through hooks, in an exact forward")
        cache = self.cache
        start, m = cache.length, ids.numel()
        bucket = None if exact or extra or self.mode == "exact" else self.width_for(m)
        width = m if bucket is None else bucket
        window = start + m if bucket is None else round_up(start + bucket)
        cache.grow(round_up(window))  # the window always holds the (padded) new rows
        positions = list(range(start, start + m)) if positions is None else list(positions)
        mask = self.masks.build(start, m, width, window, attend)
        padded = positions + [positions[-1]] * (width - m)  # padded rows repeat the last position
        if cache.device.type == "cpu":
            positions_t = self.host_ids.row(padded)  # (a kept tensor: engine/host_ids.py)
        else:
            positions_t = torch.tensor([padded], dtype=torch.long).to(cache.device, non_blocking=True)
        if width > m:
            ids = torch.cat([ids, ids.new_zeros(width - m)])
        cache.prepare(start, window)
        key = (bucket, window, HIDDEN) if hidden else (bucket, window)
        if bucket is not None and self.mode == "graphs" and key not in self.failed:
            out = self.clock.run(self._replay, key, ids, positions_t, mask)
        else:
            kw = dict(input_ids=ids[None], position_ids=positions_t, attention_mask=mask[None, None],
                      past_key_values=cache, use_cache=True, **extra)
            if bucket is None:
                self.eager += 1
                out = self.clock.run(self.hidden_call if hidden else self.model, logits_to_keep=keep, **kw)
            else:
                out = self.clock.run(self._padded, hidden=hidden, **kw)
            out = _first(out if hidden else out.logits)
        cache.set_length(start + m)
        if hidden:
            return _real_rows(out[0], m, keep), _real_rows(out[1], m, keep)
        return _real_rows(out, m, keep)

    # -- CUDA graphs -------------------------------------------------------------------
    def _replay(self, key: tuple, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        """The logits (bucket, V) of the graph for `key`, captured on first use; with HIDDEN in
        the key, (logits, hidden states)."""
        if self._generation != self.cache.generation:  # the store moved: every graph read the old one
            self.graphs.clear()
            self._generation = self.cache.generation
        bucket, window = key[:2]
        hidden = key[-1] == HIDDEN
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = Graph(bucket, window, self.cache.device, self.mask_dtype)
        graph.ids.copy_(ids[None])
        graph.positions.copy_(positions)
        graph.mask.copy_(mask[None, None])
        if graph.replay is None:
            try:
                graph.replay, out = self.backend.capture(lambda: self._call(graph, hidden))
                graph.logits, graph.hidden = out if hidden else (out, None)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                del self.graphs[key]
                self.failed[key] = f"capture failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # what the failed capture took
                return _first(self._call(graph, hidden))
        graph.replay()
        self.replays += 1
        # the next replay (any graph: they share a pool) overwrites the outputs
        return _first((graph.logits, graph.hidden) if hidden else graph.logits, clone=True)

    def _call(self, graph: Graph, hidden: bool = False):
        """The graph's forward on its static inputs: logits (1, bucket, V), or with `hidden`
        (logits, hidden states)."""
        out = self._padded(input_ids=graph.ids, position_ids=graph.positions, attention_mask=graph.mask,
                           past_key_values=self.cache, use_cache=True, hidden=hidden)
        return out if hidden else out.logits

    def _padded(self, hidden: bool = False, **kw):
        """A padded shape's forward: compiled where it compiles (and, with a Warmup, where it
        has compiled already), else the model itself; with `hidden`, the hidden-state forward
        ((logits, hidden)) likewise, on a compile of its own whose failure leaves only those
        forwards eager (with a note)."""
        fn, eager = (self.hidden_fn, self.hidden_call) if hidden else (self.fn, self.model)
        if fn is not eager:
            mark_dynamic_sizes(kw, self.cache)
            shape = (kw["input_ids"].shape[1], self.cache.window, self.cache.capacity) + ((HIDDEN,) if hidden else ())
            try:
                with grouped_attention(*self.grouped) if self.grouped else nullcontext():
                    out = self.compiled_call(kw, shape, fn=fn)
            except torch.OutOfMemoryError:
                raise  # the forward's, not the compiler's
            except Exception as e:  # noqa: BLE001 - the compiler fails in many types (dynamo asserts too)
                problem = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
                if hidden:
                    self.hidden_fn, self.hidden_problem = self.hidden_call, problem
                else:
                    self.fn, self.compile_problem = self.model, problem
                out = None
            if out is not None:
                self.compiled_runs += 1
                return out
        self.eager += 1
        return eager(**kw)

    def compiled_call(self, kw: dict, shape: tuple[int, ...] | None = None, run: Callable | None = None,
                      fn: Callable | None = None):
        """The compiled forward, or None where it would have to wait: with a Warmup, a call that
        would compile runs nothing (the Warmup is asked for that shape). Such a call takes no
        lock: the "fail_on_recompile" stance makes it raise before it could compile (which must
        never overlap a Warmup's compile), and a Warmup whose compile begins under that stance
        tries again. `shape` and `run`: what the Warmup is asked for (default: this runner's
        (bucket, window, capacity)); beam rows over this model (engine/rows.py) pass theirs.
        `fn`: the compiled callable (default the forward's; the hidden-state forward's)."""
        fn = fn or self.fn
        if self.warmup is None or self.blocking:
            with DYNAMO:
                return fn(**kw)
        shape = shape or (kw["input_ids"].shape[1], self.cache.window, self.cache.capacity)
        if self.warmup.waiting(shape):  # asked already: a failed try costs more than the forward
            return None
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return fn(**kw)
        except RuntimeError as e:
            if RECOMPILE not in str(e):
                raise
            self.warmup.ask(shape, run)
            return None


def _first(out, clone: bool = False):
    """The first (only) batch row of a forward's output: of a tensor, or of each in a (logits,
    hidden) pair; copies with `clone` (a graph's outputs, which the next replay overwrites)."""
    if isinstance(out, tuple):
        return tuple(_first(t, clone) for t in out)
    return out[0].clone() if clone else out[0]


def _real_rows(out: torch.Tensor, m: int, keep: int) -> torch.Tensor:
    """The rows (keep or m, .) of the real tokens' last `keep` (0: all) of a forward's padded output."""
    rows = out if out.shape[0] == m else out[:m]  # (each view op is a few us on a CPU)
    return rows[-keep:] if 0 < keep < m else rows


def mark_dynamic_sizes(kw: dict, cache: StaticKVCache) -> None:
    """Sizes a compile sees as symbols: one compile for every bucket and window (size 1 is
    specialised anyway), the window a size, not a constant."""
    for name, dims in (("input_ids", (1,)), ("position_ids", (1,)), ("attention_mask", (2, 3))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(kw[name], dim)
    torch._dynamo.maybe_mark_dynamic(cache.columns, 0)
