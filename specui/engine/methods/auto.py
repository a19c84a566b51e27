"""`auto`: choose, step by step, the decoding that gives the most tokens per millisecond.

Candidates: autoregressive (one target forward, cost t(1)) and speculative chains of
length g = 1..G. With per-token acceptance alpha (engine-owned running estimate), a chain
of g drafts commits E = (1 - alpha^(g+1)) / (1 - alpha) tokens for g * t_draft + t(g+1) ms
(t from the measured cost profile, corrected by running ratios of measured to predicted
step time, unless `calibrate` is off). The best rate wins; speculation must beat autoregressive by `margin`, so when
drafting does not pay the draft stays idle and auto decodes autoregressively. After
`probe_every` autoregressive steps a gamma-1 chain probes whether the draft agrees again; the
wait doubles while probes fail (up to 8x) and, kept in EngineCosts.chains, carries over to
the next reply.

With `confidence` set (default 0.4), a chain the profile chose may run past its length g and
ends after the first token the draft itself gave less than that probability (as transformers'
assisted generation does): long where the draft is sure, short where it is not, but not shorter
than the drafts that pay even after an unsure one (chain_rate.stop_floor: late in the chain, or
all g, where verifying is flat and a draft cheap). How far past g
is the profile's choice too (`extended`): the length of the best expected rate when the drafts
past g are accepted at the rate measured for such drafts (EngineCosts.sure, never below alpha): up
to G where verification is flat, g where it grows steeply (unbounded, such chains ran at 0.91x
autoregressive on such a CPU). The stop depends on the draft alone: verification stays lossless.

With `lookup` (default on) the conversation's own continuation is a candidate too, weighed each
step against the chains and plain decoding by its measured rightness (auto_lookup.py): where a
reply copies its prompt one such step commits many tokens for one target forward, no draft.

With a node budget (`nodes`, the UI's and CLI's; `trees=False` turns it off) OPT-Tree with an
adaptive budget is a candidate too. A tree's yield cannot be predicted from alpha alone, so
it is measured: when an optimistic bound (two candidates per depth, accepted with
1 - (1 - alpha)^2, at the profile's cost of drafting and verifying such a tree) says a tree
could beat the chains or plain decoding, auto runs a burst of PROBE_BURST tree steps and keeps
trees while their committed tokens per (calibrated) predicted ms stay ahead of plain decoding and
of what the profile's chains committed, measured alike (EngineCosts.chains.yield_), with one
chain step every `probe_every` tree steps to keep alpha fresh. The first probe on a pair comes
after PROBE_BURST steps, once 4 chains have run (or plain decoding leads). A tree that loses waits twice
as long for its next probe (up to 16 x probe_every), and until then the bound is scaled by how
far that probe fell short of it, so a probe is only repeated early where alpha or the costs
have moved enough to make up for it. The verdict (and the steps since the last tree) is the
engine's (EngineCosts.trees), so it carries over to the next reply as alpha does.
Each step is one lossless step of its sub-method: the reply is the target's greedy reply,
and sampling stays distributed as the target."""

from __future__ import annotations

import time

from specui.engine.costs import ChainProbes, EngineCosts, StepYield, TreeVerdict
from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.methods.auto_lookup import LookupChoice
from specui.engine.methods.autoregressive import Autoregressive
from specui.engine.methods.chain_rate import (
    HORIZON,
    catch_up,
    catch_up_per_token,
    chain_ms,
    chain_tokens,
    extended_length,
    stop_floor,
    unread,
)
from specui.engine.methods.speculative import Speculative
from specui.engine.methods.tree import OptTree
from specui.engine.methods.tree_budget import optimistic_rate, step_ms
from specui.errors import SpecUIError

AR = "autoregressive"
TREE = -1  # choose(): an OPT-Tree step
LOOKUP = -2  # choose(): a prompt-lookup step (auto_lookup.py)
PROBE_BURST = 4  # tree steps a probe runs before trees are judged
CHAIN_EVIDENCE = 2.9  # the decayed count of 4 chain steps: below it trees are judged against alpha's prediction


