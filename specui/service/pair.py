"""A target + draft pair ready to decode: loading both, checking they fit, building the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specui.chat import stop_token_ids
from specui.engine import Engine
from specui.engine.capture import CAPTURES
from specui.errors import SpecUIError
from specui.heads.acceptance import TRAIN_COMMAND, load_head
from specui.heads.decision import TRAIN_COMMAND as DECISION_TRAIN_COMMAND
from specui.heads.decision import DecisionModels, load_decision_models
from specui.service.joint import choose_with_draft
from specui.service.process_memory import release_freed_memory
from specui.settings import PairChoice
from specui.weights.draft import is_specui_draft, load_draft, made_for_vocabulary, misfit
from specui.weights.dtypes import choice_key, choose_dtype
from specui.weights.loading import (
    BUNDLED,
    BUNDLED_GGUF,
    QUANTIZATIONS,
    LoadedModel,
    ModelSpec,
    check_same_tokenizer,
    gguf_source,
    load_concrete,
    load_model,
    locate,
    measures_dtype,
    resolve_dtype,
)
from specui.weights.stand_in import check_size, is_source_copy

REPO = Path(__file__).resolve().parents[2]  # specui/service/pair.py -> the repository
SHIPPED_DRAFT = REPO / "models" / "smollm2-135m-draft"
SHIPPED_HEAD = REPO / "models" / "smollm2-135m-specdec-head"  # SpecDec++'s acceptance head for it
SHIPPED_DECISION = REPO / "models" / "smollm2-135m-mcsd-decision"  # MCSD's early-stop decision models for it
PRESETS_FILE = REPO / "models" / "presets.json"
DEFAULT_TARGET = BUNDLED


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: str
    draft: str
    quantization: str = "auto"


def load_presets(path: Path = PRESETS_FILE) -> dict[str, Preset]:
    """Named model pairs from models/presets.json."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {name: Preset(name=name, **entry) for name, entry in raw.items()}


def get_preset(name: str) -> Preset:
    presets = load_presets()
    if name not in presets:
        raise SpecUIError(f"unknown preset '{name}'; choose one of: {', '.join(presets)}")
    return presets[name]


def default_draft_source() -> str:
    """The default draft: the one distilled from the bundled target and shipped in models/
    (see models/smollm2-135m-draft/README.md)."""
    if not (SHIPPED_DRAFT / "config.json").is_file():
        raise SpecUIError(
            f"the default draft is missing ({SHIPPED_DRAFT}); restore it from git, train one with "
            "'python -m specui.train draft --out models/smollm2-135m-draft', or pass --draft none"
        )
    return str(SHIPPED_DRAFT)


def pair_specs(choice: PairChoice) -> tuple[ModelSpec, ModelSpec | None]:
    """Model specs for a target / draft choice; the draft 'default' is the shipped one,
    'none' (or empty) means no draft. The CLI flags and the model panel both come here."""
    if not choice.target.strip():
        raise SpecUIError("choose a target model (a preset, a hub id, a folder or a .gguf file)")
    for quantization in (choice.quantization, choice.draft_quantization):
        if quantization not in QUANTIZATIONS:
            raise SpecUIError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
    if choice.capture not in CAPTURES:
        raise SpecUIError(f"capture must be one of {', '.join(CAPTURES)}, not '{choice.capture}'")
    size = (choice.stand_in or "").strip()
    if size:  # before anything loads (quantization auto would try it once an option)
        check_size(size)
    target = ModelSpec(choice.target.strip(), choice.dtype, choice.device, choice.quantization,
                       choice.trust_remote_code, size)
    draft = choice.draft.strip() or "none"
    if draft == "none":
        return target, None
    source = default_draft_source() if draft == "default" else draft
    return target, ModelSpec(source, choice.dtype, choice.device, choice.draft_quantization,
                             choice.trust_remote_code)


@dataclass
class HeadChoice:
    """SpecDec++'s acceptance head for the loaded draft: the module and its config, or why
    there is none."""

    head: torch.nn.Module | None = None
    config: dict = field(default_factory=dict)
    problem: str = "no acceptance head is loaded for this draft"


def head_folder(head: str, draft: ModelSpec | None, shipped: Path = SHIPPED_HEAD) -> Path | None:
    """Where a draft's learned helper (SpecDec++'s acceptance head, MCSD's decision models)
    comes from: 'default' = the shipped one when the draft is the shipped draft (else none),
    'none' = none, anything else a folder."""
    head = (head or "default").strip()
    if draft is None or head == "none":
        return None
    if head == "default":
        return shipped if Path(draft.source).resolve() == SHIPPED_DRAFT.resolve() else None
    return Path(head)


def load_head_choice(folder: Path | None, draft: LoadedModel | None) -> HeadChoice:
    """Never raises: a head that cannot be used becomes a HeadChoice saying why (the pair
    stays usable for every other method; specdec++ falls back or refuses with that message)."""
    if draft is None:
        return HeadChoice(problem="no draft is loaded")
    if folder is None:
        return HeadChoice(problem=f"no acceptance head is known for the draft {draft.label}; train one with: "
                                  f"{TRAIN_COMMAND}, then pass --specdec-head FOLDER")
    try:
        head, config = load_head(folder, draft.model)
    except SpecUIError as e:
        return HeadChoice(problem=str(e))
    return HeadChoice(head, config, "")


