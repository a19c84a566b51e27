"""SpecDec++: the acceptance head (own weights per block), lossless adaptive drafting (greedy
equals autoregressive, the stop rule follows 1 - prod a_t > H), the exact greedy replay the
sweep uses, head training end to end on a tiny pair, and every way a head can be unusable."""

import json

import pytest
import torch
from conftest import EOS, TinyTokenizer, save_tiny_model, tiny_llama
from test_train import write_prompts

from specui.bench.prompts import load_prompts
from specui.chat import stop_token_ids
from specui.engine import Engine, GenerationRequest, make_method
from specui.errors import SpecUIError
from specui.heads.acceptance import AcceptanceHead, draft_fingerprint, load_head, save_head
from specui.service.pair import load_pair
from specui.train import acceptance as acc
from specui.train.__main__ import main as train_main
from specui.train.data import collect
from specui.train.distill import build_draft, choose_head_tokens
from specui.weights.draft import load_draft, save_draft
from specui.weights.loading import ModelSpec, load_model

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3], [1, 17, 22, 22, 9, 60, 33, 12]]


def make_head(hidden: int, depth: int, bias: float, seed: int = 0, reads: str = "after") -> AcceptanceHead:
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden, depth, reads=reads).double()
    with torch.no_grad():
        head.out.bias.fill_(bias)
    return head.eval()


def run(engine, prompt, n, name, **params):
    return engine.generate(GenerationRequest(list(prompt), n), make_method(name, **params)).run()


def test_head_blocks_have_their_own_weights():
    head = AcceptanceHead(16, depth=3)
    weights = [b.linear.weight for b in head.blocks]
    assert len({w.data_ptr() for w in weights}) == 3
    assert sum(p.numel() for p in head.parameters()) == 3 * (16 * 16 + 16) + 17
    with torch.no_grad():
        weights[0].add_(1.0)
    assert not torch.equal(weights[0], weights[1])
    assert AcceptanceHead(16, depth=0)(torch.zeros(4, 16)).shape == (4,)  # D = 0: one linear layer


@pytest.mark.parametrize("reads", ["after", "before"])
@pytest.mark.parametrize("threshold,gamma_max", [(0.2, 4), (0.6, 8), (0.9, 16)])
def test_greedy_specdec_equals_autoregressive(tiny_target, threshold, gamma_max, reads):
    from test_greedy_equivalence import near_copy

    for draft in (tiny_llama(1, layers=1), near_copy(tiny_target, 0.003, 7)):
        head = make_head(32, 2, bias=2.0, reads=reads)
        engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS], acceptance_head=head)
        for prompt in PROMPTS:
            reference = run(engine, prompt, 40, "autoregressive").output_ids
            gen = run(engine, prompt, 40, "specdec++", threshold=threshold, gamma_max=gamma_max)
            assert gen.output_ids == reference
            for step in gen.steps:
                assert step.gamma <= gamma_max and step.threshold == threshold
                risks = [n.reject_pred for n in step.nodes if n.reject_pred is not None]
                assert all(r <= threshold for r in risks[:-1])  # drafting went on only under H
                if step.stop_reason == "threshold":
                    assert risks[-1] > threshold
                assert risks == sorted(risks)  # 1 - prod a_i only grows


def test_stop_rule_follows_the_head(tiny_target):
    """A head that predicts acceptance ~1 drafts to gamma_max; one that predicts ~0 stops after
    one candidate."""
    draft = tiny_llama(1, layers=1)
    for bias, want in ((30.0, 6), (-30.0, 1)):
        engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[], acceptance_head=make_head(32, 0, bias))
        gen = run(engine, PROMPTS[0], 30, "specdec++", threshold=0.5, gamma_max=6)
        assert [s.gamma for s in gen.steps[:3]] == [want] * 3  # (later chains are cut by the tokens left)


def test_no_head_falls_back_to_fixed_gamma_with_a_note(tiny_engine):
    gen = run(tiny_engine, PROMPTS[0], 20, "specdec++", gamma=3)
    assert gen.output_ids == run(tiny_engine, PROMPTS[0], 20, "autoregressive").output_ids
    assert "runs as speculative with fixed gamma 3" in gen.steps[0].notes[0]
    assert all(s.gamma <= 3 for s in gen.steps) and not gen.steps[1].notes


def test_stats_report_discard_and_verification_rates(tiny_engine):
    stats = run(tiny_engine, PROMPTS[1], 24, "speculative", gamma=4).stats
    d = stats.to_dict()
    assert d["discard_rate"] == pytest.approx((stats.drafted - stats.accepted) / stats.new_tokens, abs=1e-4)
    assert d["verification_rate"] == pytest.approx(stats.target_forwards / stats.new_tokens, abs=1e-4)


