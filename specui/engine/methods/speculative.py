"""Speculative decoding with a fixed candidate length (DESIGN.md 3.3; Leviathan et al.,
Chen et al.). Draft gamma tokens from q~, score them in one target forward, accept x_t with
probability min(1, p~(x_t) / q~(x_t)); at the first rejection sample from res(p~, q~); if
all pass, sample a bonus token from p~. Greedy: accept while the target's argmax agrees."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specui.engine.device_chain import greedy_chain_on_device, queue_greedy_chain
from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.methods.device_verify import ChainStats, through_eos, verified_once
from specui.engine.sampling import (
    SamplingConfig,
    argmax_tokens,
    drawn,
    greedy_tokens,
    read_entries,
    residual,
    sample,
    scored,
    shown_probs,
    uniform,
)
from specui.engine.session import ModelSession
from specui.engine.trace import ACCEPTED, BONUS, REJECTED, RESAMPLED, UNVERIFIED, NodeTrace
from specui.errors import SpecUIError


@dataclass
class ChainVerdict:
    accepted: int  # number of draft tokens accepted
    next_token: int  # the correction (resampled) or bonus token
    bonus: bool  # True if every draft token was accepted


def draft_chain(
    draft: ModelSession, ids: list[int], gamma: int, cfg: SamplingConfig,
    generator: torch.Generator, eos_ids: frozenset[int], confidence: float | None = None, floor: int = 0,
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Draw up to gamma tokens from the draft's warped q~, stopping after an EOS or after a
    token the draft itself gave less than `confidence` (its softmax probability), the `floor`-th
    draft or a later one (the stop depends on the draft alone, so verification stays lossless).
    Returns (tokens, q~ rows (n, V), raw draft logits (n, V)); greedy: the logits (float32)
    stand in for q~'s one-hot rows (sampling.drawn)."""
    if cfg.greedy and gamma > 1 and draft.feeds_device_tokens:
        return greedy_chain_on_device(draft, ids, gamma, eos_ids, confidence, floor)
    tokens: list[int] = []
    q_rows, logit_rows = [], []
    for _ in range(gamma):
        logits = draft.advance(ids + tokens, need=1)[-1]
        q, token = drawn(logits, cfg, generator)
        tokens.append(token)
        q_rows.append(q)
        logit_rows.append(logits)
        if token in eos_ids:
            break
        if confidence is not None and len(tokens) >= floor:  # the draft's own softmax (greedy: q is its logits)
            own = q if cfg.greedy else logits.float()
            if float(own.softmax(-1)[token]) < confidence:
                break
    q = torch.stack(q_rows)
    if all(a is b for a, b in zip(q_rows, logit_rows)):  # greedy's q~ rows are the float32 logits: one copy
        return tokens, q, q
    return tokens, q, torch.stack(logit_rows)