def load_decision_choice(folder: Path | None, draft: LoadedModel | None) -> DecisionModels:
    """Never raises: decision models that cannot be used become a DecisionModels saying why
    (mcsd then drafts without early stop and says so)."""
    if draft is None:
        return DecisionModels(problem="no draft is loaded")
    if folder is None:
        return DecisionModels(problem=f"no MCSD decision models are known for the draft {draft.label}; train them "
                                      f"with: {DECISION_TRAIN_COMMAND}, then pass --mcsd-decision FOLDER")
    try:
        return load_decision_models(folder, draft.model)
    except SpecUIError as e:
        return DecisionModels(problem=str(e))


@dataclass
class ModelPair:
    target: LoadedModel
    draft: LoadedModel | None
    head: HeadChoice = field(default_factory=HeadChoice)
    decision: DecisionModels = field(default_factory=DecisionModels)
    capture: str = "auto"  # the engines' forwards: auto / on / off (specui.engine.capture)
    context: int = 0  # the engines' context window in tokens, at most the target's own (0: the target's own)

    @property
    def notes(self) -> tuple[str, ...]:
        """What loading chose and why (dtype auto's measurements)."""
        return self.target.notes + (self.draft.notes if self.draft else ())

    def for_one_run(self) -> str:
        """`--capture auto` on a CPU compiles in the background for the app's later replies; one CLI run
        ends first, and meanwhile the compile slows it (2-core Zen 4, bundled pair, autoregressive: 38.7
        tok/s against 75.3 eager, measured while paused compiles still kept their OpenMP teams; they hand
        them back now, engine/openmp_team.py, but a compile that may not pause still runs beside the
        reply). So such a run's engines run eagerly; the note says so ("" where nothing changed: a GPU's
        auto is CUDA graphs)."""
        if self.capture != "auto" or self.target.device.type != "cpu":
            return ""
        self.capture = "off"
        return ("--capture auto in one CLI run on a CPU: eager forwards (a background compile would not be ready "
                "before the run ends, and slows it meanwhile); --capture on compiles first")

    def engine(self, capture: str | None = None) -> Engine:
        """A fresh engine on this pair; `capture` (auto / on / off) defaults to the pair's."""
        t = self.target
        return Engine(
            t.model, t.tokenizer, draft=self.draft.model if self.draft else None,
            eos_ids=stop_token_ids(t.tokenizer, t.model.generation_config),
            quantization=t.spec.quantization, acceptance_head=self.head.head, head_config=self.head.config,
            head_problem=self.head.problem, decision=self.decision,
            capture=self.capture if capture is None else capture, context_len=self.context or None,
        )


def load_pair(target: ModelSpec, draft: ModelSpec | None, on_target_loaded=None, head: str = "default",
              decision: str = "default", progress=None, speculate: bool = True, capture: str = "auto") -> ModelPair:
    """Load the target, then the draft on the same device; the draft must share the
    target's tokenizer; then the draft's SpecDec++ acceptance head (see head_folder; a
    head that cannot be used is recorded, not raised). Raises SpecUIError (and loads
    nothing) on any problem with the models. `progress(fraction, what)` hears the target's slow
    parts (a stand-in built, matrices quantized). With target quantization auto and a draft,
    `speculate` (the methods to come use the draft) makes quantization and method one choice
    (specui.service.joint): the target may be reloaded with the option that commits more
    tokens per second with speculation. `capture` (the pair's engines' forwards: auto / on / off)
    is the pair's, and with quantization auto the target's option is chosen as those run
    (specui.service.captured_quantization), where that was measured on this machine. The heap a
    load freed (a GGUF's dequantized tensors, matrices packed one by one) goes back to the system:
    a 1.07B Q4_0 GGUF on w4a8 held 3.4 GiB after loading, 1.4 after."""
    try:
        return _load_pair(target, draft, on_target_loaded, head, decision, progress, speculate, capture)
    finally:
        release_freed_memory()


