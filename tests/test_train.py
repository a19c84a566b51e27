"""The distillation pipeline on tiny local models: data along target answers, the reduced-
head draft (lossless in the engine), the trainer (resumable), save/load, the CLI, bad input."""

import json

import pytest
import torch
from conftest import save_tiny_model

from specui.bench.prompts import load_prompts
from specui.chat import stop_token_ids
from specui.engine import Engine, GenerationRequest, make_method
from specui.errors import SpecUIError
from specui.service.pair import load_pair
from specui.train.__main__ import main as train_main
from specui.train.data import collect
from specui.train.distill import (
    build_draft,
    choose_head_tokens,
    distill_loss,
    evaluate,
    grow_draft,
    make_batches,
    quantization_aware,
)
from specui.train.trainer import TrainConfig, train
from specui.weights import draft as draft_module
from specui.weights.draft import Int4Linear, Int8Linear, load_draft, save_draft
from specui.weights.loading import ModelSpec, load_model
from specui.weights.w4a8 import W4A8Linear
from specui.weights.w8a8 import W8A8Linear, full_range_exact


def write_prompts(path, n, prefix, offset=0):
    rows = [{"id": f"{prefix}-{i}", "category": "chat",
             "messages": [{"role": "user", "content": " ".join(f"w{(i * 7 + j + offset) % 50}" for j in range(4))}]}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    folder = save_tiny_model(root / "target", seed=0, layers=3)
    target = load_model(ModelSpec(str(folder), dtype="float32"))
    train_file = write_prompts(root / "train.jsonl", 24, "train")
    heldout_file = write_prompts(root / "heldout.jsonl", 6, "heldout", offset=3)
    eos = stop_token_ids(target.tokenizer, target.model.generation_config)
    data = collect(target.model, target.tokenizer, load_prompts(train_file), eos, root / "train.pt",
                   max_new_tokens=24, batch_size=8, k=8)
    return root, folder, target, data, train_file, heldout_file


def test_collect_records_target_answers_and_resumes(setup):
    root, _, target, data, train_file, _ = setup
    assert len(data) == 24 and data.answer_tokens > 24
    for answer, ids, logp in zip(data.answer_ids, data.topk_ids, data.topk_logp):
        assert ids.shape == (len(answer), 8)
        # answers are greedy: the target's top-1 is the answer token at every position
        assert ids[:, 0].tolist() == answer
        assert bool((logp[:, :-1] >= logp[:, 1:]).all())
    eos = stop_token_ids(target.tokenizer, target.model.generation_config)
    again = collect(target.model, target.tokenizer, load_prompts(train_file), eos, root / "train.pt",
                    max_new_tokens=24, batch_size=8, k=8)
    assert again.ids == data.ids  # nothing recollected


def test_reduced_head_draft_is_lossless_and_trainable(setup):
    _, _, target, data, _, _ = setup
    head = choose_head_tokens(data, 20, always=[2])
    assert 2 in head.tolist() and len(head) == 20
    draft = build_draft(target.model, [0, -1], head)
    assert draft.model.embed_tokens is target.model.get_input_embeddings()
    logits = draft(input_ids=torch.tensor([[1, 5, 9]])).logits[0, -1]
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[head] = False
    assert torch.isinf(logits[outside]).all() and torch.isfinite(logits[head]).all()

    batches = make_batches(data, head, draft.config.vocab_size, batch_tokens=256)
    before = evaluate(draft, data)
    losses = train(draft, batches, lambda b: distill_loss(draft, b),
                   TrainConfig(epochs=6, lr=3e-3, warmup_steps=2)).losses
    after = evaluate(draft, data)
    assert sum(losses[-len(batches):]) < sum(losses[: len(batches)])
    assert after.agreement > before.agreement and 0 <= after.alpha <= 1
    assert after.expected_accepted[4] >= after.expected_accepted[2] >= 1

    engine = Engine(target.model, target.tokenizer, draft=draft, eos_ids=[2])
    for prompt in data.prompt_ids[:4]:
        ar = engine.generate(GenerationRequest(prompt, 20), make_method("autoregressive")).run().output_ids
        spec = engine.generate(GenerationRequest(prompt, 20), make_method("speculative", gamma=3)).run()
        assert spec.output_ids == ar


def test_grown_draft_starts_as_the_draft_and_learns_with_its_new_layers(setup):
    """--init with a longer --layers: the new layers start as no-ops (same logits as the draft
    grown), train, and the grown draft stays lossless; layers that drop or reorder the draft's
    own are refused."""
    _, _, target, data, _, _ = setup
    head = choose_head_tokens(data, 20, always=[2])
    small = build_draft(target.model, [0, -1], head)
    grown = grow_draft(small, target.model, [0, 1, -1])
    assert grown.config.num_hidden_layers == 3 and grown.config.specui_draft["init_layers"] == [0, 1, 2]
    ids = torch.tensor([[1, 5, 9, 13, 4]])
    want, got = small(input_ids=ids).logits, grown(input_ids=ids).logits
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.allclose(got[finite], want[finite], atol=1e-5)
    assert grown.model.embed_tokens is target.model.get_input_embeddings()
    new = grown.model.layers[1]
    assert torch.equal(new.self_attn.q_proj.weight, target.model.model.layers[1].self_attn.q_proj.weight)
    batches = make_batches(data, head, grown.config.vocab_size, batch_tokens=256)
    train(grown, batches, lambda b: distill_loss(grown, b), TrainConfig(epochs=2, lr=3e-3, warmup_steps=2))
    assert new.mlp.down_proj.weight.abs().sum() > 0 and new.self_attn.o_proj.weight.abs().sum() > 0
    engine = Engine(target.model, target.tokenizer, draft=grown, eos_ids=[2])
    for prompt in data.prompt_ids[:3]:
        ar = engine.generate(GenerationRequest(prompt, 16), make_method("autoregressive")).run().output_ids
        assert engine.generate(GenerationRequest(prompt, 16), make_method("speculative", gamma=3)).run().output_ids \
            == ar
    for bad in ([0, 1], [-1, 0, 1], [0, 0, -1]):
        with pytest.raises(SpecUIError, match="must keep the draft's layers"):
            grow_draft(small, target.model, bad)


@pytest.mark.parametrize("layer_bits", [4, 8])
def test_quantization_aware_training_sees_the_stored_weights(setup, tmp_path, layer_bits):
    """--quant-aware: inside the block the draft computes exactly as it will load after saving,
    gradients reach the float weights, and afterwards they are plain parameters again."""
    _, _, target, data, _, _ = setup
    draft = build_draft(target.model, [0, 1], choose_head_tokens(data, 24, always=[2]))
    ids = torch.tensor([[1, 7, 8, 9, 3]])
    plain = draft(input_ids=ids).logits
    with quantization_aware(draft, layer_bits) as wrapped:
        assert wrapped == 2 * 7 + 1  # every decoder matrix and the head
        seen = draft(input_ids=ids).logits
        finite = torch.isfinite(seen)
        seen[finite].sum().backward()
        assert draft.model.layers[0].mlp.up_proj.parametrizations.weight.original.grad.abs().sum() > 0
    assert not any("parametrizations" in name for name, _ in draft.named_parameters())
    assert torch.equal(draft(input_ids=ids).logits[finite], plain[finite])  # the float weights, untouched
    save_draft(draft, tmp_path / "d", target.tokenizer, layer_bits=layer_bits)
    loaded = load_draft(tmp_path / "d", target.model, target.tokenizer, kernels=False)
    stored = loaded(input_ids=ids).logits[finite]
    assert torch.allclose(stored, seen[finite].detach(), atol=2e-3)  # only the norms' fp16 storage differs
    assert (stored - plain[finite]).abs().max() > 10 * (stored - seen[finite]).abs().max()


def test_trainer_resumes_from_checkpoint(setup, tmp_path):
    _, _, target, data, _, _ = setup
    head = choose_head_tokens(data, 20, always=[2])
    batches = make_batches(data, head, target.model.config.vocab_size, batch_tokens=256)
    ckpt = tmp_path / "run.ckpt"
    first = build_draft(target.model, [0], head)
    modes = []

    def probe(model):  # a learning-curve probe: called in eval mode, without gradients
        modes.append((model.training, torch.is_grad_enabled()))
        return float(len(modes))

    train(first, batches, lambda b: distill_loss(first, b), TrainConfig(epochs=1, checkpoint=ckpt, save_every=1),
          probe=lambda: probe(first))
    state = torch.load(ckpt, weights_only=False)
    assert state["step"] == len(batches) and "model.embed_tokens.weight" not in state["module"]
    assert [step for step, _ in state["probes"]] == [0, len(batches)]  # before training and at the end
    resumed = build_draft(target.model, [0], head)
    log = train(resumed, batches, lambda b: distill_loss(resumed, b),
                TrainConfig(epochs=2, checkpoint=ckpt, probe_every=2), probe=lambda: probe(resumed))
    assert len(log.losses) == 2 * len(batches)  # the first epoch's losses came from the checkpoint
    steps = [step for step, _ in log.probes]  # the first run's probes kept, none repeated
    assert steps[:2] == [0, len(batches)] and steps == sorted(set(steps)) and steps[-1] == 2 * len(batches)
    assert set(modes) == {(False, False)} and not resumed.training
    calls = len(modes)  # a value the caller measured before training is not measured again
    log = train(first, batches, lambda b: distill_loss(first, b), TrainConfig(epochs=1), probe=lambda: probe(first),
                probed_before=0.25)
    assert log.probes[0] == (0, 0.25) and len(log.probes) == 2 and len(modes) == calls + 1


def test_save_load_round_trip_shares_embeddings(setup, tmp_path):
    _, _, target, data, _, _ = setup
    draft = build_draft(target.model, [0, 1], choose_head_tokens(data, 24, always=[2]))
    save_draft(draft, tmp_path / "d", target.tokenizer, quantized=False)
    loaded = load_draft(tmp_path / "d", target.model, target.tokenizer)
    assert loaded.model.embed_tokens is target.model.get_input_embeddings()
    ids = torch.tensor([[1, 7, 8, 9]])
    logits = draft(input_ids=ids).logits
    assert torch.allclose(loaded(input_ids=ids).logits, logits, atol=1e-2)  # fp16 storage
    save_draft(draft, tmp_path / "q", target.tokenizer)  # 4-bit groups and int8 rows, with scales
    quantized = load_draft(tmp_path / "q", target.model, target.tokenizer)
    finite = torch.isfinite(logits)
    got, want = quantized(input_ids=ids).logits[finite], logits[finite]
    assert (got - want).abs().max() <= 0.1 * want.abs().max()  # 4-bit groups: a few % of the range
    size = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in ("d", "q")}
    assert size["q"] < 0.6 * size["d"]
    other = load_model(ModelSpec(str(save_tiny_model(tmp_path / "other", seed=4, layers=1,
                                                     words=[f"x{i}" for i in range(57)]))))
    with pytest.raises(SpecUIError, match="another tokenizer"):
        load_draft(tmp_path / "q", target.model, other.tokenizer)
    wrong = load_model(ModelSpec(str(save_tiny_model(tmp_path / "wide", seed=3, layers=1, hidden=64))))
    with pytest.raises(SpecUIError, match="made for a target"):
        load_draft(tmp_path / "d", wrong.model)


