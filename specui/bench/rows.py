"""The rows of a throughput bench (`specui.bench.run`): a Sample is one reply, a Row one
method's replies over rounds and prompts with the figures the tables show; the runners that
make them (ours: our engine; transformers_generate: transformers' greedy and assisted
`generate`), method specs (name[:value]) and make_rows, which turns specs into rows."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import StaticCache

from specui.engine import GenerationRequest, make_method
from specui.engine.sampling import SamplingConfig
from specui.engine.trace import outside_share
from specui.service.pair import ModelPair

AR = "autoregressive"
RETIMES = 2  # a reply that met a shape still to compile is timed again (after it compiled) up to this often


def compiles_run() -> int:
    """Frames torch.compile has compiled in this process so far: a reply during which this grew
    compiled in the foreground (`--capture on` compiles a shape where it is first met: a DSBD
    reply's forests, wider than the warm-up's, took 88 s once) or beside a background compile."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


@dataclass
class Sample:
    """One reply: what a row produced for one prompt in one round."""

    output: list[int]
    seconds: float
    forwards: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    max_draft_len: int = 0  # the seed's (MCSD) denominator: the longest draft each step could have had accepted
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    step_ms: float = 0.0
    expected: list[float] = field(default_factory=list)  # OPT-Tree E(A) per step
    achieved: list[int] = field(default_factory=list)  # A per step
    lengths: list[int] = field(default_factory=list)  # tokens each step committed (accepted length histograms)
    prefill_s: float = 0.0  # of `seconds`, the prompt's prefill (our methods)
    decode_s: float = 0.0  # of `seconds`, the steps after the prefill (our methods)
    forward_s: float | None = None  # of `decode_s`, inside the models' forwards (our methods, CPU)
    cache_mb: float = 0.0  # KV-cache buffers held at the end, target + draft (our methods)
    joules: float | None = None  # GPU energy of the reply (NVML, CUDA only)
    peak_mb: float | None = None  # peak device memory allocated during the reply (CUDA only)
    retimed: int = 0  # replies before this one that met a shape still to compile (ours.run)
    capture: str | None = None  # how our reply's target forwards ran: off (eager), or the row's auto / on


@dataclass
class Row:
    name: str
    dtype: str
    run: Callable[..., Sample] = field(repr=False)  # (prompt, max new tokens[, sampling]) -> Sample
    capture: str = "off"  # on / auto: static caches and captured forwards (engine/capture.py); off: eager
    # (our rows: as their timed replies ran, `ran_as`; an `auto` engine adopts compiled forwards
    # once its background measurement is done, after the row was made)
    stand_in: str | None = None  # the stand-in size its target was padded to (None: the model itself)
    rounds: list[list[Sample]] = field(default_factory=list, repr=False)  # rounds x prompts

    def round_rate(self, r: int) -> float:
        samples = self.rounds[r]
        return sum(len(s.output) for s in samples) / sum(s.seconds for s in samples)

    @property
    def rates(self) -> list[float]:
        return [self.round_rate(r) for r in range(len(self.rounds))]

    @property
    def all_samples(self) -> list[Sample]:
        return [s for samples in self.rounds for s in samples]

    @property
    def tokens(self) -> int:
        return sum(len(s.output) for s in self.rounds[0])

    @property
    def per_forward(self) -> float | None:
        forwards = sum(s.forwards for s in self.all_samples)
        return sum(len(s.output) for s in self.all_samples) / forwards if forwards else None

    @property
    def acceptance_rate(self) -> float | None:
        """MCSD's (seed 001): accepted draft tokens / the longest drafts the steps could have had accepted."""
        longest = sum(s.max_draft_len for s in self.all_samples)
        return sum(s.accepted for s in self.all_samples) / longest if longest else None

    def rates_dv(self) -> tuple[float, float] | None:
        """SpecDec++'s discard rate D/N and verification rate V/N (our methods only)."""
        samples = self.all_samples
        n = sum(len(s.output) for s in samples)
        if not n or not any(s.steps for s in samples):
            return None
        return (sum(s.drafted - s.accepted for s in samples) / n, sum(s.forwards for s in samples) / n)

    def split_ms(self) -> tuple[float, float, float] | None:
        """Mean draft / verify / other ms per step (our methods only)."""
        steps = sum(s.steps for s in self.all_samples)
        if not steps:
            return None
        draft = sum(s.draft_ms for s in self.all_samples) / steps
        verify = sum(s.verify_ms for s in self.all_samples) / steps
        return draft, verify, sum(s.step_ms for s in self.all_samples) / steps - draft - verify

    def ran_as(self) -> str:
        """How the timed replies' target forwards ran (`capture` for rows that do not say; "mixed"
        where they differ: a row timed before and after an adoption)."""
        seen = {s.capture for s in self.all_samples if s.capture is not None}
        return self.capture if not seen else seen.pop() if len(seen) == 1 else "mixed"

    @property
    def outside_share(self) -> float | None:
        """The share of the decoding time (after the prefills) spent outside the models'
        forwards: our own Python per step (our methods on a CPU only)."""
        samples = [s for s in self.all_samples if s.forward_s is not None]
        return outside_share(sum(s.forward_s for s in samples), sum(s.decode_s for s in samples))  # no samples: None

    @property
    def joules_per_token(self) -> float | None:
        samples = self.all_samples
        if not samples or any(s.joules is None for s in samples):
            return None
        return sum(s.joules for s in samples) / max(1, sum(len(s.output) for s in samples))

    @property
    def retimed_replies(self) -> int:
        """Timed replies that met a forward still to compile and were timed again (ours.run)."""
        return sum(1 for s in self.all_samples if s.retimed)

    @property
    def peak_mb(self) -> float | None:
        peaks = [s.peak_mb for s in self.all_samples if s.peak_mb is not None]
        return max(peaks) if peaks else None

    def divergent(self, base: Row) -> int:
        """Prompts whose reply (first round) differs from the base row's."""
        return sum(a.output != b.output for a, b in zip(self.rounds[0], base.rounds[0]))