def accept_chain(drafts: list[int], q, p, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """Sampling: accept x_t with probability min(1, p~(x_t) / q~(x_t)) in order, until the
    first rejection. Returns (accepted, the distribution the next token comes from: res(p~, q~)
    at the rejection, p~ after the last draft). q: n warped draft rows; p: n + 1 target rows."""
    for t, x in enumerate(drafts):
        if uniform(generator) >= min(1.0, float(p[t][x]) / float(q[t][x])):
            return t, residual(p[t], q[t])
    return len(drafts), p[len(drafts)]


def verify_chain(
    drafts: list[int], q: torch.Tensor, p: torch.Tensor, cfg: SamplingConfig,
    generator: torch.Generator | None, best: list[int] | None = None,
) -> ChainVerdict:
    """q: warped draft rows (n, V); p: warped target rows (n + 1, V). Greedy: accept while
    the target's argmax agrees (p's rows may then be the logits themselves; `best`: their
    argmax where the caller has it already)."""
    if cfg.greedy:
        best = argmax_tokens(p) if best is None else best  # one call for every row
        n = next((t for t, x in enumerate(drafts) if best[t] != x), len(drafts))
        return ChainVerdict(accepted=n, next_token=best[n], bonus=n == len(drafts))
    n, end = accept_chain(drafts, q, p, generator)
    return ChainVerdict(accepted=n, next_token=sample(end, generator), bonus=n == len(drafts))


def chain_nodes(
    drafts: list[int], verdict: ChainVerdict, q_shown: torch.Tensor | None, p_shown: torch.Tensor,
) -> list[NodeTrace]:
    """The step's chain for the trace: accepted..., rejected, unverified..., then the
    resampled or bonus token hanging under the last accepted draft. `q_shown` None: every draft
    was proposed with certainty (a lookup step's point masses)."""
    a, n = verdict.accepted, len(drafts)
    scored_n = min(a + 1, n)  # the drafts verification reached (the rest: unverified, no p)
    steps = list(range(n))
    q = read_entries(q_shown, steps, drafts) if q_shown is not None else [1.0] * n
    p = read_entries(p_shown, steps[:scored_n] + [a], drafts[:scored_n] + [verdict.next_token])
    nodes = []
    for t, x in enumerate(drafts):
        status = ACCEPTED if t < a else REJECTED if t == a else UNVERIFIED
        nodes.append(NodeTrace(token_id=x, text="", parent=t - 1, depth=t + 1, status=status,
                               q=q[t], p=p[t] if t < scored_n else None))
    nodes.append(NodeTrace(
        token_id=verdict.next_token, text="", parent=a - 1, depth=a + 1,
        status=BONUS if verdict.bonus else RESAMPLED, p=p[-1],
    ))
    return nodes


class Speculative(Method):
    name = "speculative"
    uses_draft = True

    def __init__(self, gamma: int = 2, confidence: float | None = None) -> None:
        if gamma < 1:
            raise SpecUIError(f"gamma (draft length) must be >= 1, got {gamma}")
        if confidence is not None and not 0.0 <= confidence < 1.0:
            raise SpecUIError(f"confidence must be in [0, 1), got {confidence}")
        self.gamma = gamma
        self.confidence = confidence  # stop drafting after a token the draft gave less (None: never)
        self.floor = 0  # ... from the floor-th draft on (`auto` sets it per step: chain_rate.stop_floor)

    def step(self, ctx: DecodeContext) -> StepResult:
        assert ctx.draft is not None
        cfg = ctx.sampling
        gamma = max(0, min(self.gamma, ctx.remaining - 1))  # room for the bonus token
        if gamma and cfg.greedy and ctx.draft.feeds_device_tokens and ctx.target.feeds_device_tokens:
            return self.step_on_device(ctx, gamma)  # one read a step (a GPU)
        # 1. draft
        with ctx.timer.phase("draft"):
            if gamma:
                drafts, q, q_logits = draft_chain(ctx.draft, ctx.ids, gamma, cfg, ctx.generator, ctx.eos_ids,
                                                  self.confidence, self.floor)
            else:
                drafts, q, q_logits = [], None, None
        # 2. score all candidates in one target forward, 3. accept
        with ctx.timer.phase("verify"):
            p_logits = ctx.target.advance(ctx.ids + drafts, need=len(drafts) + 1)
            return chain_step(drafts, q, q_logits, p_logits, cfg, ctx.generator, gamma)


    def step_on_device(self, ctx: DecodeContext, gamma: int) -> StepResult:
        """Greedy, where reads wait (a GPU: methods/device_verify.py): a fixed chain's tokens stay on
        the device, go into the target's verification unread, and the step reads the device once; a
        chain that stops on the draft's confidence reads its tokens as it drafts, then once more."""
        draft, target, ids = ctx.draft, ctx.target, ctx.ids
        if self.confidence is not None:
            with ctx.timer.phase("draft"):
                drafts, _, q_logits = draft_chain(draft, ids, gamma, ctx.sampling, ctx.generator, ctx.eos_ids,
                                                  self.confidence, self.floor)
            with ctx.timer.phase("verify"):
                stats = verified_once(ctx, drafts, q_logits)
        else:  # no sync between the phases (StepTimer): the target's forward queues behind the draft's
            with draft.feeding_device_tokens(ids), target.feeding_device_tokens(ids):
                with ctx.timer.phase("draft", sync=False):
                    picks, q_logits = queue_greedy_chain(draft, ids, gamma)  # unread
                with ctx.timer.phase("verify", sync=False):
                    stats = ChainStats(picks, q_logits, target.advance(ids, need=gamma + 1, pending=picks))
                draft.settle_tokens(stats.tokens[:-1])  # the last drafted token was not fed to the draft
                target.settle_tokens(stats.tokens)
            drafts = through_eos(stats.tokens, ctx.eos_ids)
        p_shown, q_shown = stats.shown(len(drafts))
        verdict = verify_chain(drafts, None, None, ctx.sampling, None, p_shown.best)
        return chain_result(drafts, verdict, q_shown, p_shown, gamma)


def chain_step(drafts: list[int], q: torch.Tensor | None, q_logits: torch.Tensor | None, p_logits: torch.Tensor,
               cfg: SamplingConfig, generator: torch.Generator, gamma: int) -> StepResult:
    """Verify a drafted chain against the target's logits (len(drafts) + 1, V) and build the
    step's result: accepted drafts, then the correction or bonus token (Speculative, EMS-SD)."""
    p, p_shown = scored(p_logits, cfg)
    verdict = verify_chain(drafts, q, p, cfg, generator, greedy_tokens(p, p_shown) if cfg.greedy else None)
    q_shown = shown_probs(q_logits, q, cfg) if drafts else p_shown
    return chain_result(drafts, verdict, q_shown, p_shown, gamma)


def chain_result(drafts: list[int], verdict: ChainVerdict, q_shown, p_shown, gamma: int) -> StepResult:
    """A verified chain's step: accepted drafts, then the correction or bonus token, with the trace's
    nodes read from the probabilities shown (tensors or sampling.SoftmaxEntries)."""
    return StepResult(
        tokens=drafts[: verdict.accepted] + [verdict.next_token],
        from_draft=[True] * verdict.accepted + [False],
        nodes=chain_nodes(drafts, verdict, q_shown, p_shown),
        drafted=len(drafts),
        accepted=verdict.accepted,
        gamma=gamma,
    )
