"""The one generate loop. Every method plugs in here; each step yields a StepTrace."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from specui.engine.costs import EngineCosts
from specui.engine.detok import GrowingText
from specui.engine.method import DecodeContext, Method, StepResult, StepTimer
from specui.engine.sampling import SamplingConfig, make_generator
from specui.engine.session import ModelSession
from specui.engine.trace import GenerationStats, StepTrace


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()


class Generation:
    """Iterate to run the generation step by step; `text`, `output_ids`, `steps` and
    `stats` are filled in as it goes. Setting `cancel` stops it after the current step."""

    def __init__(
        self,
        method: Method,
        request: GenerationRequest,
        target: ModelSession,
        draft: ModelSession | None,
        decode: Callable[[Sequence[int]], str],
        eos_ids: frozenset[int],
        context_len: int,
        cancel: threading.Event | None = None,
        costs: EngineCosts | None = None,
    ) -> None:
        self.method = method
        self.request = request
        self.decode = decode
        self._text_of = GrowingText(decode)  # decode(reply ids), from what the step added
        self._token_texts: dict[int, str] = {}  # a node's label by token id (a tree step labels dozens)
        self.cancel = cancel or threading.Event()
        self.steps: list[StepTrace] = []
        self.output_ids: list[int] = []
        self.text = ""
        self.stats = GenerationStats(method=method.name, prompt_tokens=len(request.prompt_ids))
        self._ctx = DecodeContext(
            target=target,
            draft=draft,
            sampling=request.sampling,
            generator=make_generator(request.sampling.seed, target.device),
            ids=list(request.prompt_ids),
            prompt_len=len(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
            eos_ids=eos_ids,
            timer=StepTimer(target.device),
            context_len=context_len,
            costs=costs,
        )

    def run(self) -> Generation:
        deque(self, maxlen=0)  # drain the steps
        return self

    def __iter__(self) -> Iterator[StepTrace]:
        ctx, stats = self._ctx, self.stats
        if self.cancel.is_set():  # stopped while it waited for the model: not even a prefill
            stats.finish_reason = "cancelled"
            return
        t0 = time.perf_counter()
        self.method.begin(ctx)
        stats.prefill_s = time.perf_counter() - t0
        # time inside the forwards: where every session keeps a clock (not an EMS-SD batch's rows)
        clocks = [getattr(s, "clock", None) for s in (ctx.target, ctx.draft) if s is not None]
        start = None if any(c is None or c.seconds is None for c in clocks) else sum(c.seconds for c in clocks)
        t_decode = time.perf_counter()
        try:
            while not stats.finish_reason:
                reason = self.stop_reason()
                if reason:
                    stats.finish_reason = reason
                    break
                ctx.timer.reset()
                t_step = time.perf_counter()
                result = self.method.step(ctx)
                step_ms = (time.perf_counter() - t_step) * 1000.0
                trace = self.commit_step(result, step_ms)
                stats.decode_s = time.perf_counter() - t_decode
                if start is not None:
                    stats.forward_s = sum(c.seconds for c in clocks) - start
                yield trace
        finally:  # also when the consumer stops early (the generator is closed)
            self.method.end(ctx)
        stats.decode_s = time.perf_counter() - t_decode

    @property
    def ctx(self) -> DecodeContext:
        return self._ctx

    def stop_reason(self) -> str:
        """Why the generation must stop before its next step ("" while it may go on)."""
        if self.stats.finish_reason:
            return self.stats.finish_reason
        if self.cancel.is_set():
            return "cancelled"
        return "length" if self._ctx.remaining <= 0 else ""

    # 4. commit: apply stops (EOS, max tokens, stop strings), update text, caches, stats
    def commit_step(self, result: StepResult, step_ms: float) -> StepTrace:
        ctx = self._ctx
        base = [] if result.replace else self.output_ids
        tokens, from_draft, reason = self._cut(result, ctx.max_new_tokens - len(base))
        self.output_ids = base + tokens
        ctx.ids = ctx.ids[: ctx.prompt_len] + self.output_ids
        ctx.target.commit(ctx.ids)
        if ctx.draft is not None and self.method.uses_draft:
            ctx.draft.commit(ctx.ids)
        new_text, draft_chars, reason = self._new_text(result, base, tokens, from_draft, reason)
        stats = self.stats
        stats.target_forwards += 1
        stats.drafted += result.drafted
        stats.max_draft_len += result.max_draft_len
        # accepted drafts that survived EOS / length cuts; a rewriting (beam) step says its own
        stats.accepted += result.accepted if result.replace else sum(from_draft)
        stats.new_tokens = len(self.output_ids)
        stats.finish_reason = reason
        trace = self._trace(result, tokens, from_draft, new_text, draft_chars, step_ms)
        self.steps.append(trace)
        return trace

    def _cut(self, result: StepResult, room: int) -> tuple[list[int], list[bool], str]:
        """The step's tokens (and which came from the draft) up to an EOS and within `room`, and
        the reason the generation ends there ("" if it goes on)."""
        tokens = list(result.tokens)
        from_draft = list(result.from_draft) if result.from_draft else [False] * len(tokens)
        reason = "finished" if result.finished else ""
        for i, tok in enumerate(tokens):
            if tok in self._ctx.eos_ids:
                tokens, from_draft, reason = tokens[: i + 1], from_draft[: i + 1], "eos"
                break
        if len(tokens) >= room:
            tokens, from_draft = tokens[:room], from_draft[:room]
            reason = reason or "length"
        return tokens, from_draft, reason

    def _new_text(self, result: StepResult, base: list[int], tokens: list[int], from_draft: list[bool],
                  reason: str) -> tuple[str, int, str]:
        """The reply's text after this step (cut at a stop string, a half-decoded character or a
        partial stop string held back): (the text new this step, how many of its characters the
        accepted drafts gave, the reason, "stop" where a stop string ended it)."""
        n_drafted = next((i for i, d in enumerate(from_draft) if not d), len(from_draft))
        # the text up to the accepted drafts first (for the new text's draft share), then the whole
        drafted = self._text_of(base + tokens[:n_drafted]) if 0 < n_drafted < len(tokens) else None
        text = self._text_of(self.output_ids)
        if not reason:
            text = text.rstrip("\ufffd")  # hold back a half-decoded multi-byte character
        for stop in self.request.stop_strings:
            cut = text.find(stop) if stop else -1
            if cut >= 0:
                text, reason = text[:cut], "stop"
        if not reason:
            text = text[: len(text) - _partial_stop(text, self.request.stop_strings)]
        previous = "" if result.replace else self.text
        new_text = text[len(previous):] if text.startswith(previous) else text
        self.text = text
        return new_text, _draft_chars(n_drafted, len(tokens), drafted, previous, new_text), reason

    def _trace(self, result: StepResult, tokens: list[int], from_draft: list[bool], new_text: str,
               draft_chars: int, step_ms: float) -> StepTrace:
        """The step as plain data for the UI: the method's own record plus what the commit kept."""
        for node in result.nodes:
            node.text = self._token_text(node.token_id)
        ms = self._ctx.timer.ms
        return StepTrace(
            index=len(self.steps),
            method=self.method.name,
            nodes=result.nodes,
            drafted=result.drafted,
            accepted=result.accepted,
            new_token_ids=tokens,
            new_from_draft=from_draft,
            new_text=new_text,
            replaces=bool(result.replace),
            new_draft_chars=draft_chars,
            text=self.text,
            gamma=result.gamma,
            beam_width=result.beam_width,
            tree_nodes=result.tree_nodes,
            tree_depth=result.tree_depth,
            expected_accept=result.expected_accept,
            notes=result.notes,
            choice=result.choice,
            layer_widths=result.layer_widths,
            stop_layer=result.stop_layer,
            threshold=result.threshold,
            stop_reason=result.stop_reason,
            stop_value=result.stop_value,
            chains=result.chains,
            beams=None if result.beams is None else [
                {"text": self.decode(tokens), "score": score} for tokens, score in result.beams],
            draft_ms=ms.get("draft", 0.0),
            verify_ms=ms.get("verify", 0.0),
            step_ms=step_ms,
        )

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.decode([token]) or (
                "<eos>" if token in self._ctx.eos_ids else f"<{token}>")
        return text


def _draft_chars(n: int, n_tokens: int, drafted: str | None, previous: str, new_text: str) -> int:
    """Characters of this step's new text that came from its `n` accepted draft tokens (they
    lead the step's `n_tokens`; the target's own token follows); `drafted`: the reply's text up
    to them (where some but not all of the step's tokens were drafted)."""
    if n == 0:
        return 0
    if n == n_tokens or drafted is None:
        return len(new_text)
    return max(0, min(len(new_text), len(drafted.rstrip("\ufffd")) - len(previous)))


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin a stop string: held back from
    streaming until the next step shows whether the stop string completes."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held
