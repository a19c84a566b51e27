"""The bundled SmolLM2-135M-Instruct in float32: our methods against transformers' own
generate, chat templating and stops on the real tokenizer."""

import pytest
import torch

from specui.chat import build_prompt, stop_token_ids
from specui.engine import Engine, GenerationRequest, make_method
from specui.service.chat_service import ChatService
from specui.settings import ChatSettings

pytestmark = pytest.mark.bundled

CHATS = [
    [{"role": "user", "content": "Give me three tips for learning to cook."}],
    [{"role": "user", "content": "What is 12 times 7?"}, {"role": "assistant", "content": "12 times 7 is 84."},
     {"role": "user", "content": "And divided by 4?"}],
]


@pytest.fixture(scope="module")
def prompts(bundled_pair):
    tok = bundled_pair.target.tokenizer
    return [build_prompt(tok, chat, 8000)[0] for chat in CHATS]


def run(engine, prompt, n, name, **params):
    return engine.generate(GenerationRequest(list(prompt), n), make_method(name, **params)).run()


def test_chat_prompt_uses_the_models_template(bundled_pair):
    tok = bundled_pair.target.tokenizer
    ids, dropped = build_prompt(tok, CHATS[1], 8000)
    text = tok.decode(ids)
    assert dropped == 0
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")
    ids_short, dropped = build_prompt(tok, CHATS[1], len(ids) - 1)  # too long: the oldest turn goes
    assert dropped == 2 and tok.decode(ids_short).count("<|im_start|>user") == 1


def test_autoregressive_greedy_equals_transformers(bundled_pair, prompts):
    engine = bundled_pair.engine()
    model = bundled_pair.target.model
    eos = stop_token_ids(bundled_pair.target.tokenizer, model.generation_config)
    for prompt in prompts:
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=eos)
        assert run(engine, prompt, 32, "autoregressive").output_ids == hf[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft", ["default", "target-as-draft"])
def test_speculative_greedy_equals_autoregressive(bundled_pair, prompts, draft):
    t = bundled_pair.target
    draft_model = bundled_pair.draft.model if draft == "default" else t.model
    engine = Engine(t.model, t.tokenizer, draft=draft_model, eos_ids=stop_token_ids(t.tokenizer))
    for prompt in prompts:
        reference = run(engine, prompt, 32, "autoregressive").output_ids
        spec = run(engine, prompt, 32, "speculative", gamma=4)
        assert spec.output_ids == reference
        if draft == "target-as-draft":
            assert spec.stats.mean_accepted_length > 3


def test_beam_equals_transformers_beam_search(bundled_pair, prompts):
    engine = bundled_pair.engine()
    model = bundled_pair.target.model
    prompt = prompts[0]
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, num_beams=2, do_sample=False,
                        length_penalty=0.0, eos_token_id=list(engine.eos_ids))[0, len(prompt):].tolist()
    assert run(engine, prompt, 8, "beam", width=2).output_ids == hf


def test_service_reply_stops_at_end_of_turn(bundled_pair):
    service = ChatService(bundled_pair)
    gen, _ = service.start([{"role": "user", "content": "What is the capital of France?"}],
                           ChatSettings(method="speculative", max_new_tokens=64))
    steps = list(service.stream(gen))
    assert gen.stats.finish_reason == "eos"
    assert "Paris" in gen.text and "<|im_end|>" not in gen.text
    assert "".join(s.new_text for s in steps) == gen.text


def test_auto_greedy_equals_autoregressive_in_float32(bundled_pair, prompts):
    """A synthetic profile on the edge (so auto switches between chains and autoregressive
    steps, probing every 2) keeps the test quick; measuring is tested on tiny models."""
    from test_profile import synthetic

    from specui.engine.costs import EngineCosts

    engine = bundled_pair.engine()
    engine.costs = EngineCosts(profile=synthetic(t1=10.0, slope=0.3, draft=1.5), note="synthetic")
    for prompt in prompts[:2]:
        reference = run(engine, prompt, 48, "autoregressive").output_ids
        gen = run(engine, prompt, 48, "auto", probe_every=2, calibrate=False)
        assert gen.output_ids == reference
        assert all(s.choice for s in gen.steps)


def test_specdec_with_the_shipped_head_equals_autoregressive(bundled_pair, prompts):
    """The shipped acceptance head loads for the shipped draft (bundled_pair loads it by
    default) and greedy SpecDec++ reproduces autoregressive decoding in float32, at the
    tuned threshold and at a low and a high one."""
    assert bundled_pair.head.head is not None, bundled_pair.head.problem
    engine = bundled_pair.engine()
    for prompt in prompts:
        reference = run(engine, prompt, 40, "autoregressive").output_ids
        for threshold in (None, 0.2, 0.9):
            gen = run(engine, prompt, 40, "specdec++", threshold=threshold)
            assert gen.output_ids == reference
            assert all(s.threshold is not None and s.stop_reason for s in gen.steps)
        assert max(s.gamma for s in gen.steps) > 2  # at H = 0.9 some chains run long


def test_a_draft_quantization_the_specui_draft_cannot_take_is_said_not_dropped(bundled_pair):
    from specui.service.pair import default_draft_source, load_specui_draft
    from specui.weights.loading import ModelSpec

    draft = load_specui_draft(ModelSpec(default_draft_source(), dtype="float32", quantization="int8"),
                              bundled_pair.target)
    assert any(n.startswith("draft quantization int8 not applied") for n in draft.notes)
    plain = load_specui_draft(ModelSpec(default_draft_source(), dtype="float32"), bundled_pair.target)
    assert not any("not applied" in n for n in plain.notes)
