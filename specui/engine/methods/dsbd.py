"""DSBD: dynamic-width speculative beam decoding (DESIGN.md 3.7, seed 000).

Each step starts from W_L input beams (rows of a RowSession in both models). The draft runs
beam sampling of width W_S for gamma layers from them: a forest, one tree per input beam.
One target forward scores every node, each tree over its own beam's cache. Verification
goes layer by layer on joint beam probabilities:

- p_beam = warp(log P(parent) + log p(x | parent)) over (accepted parents x vocabulary);
  q_beam = the draft's layer distribution the candidates came from, restricted to the
  accepted parents (candidates under rejected parents are dropped);
- W_L^(l) is chosen (fixed, or dynamically from the alpha / P(m, k) recursion); each
  candidate in drawn order is accepted with probability min(1, p'(x) / q_beam(x)) (p' starts
  as p_beam; an acceptance resets it, a rejection sets p' = res(p', q_beam)); the layer
  stops once W_L^(l) are accepted;
- if fewer were accepted, one beam is drawn from p' and the rest from p_beam, and the step
  ends at this layer; if every layer passed, W_L beams are drawn from the target's p_beam
  of layer gamma + 1.

Every accepted or drawn beam of a layer is thus an exact sample of the target's p_beam.
Temperature 0 with a fixed width is deterministic beam search: each layer keeps the
target's top W_L (select_beams, as `beam`), continuing while the draft's forest holds them,
so the reply equals the target's beam search exactly. Memory mode keeps only the best
output beam (lowest perplexity) as the next step's single input beam.

Beams all have the same length, so the rows never need padding in their committed part;
a beam's last token is cached at the next step (as the root of its tree).

This module holds the method: drafting the forest, scoring it with the target, verifying it
layer by layer and advancing the beams. The verification maths (acceptance counts, dynamic
width, one layer's acceptance) is in dsbd_verify.py; the forest's data (nodes, layers,
beams, outputs) and the trace drawn from it are in dsbd_forest.py.
"""

from __future__ import annotations

import time

import torch

from specui.engine.costs import DepthRecord
from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.methods.beam import Hypothesis, beam_search_done, select_beams
from specui.engine.methods.dsbd_depth import DepthPolicy
from specui.engine.methods.dsbd_forest import Beam, Layer, Node, Output, forest_trace
from specui.engine.methods.dsbd_verify import LayerVerdict, acceptance_count_probs, dynamic_width, verify_layer
from specui.engine.rows import RowSession
from specui.engine.sampling import sample, warp
from specui.engine.trace import ACCEPTED, BONUS, DROPPED, FILLED, REJECTED, RESAMPLED
from specui.errors import SpecUIError

# The verification maths (dsbd_verify) and the forest (dsbd_forest) stay importable from here.
__all__ = [
    "DSBD", "Beam", "Layer", "LayerVerdict", "Node", "Output", "acceptance_count_probs", "dynamic_width",
    "forest_trace", "verify_layer",
]