def ours(pair: ModelPair, method: str, params: dict) -> Callable[..., Sample]:
    """The row's runner; `run.engine` is its own engine (auto's running estimates are not
    shared with other rows; its capture report says what it captured)."""
    engine, setting = pair.engine(), pair.capture

    def run(prompt: list[int], n: int, sampling: SamplingConfig | None = None) -> Sample:
        """One timed reply once the background compiles are done; a reply that met a shape not
        compiled yet (it ran that forward eagerly and asked for it) is timed again once that
        compiled, up to RETIMES times, and says how often (`Sample.retimed`): the bench measures
        the steady state, which the first replies of a session reach after their compiles. So is
        a reply that compiled a shape itself (`--capture on`)."""
        for retimed in range(RETIMES + 1):
            engine.settle()  # forwards compiling in the background (capture auto) are ready before timing
            asked, compiled = engine.compiles_asked(), compiles_run()
            sample = reply(prompt, n, sampling)
            sample.retimed = retimed
            if engine.compiles_asked() == asked and compiles_run() == compiled:
                break
        return sample

    def reply(prompt: list[int], n: int, sampling: SamplingConfig | None) -> Sample:
        engine.target.reset()  # no cross-prompt cache reuse: same work as the peers
        if engine.draft is not None:
            engine.draft.reset()
        t0 = time.perf_counter()
        request = GenerationRequest(prompt, n, sampling or SamplingConfig())
        with engine.lock:  # as in the app: a shape still to compile waits, not the reply
            gen = engine.generate(request, make_method(method, **params)).run()
        s = Sample(gen.output_ids, time.perf_counter() - t0, gen.stats.target_forwards, len(gen.steps),
                   gen.stats.drafted, gen.stats.accepted, gen.stats.max_draft_len, prefill_s=gen.stats.prefill_s,
                   decode_s=gen.stats.decode_s, forward_s=gen.stats.forward_s,
                   cache_mb=sum(m.cache.nbytes() for m in (engine.target, engine.draft) if m is not None) / 2**20,
                   capture="off" if engine.target.runner is None else setting)  # auto on a CPU: as measured
        for step in gen.steps:
            s.draft_ms += step.draft_ms
            s.verify_ms += step.verify_ms
            s.step_ms += step.step_ms
            s.lengths.append(len(step.new_token_ids))
            if step.expected_accept is not None:
                s.expected.append(step.expected_accept)
                s.achieved.append(step.accepted + 1)
        return s

    run.engine = engine
    return run


@contextlib.contextmanager
def assistant_schedule(pair: ModelPair, constant_tokens: int | None) -> Iterator[None]:
    """transformers' assisted generation with a constant number of draft tokens (no dynamic
    schedule, no confidence threshold) for the duration; restored after. None: as configured."""
    if constant_tokens is None or pair.draft is None:
        yield
        return
    cfg = pair.draft.model.generation_config
    saved = {k: getattr(cfg, k, None) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                                "assistant_confidence_threshold")}
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold = (
        constant_tokens, "constant", 0.0)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)


