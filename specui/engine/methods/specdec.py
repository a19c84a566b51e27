"""SpecDec++ (DESIGN.md 3.4; seed 002): speculative decoding whose candidate length is chosen
on the fly. After each drafted token t the draft's acceptance head gives
a_t = P(t accepted | all before it accepted); drafting stops once the predicted probability
that at least one candidate is rejected, 1 - prod_{i<=t} a_i, exceeds the threshold H, at EOS,
or at gamma_max. Verification is `speculative`'s, so the method is lossless: the stop depends
on the draft alone.

The seed's head ("after") reads the hidden state the draft computes when it reads token t,
the same forward that gives q~ for token t + 1; so the chain costs one draft forward per
candidate, as a fixed chain does, plus one for the last candidate's a_t (kept in the draft's
cache when accepted). A "before" head reads the hidden state that gave q~ for token t (with
q~'s entropy, top probabilities and q~(t)) and decides before t is fed: no extra forward.

Without a usable head (missing, made for another draft, corrupt) the method decodes as
`speculative` with the fixed gamma and says so in the step's notes.

The threshold (unless given): the one this pair's measured costs favour. A head carries its
held-out greedy replay at each H (`threshold_replay`: discard rate D/N and verification rate
V/N, which depend on the draft, head and target but not on the hardware, as the seed notes), so
the time per committed token at each H is t_draft x (1 - V/N + D/N) + V/N x t_target(mean call
size) from the cost profile; the least wins. The head's own tuned H was chosen with the costs of
the machine and target it was trained beside (0.2 for the bundled int4 target on a 2-core EPYC);
at the 1.7b stand-in on w4a8 (2-core Xeon) the profile picked 0.6. Without a profile or a replay: the tuned H."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specui.engine import sampling
from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.methods.device_verify import verified_once
from specui.engine.methods.speculative import Speculative, chain_nodes, verify_chain
from specui.engine.sampling import SamplingConfig, drawn, greedy_tokens, scored, shown_probs
from specui.engine.session import ModelSession
from specui.errors import SpecUIError
from specui.heads.acceptance import AcceptanceHead

DEFAULT_THRESHOLD = 0.5  # used only when a head's config names no tuned threshold


def modelled_ms(row: dict, target_ms: Callable[[float], float], draft_ms: float) -> float:
    """Ms per committed token of a replay row (discard and verification rates per token)."""
    v, d = float(row["verification_rate"]), float(row["discard_rate"])
    drafted = 1.0 - v + d  # draft tokens (forwards) per committed token: accepted ones and discarded
    return draft_ms * drafted + v * target_ms(1.0 + drafted / v)


def threshold_for_costs(replay: list[dict], target_ms: Callable[[float], float],
                        draft_ms: float) -> tuple[float, float] | None:
    """The replay's threshold with the least modelled ms per committed token, and that ms; None
    for an empty or malformed replay."""
    try:
        rows = [(modelled_ms(r, target_ms, draft_ms), float(r["threshold"])) for r in replay
                if float(r["verification_rate"]) > 0]
    except (KeyError, TypeError, ValueError):
        return None
    if not rows:
        return None
    ms, threshold = min(rows)
    return threshold, ms


class DraftedChain:
    """The candidates of one step with the head's a_t and the running rejection risk
    1 - prod a_i after each (None for a last candidate whose a_t was not needed)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.q_rows: list[torch.Tensor] = []
        self.logit_rows: list[torch.Tensor] = []
        self.accept: list[float | None] = []
        self.risk: list[float | None] = []
        self.stop_reason = ""


