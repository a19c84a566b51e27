"""What the page and the API share: chat history -> model messages, form values -> settings,
and a generation run on the model thread whose steps are handed over as the reader is ready.

No torch here: the service is injected and steps are plain-data StepTraces."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from specui.engine.trace import StepTrace
from specui.errors import SpecUIError
from specui.service.batch_loop import DONE, Request, Started
from specui.service.fair import MAX_TURNS
from specui.settings import RANGES, SEED_MAX, SWITCHES, ChatSettings, coerce

log = logging.getLogger("specui")
STOPPED_MARK = " ⏹"  # ends a reply that Stop cut short
# requests the page and the API handle at once: ems-sd chats from every tab decode together
# (one batch of up to this many); a request of another method waits for the model thread
ENGINE_CONCURRENCY = 16
ENGINE = dict(concurrency_id="engine", concurrency_limit=ENGINE_CONCURRENCY)  # every event that runs the model
# a shared app's fair gate (specui.service.fair) decides who runs: Gradio only has to let its turns in
SHARED_ENGINE = dict(concurrency_id="engine", concurrency_limit=MAX_TURNS + 8)
WAIT_POLL_S = 0.5  # a request waiting for its turn says so (and can be stopped or dropped) this often


@dataclass
class Waiting:
    """The request waits for its turn on a shared app's engine; `ahead`: turns that go first."""

    ahead: int


def session_key(request) -> str:
    """A request's session (a browser tab, an API client); "local" without one (tests, scripts)."""
    return getattr(request, "session_hash", None) or "local"


def content_text(content: Any) -> str:
    """Gradio may hand message content back as a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return str(content)


def is_note(message: dict) -> bool:
    """A notice shown in the chat (e.g. "your message was cut"), not part of the conversation."""
    return bool((message.get("metadata") or {}).get("title"))


def to_messages(history: list, system: str = "") -> list[dict[str, str]]:
    """The conversation the model sees: the system prompt (if any), then every user and
    assistant turn as plain text; notices and error messages are left out and a stopped
    reply loses its ⏹ mark."""
    messages = [{"role": "system", "content": system}] if system and system.strip() else []
    for m in history or []:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or is_note(m):
            continue
        text = content_text(m.get("content", ""))
        if m["role"] == "assistant":
            text = text.rstrip().removesuffix(STOPPED_MARK.strip()).rstrip()
            if text.startswith("⚠️") or not text:  # an error, or a reply stopped before it began
                continue
        messages.append({"role": m["role"], "content": text})
    return messages


def settings_from_values(method: str, values: dict[str, Any], base: ChatSettings | None = None) -> ChatSettings:
    """ChatSettings from form or API values (numbers may arrive as floats, strings or None):
    each is checked by specui.settings.coerce, which names the field and its range. A
    negative seed means random; a delta of 0 or empty means measured. Fields not in `values`
    come from `base`."""
    base = base or ChatSettings()
    raw = dict(values)
    seed = raw.get("seed")
    if isinstance(seed, (int, float)) and not isinstance(seed, bool) and seed == seed and seed < 0:
        raw["seed"] = None
    for name in ("delta", "width_threshold", "draft_width", "threshold"):  # 0 or empty: measured / off / 2 W_L
        if raw.get(name) in (0, 0.0, ""):
            raw[name] = None
    fields = {name: coerce(name, raw[name]) for name in RANGES if name in raw}
    for name in ("preset", "system", "k_config", "root_selection", "decision", "padding"):
        if name in raw and raw[name] is not None:
            if not isinstance(raw[name], str):
                raise SpecUIError(f"{name} must be text, got {raw[name]!r}")
            fields[name] = raw[name]
    for name in SWITCHES:
        if raw.get(name) is not None:
            if not isinstance(raw[name], bool):
                raise SpecUIError(f"{name.replace('_', ' ')} must be true or false, got {raw[name]!r}")
            fields[name] = raw[name]
    return ChatSettings(**{**base.__dict__, "method": method, **fields})


def _arrivals(updates: queue.Queue, interval_s: float, final: Callable[[Any], bool]) -> Iterator[list]:
    """What arrives on `updates`, in lists: each starts with the next item (waited for) and
    takes whatever else arrives until `interval_s` after the previous list was handed over, or
    until an item that is `final` (handed over at once)."""
    last = 0.0
    while True:
        items = [updates.get()]
        while not final(items[-1]):
            wait = last + interval_s - time.perf_counter()
            try:
                items.append(updates.get(timeout=wait) if wait > 0 else updates.get_nowait())
            except queue.Empty:
                break
        last = time.perf_counter()
        yield items


def take_turn(service, session: str, settings: ChatSettings, cancel: threading.Event, rows: int = 1):
    """On a shared app, wait for this session's turn at the engine (yielding Waiting meanwhile);
    returns the Turn to release when the work ends, or None (no gate here, or stopped while
    waiting: the request then ends at once, as one stopped in the queue). Raises SpecUIError
    when the session already has its most requests running or waiting."""
    gate = getattr(service, "gate", None)
    if gate is None:
        return None
    turn = gate.enter(session, exclusive=settings.method != "ems-sd", rows=rows, cost=settings.max_new_tokens)
    try:
        while not turn.wait(0 if turn.granted.is_set() else WAIT_POLL_S):
            if cancel.is_set():
                turn.release()
                return None
            yield Waiting(turn.ahead())
    except BaseException:
        turn.release()
        raise
    return turn


def _keyed(key, gen):
    """`gen`'s items as (key, item); returns what `gen` returns."""
    try:
        while True:
            try:
                item = next(gen)
            except StopIteration as done:
                return done.value
            yield key, item
    finally:
        gen.close()


