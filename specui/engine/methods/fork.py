"""The pieces of MCSD's improved mode (DESIGN.md 3.5; seed 001): the fork-shaped tree of W
chains, its ancestor mask built once and sliced, drafting the chains layer by layer with the
decision models' early stop, and the seed's approximate root selection.

Layout: depth-major. Node d * W + w is chain w's token at layer d (layer 0 = the first
layer of the fork), so the fork of any depth is the top-left block of the largest one's mask
and a fork of fewer chains is a gather of its rows and columns: no mask is rebuilt per step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specui.engine.method import DecodeContext
from specui.engine.methods.speculative import accept_chain
from specui.engine.methods.tree import draft_probs, top_tokens
from specui.engine.sampling import SamplingConfig, argmax_tokens
from specui.engine.tree import TokenTree
from specui.heads.decision import DecisionModel


class ForkMask:
    """The ancestor mask of the largest fork (W chains, L layers), built once; `builds`
    counts how often that happened (a test holds it at 1 per generation)."""

    def __init__(self, width: int, layers: int) -> None:
        self.width, self.layers, self.builds = width, layers, 0
        self.full = self._build()

    def _build(self) -> torch.Tensor:
        self.builds += 1
        idx = torch.arange(self.width * self.layers)
        chain, layer = idx % self.width, idx // self.width
        return (chain[:, None] == chain[None, :]) & (layer[None, :] <= layer[:, None])

    def slice(self, width: int, n: int) -> torch.Tensor:
        """The mask of the first n nodes of a fork of `width` <= W chains (same layout)."""
        if width == self.width:
            return self.full[:n, :n]
        layers = math.ceil(n / width)
        idx = torch.tensor([d * self.width + w for d in range(layers) for w in range(width)], dtype=torch.long)[:n]
        return self.full[idx][:, idx]


@dataclass
class Fork:
    """A drafted fork: the tree (roots first when the target gave them), the q~ each node's
    child(ren) were drawn from (node -1: the first layer under the committed context), each
    candidate's predicted acceptance, and why drafting stopped."""

    tree: TokenTree
    width: int
    q_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    accept: dict[int, float] = field(default_factory=dict)  # node -> predicted P(accepted | its prefix accepted)
    survive: dict[int, float] = field(default_factory=dict)  # node -> product of `accept` down its chain
    layers: int = 0  # draft layers (a chain's length)
    stop_reason: str = ""
    stop_value: float | None = None  # the best chain's predicted acceptance where the decision stopped

    def risk(self, node: int) -> float | None:
        """1 - the predicted acceptance of the chain down to `node` (None: not predicted)."""
        return None if node not in self.survive else 1.0 - self.survive[node]


class ForkDrafter:
    """Grows W chains with the draft, one draft forward per layer, over the sliced mask.

    `decision` (optional) predicts each new candidate's acceptance a from the draft's state
    that drew it; a chain's predicted acceptance is the product of a down the chain (the
    probability the target accepts the whole sequence). Drafting stops after a layer where
    every chain's is below `threshold` (the layer is kept: it cost nothing to draw)."""

    def __init__(self, mask: ForkMask, decision: DecisionModel | None, threshold: float) -> None:
        self.mask, self.decision, self.threshold = mask, decision, threshold

    def grow(self, ctx: DecodeContext, fork: Fork, rows: torch.Tensor, hidden: torch.Tensor | None,
             tips: list[int], layers: int) -> Fork:
        """rows (len(tips), V): the draft's logits under each tip (tip -1: the committed
        context, whose one row yields all W first candidates); `hidden` their hidden states."""
        draft, cfg, tree = ctx.draft, ctx.sampling, fork.tree
        for layer in range(1, layers + 1):
            start = len(tree)
            if tips == [-1]:  # W candidates of the first layer, all drawn from the context's q~
                q = draft_probs(rows[0], cfg)
                fork.q_rows[-1] = q
                for q_tok, tok in first_layer(q, fork.width, cfg, ctx.generator):
                    tree.add(tok, -1, q_tok)
                preds = self._predict(hidden, rows, len(tree) - start)
            else:
                for w, tip in enumerate(tips):
                    q = draft_probs(rows[w], cfg)
                    fork.q_rows[tip] = q
                    tok = (argmax_tokens(rows[w])[0] if cfg.greedy
                           else int(torch.multinomial(q, 1, generator=ctx.generator)))
                    tree.add(tok, tip, float(q[tok]))
                preds = self._predict(hidden, rows, len(tips))
            fork.width = len(tree) - start
            fork.layers = layer
            if preds is not None:
                chains = []
                for node, a in zip(range(start, len(tree)), preds):
                    parent = tree.parents[node]
                    fork.accept[node] = a
                    fork.survive[node] = a * fork.survive.get(parent, 1.0)
                    chains.append(fork.survive[node])
                if max(chains) < self.threshold:
                    fork.stop_reason, fork.stop_value = "decision", max(chains)
                    return fork
            if layer == layers:
                fork.stop_reason = "depth"
                return fork
            rows, hidden = tree_forward(draft, self.decision is not None, draft.extend_tree, tree, start,
                                        self.mask.slice(fork.width, len(tree)))
            tips = list(range(start, len(tree)))
        fork.stop_reason = "depth"
        return fork

    def _predict(self, hidden: torch.Tensor | None, rows: torch.Tensor, count: int) -> list[float] | None:
        if self.decision is None or hidden is None:
            return None
        preds = self.decision.predict(hidden, rows)
        return preds * count if len(preds) == 1 and count > 1 else preds


def tree_forward(session, want_hidden: bool, forward, *args) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward(*args)` (a session's forward_tree / extend_tree), and when asked the hidden
    states its output layer read for the rows it returned."""
    return session.with_hidden(forward, *args) if want_hidden else (forward(*args), None)


def first_layer(q: torch.Tensor, width: int, cfg: SamplingConfig,
                generator: torch.Generator) -> list[tuple[float, int]]:
    """(q~, token) of the W first candidates under the context: the draft's top-W distinct
    tokens when greedy (W copies of one argmax would be one chain), W i.i.d. draws from q~
    otherwise (duplicates allowed: multi-candidate verification handles them)."""
    if cfg.greedy:
        return top_tokens(q, width)
    draws = torch.multinomial(q.float(), width, replacement=True, generator=generator).tolist()
    return [(float(q[t]), t) for t in draws]


@dataclass
class ChainCheck:
    root: int
    path: list[int]  # the root, then its accepted chain nodes
    end: torch.Tensor  # the target's distribution for the token after the path (residual after a rejection)
    rejected: int | None  # the chain node turned down, if any


def check_chains(tree: TokenTree, roots: list[int], p: torch.Tensor, q_rows: dict[int, torch.Tensor],
                 generator: torch.Generator | None) -> list[ChainCheck]:
    """Speculative verification of the chain under each target-sampled root, each with its
    own draws (p: warped target rows, row 1 + i after node i)."""
    kids: dict[int, int] = {parent: i for i, parent in enumerate(tree.parents) if parent >= 0}
    out = []
    for root in roots:
        chain = [root]
        while chain[-1] in kids:
            chain.append(kids[chain[-1]])
        drafts = [tree.tokens[c] for c in chain[1:]]
        accepted, end = accept_chain(drafts, [q_rows[c] for c in chain[:-1]], [p[c + 1] for c in chain], generator)
        rejected = chain[1 + accepted] if accepted < len(drafts) else None
        out.append(ChainCheck(root, chain[: 1 + accepted], end, rejected))
    return out