@pytest.mark.parametrize("rows", [1, 4, 9, 200])
def test_int8_linear_matches_the_dequantized_product(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randint(-127, 128, (96, 64), dtype=torch.int8, generator=g)
    scale = torch.rand(96, 1, generator=g) / 100
    module = Int8Linear(weight, scale)
    x = torch.randn(2, rows, 64, generator=g)
    want = x @ (weight.float() * scale.to(torch.bfloat16).float()).T
    got = module(x)
    assert got.dtype == x.dtype and got.shape == want.shape
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # bfloat16 activations


@pytest.mark.parametrize("specui_kernels", [True, False])
@pytest.mark.parametrize("layer_bits", [4, 8])
def test_cpu_float32_draft_computes_with_the_stored_bytes(setup, tmp_path, layer_bits, specui_kernels, monkeypatch):
    _, _, target, data, _, _ = setup
    if not specui_kernels:  # a CPU where SpecUI's kernels have no vector path: torch's int4 / int8 kernels
        monkeypatch.setattr(draft_module, "w4a8_vector", lambda: False)
        monkeypatch.setattr(draft_module, "has_w8a8_kernel", lambda: False)
    draft = build_draft(target.model, [0, 1], choose_head_tokens(data, 32, always=[2]))
    save_draft(draft, tmp_path / "q", target.tokenizer, layer_bits=layer_bits)
    fast = load_draft(tmp_path / "q", target.model, target.tokenizer)
    plain = load_draft(tmp_path / "q", target.model, target.tokenizer, kernels=False)
    # what this CPU serves (a test must hold on any): SpecUI's kernels where they run a vector path, else torch's
    groups_kind = W4A8Linear if draft_module.w4a8_vector() else Int4Linear
    rows_kind = W8A8Linear if draft_module.has_w8a8_kernel() and full_range_exact() else Int8Linear
    layer_kind = groups_kind if layer_bits == 4 else rows_kind
    layers = [n for n, m in fast.named_modules() if isinstance(m, layer_kind) and n.startswith("model.layers.")]
    assert len(layers) == 2 * 7 and isinstance(fast.lm_head, rows_kind)  # every matrix of both layers; the head
    assert not any(isinstance(m, (Int4Linear, Int8Linear, W4A8Linear, W8A8Linear)) for m in plain.modules())
    ids = torch.tensor([[1, 7, 8, 9, 10, 11]])
    a, b, full = fast(input_ids=ids).logits, plain(input_ids=ids).logits, draft(input_ids=ids).logits
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite)
    assert (a[finite] - b[finite]).abs().max() <= 0.05 * b[finite].abs().max()  # kernels: the stored weights
    assert (b[finite] - full[finite]).abs().max() <= 0.1 * full[finite].abs().max()  # storage: near the trained ones
    sizes = (tmp_path / "q" / "model.safetensors").stat().st_size
    save_draft(draft, tmp_path / "other", target.tokenizer, layer_bits=12 - layer_bits)
    assert (sizes < (tmp_path / "other" / "model.safetensors").stat().st_size) == (layer_bits == 4)
    with pytest.raises(ValueError, match="layer_bits"):
        save_draft(draft, tmp_path / "bad", layer_bits=3)


