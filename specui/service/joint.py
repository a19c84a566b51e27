"""Quantization and method as one choice (`--quantization auto` with a draft).

`--quantization auto` first loads the option whose single token is fastest here
(specui.weights.quant_choice: each option timed for 1 token and for 4 tokens in one forward).
With a draft that is not yet the right question: int4 on a CPU without matrix units costs
more per verified token than bfloat16 does (its kernel's cost grows with the tokens scored),
so bfloat16 with speculation can commit more tokens per second than int4 decoding
autoregressively, or int4 with speculation can beat both. So once the pair is loaded, each
option's committed tokens per ms is predicted with auto's own chain model
(specui.engine.methods.auto): the best of autoregressive, 1 / t(1), and of chains of g = 1..G
drafts, E(alpha, g) / (g t_draft + t(g + 1)), where t(k) runs through the option's two
measured points, alpha and t_draft come from a short probe reply (speculative gamma 4, eager,
greedy) on the loaded pair. If another option is predicted MARGIN faster, the target is
reloaded with it. The probe's figures are cached beside the quantization choice (keyed by the
options' measurements, the draft's files, the CPU and threads), so a later load only
predicts."""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from specui.chat import render_ids
from specui.engine.loop import GenerationRequest
from specui.engine.measure import cache_root, cpu_signature, forward_ms, slower_then
from specui.engine.methods.chain_rate import chain_tokens
from specui.engine.methods.speculative import Speculative
from specui.weights.dtypes import measured_stamp, read_cache, write_cache
from specui.weights.quant_choice import OptionCost, identity
from specui.weights.sources import ModelSpec

MAX_GAMMA = 6  # auto's default longest chain
MARGIN = 1.10  # another option must be predicted this much faster to be reloaded
PROBE_GAMMA = 4
PROBE_TOKENS = 48
# a cached probe whose draft ms a token is `slower_then` one draft forward now by this is probed again
# (wider than the profile's: a chain's token costs a little more than a bare forward)
STALE_SLACK = 2.0
PROBE_PROMPT = "Explain in a few sentences how a rainbow forms."
PRIOR_ALPHA = 0.5  # where the probe drafted nothing (e.g. it stopped at once)


@dataclass(frozen=True)
class PairProbe:
    """What a short reply on the loaded pair showed: the draft's per-token acceptance (the
    geometric MLE over chains: accepted / (accepted + steps that rejected one)) and its ms a token."""

    alpha: float
    draft_ms: float
    drafted: int = 0


@dataclass(frozen=True)
class Prediction:
    quantization: str
    rate: float  # committed tokens per ms
    gamma: int  # 0: autoregressive
    dtype: str = ""

    @property
    def method(self) -> str:
        return "autoregressive" if self.gamma == 0 else f"speculative gamma {self.gamma}"

    def describe(self) -> str:
        computes = f" ({self.dtype})" if self.quantization == "none" and self.dtype else ""
        return f"{self.quantization}{computes} {1000 * self.rate:.1f} tok/s ({self.method})"


def verify_ms(option: OptionCost, k: int) -> float:
    """The option's ms for k tokens in one forward, on the line through its measured 1 and 4
    (never below the cheaper of the two: a measured dip is noise, not a cheaper forward)."""
    one, four = float(option.ms_token), float(option.ms_four or option.ms_token)
    return max(min(one, four), one + (four - one) * (k - 1) / 3.0)


def predict(option: OptionCost, probe: PairProbe, max_gamma: int = MAX_GAMMA) -> Prediction:
    """The option's best committed tokens per ms: autoregressive or a chain of 1..max_gamma."""
    alpha = min(max(probe.alpha, 0.0), 0.999)
    best = Prediction(option.quantization, 1.0 / float(option.ms_token), 0, option.dtype)
    for g in range(1, max_gamma + 1):
        rate = chain_tokens(alpha, g) / (g * probe.draft_ms + verify_ms(option, g + 1))
        if rate > best.rate:
            best = Prediction(option.quantization, rate, g, option.dtype)
    return best


def joint_choice(options: list[OptionCost], current: str, probe: PairProbe,
                 margin: float = MARGIN) -> tuple[str, str]:
    """(the option to use, why): `current` unless another is predicted `margin` faster."""
    measured = [o for o in options if o.ms_token]
    predictions = {o.quantization: predict(o, probe) for o in measured}
    mine = predictions.get(current)
    best = max(predictions.values(), key=lambda p: p.rate)
    chosen = best.quantization if mine is None or best.rate > margin * mine.rate else current
    others = "; ".join(p.describe() for q, p in predictions.items() if q != chosen)
    verdict = f"reloaded with {chosen}" if chosen != current else f"{chosen} kept"
    note = (f"target quantization auto with the draft: {verdict}, predicted {predictions[chosen].describe()} "
            f"against {others or 'nothing else'}; alpha {probe.alpha:.2f}, draft {probe.draft_ms:.1f} ms a token, "
            f"from a probe that drafted {probe.drafted} tokens (--quantization {chosen} to skip the probe)")
    return chosen, note


