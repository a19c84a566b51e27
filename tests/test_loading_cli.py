"""Loading from local folders (and quantized), the headless CLI, and bad input: one clear
message each, exit code 2, never a traceback."""

import json
import re

import pytest
import torch
from conftest import save_tiny_model

import app
from specui.engine import Engine, GenerationRequest, make_method
from specui.errors import SpecUIError
from specui.service.pair import load_pair
from specui.weights.loading import ModelSpec, load_model


def cli(capsys, *argv):
    code = app.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_reports_reply_and_stats(capsys, tiny_dirs):
    target, draft, _ = tiny_dirs
    code, out, err = cli(capsys, "--cli", "--target", str(target), "--draft", str(draft), "--method", "speculative",
                         "--prompt", "w1 w2 w3", "--max-new-tokens", "16", "--temperature", "0", "--json")
    assert code == 0, err
    result = json.loads(out)
    stats = result["stats"]
    assert isinstance(result["reply"], str)
    assert 1 <= stats["new_tokens"] <= 16
    for key in ("target_forwards", "mean_accepted_length", "acceptance_rate", "tokens_per_s", "wall_s"):
        assert key in stats
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["accepted"] / stats["target_forwards"], abs=1e-3)


def test_cli_methods_agree_greedy_and_write_a_trace(capsys, tiny_dirs, tmp_path):
    target, draft, _ = tiny_dirs
    replies = {}
    for method in ("autoregressive", "speculative", "beam"):
        extra = ["--beam-width", "1"] if method == "beam" else []
        # float32: where --dtype auto picks bfloat16 (a CPU with fast bfloat16), batched verification may
        # break a near tie otherwise than one token at a time
        code, out, err = cli(capsys, "--cli", "--target", str(target), "--draft", str(draft), "--method", method,
                             "--prompt", "w4 w5", "--max-new-tokens", "12", "--json", "--dtype", "float32", "--trace",
                             str(tmp_path / f"{method}.json"), *extra)
        assert code == 0, err
        replies[method] = json.loads(out)["reply"]
        steps = json.loads((tmp_path / f"{method}.json").read_text())["steps"]
        assert steps and all("nodes" in s for s in steps)
    assert replies["autoregressive"] == replies["speculative"] == replies["beam"]


def test_cli_plain_output_streams_text_and_stats(capsys, tiny_dirs):
    target, _, _ = tiny_dirs
    code, out, err = cli(capsys, "--cli", "--target", str(target), "--draft", "none", "--method", "autoregressive",
                         "--prompt", "w1", "--max-new-tokens", "5", "--temperature", "0.7", "--seed", "1")
    assert code == 0 and "tokens_per_s=" in err


def test_one_cli_run_on_a_cpu_takes_capture_auto_as_eager_forwards(capsys, tiny_dirs, monkeypatch):
    from types import SimpleNamespace

    from specui.service.pair import ModelPair

    target, _, _ = tiny_dirs
    seen, engine = [], ModelPair.engine
    monkeypatch.setattr(ModelPair, "engine", lambda self, capture=None: seen.append(self.capture) or engine(self))
    base = ("--cli", "--target", str(target), "--draft", "none", "--method", "autoregressive", "--prompt", "w1",
            "--max-new-tokens", "4")
    code, _, err = cli(capsys, *base)  # --capture auto, the default: nothing compiles behind a run that ends first
    assert code == 0 and "--capture auto in one CLI run on a CPU: eager forwards" in err and seen == ["off"]
    code, _, err = cli(capsys, *base, "--capture", "off")
    assert code == 0 and "--capture auto in one CLI run" not in err and seen == ["off", "off"]
    on_gpu = ModelPair(SimpleNamespace(device=torch.device("cuda")), None)  # CUDA graphs: no compile to wait for
    assert on_gpu.for_one_run() == "" and on_gpu.capture == "auto"