@pytest.mark.parametrize("reads", ["after", "before"])
def test_replay_counts_match_the_engine(tiny_target, reads):
    """The sweep's greedy replay along the target's greedy answer predicts exactly the target
    calls and accepted tokens the engine makes (same head, same threshold)."""
    from test_greedy_equivalence import near_copy

    draft = near_copy(tiny_target, 0.01, 3)
    head = make_head(32, 1, bias=1.0, seed=4, reads=reads)
    engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[], acceptance_head=head)
    for prompt in PROMPTS:
        for threshold, gamma_max in ((0.5, 8), (0.8, 5)):
            gen = run(engine, prompt, 40, "specdec++", threshold=threshold, gamma_max=gamma_max)
            answer = acc.greedy_answer(draft, list(prompt), gen.output_ids)
            values = acc.head_values(head, [answer])
            rep = acc.replay(answer.match, values[0][0], values[0][1], threshold, gamma_max, reads == "after")
            # the replay ends at the answer's last token; the engine's last chain is cut by max_new_tokens
            assert abs(rep.verified - gen.stats.target_forwards) <= 1
            assert rep.generated == len(gen.output_ids)
            fixed = acc.replay(answer.match, None, None, 0.0, 3)
            spec = run(engine, prompt, 40, "speculative", gamma=3).stats
            assert abs(fixed.verified - spec.target_forwards) <= 1
            # the engine cuts its last chains to the tokens left (gamma <= remaining - 1); the replay does not
            assert abs(fixed.discarded - (spec.drafted - spec.accepted)) <= 2 * 3


@pytest.fixture(scope="module")
def tiny_head_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    folder = save_tiny_model(root / "target", seed=0, layers=3)
    target = load_model(ModelSpec(str(folder), dtype="float32"))
    train_file = write_prompts(root / "train.jsonl", 21, "train")
    heldout_file = write_prompts(root / "heldout.jsonl", 5, "heldout", offset=3)
    eos = stop_token_ids(target.tokenizer, target.model.generation_config)
    data = collect(target.model, target.tokenizer, load_prompts(train_file), eos, root / "d.pt",
                   max_new_tokens=16, batch_size=8, k=8)
    draft = build_draft(target.model, [0], choose_head_tokens(data, 24, always=[2]))
    save_draft(draft, root / "draft", target.tokenizer)
    out = root / "head"
    argv = ["head", "--target", str(folder), "--draft", str(root / "draft"), "--out", str(out),
            "--train-prompts", str(train_file), "--heldout-prompts", str(heldout_file), "--work", str(root / "work"),
            "--max-new-tokens", "16", "--batch-size", "8", "--depths", "0,1", "--mixes", "0.5",
            "--rej-weights", "1,3", "--labels", "greedy", "--epochs", "1", "--gamma-max", "6", "--dev-prompts", ""]
    assert train_main(argv) == 0
    return root, folder, target, out, argv


def test_head_training_end_to_end(tiny_head_setup):
    root, folder, target, out, _ = tiny_head_setup
    config = json.loads((out / "config.json").read_text())
    assert config["depth"] in (0, 1) and config["w_rej"] in (1, 3) and 0 < config["threshold"] < 1
    metrics = json.loads((out / "metrics.json").read_text())
    # D x w_rej x (hidden after, hidden+q after, hidden+q before)
    assert len(metrics["sweep"]) == 12 and metrics["heldout_bce"] > 0
    assert {p["method"] for p in metrics["heldout_replay"]} == {"speculative", "specdec++"}
    replay = config["threshold_replay"]  # travels with the head: the threshold is priced per machine at load
    assert replay and {r["threshold"] for r in replay} == {
        float(p["setting"].removeprefix("H ")) for p in metrics["heldout_replay"] if p["method"] == "specdec++"}
    assert "| r | D | w_rej |" in (out / "README.md").read_text()
    cache = acc.draft_cache(root / "work", "head-fit-r0.5-v2", load_draft(root / "draft", target.model))
    assert cache.is_file()  # the examples are cached under this draft's weights' hash
    feats = acc.Features.load(cache)
    assert len(feats) > 0 and float(feats.soft.min()) >= 0 and float(feats.soft.max()) <= 1
    assert len(set(feats.done)) == len(feats.done) == 18  # 21 conversations, every 7th is dev
    pair = load_pair(ModelSpec(str(folder), dtype="float32"), ModelSpec(str(root / "draft"), dtype="float32"),
                     head=str(out))
    assert pair.head.head is not None and pair.head.problem == ""
    engine = pair.engine()
    prompt = [5, 9, 12, 30]
    ar = engine.generate(GenerationRequest(prompt, 12), make_method("autoregressive")).run().output_ids
    assert engine.generate(GenerationRequest(prompt, 12), make_method("specdec++")).run().output_ids == ar