class DSBD(Method):
    name = "dsbd"
    uses_draft = True

    def __init__(self, width: int = 2, draft_width: int | None = None, gamma: int = 3,
                 width_threshold: float | None = None, min_width: int = 1, memory_mode: bool = False,
                 adaptive_gamma: bool = False) -> None:
        """width: W_L, the beams kept; draft_width: W_S, the draft's beams per layer
        (None: 2 W_L); width_threshold: t, dynamic width on when given; min_width: W_min;
        adaptive_gamma: each step's depth chosen in 0..gamma by measurement (dsbd_depth.py),
        else always gamma (the seed's)."""
        beam_width = width
        draft_width = 2 * width if draft_width is None else draft_width
        if beam_width < 1 or gamma < 1:
            raise SpecUIError(f"dsbd needs beam width and gamma >= 1, got {beam_width}, {gamma}")
        if draft_width <= beam_width:
            raise SpecUIError(f"draft width W_S must exceed the beam width W_L = {beam_width} (the draft proposes "
                              f"more beams than are kept), got {draft_width}")
        if not 1 <= min_width <= beam_width:
            raise SpecUIError(f"min width must be in [1, beam width = {beam_width}], got {min_width}")
        if width_threshold is not None and not 0.0 < width_threshold <= 1.0:
            raise SpecUIError(f"width threshold must be in (0, 1], got {width_threshold}")
        self.beam_width, self.draft_width, self.gamma = beam_width, draft_width, gamma
        self.threshold, self.min_width, self.memory_mode = width_threshold, min_width, memory_mode
        self.adaptive_gamma = adaptive_gamma
        self.depth: DepthPolicy | None = None
        self.root_ms: float | None = None  # the last step's first draft forward (the beams' unfed tokens)
        self.target: RowSession | None = None
        self.draft: RowSession | None = None
        self.running: list[Beam] = []
        self.finished: list[Hypothesis] = []

    def begin(self, ctx: DecodeContext) -> None:
        assert ctx.draft is not None
        # Beams live in rows of their own caches; the shared sessions keep their prefix caches.
        self.target = RowSession(ctx.target.model, ctx.target.vocab_size, ctx.target.clock, ctx.target.runner)
        self.draft = RowSession(ctx.draft.model, ctx.target.vocab_size, ctx.draft.clock,
                                getattr(ctx.draft, "runner", None))
        self.target.prefill(ctx.ids[:-1])
        self.draft.prefill(ctx.ids[:-1])
        self.running = [Beam([], 0.0, [ctx.ids[-1]], [ctx.ids[-1]])]
        self.finished = []
        if self.adaptive_gamma:
            key = (f"{self.beam_width}/{self.draft_width} {'greedy' if ctx.sampling.greedy else 'sampled'}"
                   f" t={self.threshold} min={self.min_width} memory={self.memory_mode}")
            record = ctx.costs.depths.setdefault(key, DepthRecord()) if ctx.costs is not None else DepthRecord()
            self.depth = DepthPolicy(self.gamma, record)

    # --- one step ---------------------------------------------------------------------------
    def step(self, ctx: DecodeContext) -> StepResult:
        start = time.perf_counter()
        before = len(self.running[0].tokens)
        cap = ctx.max_new_tokens - before - 1
        notes = []
        if self.depth is not None:
            gamma, why = self.depth.choose(cap)
            notes.append(why)
            behind = max(len(b.d_fresh) for b in self.running) > 2  # the draft first catches up (depth 0 ran)
            # a step's time stands for its depth's where the usual beams run it (any count under dynamic width),
            # not the reply's first step from its one prompt beam
            typical = before > 0 and (self.threshold is not None
                                      or len(self.running) == (1 if self.memory_mode else self.beam_width))
        else:
            gamma = max(0, min(self.gamma, cap))
        self.root_ms = None
        with ctx.timer.phase("draft"):
            roots, layers = self._draft_forest(ctx, gamma)
        with ctx.timer.phase("verify"):
            self._score_forest(roots, layers)
            outputs, widths, done = self._verify(ctx, roots, layers)
            self._advance(outputs, ctx.eos_ids)
            done = done or self._done(ctx)
        best = max(self.finished + self.running if done else self.running or self.finished, key=lambda h: h.score)
        forest = [n for layer in layers for n in layer.nodes]
        gained = len(self.running[0].tokens) - before if self.running else len(best.tokens) - before
        accepted = max(0, gained - 1)  # draft layers the beams advanced by beyond the target's own token
        stop = outputs[0].parent.layer + 1 if outputs else len(widths)
        if self.depth is not None:  # a reply that ended at this step says nothing of how often layers pass
            verified = 0 if done or not outputs else len(layers)
            passed = min(verified, stop - 1)
            self.depth.observe(gamma, 1000 * (time.perf_counter() - start), verified, passed, self.root_ms, behind,
                               typical)
        return StepResult(
            tokens=list(best.tokens), replace=True, finished=done, nodes=forest_trace(roots, layers, outputs),
            drafted=len(forest), accepted=accepted, gamma=gamma, beam_width=len(self.running) or None,
            tree_nodes=len(forest), tree_depth=len(layers), layer_widths=widths, stop_layer=stop, notes=notes,
            beams=[(b.tokens, b.score) for b in self.running] + [(h.tokens, h.score) for h in self.finished[-8:]
                                                                 if h.tokens and len(h.tokens) > before],
        )

    def _draft_forest(self, ctx: DecodeContext, gamma: int) -> tuple[list[Node], list[Layer]]:
        """Beam sampling (deterministic: beam search) of width W_S for gamma layers."""
        roots = [Node(r, b.t_fresh[-1], None, 0, b.score, t_idx=len(b.t_fresh) - 1) for r, b in enumerate(self.running)]
        if gamma == 0:
            return roots, []
        began = time.perf_counter()
        logits = self.draft.forward([[(t, i - 1) for i, t in enumerate(b.d_fresh)] for b in self.running])
        if self.depth is not None:  # timed for the depth policy only
            if logits and logits[0].is_cuda:  # a GPU's forward returns before it ran
                torch.cuda.synchronize(logits[0].device)
            self.root_ms = 1000 * (time.perf_counter() - began)
        for root, b, rows in zip(roots, self.running, logits):
            root.d_idx, root.q_logits = len(b.d_fresh) - 1, rows[-1]
        layers, parents = [], roots
        vocab = self.target.vocab_size
        for layer_no in range(1, gamma + 1):
            logq = torch.stack([n.q_logits for n in parents]).double().log_softmax(-1)
            joint = _column([n.draft_score for n in parents], logq) + logq
            q_beam = warp(joint.view(-1), ctx.sampling)
            if ctx.sampling.greedy:
                picks = torch.topk(joint.view(-1), min(self.draft_width, joint.numel())).indices.tolist()
            else:
                picks = torch.multinomial(q_beam, self.draft_width, replacement=True, generator=ctx.generator).tolist()
            nodes = [Node(parents[f // vocab].row, f % vocab, parents[f // vocab], layer_no, float(joint.view(-1)[f]))
                     for f in picks]
            layers.append(Layer(parents, q_beam, nodes))
            parents = [n for n in nodes if n.token not in ctx.eos_ids]
            if layer_no == gamma or not parents:
                break
            self._feed_draft(parents)
        return roots, layers

    def _feed_draft(self, nodes: list[Node]) -> None:
        base = [len(p) for p in self.draft.pending]
        new: list[list[tuple[int, int]]] = [[] for _ in self.running]
        for n in nodes:
            n.d_idx = base[n.row] + len(new[n.row])
            new[n.row].append((n.token, n.parent.d_idx))
        logits = self.draft.forward(new)
        for n in nodes:
            n.q_logits = logits[n.row][n.d_idx - base[n.row]]

    def _score_forest(self, roots: list[Node], layers: list[Layer]) -> None:
        """One target forward: each row's uncached beam tokens, then its tree."""
        new = [[(t, i - 1) for i, t in enumerate(b.t_fresh)] for b in self.running]
        for layer in layers:
            for n in layer.nodes:
                n.t_idx = len(new[n.row])
                new[n.row].append((n.token, n.parent.t_idx))
        logits = self.target.forward(new)
        for n in roots + [n for layer in layers for n in layer.nodes]:
            n.p_logits = logits[n.row][n.t_idx]
        for root, b in zip(roots, self.running):
            root.score = b.score

    def _verify(self, ctx: DecodeContext, roots: list[Node], layers: list[Layer]
                ) -> tuple[list[Output], list[int], bool]:
        """Layer by layer; returns the output beams, the width chosen at each layer, and
        whether beam search is done (deterministic mode: best finished beats every beam)."""
        accepted, widths = roots, []
        vocab = self.target.vocab_size
        for layer in layers:
            joint = self._joint(accepted)
            if ctx.sampling.greedy:
                outputs, nxt, done = self._layer_greedy(ctx, accepted, joint, layer)
                widths.append(self.beam_width)
            else:
                outputs, nxt, width = self._layer_sampled(ctx, accepted, joint, layer)
                widths.append(width)
                done = False
            if outputs is not None or done:
                return outputs or [], widths, done
            accepted = nxt
            if not accepted:
                return [], widths, False
        joint = self._joint(accepted)  # every layer passed: the target's own layer gamma + 1
        if ctx.sampling.greedy:
            picks = select_beams(joint, self.beam_width, ctx)
            self.finished += [self._hyp(accepted[p.parent], p.token, p.score) for p in picks.finished]
            return [Output(accepted[p.parent], p.token, p.score, BONUS) for p in picks.kept], widths, False
        p_beam = warp(joint.view(-1), ctx.sampling)
        draws = [sample(p_beam, ctx.generator) for _ in range(self.beam_width)]
        return [Output(accepted[f // vocab], f % vocab, float(joint.view(-1)[f]), BONUS) for f in draws], widths, False

    def _joint(self, parents: list[Node]) -> torch.Tensor:
        """log P(parent) + log p(x | parent), (parents, V), float64 on CPU."""
        logp = torch.stack([n.p_logits for n in parents]).double().log_softmax(-1)
        return _column([n.score for n in parents], logp) + logp

    def _layer_greedy(self, ctx: DecodeContext, parents: list[Node], joint: torch.Tensor, layer: Layer
                      ) -> tuple[list[Output] | None, list[Node], bool]:
        """The target's top W_L at this layer; continue while the forest holds all of them."""
        picks = select_beams(joint, self.beam_width, ctx)
        self.finished += [self._hyp(parents[p.parent], p.token, p.score) for p in picks.finished]
        drafted = {(id(n.parent), n.token): n for n in layer.nodes}
        found = []
        for p in picks.kept:
            node = drafted.get((id(parents[p.parent]), p.token))
            if node is None:
                break
            node.score = p.score
            found.append(node)
        live = {id(a): i for i, a in enumerate(parents)}
        for n in layer.nodes:
            if id(n.parent) not in live:
                n.status = DROPPED
                continue
            n.score = float(joint[live[id(n.parent)], n.token])
            n.status = ACCEPTED if any(n is f for f in found) else REJECTED
        kept_best = max((p.score for p in picks.kept), default=float("-inf"))
        done = not picks.kept or (bool(self.finished) and max(h.score for h in self.finished) >= kept_best)
        if len(found) == len(picks.kept) and not done:
            return None, found, False
        return [Output(parents[p.parent], p.token, p.score, ACCEPTED if i < len(found) else FILLED)
                for i, p in enumerate(picks.kept)], [], done

    def _layer_sampled(self, ctx: DecodeContext, parents: list[Node], joint: torch.Tensor, layer: Layer
                       ) -> tuple[list[Output] | None, list[Node], int]:
        vocab = joint.shape[-1]
        where = {id(n): i for i, n in enumerate(layer.parents)}
        rows = torch.tensor([where[id(a)] for a in parents])
        q_beam = layer.q_beam.view(len(layer.parents), vocab)[rows].reshape(-1)
        q_beam = q_beam / q_beam.sum()
        p_beam = warp(joint.view(-1), ctx.sampling)
        slot = {id(a): i for i, a in enumerate(parents)}
        candidates = [n for n in layer.nodes if id(n.parent) in slot]
        flat = [slot[id(n.parent)] * vocab + n.token for n in candidates]
        width = self.beam_width if self.threshold is None else dynamic_width(
            p_beam, q_beam, len(candidates), self.beam_width, self.min_width, self.threshold)
        verdict = verify_layer(p_beam, q_beam, flat, width, ctx.generator)
        for n in layer.nodes:
            if id(n.parent) not in slot:
                n.status = DROPPED
        for i, (n, f) in enumerate(zip(candidates, flat)):
            n.q, n.p, n.score = float(q_beam[f]), float(p_beam[f]), float(joint.view(-1)[f])
            if i < verdict.considered:
                n.status = REJECTED
        chosen = [candidates[i] for i in verdict.accepted]
        for n in chosen:
            n.status = ACCEPTED
        if verdict.drawn:
            drawn = [Output(parents[f // vocab], f % vocab, float(joint.view(-1)[f]), RESAMPLED if i == 0 else FILLED)
                     for i, f in enumerate(verdict.drawn)]
            return [Output(n.parent, n.token, n.score, ACCEPTED) for n in chosen] + drawn, [], width
        self.finished += [self._hyp(n.parent, n.token, n.score) for n in chosen if n.token in ctx.eos_ids]
        return None, [n for n in chosen if n.token not in ctx.eos_ids], width

    # --- after verification -----------------------------------------------------------------
    def _hyp(self, parent: Node, token: int, score: float) -> Hypothesis:
        base = self.running[parent.row].tokens
        return Hypothesis(base + [n.token for n in parent.path()] + [token], score)

    def _advance(self, outputs: list[Output], eos: frozenset[int]) -> None:
        """The output beams become the next input beams: rows copied, caches kept along
        each beam's path (nothing accepted is recomputed)."""
        live = [o for o in outputs if o.token not in eos]
        self.finished += [self._hyp(o.parent, o.token, o.score) for o in outputs if o.token in eos]
        if self.memory_mode and live:
            live = [max(live, key=lambda o: o.score)]
        if not live:
            self.running = []
            return
        t_keep, d_keep, beams = [], [], []
        for o in live:
            old, path = self.running[o.parent.row], o.parent.path()
            t_keep.append((o.parent.row, list(range(len(old.t_fresh))) + [n.t_idx for n in path]))
            fed = [n for n in path if n.d_idx >= 0]  # a prefix of the path: layers below gamma
            drafted = bool(self.draft.pending[o.parent.row])  # the draft ran this step (gamma > 0)
            d_chain = list(range(len(old.d_fresh))) if drafted else []
            d_keep.append((o.parent.row, d_chain + [n.d_idx for n in fed]))
            unfed = ([] if drafted else old.d_fresh) + [n.token for n in path[len(fed):]] + [o.token]
            beams.append(Beam(self._hyp(o.parent, o.token, o.score).tokens, o.score, [o.token], unfed))
        self.target.commit(t_keep)
        self.draft.commit(d_keep)
        self.running = beams

    def end(self, ctx: DecodeContext) -> None:
        for rows in (self.target, self.draft):
            if rows is not None:
                rows.release()

    def _done(self, ctx: DecodeContext) -> bool:
        return beam_search_done(self.running, self.finished, ctx.max_new_tokens)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-parent scores as a (parents, 1) column beside `like` (same dtype and device)."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]