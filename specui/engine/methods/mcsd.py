"""MCSD: multi-candidate speculative decoding (DESIGN.md 3.5; Yang et al. and seed 001).

Baseline (`k_config`, e.g. 4,2,2,1,1): the draft samples k_i candidates i.i.d. from q~ under
every node at depth i, the target scores the whole tree in one forward (tree mask), and
multi-candidate verification walks it: at a node, p' = p~; each candidate c in drawing order
is accepted with min(1, p'(c) / q~(c)), else p' = res(p', q~); when all are rejected the
correction is drawn from p'. Lossless.

Forks (no k_config; the default): W chains of up to gamma draft tokens (the seed's fork-shaped
tree), over an ancestor mask built once and sliced (fork.py), with an optional early stop by
a decision model (`decision` hidden | entropy | none, `stop_threshold`).
- root_selection "lossless" (default): the fork hangs under the token the target itself drew
  at the last verified position (one honest sample of p~, committed by the previous step);
  the W chains' first candidates are drawn i.i.d. from q~ and verified as MCSD's multi-
  candidate set, each chain below as speculative decoding: lossless.
- root_selection "approximate" (the seed's; sampling only): W roots drawn i.i.d. from the
  target's distribution at the last verified position, a chain drafted under each, and the
  root whose chain is accepted longest is kept. Choosing the root by its chain's acceptance
  is NOT distribution-preserving (a test measures by how much).

Greedy (temperature 0): i.i.d. draws from a point mass would all be the same token, so the
children are the draft's top-k distinct tokens and the target's argmax picks among them (as
`tree` does); the reply equals autoregressive decoding in every mode."""

from __future__ import annotations

import torch

from specui.engine.method import DecodeContext, StepResult
from specui.engine.methods.fork import ChainCheck, Fork, ForkDrafter, ForkMask, check_chains, tree_forward
from specui.engine.methods.tree import DraftedTree, TreeMethod, draft_probs, expected_accept, top_tokens_rows
from specui.engine.sampling import read_entries, sample, shown_probs, warp
from specui.engine.trace import ACCEPTED, DROPPED, REJECTED, TARGET, UNVERIFIED, NodeTrace
from specui.engine.tree import TokenTree
from specui.errors import SpecUIError
from specui.heads.decision import DECISIONS