def test_default_threshold_is_the_shortest_near_the_best():
    from specui.train.head_command import shortest_near_best

    scored = [(30.0, 0.3), (34.0, 0.4), (34.2, 0.6), (34.3, 0.7), (33.0, 0.8)]
    assert shortest_near_best(scored) == (34.0, 0.4)  # within 1% of 34.3: 0.4, 0.6, 0.7; the smallest drafts least
    assert shortest_near_best(scored, within=0.0) == (34.3, 0.7)


def test_example_caches_are_per_draft(tiny_head_setup, tmp_path):
    """A retrained draft written to the same folder never reads the old draft's examples."""
    root, _, target, _, _ = tiny_head_setup
    draft = load_draft(root / "draft", target.model, target.tokenizer, kernels=False, dtype=torch.float32)
    save_draft(draft, tmp_path / "same", target.tokenizer)
    before = acc.draft_cache(tmp_path, "head-fit-r0.5-v2", load_draft(tmp_path / "same", target.model))
    with torch.no_grad():
        next(p for p in draft.model.layers.parameters()).mul_(2.0)
    save_draft(draft, tmp_path / "same", target.tokenizer)
    assert acc.draft_cache(tmp_path, "head-fit-r0.5-v2", load_draft(tmp_path / "same", target.model)) != before


def test_features_resume_without_duplicates(tiny_head_setup):
    """An interrupted collection (here: after 7 conversations) resumes where it stopped and
    ends with exactly what one uninterrupted run gives."""
    root, _, target, _, _ = tiny_head_setup
    from specui.train.data import AnswerSet
    from specui.train.head_command import split

    draft = load_draft(root / "draft", target.model, target.tokenizer)
    fit, _ = split(AnswerSet.load(root / "d.pt"))
    whole = acc.build_features(draft, target.model, fit, 0.5, 0)
    first7 = AnswerSet(*(getattr(fit, name)[:7] for name in ("ids", "prompt_ids", "answer_ids", "topk_ids",
                                                              "topk_logp")))
    path = root / "partial.pt"
    acc.build_features(draft, target.model, first7, 0.5, 0, path, save_every=3)
    assert len(acc.Features.load(path).done) == 7
    resumed = acc.build_features(draft, target.model, fit, 0.5, 0, path)
    assert resumed.done == whole.done and len(set(resumed.done)) == len(fit)
    assert torch.equal(resumed.soft, whole.soft) and torch.equal(resumed.hidden, whole.hidden)


