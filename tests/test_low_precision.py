"""Low precision, honestly (DESIGN.md 4.3). In bfloat16 a speculative method's greedy reply
may differ from autoregressive decoding, because scoring k tokens in one forward rounds
differently from scoring them one at a time. Such a divergence must be a near-tie: at the
first divergent position, the gap between the two tokens' logits (as autoregressive decoding
computed them) is no larger than the largest difference between the two computations' logits
there. Anything else would be a bug in the method, not rounding.

The logits are captured from the forwards the methods really ran (a wrapper on the target
session's one forward), keyed by the exact token context each logits row was computed for."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, make_method

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3], [1, 17, 22, 22, 9, 60, 33, 12], [1, 8, 8, 30], [1, 50, 6]]


def record_logits(engine: Engine) -> dict[tuple[int, ...], torch.Tensor]:
    """Wrap the target session's forward: every chain forward's logits rows, keyed by the
    context (all token ids up to and including the row's own token) they were computed for."""
    session = engine.target
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    forward = session._forward

    def recording(input_ids, **kwargs):
        before = list(session.cached_ids)
        out = forward(input_ids, **kwargs)
        if kwargs.get("positions") is None:  # a chain forward (trees are not needed here)
            ids = before + input_ids[0].tolist()
            rows = out[:, : session.vocab_size].float()
            for j in range(rows.shape[0]):
                seen[tuple(ids[: len(ids) - rows.shape[0] + j + 1])] = rows[j].clone()
        return out

    session._forward = recording
    return seen


def generate(engine: Engine, prompt: list[int], n: int, method: str, **params) -> list[int]:
    engine.target.reset()
    if engine.draft is not None:
        engine.draft.reset()
    return engine.generate(GenerationRequest(list(prompt), n), make_method(method, **params)).run().output_ids


def check_near_ties(make_engine, prompts, n, runs) -> tuple[int, list[float], float]:
    """Compare each (method, params) in `runs` with autoregressive decoding on every prompt;
    returns (divergent replies, the gap/difference ratios at their first divergences, the
    largest logit difference over the contexts both computed)."""
    divergent, ratios, most = 0, [], 0.0
    ar_engine = make_engine()
    ar_logits = record_logits(ar_engine)
    for prompt in prompts:
        ar = generate(ar_engine, prompt, n, "autoregressive")
        for method, params in runs:
            engine = make_engine()
            spec_logits = record_logits(engine)
            ours = generate(engine, prompt, n, method, **params)
            i = next((i for i, (a, b) in enumerate(zip(ar, ours)) if a != b), None)
            for context in set(ar_logits) & set(spec_logits):
                most = max(most, (ar_logits[context] - spec_logits[context]).abs().max().item())
            if i is None:
                assert len(ours) == len(ar) or EOS in ours, (method, params, prompt)
                continue
            divergent += 1
            context = tuple(prompt + ar[:i])
            la, lb = ar_logits[context], spec_logits[context]
            a, b = ar[i], ours[i]
            assert la.argmax().item() == a and lb[b] == lb.max(), "each reply is the argmax of its own logits"
            gap, difference = (la[a] - la[b]).item(), (la - lb).abs().max().item()
            assert gap <= difference, (f"{method} {params} diverged at {i} with a logit gap of {gap:.4g}, larger "
                                       f"than the two computations' largest difference {difference:.4g}: not rounding")
            ratios.append(gap / difference)
    return divergent, ratios, most


def test_bf16_speculative_divergences_on_a_tiny_model_are_near_ties():
    target = tiny_llama(0, layers=3, dtype=torch.bfloat16)
    draft = tiny_llama(0, layers=3, dtype=torch.bfloat16)  # the same weights: every draft is the target's pick
    runs = [("speculative", {"gamma": g}) for g in (2, 4, 7)] + [("auto", {})]
    divergent, ratios, most = check_near_ties(
        lambda: Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS]), PROMPTS, 48, runs)
    # not vacuous: where bf16 chains of 3-8 tokens round differently from one token at a time
    # (CPUs with bfloat16 dot products) some replies diverge here; on a CPU without AVX-512 the
    # logits differed by at most 1/64 and no reply diverged: nothing to check there
    if divergent == 0:
        pytest.skip(f"no bf16 reply diverged on this CPU (largest logit difference {most:.4g})")
    print(f"\n{divergent} divergent replies of {len(PROMPTS) * len(runs)}; gap/difference at each: "
          + ", ".join(f"{r:.2f}" for r in ratios))


def test_float32_keeps_exact_equality():
    """The rule with --dtype float32: no divergence at all (the greedy-equivalence tests hold
    it in float64 for every method; this is the same check in float32 on a chain)."""
    target = tiny_llama(0, layers=3, dtype=torch.float32)
    draft = tiny_llama(0, layers=3, dtype=torch.float32)
    runs = [("speculative", {"gamma": 4})]
    divergent, _, _ = check_near_ties(lambda: Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS]),
                                   PROMPTS[:3], 32, runs)
    assert divergent == 0


@pytest.mark.bundled
def test_bundled_pair_in_bfloat16_diverges_only_at_near_ties():
    from specui.chat import build_prompt
    from specui.service.pair import default_draft_source, load_pair
    from specui.weights.loading import BUNDLED, ModelSpec

    spec = ModelSpec(BUNDLED, dtype="bfloat16", device="cpu")
    pair = load_pair(spec, spec.with_source(default_draft_source()))
    chats = ["Give me three tips for learning to play the guitar.", "Why is the sky blue?",
             "Write a haiku about autumn."]
    prompts = [build_prompt(pair.target.tokenizer, [{"role": "user", "content": c}], 2048)[0] for c in chats]
    divergent, ratios, _ = check_near_ties(pair.engine, prompts, 48, [("speculative", {"gamma": 3})])
    print(f"\nbundled pair, bfloat16: {divergent} of {len(prompts)} replies diverge; gap/difference "
          + ", ".join(f"{r:.2f}" for r in ratios))
