"""Quantization and capture as one choice (`--quantization auto` with `--capture auto` on a CPU).

`--quantization auto` times each option's eager forwards when it loads
(specui.weights.quant_choice), and `--capture auto` then runs compiled forwards where they
measure faster (specui.engine.capture_choice). The two orders need not agree: on a 2-core Zen 4
EPYC the bundled target's int4 and w4a8 options were a near tie eagerly (the choice flipped from
load to load) while compiled, timed side by side in one process, w4a8 took 12.3 ms a token
against int4's 14.1. So where a target's options have no captured record yet, each option
within REACH of the fastest eager one is loaded, compiled and given its own capture record,
then the options are timed side by side as `--capture auto` runs each, and the winner is
recorded in the quantization record: every later load with capture on or auto loads it
(`--capture off` keeps the eager choice). Done in the foreground by the benches and
`python -m specui.bench.capture` (measure()), and by the app in the background (Comparison); at
most one extra copy of the target is in memory per option, and an option that would not fit in
the memory left is skipped and said."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import chain
from pathlib import Path

import torch

from specui.engine import calibration, capture_choice
from specui.engine.giving_way import lowest_priority
from specui.engine.host_memory import free_memory
from specui.engine.timing import fastest_in_turns
from specui.errors import SpecUIError
from specui.service.process_memory import release_freed_memory
from specui.weights.concrete import load_concrete
from specui.weights.loading import LoadedModel, gguf_source
from specui.weights.quant_choice import captured_pending, record_captured

REACH = 2.0  # an option whose eager token costs more than this times the fastest one's is not compiled
ROUNDS = 5  # side-by-side rounds (each capture_choice.TOKENS tokens) of every option
ROOM = 1.5  # an extra option loads only where the memory left holds this many times its weights


def _auto_spec(target: LoadedModel):
    return replace(target.spec, quantization="auto")


def _candidates(target: LoadedModel) -> tuple[str, ...]:
    """The options `--quantization auto` chose `target` among, most preferred first (its
    options are listed in that order, those that could not run included)."""
    return tuple(o.quantization for o in target.options)


def pending(target: LoadedModel, capture: str, cache_file: Path | None = None) -> bool:
    """True where `target` was loaded by `--quantization auto` among several measured options
    on a CPU, `capture` is auto, and no option has yet been chosen as captured forwards run."""
    if capture != "auto" or target.device.type != "cpu" or len([o for o in target.options if o.ms_token]) < 2:
        return False
    return captured_pending(_auto_spec(target), _candidates(target), cache_file, target.options_key)


def run_kind(entry: dict) -> str:
    """How `--capture auto` runs a model with this capture record: off, on, or on+grouped."""
    if entry["choice"] == "off":
        return "off"
    return "on+grouped" if entry.get("attention") == "grouped" else "on"


def _fits(weight_bytes: int | None) -> bool:
    room = free_memory(torch.device("cpu"))
    return room is None or weight_bytes is None or room >= ROOM * weight_bytes


def measure(target: LoadedModel, say: Callable[[str], None] = print, cache_file: Path | None = None) -> str | None:
    """Compile and time `target`'s quantization options side by side as `--capture auto` runs
    them (module docstring); record the choice (in `cache_file`, the quantization record's);
    return the option to load with captured forwards (None: nothing was recorded)."""
    candidates = _candidates(target)
    timed = _side_by_side(target, say)
    gc.collect()  # the extra options' models and compiled forwards
    if len(timed) < 2:
        return None
    chosen = record_captured(_auto_spec(target), candidates, timed, cache_file, target.options_key)
    if chosen is not None:
        say("target quantization auto with --capture auto: " + ", ".join(f"{q} {ms:.2f} ms a token" for q, (ms, _) in
            timed.items()) + f", side by side: {chosen} loads with captured forwards from now on")
    return chosen


def _load_others(target: LoadedModel, say: Callable[[str], None],
                 stopping: Callable[[], bool] = lambda: False) -> Iterator[tuple[str, torch.nn.Module]]:
    """(quantization, model) for each option other than the loaded one within REACH of the
    fastest eager one, loaded as it is reached, in the candidates' order; one the memory left
    would not hold then is said and skipped (`stopping()`: load nothing more)."""
    spec = _auto_spec(target)
    source = gguf_source(spec)
    costs = [o for o in target.options if o.ms_token]
    fastest = min(o.ms_token for o in costs)
    for option in costs:
        if option.quantization == target.spec.quantization or option.ms_token > REACH * fastest or stopping():
            continue
        if not _fits(option.weight_bytes):
            say(f"target quantization {option.quantization}: not compiled to compare, the memory left would "
                "not hold it")
            continue
        try:
            loaded = load_concrete(replace(spec, quantization=option.quantization), "target", source=source)
        except SpecUIError as e:  # e.g. refused for the memory it would take: the others are still compared
            say(f"target quantization {option.quantization}: not compiled to compare ({e})"[:400])
            continue
        yield option.quantization, loaded.model


def _side_by_side(target: LoadedModel, say: Callable[[str], None]) -> dict[str, tuple[float, str]]:
    """{quantization: (its fastest ms a token over ROUNDS side-by-side rounds, how it ran)} for
    the loaded option and the others _load_others() loads; each compiled and given its own
    capture record first."""
    runs: dict[str, tuple[Callable[[], float], str]] = {}
    for quantization, model in chain([(target.spec.quantization, target.model)], _load_others(target, say)):
        kinds = capture_choice.prepare(model)
        entry = capture_choice.decide(model, kinds)
        kind = run_kind(entry)
        runs[quantization] = (kinds[kind][0], kind)
        say(f"target quantization {quantization}: eager {entry['ms']['off']:.2f} ms a token, compiled "
            f"{entry['ms']['on']:.2f} ({entry['compile_s']:.0f} s to compile): `--capture auto` runs it {kind}")
    if len(runs) < 2:
        return {}
    best = fastest_in_turns({q: timer for q, (timer, _) in runs.items()}, ROUNDS)
    return {q: (best[q], kind) for q, (_, kind) in runs.items()}


class Comparison:
    """The app's measure(), in the background: once the pair's own background measurement and
    compiles have settled, each other option within REACH that fits is loaded on a thread at
    the lowest priority and measured as engine/calibration.py measures a model (each kind
    compiled while no reply decodes; the rounds timed on the model thread, where replies decode,
    while no job waits; a reply ends them and they are timed again); the last rounds time every
    option side by side as `--capture auto` runs it, and the winner is recorded for the next
    load (the loaded pair stays as it is). `line`: what it is doing or found, for the Model tab."""

    def __init__(self, target: LoadedModel, engine, model_thread=None, cache_file: Path | None = None) -> None:
        self.target, self.engine, self.model_thread, self.cache_file = target, engine, model_thread, cache_file
        self.line = "quantization options: waiting for the background compiles to compare them compiled"
        self.calibration: calibration.Calibration | None = None
        self.finished = threading.Event()
        self.finished_at = 0.0  # time.monotonic() when it finished
        self._alternatives: list[tuple[str, torch.nn.Module]] = []
        self._current_kind = "off"  # how the engine runs the loaded option (its capture record's kind)
        self._stopping = False
        self._lock = threading.Lock()

    @classmethod
    def maybe(cls, pair, engine, model_thread) -> Comparison | None:
        """A started comparison where the app measures in the background and the pair's target
        has options to compare as captured forwards run (pending()); else None."""
        if model_thread is None or not calibration.enabled() or not pending(pair.target, pair.capture):
            return None
        return cls(pair.target, engine, model_thread).start()

    def start(self) -> Comparison:
        threading.Thread(target=self._run, name="specui-compare", daemon=True).start()
        return self

    def stop(self) -> None:
        """The pair is replaced: compare nothing more (and end the compile under way)."""
        with self._lock:
            self._stopping = True
            if self.calibration is not None:
                self.calibration.stop()

    def _run(self) -> None:
        lowest_priority()
        try:
            while not self._stopping and not self.engine.settle(timeout=1.0):
                pass
            current = capture_choice.read().get(capture_choice.choice_key(self.target.model))
            if self._stopping or not isinstance(current, dict) or "choice" not in current:
                return self._end("")
            self._current_kind = run_kind(current)
            self._alternatives = list(_load_others(self.target, logging.getLogger("specui").info,
                                                   lambda: self._stopping))
            if not self._alternatives:
                return self._end("")
            names = ", ".join(q for q, _ in self._alternatives)
            self.line = f"quantization options: measuring {names} compiled in the background, to compare"
            measured = calibration.Calibration([("target options", self._alternatives[0][1])],
                                               self.engine.busy, (self._timers, self._decide), self._done)
            measured.run_on(self.model_thread)
            with self._lock:  # stop() either sees it or has stopped this comparison before it starts
                if self._stopping:
                    return self._end("")
                self.calibration = measured.start()
        except Exception as e:  # noqa: BLE001 - the pair as loaded still works; the line says why
            self._end(f"quantization options: not compared ({type(e).__name__}: {str(e)[:200]})")

    def _timers(self, _model) -> dict[str, Callable]:
        """The calibration's kinds: the loaded option's as the engine runs it, every kind of the others."""
        mine = self.target.spec.quantization
        kinds = {f"{mine}|{self._current_kind}": capture_choice.timers(self.target.model)[self._current_kind]}
        for quantization, model in self._alternatives:
            kinds.update({f"{quantization}|{kind}": make for kind, make in capture_choice.timers(model).items()})
        return kinds

    def _decide(self, _model, kinds: dict) -> dict:
        """On the model thread: each other option's capture record, then every option side by side."""
        runs = {self.target.spec.quantization: self._current_kind}
        for quantization, model in self._alternatives:
            own = {name.split("|", 1)[1]: v for name, v in kinds.items() if name.startswith(quantization + "|")}
            runs[quantization] = run_kind(capture_choice.decide(model, own))
        best = fastest_in_turns({q: kinds[f"{q}|{kind}"][0] for q, kind in runs.items()}, ROUNDS)
        timed = {q: (best[q], kind) for q, kind in runs.items()}
        chosen = record_captured(_auto_spec(self.target), _candidates(self.target), timed, self.cache_file,
                                 self.target.options_key)
        return {"choice": "off", "chosen": chosen, "ms": best}

    def _done(self) -> None:
        if self.target is None:  # ended already
            return
        entry = self.calibration.entries.get("target options") if self.calibration is not None else None
        if entry is None or entry.get("chosen") is None:
            note = self.calibration.note if self.calibration is not None else ""
            return self._end(f"quantization options: not compared ({note or 'stopped'})")
        figures = ", ".join(f"{q} {ms:.1f}" for q, ms in entry["ms"].items())
        mine, chosen = self.target.spec.quantization, entry["chosen"]
        verdict = f"{chosen} kept" if chosen == mine else f"the next load uses {chosen}"
        self._end(f"quantization options, ms a token as captured forwards run them side by side: {figures}; {verdict}")

    def _end(self, line: str) -> None:
        self.line = line
        if line:
            logging.getLogger("specui").info(line)  # the app's log (stderr)
        # nothing here keeps a model alive once done: the other options, their compiled forwards, the pair
        self._alternatives, self.calibration, self.target, self.engine = [], None, None, None
        gc.collect()
        release_freed_memory()  # the other options' weights and compiled forwards
        self.finished_at = time.monotonic()
        self.finished.set()
