"""Token-tree speculative decoding: static trees (literal path lists) and OPT-Tree (seed 004).

One step: 1. draft a tree layer by layer (one draft forward per layer, tree attention over
the draft's cache), 2. score every node in one target forward, 3. verify (greedy: longest
path of target argmaxes; sampling: children are chosen deterministically, so draw from p~
and descend if the draw is a child: lossless), 4. commit the accepted path in both caches.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass

import torch

from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.methods.tree_budget import NodeBudget
from specui.engine.methods.tree_device import TreeStats, draft_static_tree_on_device, plan_static_tree
from specui.engine.sampling import SamplingConfig, greedy_tokens, read_entries, scored, warp
from specui.engine.session import ModelSession
from specui.engine.trace import ACCEPTED, BONUS, REJECTED, RESAMPLED, UNVERIFIED, NodeTrace
from specui.engine.tree import TokenTree
from specui.engine.verify_tree import TreeVerdict, verify_tree
from specui.errors import SpecUIError

# Medusa-style literal paths: each entry lists the child rank taken at each depth.
STATIC_TREES: dict[str, list[list[int]]] = {
    # full binary tree of depth 3: 2 + 4 + 8 = 14 nodes
    "binary-14": [[a] for a in range(2)] + [[a, b] for a in range(2) for b in range(2)]
    + [[a, b, c] for a in range(2) for b in range(2) for c in range(2)],
    # EAGLE-style: wide near the root, a deep spine along the most likely path (25 nodes)
    "eagle-25": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
                 [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [2, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0],
                 [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0, 0, 0],
                 [0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]],
    # MCSD k-config (4, 2, 2, 1, 1): 4 + 8 + 16 + 16 + 16 = 60 nodes
    "mcsd-42211": [[a] for a in range(4)] + [[a, b] for a in range(4) for b in range(2)]
    + [[a, b, c] for a in range(4) for b in range(2) for c in range(2)]
    + [[a, b, c, 0] for a in range(4) for b in range(2) for c in range(2)]
    + [[a, b, c, 0, 0] for a in range(4) for b in range(2) for c in range(2)],
}


def draft_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The draft distribution children are ranked by: q~ when sampling, softmax when greedy."""
    return logits.float().softmax(-1) if cfg.greedy else warp(logits, cfg).float()