def draft_adaptive(
    draft: ModelSession, head: AcceptanceHead, ids: list[int], threshold: float, gamma_max: int,
    cfg: SamplingConfig, generator: torch.Generator, eos_ids: frozenset[int],
) -> DraftedChain:
    if cfg.greedy and gamma_max > 1 and draft.feeds_device_tokens and draft.hidden_without_hooks:
        with draft.feeding_device_tokens(ids):
            return draft_adaptive_on_device(draft, head, ids, threshold, gamma_max, eos_ids)
    chain = DraftedChain()
    if gamma_max <= 0:
        chain.stop_reason = "no room"
        return chain
    before = head.reads == "before"
    out, hidden = draft.advance_with_hidden(ids, need=1)
    logits, keep = out[-1], 1.0

    def judge(h: torch.Tensor, row: torch.Tensor, token: int) -> bool:
        """Record a_t and the running risk; True when the risk passed the threshold."""
        nonlocal keep
        a = head.predict(h, row, token)
        keep *= a
        chain.accept[-1], chain.risk[-1] = a, 1.0 - keep
        return 1.0 - keep > threshold

    while True:
        q, token = drawn(logits, cfg, generator)
        chain.tokens.append(token)
        chain.q_rows.append(q)
        chain.logit_rows.append(logits)
        chain.accept.append(None)
        chain.risk.append(None)
        if token in eos_ids:
            chain.stop_reason = "eos"
            return chain
        if before and judge(hidden[-1], logits, token):  # decided before the candidate is fed
            chain.stop_reason = "threshold"
            return chain
        if len(chain.tokens) >= gamma_max:
            chain.stop_reason = "gamma_max"
            return chain
        out, hidden = draft.advance_with_hidden(ids + chain.tokens, need=1)
        if not before and judge(hidden[-1], logits, token):  # the seed's: after the draft read it
            chain.stop_reason = "threshold"
            return chain
        logits = out[-1]


DEVICE_CHUNK = 2  # candidates a chain on a device drafts between two reads


def draft_adaptive_on_device(draft: ModelSession, head: AcceptanceHead, ids: list[int], threshold: float,
                             gamma_max: int, eos_ids: frozenset[int]) -> DraftedChain:
    """`draft_adaptive`, greedy, where every read of the device waits for it (a GPU): each
    candidate's argmax and the head's a_t stay on the device, the argmax is fed straight back
    (`advance_token`), and DEVICE_CHUNK candidates are read at a time, so the chain waits once a
    chunk rather than twice a candidate; the stop rule then runs on what was read, in the same
    order as one candidate at a time (EOS, a "before" head's verdict, gamma_max, an "after"
    head's verdict), so the chain is the same. At most DEVICE_CHUNK - 1 candidates past the stop
    are drafted for nothing; their cache entries are cropped like any rejected draft's."""
    chain = DraftedChain()
    before = head.reads == "before"
    out, hidden = draft.advance_with_hidden(ids, need=1)
    logits, state = out[-1], hidden[-1]
    keep, drafted = 1.0, 0
    while True:
        chunk = []  # (raw logits row, argmax, a_t or None, fed)
        while len(chunk) < DEVICE_CHUNK and drafted < gamma_max:
            pick = logits.float().argmax()
            fed = drafted + 1 < gamma_max  # the last candidate is never fed (nor judged after)
            a = head.predict_on_device(state, logits, pick) if before else None
            row = logits
            if fed:
                out, hidden = draft.with_hidden(draft.advance_token, pick)
                logits, state = out[-1], hidden[-1]
                if not before:
                    a = head.predict_on_device(state, row, pick)
            chunk.append((row, pick, a, fed))
            drafted += 1
        judged = [a for _, _, a, _ in chunk if a is not None]
        read = torch.stack([p.to(torch.float64) for _, p, _, _ in chunk]
                           + [a.to(torch.float64).reshape(()) for a in judged]).tolist()  # the chunk's one read
        tokens, accepts = [int(t) for t in read[: len(chunk)]], iter(read[len(chunk):])
        draft.settle_tokens([t for t, (_, _, _, fed) in zip(tokens, chunk) if fed])
        for token, (row, _, a, _fed) in zip(tokens, chunk):
            chain.tokens.append(token)
            chain.q_rows.append(row.float())
            chain.logit_rows.append(row)
            accept = next(accepts) if a is not None else None
            chain.accept.append(None)
            chain.risk.append(None)
            if token in eos_ids:
                chain.stop_reason = "eos"
                return chain
            if accept is not None:
                keep *= accept
                chain.accept[-1], chain.risk[-1] = accept, 1.0 - keep
                if before and 1.0 - keep > threshold:
                    chain.stop_reason = "threshold"
                    return chain
            if len(chain.tokens) >= gamma_max:
                chain.stop_reason = "gamma_max"
                return chain
            if not before and accept is not None and 1.0 - keep > threshold:
                chain.stop_reason = "threshold"
                return chain