def test_cli_sums_up_step_notes_after_the_reply(capsys, tiny_dirs, tmp_path):
    """auto notes every step's choice: the reply on stdout stays clean text, the notes come
    after it (counted), or live on their own lines with --verbose."""
    target, draft, _ = tiny_dirs
    argv = ["--cli", "--target", str(target), "--draft", str(draft), "--method", "auto", "--prompt", "w1 w2",
            "--max-new-tokens", "12", "--profile-dir", str(tmp_path)]
    code, out, err = cli(capsys, *argv)
    assert code == 0, err
    assert "note" not in out and "auto:" not in out
    summary = err[err.index("choices: "):]
    # which choices auto makes depends on this machine's timings: what must hold is one line per
    # kind of note (notes that differ in figures only are counted, not repeated)
    kinds = [re.sub(r"\d+(\.\d+)?", "#", line) for line in summary.splitlines() if line.startswith("note: auto:")]
    assert kinds and len(kinds) == len(set(kinds)) and "more like it" in summary
    code, out, err = cli(capsys, *argv, "--verbose")
    assert code == 0, err
    assert err.count("note: auto:") > len(kinds) and all(line.startswith("note: ") or "note" not in line
                                                         for line in err.splitlines())


def test_step_notes_count_notes_that_differ_in_figures_only():
    from types import SimpleNamespace

    from specui.service.reports import StepNotes
    notes = StepNotes(live=False)
    for choice, note in [("speculative:2", "auto: speculative:2 (alpha 0.50: 1.9x)"),
                         ("speculative:2", "auto: speculative:2 (alpha 0.41: 1.3x)"),
                         ("autoregressive", "budget fell back")]:
        notes.add(SimpleNamespace(choice=choice, notes=[note]))
    assert notes.summary() == ["choices: speculative:2 x2, autoregressive x1",
                               "note: auto: speculative:2 (alpha 0.50: 1.9x) (and 1 more like it)",
                               "note: budget fell back"]


