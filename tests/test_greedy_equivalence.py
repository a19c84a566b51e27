"""Greedy methods reproduce target greedy decoding token for token (tiny float64 models),
with transformers' own generate as the oracle."""

import copy

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, make_method

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3], [1, 17, 22, 22, 9, 60, 33, 12]]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(engine, prompt, n, name, **params):
    return engine.generate(GenerationRequest(list(prompt), n), make_method(name, **params)).run()


def near_copy(model, noise, seed):
    """A draft that mostly agrees with the target: its weights plus small noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=g, dtype=param.dtype) * noise)
    return draft


@pytest.mark.parametrize("prompt", PROMPTS)
def test_autoregressive_greedy_equals_transformers_generate(tiny_engine, tiny_target, prompt):
    ours = run(tiny_engine, prompt, 40, "autoregressive")
    assert ours.output_ids == hf_greedy(tiny_target, prompt, 40)


@pytest.mark.parametrize("draft_kind", ["random", "near-copy", "same-model"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_speculative_greedy_equals_autoregressive(tiny_target, tiny_draft, draft_kind, gamma):
    draft = {"random": tiny_draft, "near-copy": near_copy(tiny_target, 0.003, 7), "same-model": tiny_target}[draft_kind]
    engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    for prompt in PROMPTS:
        reference = run(engine, prompt, 40, "autoregressive").output_ids
        spec = run(engine, prompt, 40, "speculative", gamma=gamma)
        assert spec.output_ids == reference
        assert spec.stats.target_forwards <= len(reference)
        if draft_kind == "same-model":  # every draft is accepted: ceil(n / (gamma + 1)) forwards
            assert spec.stats.accepted == spec.stats.drafted


def test_speculative_accepts_drafts_when_draft_agrees(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), draft=near_copy(tiny_target, 0.003, 7), eos_ids=[EOS])
    gen = run(engine, PROMPTS[0], 40, "speculative", gamma=4)
    assert gen.stats.accepted > 0 and gen.stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_beam_equals_transformers_beam_search(tiny_engine, tiny_target, prompt, width):
    """Same definition on both sides: sum of log-probs (length_penalty=0), finished
    hypotheses only from the top-W candidates, early_stopping=False (transformers default)."""
    n = 10
    hf = tiny_target.generate(
        torch.tensor([prompt]), max_new_tokens=n, num_beams=width, do_sample=False, length_penalty=0.0,
        eos_token_id=EOS, pad_token_id=0,
    )[0, len(prompt):].tolist()
    if EOS in hf:  # transformers pads finished hypotheses after EOS
        hf = hf[: hf.index(EOS) + 1]
    ours = run(tiny_engine, prompt, n, "beam", width=width)
    assert ours.output_ids == hf


def test_beam_width_one_is_greedy(tiny_engine):
    for prompt in PROMPTS:
        assert run(tiny_engine, prompt, 20, "beam", width=1).output_ids == run(
            tiny_engine, prompt, 20, "autoregressive").output_ids


def test_eos_and_max_tokens_stop(tiny_target):
    eos_engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_target, eos_ids=[EOS])
    for name in ("autoregressive", "speculative"):
        gen = run(eos_engine, [1, 5, 9, 13, 7], 200, name)
        ids = gen.output_ids
        assert (ids[-1] == EOS and gen.stats.finish_reason == "eos") or len(ids) == 200
        assert EOS not in ids[:-1]
        gen = run(eos_engine, [1, 5, 9, 13, 7], 7, name)
        assert len(gen.output_ids) <= 7


def test_stop_string_truncates_text(tiny_engine):
    ref = run(tiny_engine, PROMPTS[1], 30, "autoregressive")
    stop = ref.text.split()[3]  # the 4th emitted word
    gen = tiny_engine.generate(
        GenerationRequest(list(PROMPTS[1]), 30, stop_strings=(stop,)), make_method("speculative", gamma=3)
    ).run()
    assert gen.stats.finish_reason == "stop"
    assert stop not in gen.text and ref.text.startswith(gen.text)


def test_tiny_models_are_not_trivial():
    """Guard: the random draft must disagree with the target often, or the tests above prove little."""
    target, draft = tiny_llama(0, layers=3), tiny_llama(1, layers=1)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    gen = run(engine, PROMPTS[0], 40, "speculative", gamma=4)
    assert gen.stats.acceptance_rate < 0.5


def test_stop_string_spanning_steps_streams_cleanly(tiny_engine):
    ref = run(tiny_engine, PROMPTS[1], 30, "autoregressive")
    words = ref.text.split()
    stop = f"{words[4]} {words[5]}"  # spans two tokens, so usually two steps
    for name in ("autoregressive", "speculative"):
        gen = tiny_engine.generate(GenerationRequest(list(PROMPTS[1]), 30, stop_strings=(stop,)), make_method(name))
        streamed = "".join(step.new_text for step in gen)
        assert gen.stats.finish_reason == "stop"
        assert streamed == gen.text == ref.text[: ref.text.find(stop)]


@pytest.mark.parametrize("confidence", [0.0, 0.3, 0.999])
def test_confidence_stopped_chains_stay_lossless(tiny_target, confidence):
    """Drafting stops after a token the draft gave less than `confidence`: chains get
    shorter (0.999: one draft per step), replies stay the target's greedy ones."""
    engine = Engine(tiny_target, TinyTokenizer(), draft=near_copy(tiny_target, 0.003, 7), eos_ids=[EOS])
    for prompt in PROMPTS:
        reference = run(engine, prompt, 40, "autoregressive").output_ids
        gen = run(engine, prompt, 40, "speculative", gamma=6, confidence=confidence)
        assert gen.output_ids == reference
        drafted = [s.drafted for s in gen.steps]
        if confidence == 0.999:
            assert max(drafted) <= 1
        if confidence == 0.0:
            assert max(drafted) == 6
