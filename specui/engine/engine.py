"""Engine: a loaded target (and optional draft) with their sessions; starts generations."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specui.engine import calibration
from specui.engine.calibration import Calibration, measuring
from specui.engine.capture_choice import cached
from specui.engine.costs import EngineCosts
from specui.engine.detok import reply_decoder
from specui.engine.feature_draft import FeatureDraftSession
from specui.engine.loop import Generation, GenerationRequest
from specui.engine.method import Method
from specui.engine.methods.emssd import Batch, EmsSd
from specui.engine.profile import Progress, cached_profile
from specui.engine.profiling import get_profile
from specui.engine.session import ModelSession
from specui.errors import SpecUIError
from specui.heads.decision import DecisionModels
from specui.heads.feature_draft import reads_features


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Engine:
    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: Decoder,
        draft: PreTrainedModel | None = None,
        eos_ids: Sequence[int] = (),
        context_len: int | None = None,
        profile_dir: Path | None = None,
        quantization: str = "none",
        acceptance_head: torch.nn.Module | None = None,
        head_config: dict | None = None,
        head_problem: str = "",
        decision: DecisionModels | None = None,
        capture: str = "off",
        measure_capture: bool | None = None,
    ) -> None:
        """`measure_capture`: with `capture="auto"` on a CPU, measure models this machine has no
        capture record for in the background and adopt the faster forwards (engine/calibration.py;
        None: unless SPECUI_MEASURE_CAPTURE=0)."""
        self.vocab = min(target.config.vocab_size, draft.config.vocab_size if draft is not None else 1 << 62)
        self.capture = capture  # auto / on / off: static caches and captured forwards (engine/capture.py)
        self._heads = (acceptance_head, head_config, head_problem, decision)
        self.lock = threading.Lock()  # one generation at a time on these sessions
        self._profiling = False  # ensure_profile is timing forwards (the background measurement waits)
        self.target, self.draft = self._sessions(target, draft)
        self.tokenizer = tokenizer
        self._decode = reply_decoder(tokenizer)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        # a smaller window (--context) bounds the cache and truncates long chats earlier; never a larger one
        own = _context_len(target)
        self.context_len = min(context_len, own) if context_len else own
        self.profile_dir = profile_dir  # None: ~/.cache/specui/profiles
        self.quantization = quantization
        self.costs = EngineCosts()  # profile (measured on first need) + running acceptance
        self.capture_notes: list[str] = []  # what the background measurement said (a failure)
        self._measured_at = 0.0  # time.monotonic() when its choice was adopted
        # `auto` on a CPU, models never measured here: measured in the background, adopted after
        unmeasured = [(role, m) for role, m, s in (("target", target, self.target), ("draft", draft, self.draft))
                      if m is not None and s.runner is None and unmeasured_capture(capture, m)]
        measure = calibration.enabled() if measure_capture is None else measure_capture
        self.calibration = self._measurement(unmeasured) if unmeasured and measure else None

    def _measurement(self, unmeasured: list[tuple[str, PreTrainedModel]]) -> Calibration:
        """The background measurement of `unmeasured`: one another engine has under way for
        one of these models (a bench makes an engine per row on one pair), followed and given the
        rest, else a new one. Measured side by side, each measurement timed the
        others' compiles and forwards too, on the same cores (engine/calibration.py)."""
        for _, model in unmeasured:
            under_way = measuring(model)
            followed = None if under_way is None else under_way.follow(self.busy, self.adopt_measurement, unmeasured)
            if followed is not None:
                return followed
        return Calibration(unmeasured, self.busy, done=self.adopt_measurement).start()

    def use_model_thread(self, model_thread) -> None:
        """The background measurement times its rounds on `model_thread` (the app's, where
        replies decode: engine/calibration.py says why), if one is under way."""
        if self.calibration is not None:
            self.calibration.run_on(model_thread)

    def busy(self) -> bool:
        """A reply decodes, or the cost profile is being measured: the background measurement
        waits (a profile timed beside its compiles, on the same cores, would be cached and read
        by every later reply's `auto`; the CLI and the benches measure it outside any reply)."""
        return self.lock.locked() or self._profiling

    def _sessions(self, target: PreTrainedModel, draft: PreTrainedModel | None) -> tuple:
        """(target session, draft session or None) as the capture setting and this machine's
        records say, the draft's heads attached."""
        target_session = self._paused_while_decoding(ModelSession(target, self.vocab, *_measured(self.capture, target)))
        if draft is None:
            return target_session, None
        draft_session = self._paused_while_decoding(
            _draft_session(draft, self.vocab, target_session, *_measured(self.capture, draft)))
        acceptance_head, head_config, head_problem, decision = self._heads
        # SpecDec++ reads its head from the draft's session
        draft_session.acceptance_head, draft_session.head_config = acceptance_head, dict(head_config or {})
        if acceptance_head is not None:
            draft_session.head_problem = ""
        elif head_problem:
            draft_session.head_problem = head_problem
        if decision is not None:  # MCSD's early-stop decision models, read from the draft's session too
            draft_session.decision_models = dict(decision.models)
            draft_session.decision_problem = decision.problem
        return target_session, draft_session

    def _paused_while_decoding(self, session: ModelSession) -> ModelSession:
        """A background compile of this session's waits while a reply decodes."""
        runner = session.runner
        if runner is not None and runner.warmup is not None:
            runner.warmup.paused = self.lock.locked
        return session

    def adopt_measurement(self) -> bool:
        """The background measurement is done (called on its last thread): where it chose
        compiled forwards for a model, sessions that run them (compiled in the background: no
        reply waits) are built, off the engine's lock (the first compiled model imports inductor:
        20-40 s on a 2-core Xeon VM, which a reply must not wait for), then swapped in once no
        reply decodes. True if they were."""
        measured = self.calibration
        if measured is None or not measured.done:
            return False
        if measured.cancelled:  # the pair was replaced (or the app exits): nothing to adopt
            self.calibration = None
            return False
        fresh, notes = None, [measured.note] if measured.note else []
        if "on" in measured.choices().values():
            try:
                fresh = self._sessions(self.target.model, None if self.draft is None else self.draft.model)
            except Exception as e:  # noqa: BLE001 - out of memory, a compile that cannot start: stay eager
                notes.append(f"compiled forwards measured faster but could not be set up ({type(e).__name__}: "
                              f"{str(e)[:160]}); eager")
        with self.lock:
            self.calibration = None
            self._measured_at = time.monotonic()
            self.capture_notes = notes
            if fresh is None:
                return False
            old = [s for s in (self.target, self.draft) if s is not None]
            self.target, self.draft = fresh
            for session in old:
                session.reset()
            self.costs.profile = None  # the profile of eager forwards: measured again for these
        return True

    def ensure_profile(self, progress: Progress | None = None, refresh: bool = False) -> EngineCosts:
        """Measure (or read from the disk cache) the pair's cost profile once. A failure or
        an interrupt leaves the engine usable: no profile, and a note saying so. While forwards
        compile in the background a profile that is not on disk yet is not measured (it would
        time eager forwards for compiled ones): fixed defaults until the compiles settle."""
        if self.costs.profile is None or refresh:
            try:
                # (a background measurement of eager forwards does not count: eager ones run meanwhile)
                if not refresh and not all(r.settled for r in self._runners()):
                    cached = cached_profile(self.target, self.draft, self.profile_dir, self.quantization)
                    if cached is None:
                        self.costs.note = ("cost profile measured once the forwards compiling in the background "
                                           "are ready; fixed defaults until then")
                        return self.costs
                    self.costs.profile, self.costs.note = cached
                    return self.costs
                runners = self._runners()
                for runner in runners:  # timings of compiled forwards, never of a stand-in eager one
                    runner.blocking = True
                self._profiling = True
                try:
                    self.costs.profile, self.costs.note = get_profile(
                        self.target, self.draft, self.profile_dir, self.quantization, progress, refresh)
                finally:
                    self._profiling = False
                    for runner in runners:
                        runner.blocking = False
            except (RuntimeError, OSError, ValueError, KeyboardInterrupt) as e:
                self.costs.profile = None
                self.costs.note = f"profiling failed ({type(e).__name__}: {e}); fixed defaults in use"
        return self.costs

    def _runners(self) -> list:
        return [s.runner for s in (self.target, self.draft) if s is not None and s.runner is not None]

    def settled(self) -> bool:
        """No forward of this pair is compiling or waiting to compile (or being measured) in the
        background."""
        return self.calibration is None and all(r.settled for r in self._runners())

    def close(self) -> None:
        """The pair is being replaced: compile and measure nothing more for it, and end the
        compile under way (nothing pauses it once this engine decodes no more)."""
        if self.calibration is not None:  # ends it unless another engine follows it too
            self.calibration.leave(self.adopt_measurement)
        for runner in self._runners():
            if runner.warmup is not None:
                runner.warmup.stop()

    def compiles_asked(self) -> int:
        """Shapes asked of the background compilers so far: a reply during which this grew met a
        shape not compiled yet, and ran that forward eagerly (benches time such a reply again)."""
        return sum(r.warmup.asked for r in self._runners() if r.warmup is not None)

    def settled_at(self) -> float:
        """time.monotonic() when the last background compile (or measurement) finished (0: none ran)."""
        return max([r.warmup.finished_at for r in self._runners() if r.warmup is not None] + [self._measured_at])

    def settle(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles (benches, before timing; `--capture on` never has
        any); True once settled, False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.calibration is not None:  # measured and adopted first, then the forwards it chose compiled
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        for runner in self._runners():
            if runner.warmup is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not runner.warmup.wait(left):
                    return False
        return True

    def capture_report(self) -> dict:
        """Plain data: the capture setting and, per model, how its forwards run (off: the growing
        cache; buckets / graphs: static shapes), the shapes held as graphs, the shapes compiled
        and still compiling in the background (bucket, window, capacity), and any notes."""
        report = {"setting": self.capture, "notes": list(self.capture_notes)}
        measured = self.calibration
        if measured is not None:  # `auto`, never measured here: eager until measured in the background
            report["measuring"] = {"models": [role for role, _ in measured.models], "state": measured.state,
                                   "seconds": round(measured.seconds, 1), "interrupted": measured.interrupted,
                                   "chosen": measured.choices()}
        for role, session in (("target", self.target), ("draft", self.draft)):
            runner = None if session is None else session.runner
            warmup = None if runner is None else runner.warmup
            report[role] = None if session is None else {
                "mode": "off" if runner is None else runner.mode + ("+compiled" if runner.compiled else ""),
                "captured": [] if runner is None else [list(shape) for shape in runner.captured()],
                "replays": 0 if runner is None else runner.replays,
                "background": warmup is not None,
                "compiled": [] if warmup is None else [list(shape) for shape in list(warmup.compiled)],
                "compiling": [] if warmup is None else [list(shape) for shape in list(warmup.queue)],
                "compile_s": 0.0 if warmup is None else round(warmup.seconds, 1),
                "compiled_forwards": 0 if runner is None else runner.compiled_runs,
                "eager_forwards": 0 if runner is None else runner.eager,
                "notes": [] if runner is None else runner.notes}
        return report

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(ids)

    def check(self, request: GenerationRequest, method: Method) -> GenerationRequest:
        """Validate a request; returns it with max_new_tokens clamped to the context left."""
        request.sampling.validate()
        n = len(request.prompt_ids)
        if n == 0:
            raise SpecUIError("the prompt is empty: type a message first")
        if n >= self.context_len:
            raise SpecUIError(
                f"the prompt is {n} tokens but the model's context window is {self.context_len}; "
                "shorten it or clear the chat history"
            )
        if request.max_new_tokens < 1:
            raise SpecUIError(f"max new tokens must be >= 1, got {request.max_new_tokens}")
        if method.uses_draft and not method.draft_optional and self.draft is None:
            raise SpecUIError(f"method '{method.name}' needs a draft model, and none is loaded")
        request.max_new_tokens = min(request.max_new_tokens, self.context_len - n)
        return request

    def generate(
        self, request: GenerationRequest, method: Method, cancel: threading.Event | None = None,
    ) -> Generation:
        request = self.check(request, method)
        if method.wants_profile(self.draft is not None):
            self.ensure_profile()
        return Generation(
            method, request, self.target, self.draft, self.decode, self.eos_ids, self.context_len, cancel,
            self.costs,
        )


    def batch(self, method: Method) -> Batch:
        """An empty EMS-SD batch on this pair with `method`'s padding and draft (generations join it)."""
        if not isinstance(method, EmsSd):
            raise SpecUIError(f"only ems-sd decodes several sequences as one batch, not '{method.name}'")
        if method.adaptive_gamma and self.draft is not None:
            self.ensure_profile()
        return Batch(method.decoder(self.target.model, self.draft.model if self.draft is not None else None,
                                    self.target.vocab_size, self.costs))


def _draft_session(draft: PreTrainedModel, vocab: int, target: ModelSession, capture: str,
                   background: bool, grouped: int | None) -> ModelSession:
    """A draft that reads the target's features gets a session that passes them on (its
    forwards take the target's states as an input, so they stay eager)."""
    if reads_features(draft.config):
        return FeatureDraftSession(draft, vocab, target)
    return ModelSession(draft, vocab, capture, background, grouped)


def _measured(capture: str, model: PreTrainedModel) -> tuple[str, bool, int | None]:
    """(capture, background, grouped): `auto` on a CPU becomes `on` compiled in the
    background for a model whose compiled forwards measured faster on this machine
    (engine/capture_choice.py), so no reply waits for a compile; every other case stays as
    asked (`on` waits). Compiled on a CPU, attention as that measurement chose (`grouped`)."""
    if next(model.parameters()).device.type != "cpu" or capture not in ("auto", "on"):
        return capture, False, None
    choice, attention = cached(model)  # one read of the record for both answers
    if capture == "auto":
        return ("on", True, attention) if choice == "on" else (capture, False, None)
    return capture, False, attention


def unmeasured_capture(capture: str, model: PreTrainedModel) -> bool:
    """`auto` on a CPU for a model with no capture record on this machine, whose forwards could
    be compiled (a draft reading the target's features stays eager): eager against compiled is
    to be measured (in the background by an Engine, in the foreground by the benches)."""
    return (capture == "auto" and next(model.parameters()).device.type == "cpu" and not reads_features(model.config)
            and cached(model)[0] is None)


def _context_len(model: PreTrainedModel) -> int:
    cfg = model.config
    return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048))