def _released(turn) -> Callable[[], None]:
    return turn.release if turn is not None else (lambda: None)


def run_alternatives(
    service, submit: Callable[..., Future], messages: list, settings: ChatSettings, cancel: threading.Event,
    interval_s: float, session: str = "local",
) -> Iterator[tuple[int, Any]]:
    """ems-sd's alternative replies: `settings.replies` generations of the same messages
    (seeds seed, seed + 1, ...) join the shared batch together. Yields (k, Started),
    (k, newest StepTrace) as `run_in_background` does for one, and (k, error) for an
    alternative that failed (the others go on); (None, Waiting) while a shared app makes it
    wait for its turn. Leaving early stops them all."""
    updates: queue.Queue = queue.Queue()
    n = settings.replies
    turn = yield from _keyed(None, take_turn(service, session, settings, cancel, rows=n))
    release, ended = _released(turn), []

    def sink(k: int, item) -> None:
        if item is DONE or isinstance(item, BaseException):
            ended.append(k)
            if len(ended) == n:
                release()
        updates.put((k, item))

    seeds = [None if settings.seed is None else (settings.seed + k) % (SEED_MAX + 1) for k in range(n)]
    service.join_batch([Request(messages, replace(settings, seed=seed, replies=1), cancel,
                                lambda item, k=k: sink(k, item)) for k, seed in enumerate(seeds)], submit)
    running = set(range(n))
    try:
        for items in _arrivals(updates, interval_s, lambda item: False):
            newest: dict[int, StepTrace] = {}
            for k, item in items:
                if item is DONE or isinstance(item, BaseException):
                    running.discard(k)
                if isinstance(item, (Started, BaseException)):
                    yield k, item
                elif isinstance(item, StepTrace):
                    newest[k] = item
            yield from sorted(newest.items())
            if not running:
                return
    finally:
        cancel.set()
        release()


def run_in_background(
    service, submit: Callable[..., Future], messages: list, settings: ChatSettings, cancel: threading.Event,
    interval_s: float, session: str = "local",
) -> Iterator[Started | StepTrace | Waiting]:
    """Start and run the generation on the model thread (so a model swap cannot fall between
    the two; ems-sd generations join the service's shared batch loop there); yield a Started,
    then the newest step whenever the reader is ready for an update:
    decoding never waits for the reader (steps that arrive while an update is being sent are
    folded into the next one; updates are at least `interval_s` apart, the end is sent at
    once). A shared app first makes it wait for its session's turn (Waiting items meanwhile).
    Leaving early cancels the generation."""
    updates: queue.Queue = queue.Queue()
    turn = yield from take_turn(service, session, settings, cancel)
    release, started = _released(turn), []

    def sink(item) -> None:
        """Every item of the work, in order; its last one (DONE, an error) ends the turn first."""
        if isinstance(item, Started):
            started.append(item.generation)
        elif item is DONE or isinstance(item, BaseException):
            release()
            if turn is not None:  # a shared app: the owner's terminal says how each reply ended
                how = started[0].stats.finish_reason if item is DONE and started else repr(item)
                tokens = len(started[0].output_ids) if started else 0
                log.info("reply ended (session %s): %s, %d new tokens", session[:8], how, tokens)
        updates.put(item)

    service.run(messages, settings, cancel, sink, submit)
    try:
        for items in _arrivals(updates, interval_s, lambda item: item is DONE or isinstance(item, BaseException)):
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Started):
                    yield item
            steps = [i for i in items if isinstance(i, StepTrace)]
            if steps:
                yield steps[-1]
            if items[-1] is DONE:
                return
    finally:
        cancel.set()  # no-op when finished; stops the generation if the reader went away
        release()