def top_tokens(q: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The draft's k most likely tokens (probability, token), skipping zero-probability ones
    (top-k / top-p warping or the reduced head can leave fewer than k)."""
    return top_tokens_rows(q[None], k)[0]


def top_tokens_rows(q: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """`top_tokens` of every row of q (m, V) in one top-k call (a layer of a tree: one call
    per node cost 8 ms of Python a step at 25 nodes on a 49k vocabulary)."""
    top = torch.topk(q, min(k, q.shape[-1]), dim=-1)
    return [[(v, tok) for v, tok in zip(vs, toks) if v > 0]
            for vs, toks in zip(top.values.tolist(), top.indices.tolist())]


def select_top_nodes(p_hat: list[float], n: int) -> list[int]:
    """OPT-Tree's selection: the n nodes with the largest p^ (earlier = shallower on ties).
    p^ never grows along a path, so the choice is closed under parents: a subtree with the
    root, and the one maximising E(A) = 1 + sum p^ among subtrees of n nodes."""
    order = sorted(range(len(p_hat)), key=lambda i: (-p_hat[i], i))
    return sorted(order[:n])


def expected_accept(p_hat: list[float], nodes: list[int]) -> float:
    return 1.0 + sum(p_hat[i] for i in nodes)


@dataclass
class DraftedTree:
    tree: TokenTree  # what the target verifies
    drafted: TokenTree  # the tree as laid out in the draft's cache (may hold more nodes)
    index: list[int]  # tree node -> drafted node
    expected_accept: float

    def drafted_path(self, path: list[int]) -> list[int]:
        return [self.index[i] for i in path]

    @classmethod
    def whole(cls, tree: TokenTree) -> DraftedTree:
        """Every node drafted is verified (a static tree)."""
        everything = list(range(len(tree)))
        return cls(tree, tree, everything, expected_accept(tree.p_hat, everything))


class TreeMethod(Method):
    """Shared step: subclasses decide how to draft the tree (`draft_tree`)."""

    uses_draft = True

    @abstractmethod
    def draft_tree(self, ctx: DecodeContext, max_depth: int) -> DraftedTree:
        """Grow a tree of at most max_depth layers with the draft."""

    def step(self, ctx: DecodeContext) -> StepResult:
        assert ctx.draft is not None
        cfg = ctx.sampling
        notes = []
        max_depth = max(0, ctx.remaining - 1)  # room for the target's own token
        # 1. draft
        with ctx.timer.phase("draft"):
            drafted = self.draft_tree(ctx, max_depth) if max_depth else None
        tree = drafted.tree if drafted else TokenTree()
        room = ctx.room
        if len(tree) > room:
            notes.append(f"tree cut from {len(tree)} to {room} nodes: context window")
            tree = tree.subtree(list(range(max(0, room))))
        # 2. score, 3. verify
        with ctx.timer.phase("verify"):
            logits = ctx.target.forward_tree(ctx.ids, tree, self.ancestors(tree))
            p, p_shown = scored(logits, cfg)
            verdict = verify_tree(tree, p, cfg, ctx.generator, self.verify_rows(),
                                  greedy_tokens(p, p_shown) if cfg.greedy else None)
        return self.committed(ctx, tree, drafted, verdict, p_shown, notes)

    def committed(self, ctx: DecodeContext, tree: TokenTree, drafted: DraftedTree | None, verdict: TreeVerdict,
                  p_shown, notes: list[str]) -> StepResult:
        """4. Commit the accepted path in both caches (the loop appends the tokens): the step's result."""
        ctx.target.commit_path(tree, verdict.path)
        if drafted:
            ctx.draft.commit_path(drafted.drafted, drafted.drafted_path(verdict.path))
        tokens = [tree.tokens[i] for i in verdict.path] + [verdict.next_token]
        return self.annotate(ctx, StepResult(
            tokens=tokens, from_draft=[True] * len(verdict.path) + [False],
            nodes=tree_nodes(tree, verdict, p_shown),
            drafted=len(tree), accepted=len(verdict.path), tree_nodes=len(tree),
            tree_depth=max(tree.depths, default=0), expected_accept=drafted.expected_accept if drafted else None,
            notes=notes + self.pending_notes(),
        ))

    def pending_notes(self) -> list[str]:
        return []

    def ancestors(self, tree: TokenTree) -> torch.Tensor | None:
        """The tree's ancestor mask when the method keeps one (MCSD slices a prebuilt fork
        mask); None: the session builds it from the parent array."""
        return None

    def annotate(self, ctx: DecodeContext, result: StepResult) -> StepResult:
        """Add method-specific fields to the step's result (MCSD: chains, predictions)."""
        return result

    def verify_rows(self) -> dict[int, torch.Tensor] | None:
        """q~ each node's children were drawn from i.i.d. (MCSD: multi-candidate verification);
        None when children are chosen deterministically (top-k)."""
        return None


def tree_nodes(tree: TokenTree, verdict: TreeVerdict, p_shown: torch.Tensor) -> list[NodeTrace]:
    on_path, rejected = set(verdict.path), set(verdict.rejected)
    depths = tree.depths
    last = verdict.path[-1] if verdict.path else -1
    p = read_entries(p_shown, [parent + 1 for parent in tree.parents] + [last + 1],
                     list(tree.tokens) + [verdict.next_token])
    nodes = []
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
        status = ACCEPTED if i in on_path else REJECTED if i in rejected else UNVERIFIED
        nodes.append(NodeTrace(token_id=tok, text="", parent=parent, depth=depths[i], status=status,
                               q=tree.q[i], p=p[i], p_hat=tree.p_hat[i]))
    p_next = p[-1]
    nodes.append(NodeTrace(token_id=verdict.next_token, text="", parent=last, depth=len(verdict.path) + 1,
                           status=BONUS if verdict.bonus else RESAMPLED, p=p_next))
    return nodes


class StaticTree(TreeMethod):
    """A fixed tree shape; each node's children are the draft's top-k tokens."""

    name = "tree"

    def __init__(self, preset: str = "eagle-25") -> None:
        if preset not in STATIC_TREES:
            raise SpecUIError(f"unknown tree preset '{preset}'; choose one of: {', '.join(STATIC_TREES)}")
        self.preset = preset
        self.shape = TokenTree.from_paths(STATIC_TREES[preset])
        self.plans: dict[int, tuple] = {}  # depth -> the device step's layout (plan_static_tree), made once

    def step(self, ctx: DecodeContext) -> StepResult:
        """Greedy, where reads wait (a GPU): the whole step queued, then one read (tree_device.py)."""
        assert ctx.draft is not None
        if not (ctx.sampling.greedy and ctx.draft.feeds_device_tokens and ctx.target.feeds_device_tokens):
            return super().step(ctx)
        depth = min(max(0, ctx.remaining - 1), max(self.shape.depths, default=0))
        if depth not in self.plans:
            self.plans[depth] = plan_static_tree(self.shape, depth)
        skeleton, ranks, starts = self.plans[depth]
        if not len(skeleton) or len(skeleton) > ctx.room:
            return super().step(ctx)
        with ctx.draft.feeding_device_tokens(ctx.ids), ctx.target.feeding_device_tokens(ctx.ids):
            with ctx.timer.phase("draft", sync=False):  # no sync between the phases: one read, in TreeStats
                tokens, q = draft_static_tree_on_device(ctx, skeleton, ranks, starts)
            with ctx.timer.phase("verify", sync=False):
                stats = TreeStats(skeleton, tokens, q, ctx.target.forward_tree(ctx.ids, skeleton, pending=tokens))
        verdict = verify_tree(stats.tree, stats.p_shown.rows, ctx.sampling, None, None, stats.best)
        return self.committed(ctx, stats.tree, DraftedTree.whole(stats.tree), verdict, stats.p_shown, [])

    def draft_tree(self, ctx: DecodeContext, max_depth: int) -> DraftedTree:
        shape, draft, cfg = self.shape, ctx.draft, ctx.sampling
        shape_depths = shape.depths
        tree = TokenTree()
        where: dict[int, int] = {-1: -1}  # shape node -> tree node
        rows = {-1: draft_probs(draft.forward_tree(ctx.ids, tree)[0], cfg)}
        for depth in range(1, min(max_depth, max(shape_depths)) + 1):
            start = len(tree)
            for s_parent in sorted({shape.parents[i] for i in range(len(shape)) if shape_depths[i] == depth}):
                if s_parent not in where:
                    continue
                kids = shape.children(s_parent)
                for s_kid, (q_tok, tok) in zip(kids, top_tokens(rows[where[s_parent]], len(kids))):
                    where[s_kid] = tree.add(tok, where[s_parent], q_tok)
            if len(tree) == start or depth == min(max_depth, max(shape_depths)):
                break
            new_rows = draft_probs(draft.extend_tree(tree, start), cfg)  # the layer's rows at once
            for k, i in enumerate(range(start, len(tree))):
                rows[i] = new_rows[k]
        return DraftedTree.whole(tree)


class OptTree(TreeMethod):
    """OPT-Tree (DESIGN 3.6): grow layer by layer keeping the n best nodes by p^; stop when
    E(A) grows by less than delta; mu = t_draft_step / t_target_step measured at start-up,
    delta defaults to max(mu, 0.05), capped at 1 (inside [mu, 1]). With `adaptive_nodes`,
    n is re-chosen after every step from the cost profile and the tree just drafted, up to
    `nodes` (tree_budget.NodeBudget); without a profile it stays `nodes`."""

    name = "opt-tree"

    def __init__(self, nodes: int = 25, delta: float | None = None, max_depth: int = 12,
                 adaptive_nodes: bool = False) -> None:
        self.notes: list[str] = []
        if nodes < 1:
            self.notes.append(f"node budget {nodes} raised to 1")
            nodes = 1
        self.nodes, self.delta, self.max_depth = nodes, delta, max(1, max_depth)
        self.delta_given = delta is not None
        self.mu: float | None = None
        self.budget = NodeBudget(cap=nodes) if adaptive_nodes else None
        self.needs_profile = adaptive_nodes  # the engine measures (or reads) it before the first step
        self.grown: TokenTree | None = None  # the last step's tree as the draft grew it

    def begin(self, ctx: DecodeContext) -> None:
        super().begin(ctx)
        room = ctx.room
        if self.nodes > room:
            self.notes.append(f"node budget {self.nodes} cut to {room}: context window")
            self.nodes = max(1, room)
        if self.budget:
            profile = self._profile(ctx)
            if profile is not None and profile.has_draft:
                self.budget.cap = min(self.budget.cap, max(1, room))  # nodes may start below the cap (auto's probes)
            else:
                self.notes.append(f"node budget fixed at {self.nodes}: no cost profile of this pair to choose it from")
                self.budget = None
        self.notes.append(f"delta = {self.delta:.3f} (given)" if self.delta_given else self.set_delta(ctx))

    @staticmethod
    def _profile(ctx: DecodeContext):
        return ctx.costs.profile if ctx.costs is not None else None

    def set_delta(self, ctx: DecodeContext) -> str:
        """delta = max(mu, 0.05) for the current budget (mu from the profile, else timed now);
        returns the note that says so."""
        profile = self._profile(ctx)
        mu = profile.mu(self.nodes) if profile is not None else None
        source = "cost profile"
        if mu is None:  # no profile measured yet: time one layer of each now
            mu, source = measure_mu(ctx.target, ctx.draft, ctx.ids, self.nodes), "measured"
        self.mu = mu
        self.delta = min(1.0, max(self.mu, 0.05))
        return f"mu = t_draft / t_target = {self.mu:.3f} ({source}); delta = {self.delta:.3f}"

    def annotate(self, ctx: DecodeContext, result: StepResult) -> StepResult:
        """With an adaptive budget: the next step's n from what this one drafted and accepted."""
        if self.budget is None or self.grown is None or result.expected_accept is None:
            return result
        self.budget.observe(result.expected_accept, result.accepted)
        grown, self.grown = self.grown, None
        new, note = self.budget.next(grown.p_hat, grown.depths, self._profile(ctx), len(ctx.ids), self.nodes)
        if note:
            self.nodes = new
            result.notes.append(note)
            if not self.delta_given:
                result.notes.append(self.set_delta(ctx))  # mu depends on the tree's width
        return result

    def pending_notes(self) -> list[str]:
        out, self.notes = self.notes, []
        return out

    def draft_tree(self, ctx: DecodeContext, max_depth: int) -> DraftedTree:
        draft, cfg, n = ctx.draft, ctx.sampling, self.nodes
        tree = TokenTree()
        q = draft_probs(draft.forward_tree(ctx.ids, tree)[0], cfg)
        candidates = [(v, tok, -1, v) for v, tok in top_tokens(q, n)]  # (p^, token, parent, q)
        best = 1.0
        for depth in range(1, min(max_depth, self.max_depth) + 1):
            start = len(tree)
            for _, tok, parent, q_tok in sorted(candidates, key=lambda c: -c[0])[:n]:
                tree.add(tok, parent, q_tok)
            chosen = select_top_nodes(tree.p_hat, n)
            gain = expected_accept(tree.p_hat, chosen) - best
            best += gain
            chosen_set = set(chosen)
            keep = [i for i in range(start, len(tree)) if i in chosen_set]
            tree = tree.subtree(list(range(start)) + keep)  # unchosen new nodes can never return
            if gain < self.delta or depth == min(max_depth, self.max_depth) or not keep:
                break
            if next_layer_bound(tree.p_hat, range(start, len(tree)), n) < self.delta:
                break  # the next layer cannot pass delta: spare its draft forward
            tops = top_tokens_rows(draft_probs(draft.extend_tree(tree, start), cfg), n)
            candidates = [(tree.p_hat[node] * v, tok, node, v)
                          for node, top in zip(range(start, len(tree)), tops) for v, tok in top]
        chosen = select_top_nodes(tree.p_hat, n)
        self.grown = tree
        return DraftedTree(tree.subtree(chosen), tree, chosen, expected_accept(tree.p_hat, chosen))


def next_layer_bound(p_hat: list[float], newest: range, n: int) -> float:
    """The most E(A) can gain from children of the `newest` nodes: a node's children's p^ sum
    to at most its own, and once the tree holds n nodes a child enters OPT-Tree's selection
    only by displacing one whose p^ is at least the n-th largest (ties keep the earlier)."""
    floor = sorted(p_hat, reverse=True)[n - 1] if len(p_hat) >= n else 0.0
    return sum(max(0.0, p_hat[i] - floor) for i in newest)


def measure_mu(target: ModelSession, draft: ModelSession, ids: list[int], n: int) -> float:
    """t_draft_step / t_target_step: one draft layer forward vs one target tree forward,
    both over n nodes, timed after a warm-up; caches are left as they were."""
    star = TokenTree(tokens=[ids[-1]] * n, parents=[-1] * n)

    def timed(session: ModelSession) -> float:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            session.forward_tree(ids, star)
            if session.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
            session.commit_path(star, [])
        return best

    return timed(draft) / max(1e-9, timed(target))