class SpecDecPP(Method):
    name = "specdec++"
    uses_draft = True

    def __init__(self, threshold: float | None = None, gamma_max: int = 16, gamma: int = 2) -> None:
        if threshold is not None and not 0.0 < threshold < 1.0:
            raise SpecUIError(f"threshold must be in (0, 1), got {threshold}")
        if gamma_max < 1:
            raise SpecUIError(f"gamma max must be >= 1, got {gamma_max}")
        self.threshold = threshold  # None: chosen from the cost profile, else the head's tuned one
        self.needs_profile = threshold is None  # the engine measures (or reads) it before the first step
        self.gamma_max = gamma_max
        self.fallback = Speculative(gamma=gamma)  # when no head can be used
        self._told = False
        self._chosen: float | None = None  # the last threshold chosen from the costs (said when it changes)

    def _threshold(self, ctx: DecodeContext, notes: list[str]) -> float:
        if self.threshold is not None:
            return self.threshold
        config = ctx.draft.head_config
        tuned = float(config.get("threshold", DEFAULT_THRESHOLD))
        profile = ctx.costs.profile if ctx.costs is not None else None
        replay = config.get("threshold_replay")
        context = len(ctx.ids)
        t_draft = profile.draft(1, context) if profile is not None else None
        if not replay or t_draft is None:
            return tuned

        def target(k: float) -> float:
            return profile.target(k, context)

        chosen = threshold_for_costs(replay, target, t_draft)
        if chosen is None:
            return tuned
        threshold, ms = chosen
        if threshold != self._chosen:
            self._chosen = threshold
            ar = target(1)
            at_tuned = next((modelled_ms(r, target, t_draft) for r in replay if float(r["threshold"]) == tuned), None)
            versus = "" if at_tuned is None or threshold == tuned else (
                f"; the head's tuned H = {tuned:g}: {ar / at_tuned:.2f}x")
            notes.append(f"specdec++ threshold H = {threshold:g}, chosen for this pair's measured costs (modelled "
                         f"{ar / ms:.2f}x autoregressive from the head's held-out replay{versus})")
        return threshold

    def step(self, ctx: DecodeContext) -> StepResult:
        assert ctx.draft is not None
        head = ctx.draft.acceptance_head
        if head is None:
            result = self.fallback.step(ctx)
            if not self._told:
                self._told = True
                result.notes.append(f"specdec++ runs as speculative with fixed gamma {self.fallback.gamma}: "
                                    f"{ctx.draft.head_problem}")
            return result
        cfg = ctx.sampling
        notes: list[str] = []
        threshold = self._threshold(ctx, notes)
        gamma_max = max(0, min(self.gamma_max, ctx.remaining - 1, ctx.room))
        with ctx.timer.phase("draft"):
            chain = draft_adaptive(ctx.draft, head, ctx.ids, threshold, gamma_max, cfg, ctx.generator,
                                   ctx.eos_ids)
        drafts = chain.tokens
        with ctx.timer.phase("verify"):
            if drafts and cfg.greedy and sampling.reads_wait(ctx.target.device):  # one read after the forward (a GPU)
                p_shown, q_shown = verified_once(ctx, drafts, torch.stack(chain.logit_rows)).shown(len(drafts))
                verdict = verify_chain(drafts, None, None, cfg, None, p_shown.best)
            else:
                q = torch.stack(chain.q_rows) if drafts else None
                p_logits = ctx.target.advance(ctx.ids + drafts, need=len(drafts) + 1)
                p, p_shown = scored(p_logits, cfg)
                best = greedy_tokens(p, p_shown) if cfg.greedy else None
                verdict = verify_chain(drafts, q, p, cfg, ctx.generator, best)
                q_shown = shown_probs(torch.stack(chain.logit_rows), q, cfg) if drafts else p_shown
        nodes = chain_nodes(drafts, verdict, q_shown, p_shown)
        for node, a, risk in zip(nodes, chain.accept, chain.risk):
            node.accept_pred, node.reject_pred = a, risk
        return StepResult(
            tokens=drafts[: verdict.accepted] + [verdict.next_token],
            from_draft=[True] * verdict.accepted + [False],
            nodes=nodes,
            drafted=len(drafts),
            accepted=verdict.accepted,
            gamma=len(drafts),
            threshold=threshold,
            stop_reason=chain.stop_reason,
            notes=notes,
        )