def test_unusable_heads_say_how_to_train_one(tiny_head_setup, tmp_path, capsys):
    root, folder, target, out, _ = tiny_head_setup
    draft = load_draft(root / "draft", target.model, target.tokenizer)
    with pytest.raises(SpecUIError, match="python -m specui.train head"):
        load_head(tmp_path / "missing", draft)
    other = tiny_llama(5, layers=1, vocab=len(target.tokenizer), dtype=torch.float32)
    with pytest.raises(SpecUIError, match="trained for another draft"):
        load_head(out, other)
    broken = tmp_path / "broken"
    save_head(AcceptanceHead(32, 1), broken, draft_fingerprint(draft), {"threshold": 0.5})
    (broken / "head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpecUIError, match="corrupt"):
        load_head(broken, draft)
    pair = load_pair(ModelSpec(str(folder), dtype="float32"), ModelSpec(str(root / "draft"), dtype="float32"),
                     head=str(broken))
    assert pair.head.head is None and "corrupt" in pair.head.problem  # the pair still loads
    from app import main as app_main

    code = app_main(["--cli", "--target", str(folder), "--draft", str(root / "draft"), "--specdec-head",
                     str(tmp_path / "missing"), "--method", "specdec++", "--prompt", "w1 w2", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "specdec++ needs an acceptance head" in err and "python -m specui.train head" in err


def test_panels_show_the_head_and_the_threshold(tiny_target):
    from specui.service.chat_service import ChatService
    from specui.ui.figures import choices_figure, step_markdown, tree_figure

    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_llama(1, layers=1), eos_ids=[],
                    acceptance_head=make_head(32, 1, bias=1.5))
    gen = run(engine, PROMPTS[0], 16, "specdec++", threshold=0.6, gamma_max=5)
    names = [t.name for t in choices_figure(gen.steps).data]
    assert "threshold H" in names and "SpecDec++: P(some rejected) at stop" in names
    assert "gamma (candidate length)" in names
    hover = " ".join(t for trace in tree_figure(gen.steps[0]).data for t in (trace.hovertext or ()))
    assert "predicted a_t" in hover and "P(some rejected)" in hover
    text = step_markdown(gen.steps[0])
    assert "predicted acceptance" in text and "threshold 0.6" in text
    assert ChatService.method_fields("specdec++") == {"threshold", "gamma_max", "gamma"}


# --- the threshold chosen for this machine's costs ------------------------------------------
REPLAY = [  # the shipped head's held-out replay at three thresholds (D/N, V/N)
    {"threshold": 0.2, "discard_rate": 0.3198, "verification_rate": 0.583},
    {"threshold": 0.5, "discard_rate": 0.6761, "verification_rate": 0.489},
    {"threshold": 0.9, "discard_rate": 2.0796, "verification_rate": 0.4331},
]


def test_the_threshold_follows_the_costs():
    from specui.engine.methods.specdec import threshold_for_costs

    def steep(k):  # verification grows with the tokens scored, the draft a fifth of a token: stop early
        return 45.6 + 9.0 * (k - 1)

    def flat(k):  # verification nearly flat (the w4a8 stand-in's profile), the draft cheap
        return 84.0 + 4.0 * (k - 1)

    assert threshold_for_costs(REPLAY, steep, 8.5)[0] == 0.2
    assert threshold_for_costs(REPLAY, flat, 3.6)[0] == 0.5
    assert threshold_for_costs(REPLAY, lambda k: 100.0, 0.01)[0] == 0.9  # free drafts, free verification
    h, ms = threshold_for_costs(REPLAY, flat, 3.6)
    drafted = 1 - 0.489 + 0.6761
    assert ms == pytest.approx(3.6 * drafted + 0.489 * flat(1 + drafted / 0.489))
    assert threshold_for_costs([], flat, 3.6) is None and threshold_for_costs([{"x": 1}], flat, 3.6) is None


def test_a_heads_replay_travels_with_it_and_older_heads_read_it_from_their_metrics(tmp_path):
    from specui.heads.acceptance import threshold_replay

    points = [{"method": "speculative", "setting": "gamma 2", "discard_rate": 0.5, "verification_rate": 0.5},
              {"method": "specdec++", "setting": "H 0.3", "discard_rate": 0.4, "verification_rate": 0.55}]
    want = [{"threshold": 0.3, "discard_rate": 0.4, "verification_rate": 0.55}]
    assert threshold_replay(points) == threshold_replay(repr(points)) == want  # older metrics: a repr
    assert threshold_replay("not a list") == []
    draft = tiny_llama(1, layers=1)
    save_head(make_head(32, 0, 1.0).float(), tmp_path, draft_fingerprint(draft), {"threshold": 0.3})
    assert load_head(tmp_path, draft)[1]["threshold_replay"] == []  # no replay anywhere: the tuned H only
    (tmp_path / "metrics.json").write_text(json.dumps({"heldout_replay": repr(points)}))
    assert load_head(tmp_path, draft)[1]["threshold_replay"] == want
    shipped = json.loads((__import__("pathlib").Path(__file__).parents[1] / "models" / "smollm2-135m-specdec-head"
                          / "config.json").read_text())
    assert len(shipped["threshold_replay"]) >= 10  # the shipped head carries its own


def test_specdec_chooses_its_threshold_from_the_profile_and_says_so(tiny_target):
    from test_profile import synthetic

    from specui.engine.costs import EngineCosts

    draft = tiny_llama(1, layers=1)
    config = {"threshold": 0.2, "threshold_replay": REPLAY}
    engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS], acceptance_head=make_head(32, 0, 2.0),
                    head_config=config)
    reference = run(engine, PROMPTS[0], 24, "autoregressive").output_ids
    for t1, slope, draft_ms, want in ((84.0, 4.0, 3.6, 0.5), (45.6, 9.0, 8.5, 0.2), (40.0, 0.5, 0.2, 0.9)):
        engine.costs = EngineCosts(profile=synthetic(t1=t1, slope=slope, draft=draft_ms), note="synthetic")
        gen = run(engine, PROMPTS[0], 24, "specdec++")
        assert gen.output_ids == reference  # lossless whatever H
        assert {s.threshold for s in gen.steps if s.threshold is not None} == {want}
        said = [n for s in gen.steps for n in s.notes if "specdec++ threshold" in n]
        assert len(said) == 1 and f"H = {want:g}, chosen for this pair's measured costs" in said[0]
    given = run(engine, PROMPTS[0], 24, "specdec++", threshold=0.9)
    assert {s.threshold for s in given.steps if s.threshold is not None} == {0.9}
    assert not any("specdec++ threshold" in n for s in given.steps for n in s.notes)
