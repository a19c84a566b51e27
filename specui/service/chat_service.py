"""ChatService: what the CLI and the UI call. Turns chat messages + settings into a running
Generation on the loaded pair; converts engine failures into user-facing messages."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from specui.chat import Message, build_prompt, fit_last_message
from specui.engine import METHODS, Generation, GenerationRequest, StepTrace, make_method
from specui.errors import SpecUIError
from specui.service.batch_loop import DONE, BatchLoop, Request, Started
from specui.service.captured_quantization import Comparison
from specui.service.engine_process import INFO_FIELDS
from specui.service.pair import ModelPair, load_pair, load_presets, pair_specs
from specui.service.process_memory import release_freed_memory, rss_bytes
from specui.service.reports import capture_line, options_report
from specui.service.settings_check import method_params, sampling_config, validate_settings
from specui.settings import ChatSettings, PairChoice
from specui.weights.loading import DTYPES, QUANTIZATIONS
from specui.weights.threads import use_long_threads


class ChatService:
    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.engine = pair.engine()
        self.threads_note = ""  # how many threads torch uses here, and why (set by the app)
        self.long_threads: int | None = None  # threads for long inputs where the app measured them faster
        self._batch_loop: BatchLoop | None = None
        self.gate = None  # a shared app's FairGate (specui.service.fair): whose turn it is; None: arrival order
        self.model_thread = None  # where replies decode (the app's MainThreadRunner), set by use_model_thread
        self.comparison: Comparison | None = None  # the app's: the target's quantization options compared compiled

    def use_long_threads(self, threads: int | None) -> None:
        """Long inputs (prefills) of this pair, and of every pair loaded later, run with `threads`."""
        self.long_threads = threads
        self._hook_long_threads(self.pair)

    def _hook_long_threads(self, pair: ModelPair) -> None:
        if self.long_threads:
            for loaded in (pair.target, pair.draft):
                if loaded is not None:
                    use_long_threads(loaded.model, self.long_threads)

    def use_model_thread(self, model_thread) -> None:
        """Replies decode on `model_thread` (the app's MainThreadRunner): a background capture
        measurement of this pair, and of every pair loaded later, times its rounds there."""
        self.model_thread = model_thread
        self.engine.use_model_thread(model_thread)
        self._compare_options()

    def _compare_options(self) -> None:
        """The app (a model thread serves it) compares the loaded target's quantization options
        as captured forwards run them, in the background, where that is still to be measured."""
        if self.comparison is not None:
            self.comparison.stop()
        self.comparison = Comparison.maybe(self.pair, self.engine, self.model_thread)

    def batch_loop(self, submit) -> BatchLoop:
        """The one loop that decodes every ems-sd chat of the app together (made on first use;
        `submit` runs it on the model thread)."""
        if self._batch_loop is None:
            self._batch_loop = BatchLoop(self, submit)
        return self._batch_loop

    def load(self, choice: PairChoice, progress=None) -> str:
        """Load a new pair and swap it in once no generation runs. On any failure the
        previous pair stays loaded and a SpecUIError says why."""
        target, draft = pair_specs(choice)
        if self.comparison is not None:  # nothing of the old pair loads or compiles beside the new one
            self.comparison.stop()
        if progress:
            progress(0.1, f"loading target {target.source}")
        pair = load_pair(target, draft, on_target_loaded=(lambda: progress(0.6, "loading draft"))
                         if progress else None, head=choice.head, decision=choice.decision, capture=choice.capture,
                         progress=(lambda f, what: progress(0.1 + 0.5 * f, what)) if progress else None)
        pair.context = self.pair.context  # --context is the app's: kept across loads
        engine = pair.engine()
        engine.use_model_thread(self.model_thread)
        self._hook_long_threads(pair)
        if progress:
            progress(0.95, "waiting for the running generation")
        with self.engine.lock:
            old = self.engine
            self.pair, self.engine = pair, engine
        old.close()
        self._compare_options()
        old.target.reset()
        if old.draft is not None:
            old.draft.reset()
        del old
        release_freed_memory()
        return f"loaded target `{self.target_label}` with draft `{self.draft_label}`" + "".join(
            f"; {note}" for note in pair.notes)

    def cost_profile(self, measure: bool = False, progress=None) -> tuple[dict | None, str]:
        """The pair's cost profile as plain data (measured or read from the disk cache when
        `measure`), and a note on where it came from."""
        if measure:
            with self.engine.lock:
                self.engine.ensure_profile(progress)
        costs = self.engine.costs
        return (costs.profile.to_dict() if costs.profile is not None else None), costs.note

    def quantization_options(self, progress=None) -> str:
        """Each quantization of the loaded target loaded and timed in turn (no generation runs
        meanwhile): a markdown table, and what it was measured on."""
        with self.engine.lock:
            return options_report(self.pair, progress)[0]

    def doctor_report(self) -> str:
        """`--doctor`'s block (machine, packages, kernel self-checks, cached choices), run while
        no generation does, as a fenced block to copy into a bug report."""
        from specui.weights.doctor import report

        with self.engine.lock:
            text, _ = report()
        return f"```text\n{text}\n```"

    def memory_report(self) -> str:
        """Weights of the loaded pair, process memory, GPU memory (if any)."""
        mb = 1 << 20
        parts = [f"target weights {self.pair.target.memory_bytes / mb:,.0f} MB"]
        if self.pair.draft is not None:
            parts.append(f"draft weights {self.pair.draft.memory_bytes / mb:,.0f} MB")
        rss = rss_bytes()
        if rss:
            parts.append(f"process RSS {rss / mb:,.0f} MB")
        if self.threads_note:
            parts.append(self.threads_note)
        parts.append("dtype " + "/".join(str(m.model.dtype).replace("torch.", "") for m in self.loaded))
        parts.append(capture_line(self.engine.capture_report()))
        if self.comparison is not None and self.comparison.line:
            parts.append(self.comparison.line)
        if torch.cuda.is_available():
            parts.append(f"GPU allocated {torch.cuda.memory_allocated() / mb:,.0f} MB "
                         f"(peak {torch.cuda.max_memory_allocated() / mb:,.0f} MB)")
        return " · ".join(parts) + "".join(f"  \n{note}" for note in self.pair.notes)

    def info(self) -> dict:
        """What the page shows of the loaded pair, as plain data (an engine in another process
        sends this)."""
        return {name: getattr(self, name) for name in INFO_FIELDS}

    @property
    def target_spec(self):
        """The loaded target's ModelSpec (source, dtype, quantization, stand-in)."""
        return self.pair.target.spec

    @property
    def load_notes(self) -> list[str]:
        return list(self.pair.notes)

    @property
    def dtype_names(self) -> list[str]:
        return [str(m.model.dtype).replace("torch.", "") for m in self.loaded]

    @property
    def capture_setting(self) -> str:
        return self.engine.capture

    @property
    def context_len(self) -> int:
        return self.engine.context_len

    def capture_report(self) -> dict:
        return self.engine.capture_report()

    def settle(self) -> None:
        """Wait for the background compiles (benchmarks time the settled engine)."""
        self.engine.settle()

    def compiles_quiet_s(self) -> float | None:
        """Seconds since the background compiles (and the quantization options' comparison)
        last settled; None while they run."""
        comparison = self.comparison
        if not self.engine.settled() or (comparison is not None and not comparison.finished.is_set()):
            return None
        return time.monotonic() - max(self.engine.settled_at(), comparison.finished_at if comparison else 0.0)

    @property
    def loaded(self) -> list:
        """The loaded models, target first."""
        return [self.pair.target] + ([self.pair.draft] if self.pair.draft is not None else [])

    @property
    def presets(self) -> dict[str, dict]:
        return {name: {"description": p.description, "target": p.target, "draft": p.draft,
                       "quantization": p.quantization} for name, p in load_presets().items()}

    @property
    def quantizations(self) -> tuple[str, ...]:
        return QUANTIZATIONS

    @property
    def dtypes(self) -> tuple[str, ...]:
        return ("auto", *DTYPES)

    @property
    def stand_in_sizes(self) -> tuple[str, ...]:
        """'' (the target itself) and the stand-in sizes (weights/stand_in.py)."""
        from specui.weights.stand_in import SIZES

        return ("", *SIZES)

    @property
    def device_label(self) -> str:
        return str(self.pair.target.device)

    @property
    def target_label(self) -> str:
        return self.pair.target.label

    @property
    def draft_label(self) -> str:
        return self.pair.draft.label if self.pair.draft else "none"

    @property
    def tree_presets(self) -> list[str]:
        from specui.engine.methods.tree import STATIC_TREES

        return list(STATIC_TREES)

    @staticmethod
    def method_fields(method: str) -> set[str]:
        """The ChatSettings fields a method's constructor takes (what its settings panel shows)."""
        return set(method_params(ChatSettings(method=method)))

    @property
    def method_field_sets(self) -> dict[str, list[str]]:
        """method_fields of every method, as plain data (the page's side reads these)."""
        return {name: sorted(ChatService.method_fields(name)) for name in METHODS}

    @property
    def methods(self) -> list[str]:
        names = sorted(METHODS)
        if self.engine.draft is None:
            names = [n for n in names if not METHODS[n].uses_draft or METHODS[n].draft_optional]
        return names

    def start(
        self, messages: Sequence[Message], settings: ChatSettings, cancel: threading.Event | None = None,
        truncate: bool = False,
    ) -> tuple[Generation, list[str]]:
        """Build the prompt and a ready Generation. The oldest turns are dropped to fit the
        context; with `truncate` an over-long last message is cut (else it is an error).
        Returns (generation, notes for the user about what was dropped or cut)."""
        context = self.engine.context_len
        settings = validate_settings(settings, context)
        method = make_method(settings.method, **method_params(settings))
        budget = context - max(1, min(settings.max_new_tokens, context // 4))  # room for the answer
        tokenizer = self.pair.target.tokenizer
        notes = []
        if truncate:
            messages, note = fit_last_message(tokenizer, messages, budget)
            notes += [note] if note else []
        prompt, dropped = build_prompt(tokenizer, messages, budget)
        if dropped:
            notes.append(f"Dropped the {dropped} oldest messages to fit the {context}-token context window.")
        request = GenerationRequest(
            prompt_ids=prompt, max_new_tokens=settings.max_new_tokens,
            sampling=sampling_config(settings), stop_strings=tuple(settings.stop_strings),
        )
        return self.engine.generate(request, method, cancel), notes

    def run(self, messages: Sequence[Message], settings: ChatSettings, cancel: threading.Event,
            sink: Callable[[Any], None], submit: Callable[..., Future]) -> None:
        """Start and run a reply where model work runs (`submit`: the model thread, so a model
        swap cannot fall between the two), handing `sink` its items in order: a Started, each
        StepTrace, then DONE, or the exception that ended it. ems-sd replies join the one batch
        that every chat of that method shares. Returns at once."""
        if settings.method == "ems-sd":
            self.join_batch([Request(messages, settings, cancel, sink)], submit)
            return

        def produce() -> None:
            try:
                generation, notes = self.start(messages, settings, cancel, truncate=True)
                sink(Started(generation, notes))
                for step in self.stream(generation):
                    sink(step)
                sink(DONE)
            except Exception as e:  # noqa: BLE001 - the reply's own error, handed to its reader
                sink(e)
            except BaseException:  # Ctrl+C on the model thread: end the reply, then stop
                sink(SpecUIError("the app is stopping"))
                raise

        job = submit(produce)
        job.add_done_callback(lambda f: f.exception() and sink(f.exception()))  # it never ran

    def join_batch(self, requests: Sequence[Request], submit: Callable[..., Future]) -> None:
        """ems-sd requests join the shared batch together (each with its own sink)."""
        self.batch_loop(submit).join(*requests)

    def complete(self, messages: Sequence[Message], settings: ChatSettings) -> tuple[str, float]:
        """One reply run to its end on the calling thread, as the CLI runs it: (text, engine
        tokens/s)."""
        generation, _ = self.start(messages, settings)
        for _ in self.stream(generation):
            pass
        return generation.text, generation.stats.tokens_per_s

    def stream(self, generation: Generation) -> Iterator[StepTrace]:
        """Run a generation under the engine lock; out-of-memory becomes a SpecUIError."""
        with self.engine.lock, self._out_of_memory_message():
            yield from generation

    def stream_batch(self, generations: Sequence[Generation]) -> Iterator[tuple[Generation, StepTrace]]:
        """Decode ems-sd generations as one batch under the engine lock: (generation, its new
        step) as each step ends, until every one has finished. Returns the batch's padding
        figures (BatchDecoder.padding_stats) when done."""
        with self.engine.lock, self._out_of_memory_message():
            batch = self.engine.batch(generations[0].method)
            try:
                batch.join(generations)
            except MemoryError as e:
                raise SpecUIError(f"the batch does not fit in memory ({e}); send fewer or shorter prompts, or "
                                  "lower max new tokens") from None
            while batch.running:
                yield from batch.step()
        return batch.decoder.padding_stats() | {
            "steps": len(batch.sizes), "mean_batch_size": round(sum(batch.sizes) / max(1, len(batch.sizes)), 3)}

    @contextlib.contextmanager
    def _out_of_memory_message(self) -> Iterator[None]:
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            self.engine.target.reset()
            if self.engine.draft is not None:
                self.engine.draft.reset()
            raise SpecUIError(
                "out of GPU memory during generation; lower max new tokens, gamma or beam "
                "width, or load the target in 4-bit"
            ) from None