def _load_pair(target: ModelSpec, draft: ModelSpec | None, on_target_loaded, head: str, decision: str, progress,
               speculate: bool, capture: str) -> ModelPair:
    if draft is not None:
        locate(draft.source)  # a draft path that does not exist is said before the target loads, not after
    loaded_target = load_model(target, role="target", progress=progress, capture=capture)
    if on_target_loaded is not None:
        on_target_loaded()
    if draft is not None and Path(draft.source).resolve() == SHIPPED_DRAFT.resolve():
        draft = shipped_or_family_draft(loaded_target, draft)
    pair = pair_with_draft(loaded_target, draft, head, decision)
    pair.capture = capture
    verdict = choose_with_draft(pair, draft, progress) if speculate and draft is not None else None
    if verdict is None:
        return pair
    chosen, note = verdict
    first = loaded_target.spec.quantization
    if chosen == first:
        loaded_target.notes += (note,)
        return pair
    options, options_key, notes = loaded_target.options, loaded_target.options_key, loaded_target.notes
    del pair, loaded_target  # at most one target in memory
    release_freed_memory()  # its heap back to the system: the next load's memory check counts it free
    try:
        reloaded = load_concrete(replace(target, quantization=chosen), "target", notes + (note,),
                                 gguf_source(target), progress)
    except (SpecUIError, MemoryError) as e:  # the option that loaded first still does
        release_freed_memory()
        why = f"target quantization auto with the draft: {chosen} did not load ({e}), so {first} stays"[:400]
        reloaded = load_concrete(replace(target, quantization=first), "target", notes + (why,),
                                 gguf_source(target), progress)
    reloaded.options, reloaded.options_key = options, options_key
    pair = pair_with_draft(reloaded, draft, head, decision)
    pair.capture = capture
    return pair


def shipped_or_family_draft(target: LoadedModel, draft: ModelSpec) -> ModelSpec | None:
    """The draft for `target` where the shipped one (the default for every target) was asked for: the
    shipped draft where it fits (the bundled target and its stand-ins); for another model of the
    bundled one's vocabulary (SmolLM2's family, e.g. SmolLM2-1.7B: the smollm2-1.7b preset's pair)
    the bundled SmolLM2-135M-Instruct itself; else none. Said in the target's notes."""
    if made_for_vocabulary(SHIPPED_DRAFT, target.tokenizer):
        why = misfit(SHIPPED_DRAFT, target.model)  # its width (the vocabulary is the one it was made for)
        if not why:
            return draft
        target.notes += (f"draft: the bundled {BUNDLED_GGUF}, the smallest model of this target's family (the "
                         f"shipped draft was made for it alone: {why})",)
        # on its own 4-bit blocks where they serve (quantization auto, as when it is the target), unless asked
        quantization = "auto" if draft.quantization == "none" else draft.quantization
        return replace(draft, source=BUNDLED, quantization=quantization)
    why = misfit(SHIPPED_DRAFT, target.model, target.tokenizer)  # another tokenizer: said so
    if not why:  # (a draft that records no vocabulary, of the target's width)
        return draft
    target.notes += (f"draft: none ({why}; the shipped draft fits only the bundled target: --draft names another, "
                     "e.g. a smaller model of this target's family)",)
    return None


def pair_with_draft(target: LoadedModel, draft: ModelSpec | None, head: str = "default",
                    decision: str = "default") -> ModelPair:
    """A loaded target paired with a draft (loaded here, with its head and decision model)."""
    loaded_draft = None
    if draft is not None:
        if is_specui_draft(draft.source):  # uses the target's tokenizer; checked by its vocabulary fingerprint
            loaded_draft = load_specui_draft(draft, target)
        else:
            loaded_draft = load_model(draft, role="draft")
            check_same_tokenizer(target.tokenizer, loaded_draft.tokenizer)
            if is_source_copy(target.model, loaded_draft.model):
                raise SpecUIError("this draft is the stand-in's own source model (or a copy of it): it would agree "
                                  "with the stand-in by construction, which no real model of that size does; use "
                                  "the shipped draft (default), prompt lookup, or another model")
    return ModelPair(target, loaded_draft, load_head_choice(head_folder(head, draft), loaded_draft),
                     load_decision_choice(head_folder(decision, draft, SHIPPED_DECISION), loaded_draft))


def load_specui_draft(spec: ModelSpec, target: LoadedModel) -> LoadedModel:
    """A draft trained by `python -m specui.train`: it shares the target's embeddings and
    tokenizer and follows the target's device. Its dtype: as given; with `auto` on a CPU,
    float32 (on the 4-bit / int8 kernels) or bfloat16, whichever one draft token measures faster; else the
    target's."""
    notes: tuple[str, ...] = ()
    if measures_dtype(spec, target.device):
        as_float32 = load_draft(spec.source, target.model, target.tokenizer, dtype=torch.float32)

        def variant(dtype: torch.dtype) -> torch.nn.Module:
            if dtype == torch.float32:
                return as_float32
            return load_draft(spec.source, target.model, target.tokenizer, dtype=dtype)

        choice = choose_dtype(variant, choice_key(as_float32, f"target {target.model.dtype}"))
        model = as_float32 if choice.dtype == torch.float32 else variant(choice.dtype)
        notes = (choice.note("draft"),)
    else:
        dtype = None if spec.dtype == "auto" else resolve_dtype(spec.dtype, target.device)
        model = load_draft(spec.source, target.model, target.tokenizer, dtype=dtype)
    if spec.quantization not in ("none", "auto"):  # said, not silently dropped
        notes += (f"draft quantization {spec.quantization} not applied: a SpecUI draft computes on the matrices it "
                  "was saved with (4-bit groups and int8 rows, on their kernels in float32)",)
    return LoadedModel(spec=spec, model=model, tokenizer=target.tokenizer, device=target.device,
                       label=Path(spec.source).name, notes=notes)