def probe_pair(pair) -> PairProbe:
    """A short greedy reply with speculative gamma PROBE_GAMMA on `pair`, eagerly."""
    engine = pair.engine(capture="off")
    try:
        tokenizer = pair.target.tokenizer
        ids = render_ids(tokenizer, [{"role": "user", "content": PROBE_PROMPT}])
        generation = engine.generate(GenerationRequest(ids, PROBE_TOKENS), Speculative(gamma=PROBE_GAMMA))
        with torch.inference_mode():
            for _ in generation:
                pass
    finally:
        engine.close()
    chains = [s for s in generation.steps if s.drafted > 0]
    accepted = sum(s.accepted for s in chains)
    rejected = sum(1 for s in chains if s.accepted < s.drafted)
    drafted = sum(s.drafted for s in chains)
    alpha = accepted / (accepted + rejected) if accepted + rejected else PRIOR_ALPHA
    # the first step also feeds the draft the prompt: it is left out of the draft's cost
    per_token = [s.draft_ms / s.drafted for s in chains[1:]] or [s.draft_ms / s.drafted for s in chains] or [0.0]
    return PairProbe(round(alpha, 4), round(statistics.median(per_token), 3), drafted)


def draft_token_ms(pair) -> float:
    """One draft token's forward after 64 cached, timed now (median of 3, eagerly)."""
    engine = pair.engine(capture="off")
    try:
        with torch.inference_mode():
            return forward_ms(engine.draft, 64, 1, 3, quick=True)
    finally:
        engine.draft.reset()
        engine.close()


def default_cache_file() -> Path:
    return cache_root() / "joint_choices.json"


def probe_key(options: list[OptionCost], draft: ModelSpec) -> str:
    raw = json.dumps([[o.to_dict() for o in options], identity(draft), draft.dtype, draft.quantization,
                      cpu_signature(), torch.get_num_threads(), torch.__version__])  # the draft as it runs
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def cached_probe(pair, options: list[OptionCost], draft: ModelSpec, cache_file: Path | None = None) -> PairProbe:
    """The pair's probe from the cache, else probed now and cached (a corrupt entry is probed again,
    and so is one whose draft ms a token is over STALE_SLACK times what a draft token costs now)."""
    path = cache_file if cache_file is not None else default_cache_file()
    cache = read_cache(path)
    key = probe_key(options, draft)
    try:
        entry = cache[key]
        cached = PairProbe(float(entry["alpha"]), float(entry["draft_ms"]), int(entry["drafted"]))
    except (KeyError, TypeError, ValueError):
        cached = None
    if cached is not None and not slower_then(cached.draft_ms, draft_token_ms(pair), STALE_SLACK):
        return cached
    probe = probe_pair(pair)
    cache[key] = {"alpha": probe.alpha, "draft_ms": probe.draft_ms, "drafted": probe.drafted,
                  "measured": measured_stamp()}
    write_cache(path, cache)
    return probe


def choose_with_draft(pair, draft: ModelSpec, progress=None) -> tuple[str, str] | None:
    """(the target's quantization to use with this draft, why), or None where there is no
    choice to make (no draft, or quantization auto had a single option to measure).
    `progress(fraction, what)` hears the probe begin."""
    options = [o for o in pair.target.options if o.ms_token]
    current = pair.target.spec.quantization
    if pair.draft is None or len(options) < 2:
        return None
    if progress is not None:
        progress(1.0, f"target quantization auto: a short reply with the draft on {current} (cached after)")
    try:
        probe = cached_probe(pair, options, draft)
    except Exception as e:  # noqa: BLE001 - the pair as loaded still works; the note says why it stays
        return current, f"target quantization auto with the draft: kept {current}, the probe failed ({e})"[:300]
    return joint_choice(options, current, probe)


def predicted_with_draft(pair, options: list[OptionCost]) -> tuple[dict[str, str] | None, str]:
    """For the Model tab's table of options: (quantization -> its predicted best with the
    loaded draft, a sentence on where alpha and the draft's cost came from), or (None, "")
    without a draft or where the probe fails."""
    measured = [o for o in options if o.ms_token]
    if pair.draft is None or not measured:
        return None, ""
    try:
        probe = cached_probe(pair, measured, pair.draft.spec)
    except Exception:  # noqa: BLE001 - the table stands without the column
        return None, ""
    cells = {}
    for option in measured:
        best = predict(option, probe)
        cells[option.quantization] = f"{1000 * best.rate:.1f} tok/s, " + (f"gamma {best.gamma}" if best.gamma else "AR")
    return cells, (f" With the draft: auto's chain model at alpha {probe.alpha:.2f} and {probe.draft_ms:.1f} ms a "
                   f"draft token (a short reply on the loaded pair).")
