"""A draft that reads the target's features (EAGLE-style input, specui/engine/feature_draft.py):
greedy methods still reproduce the target's greedy decoding, the draft is fed the target's
true states wherever the target computed them (its logits equal a from-scratch forward with
those states), and a feature draft saves, loads and decodes."""

import copy

import pytest
import torch
from conftest import EOS, TINY_VOCAB, TinyTokenizer, tiny_llama

from specui.draft_model import SpecUIDraftForCausalLM, add_feature_input, reads_features
from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.feature_draft import FeatureDraftSession

PROMPTS = [[1, 5, 9, 13, 7], [1, 17, 22, 22, 9, 60, 33, 12]]


def feature_draft(target, seed: int, noise: float = 0.3) -> SpecUIDraftForCausalLM:
    """A feature draft with the target's weights, its feature mixing random (`noise`): it
    agrees with the target often, not always."""
    config = copy.deepcopy(target.config)
    config.specui_draft = {"head_size": TINY_VOCAB}
    torch.manual_seed(seed)
    draft = SpecUIDraftForCausalLM(config).to(target.dtype)
    draft.load_state_dict(target.state_dict(), strict=False)
    draft = add_feature_input(draft)
    with torch.no_grad():
        draft.feature_fc.weight[:, config.hidden_size:].normal_(0, noise)
    return draft.eval()


def run(engine, prompt, n, name, **params):
    return engine.generate(GenerationRequest(list(prompt), n), make_method(name, **params)).run()


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, layers=3)
    return target, feature_draft(target, 3)


def test_feature_draft_gets_a_feature_session(pair):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    assert reads_features(draft.config) and isinstance(engine.draft, FeatureDraftSession)
    assert engine.target.features is not None


@pytest.mark.parametrize("method,params", [
    ("speculative", {"gamma": 1}), ("speculative", {"gamma": 4}), ("tree", {"preset": "binary-14"}),
    ("opt-tree", {"nodes": 12}), ("dsbd", {"width": 1, "draft_width": 3}), ("ems-sd", {}),
])
def test_greedy_methods_with_a_feature_draft_equal_autoregressive(pair, method, params):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    for prompt in PROMPTS:
        reference = run(engine, prompt, 30, "autoregressive").output_ids
        assert run(engine, prompt, 30, method, **params).output_ids == reference


def shifted_states(target, ids: list[int]) -> torch.Tensor:
    """The target's states after the final norm, moved one position on (zeros at 0): the
    feature each position of `ids` should read."""
    with torch.no_grad():
        states = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return torch.cat([torch.zeros_like(states[:1]), states[:-1]])


@pytest.mark.parametrize("method", ["speculative", "opt-tree"])
def test_the_draft_reads_the_targets_true_states_after_steps(pair, method):
    """After a generation (drafts accepted and rejected, trees committed), the draft's next
    proposal equals a from-scratch forward over the whole sequence with the target's states."""
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    gen = run(engine, PROMPTS[1], 25, method)
    assert gen.stats.drafted > gen.stats.accepted > 0  # both kinds of step happened
    ids = PROMPTS[1] + gen.output_ids
    engine.target.advance(ids, need=1)  # the target holds its state for every position now
    ours = engine.draft.advance(ids, need=1)[-1]
    with torch.no_grad():
        fresh = draft(input_ids=torch.tensor([ids]), features=shifted_states(target, ids)[None]).logits[0, -1]
    torch.testing.assert_close(ours, fresh[: ours.shape[-1]], rtol=1e-9, atol=1e-9)
    assert engine.draft.true_len == len(ids)


def test_positions_fed_zeros_are_fed_again_once_the_target_knows_them(pair):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    t, d = engine.target, engine.draft
    prompt = PROMPTS[0]
    t.prefill(prompt)
    d.prefill(prompt)
    d.advance(prompt + [11, 12], need=1)  # two proposals: fed without the target's state
    assert d.true_len == len(prompt) and d.length == len(prompt) + 2
    t.advance(prompt + [11, 12], need=3)  # the target scores them
    d.advance(prompt + [11, 12, 13], need=1)
    assert d.true_len == len(prompt) + 3  # 11 and 12 were fed again with the target's states


def test_a_feature_draft_saves_and_loads(tmp_path, pair):
    from specui.draft_model import load_draft, save_draft

    target, draft = pair
    save_draft(draft.float(), tmp_path / "d", quantized=False)
    loaded = load_draft(tmp_path / "d", target.float(), dtype=torch.float64)
    target.double()
    draft.double()
    assert reads_features(loaded.config)
    torch.testing.assert_close(loaded.feature_fc.weight, draft.feature_fc.weight, rtol=1e-3, atol=1e-3)
    engine = Engine(target, TinyTokenizer(), draft=loaded, eos_ids=[EOS])
    assert run(engine, PROMPTS[0], 20, "speculative", gamma=3).output_ids == \
        run(engine, PROMPTS[0], 20, "autoregressive").output_ids