def parse_k_config(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
    except ValueError:
        ks = ()
    if not ks or any(k < 1 for k in ks) or len(ks) > 16:
        raise SpecUIError(f"k-config must be 1 to 16 positive integers separated by commas (e.g. 4,2,2,1,1), "
                          f"got {text!r}")
    nodes, width = 0, 1
    for k in ks:
        width *= k
        nodes += width
    if nodes > 512:
        raise SpecUIError(f"k-config {text!r} makes a tree of {nodes} nodes; keep it at most 512")
    return ks


ROOT_SELECTIONS = ("lossless", "approximate")


class MCSD(TreeMethod):
    name = "mcsd"

    def __init__(self, k_config: str = "", width: int = 4, gamma: int = 4, root_selection: str = "lossless",
                 decision: str = "entropy", stop_threshold: float = 0.4) -> None:
        self.ks = parse_k_config(k_config) if str(k_config or "").strip() else None  # None: forks
        if not 1 <= width <= 32:
            raise SpecUIError(f"mcsd width (chains per fork) must be 1 to 32, got {width}")
        if not 1 <= gamma <= 64:
            raise SpecUIError(f"mcsd gamma (chain length) must be 1 to 64, got {gamma}")
        if root_selection not in ROOT_SELECTIONS:
            raise SpecUIError(f"root selection must be one of {', '.join(ROOT_SELECTIONS)}, got {root_selection!r}")
        if decision not in DECISIONS:
            raise SpecUIError(f"decision must be one of {', '.join(DECISIONS)}, got {decision!r}")
        if not 0.0 < stop_threshold < 1.0:
            raise SpecUIError(f"stop threshold must be in (0, 1), got {stop_threshold}")
        self.width, self.gamma, self.root_selection = width, gamma, root_selection
        self.decision, self.stop_threshold = decision, stop_threshold
        self.iid_rows: dict[int, torch.Tensor] | None = None  # node -> q~ its children were drawn from
        self.mask: ForkMask | None = None
        self.drafter: ForkDrafter | None = None
        self.fork: Fork | None = None
        self.next_p: torch.Tensor | None = None  # approximate: the target's distribution the next roots come from
        self.notes: list[str] = []

    @property
    def approximate(self) -> bool:
        return self.ks is None and self.root_selection == "approximate"

    def begin(self, ctx: DecodeContext) -> None:
        super().begin(ctx)
        if self.ks is not None:
            return
        if self.approximate and ctx.sampling.greedy:
            self.root_selection = "lossless"
            self.notes.append("greedy: every target-sampled root is the argmax, so root selection is exact "
                              "(decoded as the lossless fork)")
        self.mask = ForkMask(self.width, self.gamma + self.approximate)  # + the layer of roots
        model = None
        if self.decision != "none":
            model = ctx.draft.decision_models.get(self.decision)
            if model is None:
                why = ctx.draft.decision_problem or f"the loaded decision models have no '{self.decision}' model"
                self.notes.append(f"mcsd runs without early stop (decision '{self.decision}'): {why}")
        self.drafter = ForkDrafter(self.mask, model, self.stop_threshold)
        if self.approximate:
            self.notes.append("root selection 'approximate' (the seed's): the root whose chain is accepted "
                              "longest is kept, which is not an exact sample of the target's distribution")

    def pending_notes(self) -> list[str]:
        out, self.notes = self.notes, []
        return out

    def step(self, ctx: DecodeContext) -> StepResult:
        if self.approximate:
            return self._approximate_step(ctx)
        # a step with no room to draft (the last token of the reply, or of the context) drafts no
        # fork: nothing of the previous step's may describe it
        self.fork, self.iid_rows = None, None
        return super().step(ctx)

    # -- drafting ------------------------------------------------------------------------
    def draft_tree(self, ctx: DecodeContext, max_depth: int) -> DraftedTree:
        if self.ks is None:
            return self._draft_fork(ctx, max_depth)
        draft, cfg = ctx.draft, ctx.sampling
        tree = TokenTree()
        logits = {-1: draft.forward_tree(ctx.ids, tree)[0]}
        self.iid_rows = None if cfg.greedy else {}
        depth_cap = min(max_depth, len(self.ks))
        parents = [-1]
        for depth in range(1, depth_cap + 1):
            start, k = len(tree), self.ks[depth - 1]
            tops = top_tokens_rows(draft_probs(torch.stack([logits[p] for p in parents]), cfg), k) \
                if cfg.greedy else None  # the layer's rows ranked at once
            for i, parent in enumerate(parents):
                if tops is not None:
                    for q_tok, tok in tops[i]:
                        tree.add(tok, parent, q_tok)
                else:
                    q = warp(logits[parent], cfg)
                    self.iid_rows[parent] = q
                    draws = torch.multinomial(q.float(), k, replacement=True, generator=ctx.generator).tolist()
                    for tok in draws:
                        tree.add(tok, parent, float(q[tok]))
            parents = list(range(start, len(tree)))
            if depth == depth_cap or not parents:
                break
            rows = draft.extend_tree(tree, start)
            for row, node in zip(rows, parents):
                logits[node] = row
        everything = list(range(len(tree)))
        return DraftedTree(tree, tree, everything, expected_accept(tree.p_hat, everything))

    def _draft_fork(self, ctx: DecodeContext, max_depth: int) -> DraftedTree:
        """W chains under the committed context (lossless mode)."""
        tree, draft = TokenTree(), ctx.draft
        rows, hidden = tree_forward(draft, self.drafter.decision is not None, draft.forward_tree, ctx.ids, tree,
                                    self.mask.slice(self.width, 0))
        fork = self.drafter.grow(ctx, Fork(tree, self.width), rows, hidden, [-1], min(max_depth, self.gamma))
        self.fork = fork
        self.iid_rows = None if ctx.sampling.greedy else fork.q_rows
        everything = list(range(len(tree)))
        return DraftedTree(tree, tree, everything, expected_accept(tree.p_hat, everything))

    def ancestors(self, tree: TokenTree) -> torch.Tensor | None:
        if self.ks is not None:
            return None
        return self.mask.slice(self.width if self.fork is None else self.fork.width, len(tree))  # no fork: empty

    def verify_rows(self) -> dict[int, torch.Tensor] | None:
        return self.iid_rows

    def annotate(self, ctx: DecodeContext, result: StepResult) -> StepResult:
        """Forks: each candidate's predicted acceptance, chains, the stop, and the target's
        token the fork hangs under drawn as its root (not on the first step: that is the
        prompt's last token)."""
        if self.ks is not None or self.fork is None:
            return result
        fork = self.fork
        for i, node in enumerate(result.nodes[: len(fork.tree)]):
            node.accept_pred, node.reject_pred = fork.accept.get(i), fork.risk(i)
        if ctx.generated > 0:
            for node in result.nodes:
                node.parent, node.depth = node.parent + 1, node.depth + 1
            result.nodes.insert(0, NodeTrace(token_id=ctx.ids[-1], text="", parent=-1, depth=1, status=TARGET))
        return self._fork_fields(result, fork)

    def _fork_fields(self, result: StepResult, fork: Fork) -> StepResult:
        result.chains, result.tree_depth = fork.width, fork.layers
        result.stop_reason, result.stop_value = fork.stop_reason, fork.stop_value
        result.threshold = self.stop_threshold if self.drafter.decision is not None else None
        return result

    # -- the seed's root selection (approximate) -------------------------------------------
    def _approximate_step(self, ctx: DecodeContext) -> StepResult:
        cfg, draft, width = ctx.sampling, ctx.draft, self.width
        notes = self.pending_notes()
        if self.next_p is None:  # the first step: the target's distribution after the prompt
            with ctx.timer.phase("verify"):
                self.next_p = warp(ctx.target.advance(ctx.ids, need=1)[-1], cfg)
            notes.append("a first target forward gives the distribution the first roots are drawn from")
        drawn_from = self.next_p
        layers = max(0, min(self.gamma, ctx.remaining - 1, ctx.room // width - 1))
        if ctx.room < width:  # the context window is full: one honest token, no fork
            self.next_p = None
            return StepResult(tokens=[sample(drawn_from, ctx.generator)], notes=notes + ["no room for a fork"])
        tree = TokenTree()
        for tok in torch.multinomial(drawn_from.float(), width, replacement=True, generator=ctx.generator).tolist():
            tree.add(tok, -1, 1.0)  # target-sampled: not a draft token
        fork = Fork(tree, width)
        with ctx.timer.phase("draft"):
            if layers:
                rows, hidden = tree_forward(draft, self.drafter.decision is not None, draft.forward_tree, ctx.ids,
                                            tree, self.mask.slice(width, width))
                fork = self.drafter.grow(ctx, fork, rows[1:], None if hidden is None else hidden[1:],
                                         list(range(width)), layers)
                fork.width = width
        with ctx.timer.phase("verify"):
            logits = ctx.target.forward_tree(ctx.ids, tree, self.mask.slice(width, len(tree)))
            p = warp(logits, cfg)
            checks = check_chains(tree, list(range(width)), p, fork.q_rows, ctx.generator)
        best = max(checks, key=lambda c: len(c.path))  # the first root on ties
        self.next_p = best.end
        ctx.target.commit_path(tree, best.path)
        if layers:
            draft.commit_path(tree, best.path)
        nodes = approximate_nodes(tree, best, fork, shown_probs(logits, p, cfg), drawn_from)
        return self._fork_fields(StepResult(
            tokens=[tree.tokens[i] for i in best.path], from_draft=[False] + [True] * (len(best.path) - 1),
            nodes=nodes, drafted=len(tree) - width, accepted=len(best.path) - 1, tree_nodes=len(tree),
            notes=notes,
        ), fork)


def approximate_nodes(tree: TokenTree, best: ChainCheck, fork: Fork, p_shown: torch.Tensor,
                      drawn_from: torch.Tensor) -> list[NodeTrace]:
    """Roots: the kept one "target", the others "dropped" with their chains; under the kept
    root: accepted..., rejected, unverified. No token follows: the next step's roots are
    drawn from where this path ends."""
    on_path = set(best.path)
    depths = tree.depths
    kids = [i for i, parent in enumerate(tree.parents) if parent >= 0]
    p_kids = dict(zip(kids, read_entries(p_shown, [tree.parents[i] + 1 for i in kids], [tree.tokens[i] for i in kids])))
    nodes = []
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
        root = tree.path(i)[0]
        if parent < 0:
            status, q, p = (TARGET if i == best.root else DROPPED), None, float(drawn_from[tok])
        else:
            status = (ACCEPTED if i in on_path else REJECTED if i == best.rejected
                      else UNVERIFIED if root == best.root else DROPPED)
            q, p = tree.q[i], p_kids[i]
        nodes.append(NodeTrace(token_id=tok, text="", parent=parent, depth=depths[i], status=status, q=q, p=p,
                               beam=root, accept_pred=fork.accept.get(i), reject_pred=fork.risk(i)))
    return nodes