BAD = [
    (["--target", "/no/such/model"], "does not exist"),
    (["--target", "./missing-folder"], "does not exist"),
    (["--method", "warp-speed"], "unknown decoding method"),
    (["--prompt", "   "], "empty"),
    (["--prompt", " ".join(["w3"] * 400)], "context window"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--gamma", "0"], "gamma"),
    (["--max-new-tokens", "0"], "max new tokens"),
    (["--context", "8"], "--context must be 0"),
    (["--context", "-1"], "--context must be 0"),
    (["--quantization", "4bit", "--device", "cuda"], "no CUDA GPU"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_gives_one_clear_message(capsys, tiny_dirs, extra, message):
    target, draft, _ = tiny_dirs
    argv = ["--cli", "--target", str(target), "--draft", str(draft), "--prompt", "w1 w2", "--max-new-tokens", "4"]
    code, out, err = cli(capsys, *argv, *extra)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last
    assert "Traceback" not in err and err.count("error") == 1


def test_a_missing_draft_path_is_said_before_the_target_loads(capsys, tiny_dirs, monkeypatch):
    from specui.service import pair

    target, _, _ = tiny_dirs
    loads = []
    real = pair.load_model
    monkeypatch.setattr(pair, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    code, _, err = cli(capsys, "--cli", "--target", str(target), "--draft", "/no/such/draft", "--prompt", "w1")
    assert code == 2 and "model path '/no/such/draft' does not exist" in err.strip().splitlines()[-1]
    assert loads == []  # the target was not loaded first


def test_mismatched_draft_tokenizer_is_refused(capsys, tiny_dirs):
    target, _, other = tiny_dirs
    code, _, err = cli(capsys, "--cli", "--target", str(target), "--draft", str(other), "--prompt", "w1")
    assert code == 2 and "tokenizer differs" in err
    with pytest.raises(SpecUIError, match="tokenizer differs"):
        load_pair(ModelSpec(str(target)), ModelSpec(str(other)))


def test_the_shipped_draft_is_left_out_for_a_target_it_was_not_made_for(capsys, tiny_dirs):
    """The default draft shares the bundled target's embeddings: another target decodes without
    it, and the load says why (not an error after the target has loaded)."""
    from specui.service.pair import default_draft_source

    target, _, _ = tiny_dirs
    code, out, err = cli(capsys, "--cli", "--target", str(target), "--prompt", "w1", "--max-new-tokens", "3")
    assert code == 0 and out.strip()
    assert re.search(r"draft: none \(the draft in .*smollm2-135m-draft was trained for a target with another "
                     r"tokenizer.*the shipped draft fits only the bundled target", err)
    pair = load_pair(ModelSpec(str(target)), ModelSpec(default_draft_source()))
    assert pair.draft is None and any(n.startswith("draft: none") for n in pair.target.notes)


def test_method_needing_a_draft_without_one(capsys, tiny_dirs):
    target, _, _ = tiny_dirs
    code, _, err = cli(capsys, "--cli", "--target", str(target), "--draft", "none", "--method", "speculative",
                       "--prompt", "w1")
    assert code == 2 and "needs a draft" in err


def test_unreachable_hub_id_is_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the hub library read the variable when it was imported: without this, it tries the network
    # and waits for its timeouts (46 s in CI)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(SpecUIError, match="could not load"):
        load_model(ModelSpec("specui-tests/definitely-not-a-model"))


def test_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(SpecUIError, match="not a .gguf"):
        load_model(ModelSpec(str(tmp_path / "weights.bin")))


def test_engine_refuses_prompt_at_context_length(tiny_target):
    engine = Engine(tiny_target, None, eos_ids=[])
    with pytest.raises(SpecUIError, match="context window"):
        engine.generate(GenerationRequest([1] * 256, 4), make_method("autoregressive"))
    # a prompt that fits gets max_new_tokens clamped to the room left
    gen = engine.generate(GenerationRequest([1] * 250, 50), make_method("autoregressive"))
    assert gen.request.max_new_tokens == 6


def test_context_flag_caps_the_window_never_widens_it(capsys, tiny_dirs, tiny_target):
    target, draft, _ = tiny_dirs
    prompt = " ".join(["w3"] * 120)  # fits the tiny model's 256 positions, not a 100-token window
    argv = ["--cli", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "4", "--prompt", prompt]
    code, _, err = cli(capsys, *argv, "--context", "100")
    assert code == 2 and "the 96 tokens the context window leaves" in err.strip().splitlines()[-1]  # 100 - 4 new
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    assert Engine(tiny_target, None, context_len=100).context_len == 100
    assert Engine(tiny_target, None, context_len=100_000).context_len == 256  # the model's own is the most


@pytest.mark.parametrize("quantization", ["4bit", "8bit", "int8"])
def test_quantized_target_on_cpu_decodes_and_speculates_losslessly(tmp_path, quantization):
    # bitsandbytes quantizes in blocks of 64: the layers must be at least that wide
    target = save_tiny_model(tmp_path / "target", seed=0, layers=2, hidden=128)
    draft = save_tiny_model(tmp_path / "draft", seed=1, layers=1, hidden=128)
    dtype = "float32" if quantization == "int8" else "auto"  # int8 + auto would run the rest in bfloat16
    pair = load_pair(ModelSpec(str(target), dtype=dtype, quantization=quantization), ModelSpec(str(draft)))
    linear = type(pair.target.model.model.layers[0].mlp.gate_proj).__name__
    assert linear == {"4bit": "Linear4bit", "8bit": "Linear8bitLt", "int8": "Int8Linear"}[quantization]
    engine = pair.engine()
    prompt = pair.target.tokenizer("w1 w2 w3")["input_ids"]
    ar = engine.generate(GenerationRequest(prompt, 12), make_method("autoregressive")).run()
    spec = engine.generate(GenerationRequest(prompt, 12), make_method("speculative", gamma=3)).run()
    assert spec.output_ids == ar.output_ids and len(ar.output_ids) > 0
    assert pair.target.memory_bytes < load_model(ModelSpec(str(target), dtype="float32")).memory_bytes


def test_dtype_and_device_choices(tiny_dirs):
    target, _, _ = tiny_dirs
    loaded = load_model(ModelSpec(str(target), dtype="float64", device="cpu"))
    assert loaded.model.dtype == torch.float64 and loaded.device.type == "cpu"
    with pytest.raises(SpecUIError, match="unknown dtype"):
        load_model(ModelSpec(str(target), dtype="float8"))


def test_presets_resolve_and_flags_override(capsys):
    from specui.cli import build_parser, specs_from_args
    from specui.service.pair import load_presets

    presets = load_presets()
    assert "smollm2-135m" in presets and all(p.target for p in presets.values())
    args = build_parser().parse_args(["--preset", "qwen2.5-7b-4bit"])
    target, draft = specs_from_args(args)
    assert target.source == "Qwen/Qwen2.5-7B-Instruct" and target.quantization == "4bit"
    assert draft.source == "Qwen/Qwen2.5-0.5B-Instruct"
    args = build_parser().parse_args(["--preset", "qwen2.5-7b-4bit", "--quantization", "none", "--draft", "none"])
    target, draft = specs_from_args(args)
    assert target.quantization == "none" and draft is None
    code, _, err = cli(capsys, "--cli", "--preset", "nope", "--prompt", "hi")
    assert code == 2 and "unknown preset" in err