def test_four_bit_groups_pack_two_to_a_byte():
    from specui.weights.quantize import pack4, unpack4

    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8 and torch.equal(unpack4(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) + 16 * int(q[0, 1])  # even column in the low nibble


def test_train_cli_end_to_end_and_failed_run_keeps_the_shipped_draft(setup, tmp_path, capsys):
    root, folder, _, _, train_file, heldout_file = setup
    out = tmp_path / "draft"
    argv = ["draft", "--target", str(folder), "--train-prompts", str(train_file), "--heldout-prompts",
            str(heldout_file), "--work", str(tmp_path / "work"), "--out", str(out), "--max-new-tokens", "16",
            "--batch-size", "8", "--head-size", "24", "--epochs", "2", "--layers", "0", "--batch-tokens", "256"]
    assert train_main(argv) == 0
    report = json.loads((out / "metrics.json").read_text())
    for key in ("agreement", "alpha", "cost_ratio", "expected_accepted", "command"):
        assert key in report
    # the learning curve: before training, probes on the way, the final weights (float32) last
    curve = report["curve"]
    assert curve[0]["step"] == 0 and curve[0]["agreement"] == pytest.approx(report["agreement_before_training"])
    assert [p["step"] for p in curve] == sorted({p["step"] for p in curve}) and len(curve) >= 3
    assert curve[-1]["tokens_seen"] == 2 * report["train_answer_tokens"]  # two whole epochs
    assert curve[-1]["agreement"] == pytest.approx(report["agreement"], abs=0.05)  # stored int8 vs float32
    assert report["history"] == [] and (out / "curve.html").is_file()
    pair = load_pair(ModelSpec(str(folder)), ModelSpec(str(out)))  # the app loads it as a draft
    emb = pair.draft.model.model.embed_tokens  # shared; seen through a cast when dtype auto chose two dtypes
    assert getattr(emb, "embedding", emb) is pair.target.model.get_input_embeddings()
    shipped = (out / "model.safetensors").read_bytes()

    bad = list(argv)
    bad[bad.index(str(train_file))] = str(tmp_path / "missing.jsonl")
    assert train_main(bad) == 2
    assert "does not exist" in capsys.readouterr().err
    leaky = list(argv)
    leaky[leaky.index(str(train_file))] = str(heldout_file)  # training on held-out prompts is refused
    assert train_main(leaky) == 2
    assert "never trained on" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == shipped

    # --init goes on from the trained draft: its weights (so its agreement before training), its head
    again = tmp_path / "draft-again"
    resumed = [*argv[: argv.index("--out")], "--out", str(again), *argv[argv.index("--out") + 2:], "--init", str(out)]
    resumed[resumed.index("--epochs") + 1] = "1"
    del resumed[resumed.index("--layers"): resumed.index("--layers") + 2]  # the init draft's own layers are kept
    resumed[resumed.index("--head-size") + 1] = "16"
    assert train_main(resumed) == 0
    second = json.loads((again / "metrics.json").read_text())
    assert second["agreement_before_training"] == pytest.approx(report["agreement"], abs=0.05)
    # the versions so far: the init draft with its training-set size, then this run (curve.png's right panel)
    assert [h["train_answer_tokens"] for h in second["history"]] == [report["train_answer_tokens"]]
    assert second["history"][0]["agreement"] == second["agreement_before_training"]
    first, then = (load_draft(f, pair.target.model, kernels=False) for f in (out, again))
    assert then.config.num_hidden_layers == 1 and torch.equal(first.token_map, then.token_map)

    (out / "README.md").write_text("how this draft was made")
    assert train_main(argv) == 0  # a retrain replaces the weights and keeps the hand-written README
    assert (out / "README.md").read_text() == "how this draft was made"


def test_train_cli_quant_aware_grown_draft_resumes_and_ships_what_it_probed(setup, tmp_path):
    """`--init D --layers (more) --quant-aware`: starts where D was, its probes measure the stored
    weights, and a rerun resumes the finished checkpoint (parametrized keys) to the same bytes."""
    root, folder, _, _, train_file, heldout_file = setup
    base = ["draft", "--target", str(folder), "--train-prompts", str(train_file), "--heldout-prompts",
            str(heldout_file), "--work", str(tmp_path / "work"), "--max-new-tokens", "16", "--batch-size", "8",
            "--head-size", "24", "--epochs", "2", "--batch-tokens", "256"]
    assert train_main([*base, "--out", str(tmp_path / "small"), "--layers", "0"]) == 0
    small = json.loads((tmp_path / "small" / "metrics.json").read_text())
    argv = [*base, "--out", str(tmp_path / "grown"), "--init", str(tmp_path / "small"), "--layers", "0,2",
            "--quant-aware", "--lr", "3e-3"]
    assert train_main(argv) == 0
    report = json.loads((tmp_path / "grown" / "metrics.json").read_text())
    assert report["agreement_before_training"] == pytest.approx(small["agreement"], abs=0.02)
    assert report["curve"][-1]["agreement"] == pytest.approx(report["agreement"], abs=0.02)
    config = json.loads((tmp_path / "grown" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["specui_draft"]["init_layers"] == [0, 2]
    shipped = (tmp_path / "grown" / "model.safetensors").read_bytes()
    assert len(list((tmp_path / "work").glob("draft-grown-*.ckpt"))) == 1
    assert train_main(argv) == 0
    assert (tmp_path / "grown" / "model.safetensors").read_bytes() == shipped


@pytest.mark.parametrize("reads", [[], ["--feature-layers", "0,-1", "--feature-lr-scale", "10"]],
                         ids=["final-norm", "layers"])
def test_train_cli_feature_draft_from_a_token_draft(setup, tmp_path, reads):
    """--features --init: the token draft gains the target's states as input (starting as it
    was), trains, ships, and decodes losslessly in the engine; the states pass is cached. With
    --feature-layers it reads the states after those target layers, from training to the engine."""
    root, folder, _, _, train_file, heldout_file = setup
    base = ["--target", str(folder), "--train-prompts", str(train_file), "--heldout-prompts", str(heldout_file),
            "--work", str(tmp_path / "work"), "--max-new-tokens", "16", "--batch-size", "8", "--head-size", "24",
            "--epochs", "2", "--layers", "0", "--batch-tokens", "256"]
    assert train_main(["draft", *base, "--out", str(tmp_path / "tok")]) == 0
    token = json.loads((tmp_path / "tok" / "metrics.json").read_text())
    argv = ["draft", *base, "--out", str(tmp_path / "feat"), "--init", str(tmp_path / "tok"), "--features",
            "--lr", "3e-3", "--epochs", "4", *reads]
    assert train_main(argv) == 0
    report = json.loads((tmp_path / "feat" / "metrics.json").read_text())
    config = json.loads((tmp_path / "feat" / "config.json").read_text())
    assert config["specui_draft"].get("feature_layers", []) == [int(v) for v in (reads[1:2] or [""])[0].split(",") if v]
    assert report["agreement_before_training"] == pytest.approx(token["agreement"], abs=0.05)  # starts as it was
    assert 0 <= report["agreement_unknown_state"] <= 1 and report["expected_accepted"]["2"] >= 1
    chunks = sorted((tmp_path / "work").glob("states-*/chunk-*.pt"))
    assert chunks  # the target's states are cached: a rerun computes none again
    assert train_main(["eval", *base[: base.index("--head-size")], "--draft", str(tmp_path / "feat")]) == 0
    assert sorted((tmp_path / "work").glob("states-*/chunk-*.pt")) == chunks
    # float32 both (dtype auto would time bfloat16 against float32, and a busy machine can flip it)
    pair = load_pair(ModelSpec(str(folder), dtype="float32"), ModelSpec(str(tmp_path / "feat"), dtype="float32"))
    engine = pair.engine()
    accepted = 0
    for prompt in ([1, 5, 9, 13], [1, 22, 8, 30, 4, 17]):
        ar = engine.generate(GenerationRequest(prompt, 20), make_method("autoregressive")).run().output_ids
        spec = engine.generate(GenerationRequest(prompt, 20), make_method("speculative", gamma=3)).run()
        assert spec.output_ids == ar
        accepted += spec.stats.accepted
    assert accepted > 0


def test_target_without_chat_template_is_refused(setup, tmp_path, capsys):
    _, folder, _, _, train_file, heldout_file = setup
    plain = save_tiny_model(tmp_path / "plain", seed=0, layers=1)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    code = train_main(["collect", "--target", str(plain), "--train-prompts", str(train_file),
                       "--heldout-prompts", str(heldout_file), "--work", str(tmp_path / "w")])
    assert code == 2 and "no chat template" in capsys.readouterr().err


def test_feature_layers_without_features_is_refused(setup, tmp_path, capsys):
    _, folder, _, _, train_file, heldout_file = setup
    code = train_main(["draft", "--target", str(folder), "--train-prompts", str(train_file), "--heldout-prompts",
                       str(heldout_file), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "d"),
                       "--feature-layers", "0"])
    assert code == 2 and "add --features" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_versions_stand_at_the_largest_training_set_so_far():
    """curve.png's right panel: a continuation on part of the store (the new answers only)
    stands above the data already learnt, not back at its own smaller size."""
    from specui.train.curve import figure, trained_so_far

    assert trained_so_far([156, 314, 1308, 936, 371]) == [156, 314, 1308, 1308, 1308]
    versions = [{"train_answer_tokens": 1308, "agreement": 0.543}]
    fig = figure([{"tokens_seen": 0, "agreement": 0.5}], versions, 371, 0.551)
    assert list(fig.data[1].x) == [1308, 1308] and list(fig.data[1].y) == [0.543, 0.551]


def test_teacher_dtype_auto_is_measured_once_and_a_given_one_kept(setup, capsys, tmp_path):
    from argparse import Namespace

    from specui.train.__main__ import resolve_teacher_dtype

    target = setup[2]
    args = Namespace(teacher_dtype="auto", work=tmp_path)
    resolve_teacher_dtype(args, target, tokens=64)
    said = capsys.readouterr().err
    assert args.teacher_dtype in ("float32", "bfloat16") and f"teacher passes in {args.teacher_dtype}:" in said
    assert "float32" in said and "bfloat16" in said and "prefill tokens/s" in said
    again = Namespace(teacher_dtype="auto", work=tmp_path)  # the next run on this machine keeps the choice
    resolve_teacher_dtype(again, target, tokens=64)
    assert again.teacher_dtype == args.teacher_dtype and "chosen earlier" in capsys.readouterr().err
    (tmp_path / "teacher-dtype.json").write_text("{not json")  # a broken record is measured again
    resolve_teacher_dtype(Namespace(teacher_dtype="auto", work=tmp_path), target, tokens=64)
    assert "prefill tokens/s" in capsys.readouterr().err
    args = Namespace(teacher_dtype="float32", work=tmp_path)
    resolve_teacher_dtype(args, target)
    assert args.teacher_dtype == "float32" and capsys.readouterr().err == ""


def test_lr_scale_gives_named_parameters_their_own_learning_rate():
    """TrainConfig.lr_scale: parameters under a name prefix move at their own rate (0: not at all)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    before = [p.detach().clone() for p in net.parameters()]
    batches = [torch.randn(8, 4) for _ in range(4)]
    train(net, batches, lambda x: net(x).pow(2).mean(), TrainConfig(epochs=1, lr=1e-2, warmup_steps=1,
                                                                    weight_decay=0.1, lr_scale={"1.": 0.0}))
    moved = [not torch.equal(b, p) for b, p in zip(before, net.parameters())]
    assert moved == [True, True, False, False]  # layer 0's weight and bias moved, layer 1's did not


def test_time_limit_stops_early_checkpointed_and_the_same_run_goes_on(tmp_path):
    """TrainConfig.time_limit_s: training stops after the step where time ran out, probed and
    checkpointed, and the same call without a limit goes on from that step to the end."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    batches = [torch.randn(8, 4) for _ in range(5)]
    ckpt = tmp_path / "run.ckpt"
    cfg = dict(epochs=2, lr=1e-2, warmup_steps=1, checkpoint=ckpt, save_every=100)
    log = train(net, batches, lambda x: net(x).pow(2).mean(), TrainConfig(**cfg, time_limit_s=0.0),
                probe=lambda: 0.5)
    assert log.stopped_at == 1 and len(log.losses) == 1 and log.probes[-1][0] == 1 and ckpt.is_file()
    log = train(net, batches, lambda x: net(x).pow(2).mean(), TrainConfig(**cfg), probe=lambda: 0.5)
    assert log.stopped_at is None and len(log.losses) == 10 and log.probes[-1][0] == 10