def transformers_generate(pair: ModelPair, constant_tokens: int | None = None, static_cache_len: int | None = None,
                          **generate_kw) -> Callable[..., Sample]:
    """transformers' greedy `generate` on the pair's target with `generate_kw` (e.g.
    assistant_model=..., prompt_lookup_num_tokens=...), the reply cut after its first EOS.
    `static_cache_len`: each reply over a fresh StaticCache of that many slots (one shape for
    every reply, which generate compiles once on a GPU)."""
    model = pair.target.model
    eos = sorted(pair.engine().eos_ids)

    @torch.inference_mode()
    def run(prompt: list[int], n: int) -> Sample:
        ids = torch.tensor([prompt], device=model.device)
        kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **generate_kw)
        if static_cache_len:
            kw["past_key_values"] = StaticCache(config=model.config, max_cache_len=static_cache_len)
        with assistant_schedule(pair, constant_tokens):
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            seconds = time.perf_counter() - t0
        new = out[0, len(prompt):].tolist()
        if eos and any(t in eos for t in new):
            new = new[: next(i for i, t in enumerate(new) if t in eos) + 1]
        return Sample(new, seconds)

    return run


PARAM_OF = {"speculative": ("gamma", int), "beam": ("width", int), "dsbd": ("width", int), "tree": ("preset", str),
            "opt-tree": ("nodes", int), "specdec++": ("threshold", float), "mcsd": ("width", int),
            "lookup": ("lookup_tokens", int)}


def parse_method(spec: str) -> tuple[str, dict]:
    """'speculative:3' -> gamma 3; 'speculative:6@0.4' also stops drafting below confidence 0.4;
    'opt-tree:25@adaptive': a node budget chosen per step from the cost profile, at most 25;
    'dsbd:2@adaptive': W_L = 2, each forest's depth chosen per step by measurement (0..gamma);
    'auto@nolookup': auto without its prompt-lookup candidate; 'mcsd:4-2-2-1-1': MCSD on that k-config
    ('mcsd:4': forks of 4 chains)."""
    spec, _, extra = spec.partition("@")  # 'auto@0.2' has no ':'
    name, _, value = spec.partition(":")
    switch = "adaptive_gamma" if name == "dsbd" else "adaptive_nodes"
    params: dict = {switch: True} if extra == "adaptive" else {"lookup": False} if extra == "nolookup" else \
        {"confidence": float(extra)} if extra else {}
    if name == "mcsd" and "-" in value:
        params["k_config"] = value.replace("-", ",")
    elif value and name in PARAM_OF:
        key, kind = PARAM_OF[name]
        params[key] = kind(value)
    return name, params


def target_dtype(pair: ModelPair) -> str:
    """The target's dtype as the tables show it, with its quantization (e.g. bfloat16+int4)."""
    t_dtype = str(pair.target.model.dtype).removeprefix("torch.")
    t_dtype = t_dtype if pair.target.spec.quantization == "none" else f"{t_dtype}+{pair.target.spec.quantization}"
    return f"{t_dtype} stand-in {pair.target.spec.stand_in}" if pair.target.spec.stand_in else t_dtype


def make_rows(pair: ModelPair, specs: list[str], gamma: int, peers: bool) -> list[Row]:
    t_dtype = target_dtype(pair)
    d_dtype = str(pair.draft.model.dtype).removeprefix("torch.") if pair.draft else "-"
    pair_dtype = t_dtype if d_dtype in ("-", t_dtype) else f"{t_dtype}/{d_dtype}"
    rows = []
    for spec in specs:
        method, params = parse_method(spec)
        if method == "speculative" and not params:
            params = {"gamma": gamma}
        name = method + "".join(f" {k}={v}" for k, v in params.items())
        run = ours(pair, method, params)
        rows.append(Row(name, t_dtype if method == AR else pair_dtype, run, capture=pair.capture))
    if peers:
        rows.append(Row("transformers greedy", t_dtype, transformers_generate(pair)))
        if pair.draft is not None:
            rows.append(Row("transformers assisted", pair_dtype, transformers_generate(
                pair, assistant_model=pair.draft.model, tokenizer=None)))
    for row in rows:
        row.stand_in = pair.target.spec.stand_in or None
    return rows