class Auto(Method):
    name = "auto"
    uses_draft = True
    draft_optional = True
    needs_profile = True

    def __init__(self, max_gamma: int = 6, margin: float = 0.05, probe_every: int = 16,
                 gamma: int = 2, calibrate: bool = True, confidence: float | None = 0.4,
                 nodes: int = 25, trees: bool = True, lookup: bool = True, lookup_tokens: int = 10) -> None:
        if max_gamma < 1:
            raise SpecUIError(f"max_gamma must be >= 1, got {max_gamma}")
        if gamma < 1:
            raise SpecUIError(f"gamma (the fixed default used without a cost profile) must be >= 1, got {gamma}")
        self.max_gamma = max_gamma
        self.margin = margin
        self.probe_every = probe_every
        self.fallback_gamma = gamma  # the user's gamma: used where no profile could be measured
        self.calibrate = calibrate  # correct the profile by the step times measured here
        # drafting also stops after a token the draft gave less than this (then chains run up
        # to max_gamma and end where the draft grows unsure; None: exactly the chosen gamma)
        self.confidence = confidence
        self.ar = Autoregressive()
        self.chains: dict[int, Speculative] = {}
        self.since_ar = 0  # speculative steps since the last autoregressive one
        # autoregressive steps since the last chain, and between chain probes (doubling while
        # probes fail): the engine's (EngineCosts.chains) once begin() sees it, kept across replies
        self.probes = ChainProbes()
        self.pending: list[str] = []  # notes for the first step
        # OPT-Tree (adaptive budget, at most `nodes`) as a candidate; its yield is measured in bursts
        self.tree = OptTree(nodes=nodes, adaptive_nodes=True) if trees and nodes >= 2 else None
        self.tree_begun = False
        # the verdict on trees (yield, ahead or not, wait between probes) lives in the engine's
        # costs (EngineCosts.trees), kept across replies; these count steps within this reply
        self.verdict = TreeVerdict()  # the engine's (EngineCosts.trees) once begin() sees it
        self.tree_run = 0  # tree steps since the last other step
        self.burst = 0  # tree steps left in the current probe
        self.lookup = LookupChoice(tokens=lookup_tokens) if lookup else None  # the conversation's continuation

    def wants_profile(self, has_draft: bool) -> bool:
        return has_draft or self.lookup is not None  # without a draft: lookup steps against plain ones

    def begin(self, ctx: DecodeContext) -> None:
        ctx.target.prefill(ctx.ids)  # the draft catches up only when a chain runs (its advance feeds what it lacks)
        costs = ctx.costs
        if costs is not None:
            self.probes, self.verdict = costs.chains, costs.trees
            if self.lookup is not None:
                self.lookup.share(costs)
        if ctx.draft is None:
            looks = self.lookup and costs is not None and costs.profile is not None
            self.pending.append("no draft model loaded: auto decodes autoregressively" + (
                ", and verifies the conversation's own continuation where that pays" if looks else ""))
        elif costs is None or costs.profile is None:
            why = costs.note if costs is not None and costs.note else "no cost profile"
            self.pending.append(f"{why}: auto uses the fixed default, speculative gamma {self.fallback_gamma}")
        else:
            self.pending.append(costs.note)

    # -- choosing --------------------------------------------------------------------------
    def rates(self, costs: EngineCosts, context: int, behind: int = 0, room: float = HORIZON) -> dict[int, float]:
        """Expected tokens per ms for gamma = 0 (autoregressive) .. max_gamma; a chain also pays
        its share of catching the draft up on `behind` unread tokens (a long prompt)."""
        profile = costs.profile
        assert profile is not None
        alpha = min(costs.acceptance.alpha, 0.999)
        rates = {0: 1.0 / (chain_ms(profile, 0, context) * costs.ratio(AR).value)}
        if profile.draft(1, context) is not None:  # None without a draft
            spec = costs.ratio("speculative")  # until a chain is timed, the profile is off as for AR
            r = spec.value if spec.seen else costs.ratio(AR).value
            share = catch_up_per_token(profile, behind, 1, room, r)
            for g in range(1, self.max_gamma + 1):
                tokens = chain_tokens(alpha, g)
                rates[g] = tokens / (chain_ms(profile, g, context) * r + tokens * share)
        return rates

    def extended(self, costs: EngineCosts, context: int, gamma: int, limit: int) -> int:
        """chain_rate.extended_length: how far past `gamma` a chain may run while the draft is sure."""
        return extended_length(costs.profile, costs.acceptance.alpha, costs.sure.alpha, context, gamma, limit)

    def floor(self, costs: EngineCosts, context: int, chosen: int) -> int:
        """The first draft of a chain the profile chose at `chosen` that may end it where the draft is unsure."""
        profile, alpha = costs.profile, min(costs.acceptance.alpha, 0.999)
        rate = chain_tokens(alpha, chosen) / chain_ms(profile, chosen, context)
        return stop_floor(alpha, costs.unsure.alpha, profile.draft(1, context) or 0.0,
                          lambda k: profile.target(k, context), chosen, rate)

    def choose(self, ctx: DecodeContext) -> tuple[int, str]:
        """(gamma, why); gamma 0 = autoregressive, TREE = an OPT-Tree step, LOOKUP a prompt-lookup one."""
        costs = ctx.costs
        if costs is None or costs.profile is None:
            return (self.fallback_gamma, "fixed default (no profile)") if ctx.draft else (0, "no draft")
        behind = unread(ctx) if ctx.draft else 0
        rates = self.rates(costs, len(ctx.ids), behind, ctx.remaining)
        ratio = self.time_ratio(costs, "opt-tree")
        tree_rate = costs.trees.yield_.rate(ratio) if self.tree and costs.trees.win else None
        others = max(max(rates.values()), tree_rate or 0.0)  # a lookup step never cuts into a tree probe
        lookup_why = self.lookup.choice(ctx, others, self.margin) if self.lookup and not self.burst else None
        if lookup_why:
            return LOOKUP, lookup_why
        if ctx.draft is None:
            return 0, "no draft"
        best = max((g for g in rates if g > 0), key=lambda g: rates[g], default=0)
        alpha = costs.acceptance.alpha
        # the draft would not first have to read a long prompt (no probe of chains or trees then)
        caught_up = behind <= 2 or (costs.profile.draft(behind) or 0.0) <= costs.profile.target(1, len(ctx.ids))
        measured = costs.chains.yield_.rate(self.time_ratio(costs, "speculative"), least=CHAIN_EVIDENCE)
        against = max(rates[0], measured) if measured is not None else max(rates.values())
        ready = measured is not None or against == rates[0]  # a probe's trees are judged against measured rates
        tree_why = self.tree_choice(costs, len(ctx.ids), against, caught_up and ready, ctx.remaining)
        if tree_why:
            return TREE, tree_why
        if costs.trees.win and self.tree_run:  # between runs of trees: a chain refreshes alpha
            return max(best, 1), f"probe: alpha {alpha:.2f}, a chain between OPT-Tree runs"
        if best and rates[best] > rates[0] * (1.0 + self.margin):
            if self.calibrate and (not costs.ratio(AR).seen or self.since_ar >= self.probe_every):
                # plain decoding timed in this loop, not from the profile: an over-estimated t(1) kept auto speculating
                return 0, f"probe: timing autoregressive ({rates[best] / rates[0]:.2f}x expected from speculation)"
            why = f"alpha {alpha:.2f}: {rates[best] / rates[0]:.2f}x autoregressive expected"
            self.probes.gap = None
            return best, why
        # a probe refreshes alpha; not while the draft would first have to read a long prompt
        gap = self.probes.gap or self.probe_every
        if best and self.probes.since >= gap and caught_up:
            self.probes.gap = min(8 * self.probe_every, 2 * gap)  # reset when speculation wins again
            return 1, f"probe: alpha {alpha:.2f}, speculation not expected to pay"
        return 0, f"alpha {alpha:.2f}: speculation not expected to pay ({rates[best] / rates[0]:.2f}x)"

    def time_ratio(self, costs: EngineCosts, kind: str) -> float:
        """Measured / predicted step time for trees or chains (until one ran: as for chains, else AR)."""
        if not self.calibrate:
            return 1.0
        for k in (kind, "speculative", AR):
            if costs.ratio(k).seen:
                return costs.ratio(k).value
        return 1.0

    def tree_bound(self, costs: EngineCosts, context: int, remaining: int = 1 << 30) -> tuple[float, int]:
        """tree_budget.optimistic_rate for this tree's budget and the running alpha."""
        assert self.tree is not None and costs.profile is not None
        cap = self.tree.budget.cap if self.tree.budget else self.tree.nodes
        return optimistic_rate(costs.profile, costs.acceptance.alpha, cap, min(self.tree.max_depth, remaining - 1),
                               context, self.time_ratio(costs, "opt-tree"))

    def tree_choice(self, costs: EngineCosts, context: int, others: float, may_probe: bool = True,
                    remaining: int = 1 << 30) -> str | None:
        """Why this step is an OPT-Tree step, or None; `others`: the best rate of chains and plain decoding
        (tokens per ms); no new probe where `may_probe` is False (a long prompt the draft would first read)."""
        if self.tree is None or not costs.profile.has_draft:
            return None
        verdict = self.verdict = costs.trees
        if self.burst > 0:
            self.burst -= 1
            return f"probe: OPT-Tree step {PROBE_BURST - self.burst} of {PROBE_BURST}"
        rate = verdict.yield_.rate(self.time_ratio(costs, "opt-tree"))
        longest = 16 * self.probe_every
        if self.tree_run:  # judge what the trees just did
            # kept while not behind by the margin (one poor step flipped trees kept at 1.4x), taken when ahead by it
            verdict.win = rate is not None and rate > others * (1.0 + (-self.margin if verdict.win else self.margin))
            if not verdict.win and self.tree_run >= PROBE_BURST:
                verdict.gap = min(longest, 2 * (verdict.gap or self.probe_every))
                if rate is not None and verdict.probe_bound > 0:  # how optimistic the bound was
                    verdict.shortfall = min(1.0, rate / verdict.probe_bound)
        if verdict.win and rate is not None:
            verdict.gap, verdict.shortfall = self.probe_every, 1.0
            if self.tree_run < self.probe_every:
                return f"OPT-Tree: {rate / others:.2f}x the best chain or plain decoding (measured)"
            return None  # one chain step now and then keeps alpha fresh
        first = PROBE_BURST if verdict.probe_bound == 0 else self.probe_every  # never tried: once alpha is measured
        if verdict.since >= (verdict.gap or first) and may_probe:
            bound, nodes = self.tree_bound(costs, context, remaining)
            # scaled by how far the last lost probe fell short (until alpha or the costs make up, or the longest wait)
            if bound * (1.0 if verdict.since >= longest else verdict.shortfall) > others * (1.0 + self.margin):
                if self.tree.budget is not None:  # the probe starts at the bound's size, not the cap (25 nodes
                    self.tree.nodes = nodes  # cost 489 ms at the 1.7b stand-in where 8 cost 130); the budget adapts
                self.burst = PROBE_BURST - 1
                verdict.yield_ = StepYield()  # judged on this burst, not on trees long past
                verdict.probe_bound = bound
                return f"probe: OPT-Tree step 1 of {PROBE_BURST} (up to {bound / others:.2f}x expected)"
        return None

    def count_step(self, tree: bool) -> None:
        """Steps since the last tree step, tree steps since the last other one."""
        self.verdict.since, self.tree_run = (0, self.tree_run + 1) if tree else (self.verdict.since + 1, 0)

    # -- stepping --------------------------------------------------------------------------
    def step(self, ctx: DecodeContext) -> StepResult:
        result = self.chosen_step(ctx)
        if self.lookup is not None:  # what this step's lookup proposal would have yielded
            self.lookup.observe(result.tokens)
        return result

    def chosen_step(self, ctx: DecodeContext) -> StepResult:
        gamma, why = self.choose(ctx)
        gamma = min(gamma, max(0, ctx.remaining - 1), max(0, ctx.room))
        context = len(ctx.ids)
        if gamma == LOOKUP:
            return self.lookup_step(ctx, why)
        if gamma == TREE and min(ctx.remaining - 1, ctx.room) >= 1:
            return self.tree_step(ctx, why)
        if gamma == TREE:  # no room left for a tree: the last token(s) plainly
            gamma, why = 0, "end of the reply"
        self.count_step(tree=False)
        if gamma > 0:
            # the draft first reads what it has not (the prompt, tokens decoded without it), costed apart
            # (catch_up_per_token): timed in the step, one 47-token catch-up made chains look 30% dearer
            catch_up(ctx)
        t0 = time.perf_counter()
        if gamma == 0:
            result = self.ar.step(ctx)
            choice, kind = AR, AR
            self.probes.since += 1
            if ctx.costs is not None:
                ctx.costs.acceptance.relax()  # a dip's evidence fades while no chain runs
            self.since_ar = 0
        else:
            chosen = gamma
            if self.confidence is not None and why.startswith("alpha"):  # chosen by the profile (no probe)
                gamma = self.extended(ctx.costs, context, gamma,
                                      min(self.max_gamma, max(0, ctx.remaining - 1), max(0, ctx.room)))
                why += f"; up to {gamma} drafts while the draft is sure" if gamma > chosen else ""
            chain = self.chains.setdefault(gamma, Speculative(gamma, confidence=self.confidence))
            chain.floor = self.floor(ctx.costs, context, chosen) if why.startswith("alpha") else 0
            result = chain.step(ctx)
            choice, kind = f"speculative:{gamma}", "speculative"
            self.probes.since = 0
            self.since_ar += 1
            if ctx.costs is not None:
                ctx.costs.acceptance.observe(result.drafted, result.accepted)
                if why.startswith("alpha") or "between OPT-Tree runs" in why:  # the profile's choice, not a probe
                    predicted = chain_ms(ctx.costs.profile, result.drafted, context)
                    ctx.costs.chains.yield_.observe(len(result.tokens), predicted)
                if result.drafted > chosen and result.accepted >= chosen:  # drafts past the chosen length verified
                    ctx.costs.sure.observe(result.drafted - chosen, result.accepted - chosen)
                if max(chain.floor, 1) <= result.drafted < gamma and not ctx.eos_ids.intersection(result.tokens):
                    ctx.costs.unsure.observe(1, int(result.accepted >= result.drafted))  # ended on an unsure draft
        ms = (time.perf_counter() - t0) * 1000.0
        costs = ctx.costs
        calibrated = costs is not None and costs.profile is not None and (gamma == 0 or costs.profile.has_draft)
        if self.calibrate and calibrated:
            costs.ratio(kind).observe(ms, chain_ms(costs.profile, result.drafted if gamma else 0, context))
        return self.labelled(result, choice, why)

    def labelled(self, result: StepResult, choice: str, why: str) -> StepResult:
        """The step's result with auto's choice, its reason and any pending notes."""
        result.choice = choice
        result.notes = self.pending + [f"auto: {choice} ({why})"] + result.notes
        self.pending = []
        return result

    def lookup_step(self, ctx: DecodeContext, why: str) -> StepResult:
        # (not counted for trees: a run of them, or a probe's burst, is judged as if this step were not there)
        result = self.lookup.step(ctx, self.calibrate)
        self.probes.since += 1  # no chain ran: as after a plain step
        ctx.costs.acceptance.relax()
        self.since_ar += 1
        return self.labelled(result, f"lookup:{result.drafted}", why)

    def tree_step(self, ctx: DecodeContext, why: str) -> StepResult:
        assert self.tree is not None and ctx.costs is not None and ctx.costs.profile is not None
        if not self.tree_begun:  # the draft catches up on the prompt here, as a chain's first step would
            self.tree.begin(ctx)
            self.tree_begun = True
        nodes, context = self.tree.nodes, len(ctx.ids)
        catch_up(ctx)  # catching up on unread tokens is not the tree's step time
        if self.tree.budget is not None:  # a probe's trees may grow, not fall below its size (one unlucky step
            self.tree.budget.floor = nodes if why.startswith("probe") else 1  # cut 16 nodes to 1: AMX Xeon, bf16)
        t0 = time.perf_counter()
        result = self.tree.step(ctx)
        ms = (time.perf_counter() - t0) * 1000.0
        predicted = step_ms(ctx.costs.profile, result.tree_nodes or 0, result.tree_depth or 1, context)
        if self.calibrate:
            ctx.costs.ratio("opt-tree").observe(ms, predicted)
        ctx.costs.trees.yield_.observe(len(result.tokens), predicted)
        self.count_step(tree=True)
        self.probes.since = 0
        self.since_ar += 1
        return self.labelled(result, f"opt-tree:{nodes}", why)
