"""Fast answer collection (issue 18) on a tiny local model: continuous batching gives the
target's own greedy answers, an interrupted collection resumes without duplicating or losing
an answer, the store keeps token ids only and refuses another target's, and the teacher's
top-k recomputed in batched prefills equals one forward per conversation."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import save_tiny_model
from test_train import write_prompts

from specui.bench.prompts import load_prompts
from specui.chat import stop_token_ids
from specui.engine import Engine, GenerationRequest, make_method
from specui.errors import SpecUIError
from specui.train.__main__ import PromptSource
from specui.train.__main__ import main as train_main
from specui.train.answers import AnswerStore, collect_answers
from specui.train.data import Collector, teacher_topk
from specui.weights.draft import vocab_fingerprint
from specui.weights.loading import ModelSpec, load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("answers")
    folder = save_tiny_model(root / "target", seed=0, layers=2)
    target = load_model(ModelSpec(str(folder), dtype="float32"))
    prompts = write_prompts(root / "train.jsonl", 10, "train")
    eos = stop_token_ids(target.tokenizer, target.model.generation_config)
    return root, folder, target, prompts, eos


def collector(target, eos, folder, cache, batch_size=4, max_new_tokens=12):
    store = AnswerStore(folder, vocab_fingerprint(target.tokenizer), "tiny")
    return Collector(target.model, target.tokenizer, eos, store, cache, None, max_new_tokens, batch_size, k=4,
                     temperatures=(0.7, 1.2))


def test_greedy_answers_are_the_targets_own(tiny, tmp_path):
    _, _, target, prompts, eos = tiny
    c = collector(target, eos, tmp_path / "store", tmp_path)
    jobs = c.jobs(load_prompts(prompts), "train")
    report = c.gather(jobs)
    assert report.answers == 10 and report.steps > 0 and report.rows / report.steps <= 4
    engine = Engine(target.model, target.tokenizer, None, eos)
    stored = c.store.answers()
    for job in jobs:
        alone = engine.generate(GenerationRequest(list(job.prompt_ids), 12), make_method("autoregressive")).run()
        assert stored[job.key].answer_ids == alone.output_ids
        assert stored[job.key].prompt_ids == list(job.prompt_ids)
        assert stored[job.key].ended == (alone.output_ids[-1] in eos)


def test_interrupted_collection_resumes_without_duplicates_or_losses(tiny, tmp_path):
    _, _, target, prompts, eos = tiny
    whole = collector(target, eos, tmp_path / "whole", tmp_path)
    jobs = whole.jobs(load_prompts(prompts), "train", samples=2)
    assert [j.round for j in jobs] == sorted(j.round for j in jobs) and len(jobs) == 30
    whole.gather(jobs)

    parts = collector(target, eos, tmp_path / "parts", tmp_path)
    engine = Engine(target.model, target.tokenizer, None, eos)
    first = collect_answers(engine, jobs, parts.store, batch_size=4, max_new_tokens=12, save_every_s=0.0,
                            stop_after=9)  # killed after its 9th answer: what was not saved is collected again
    saved = len(AnswerStore(tmp_path / "parts", vocab_fingerprint(target.tokenizer)).keys())
    assert first.answers == 9 and 0 < saved < 9
    again = collector(target, eos, tmp_path / "parts", tmp_path)  # a new process, another day
    assert again.gather(jobs).answers == 30 - saved
    keys = chunk_keys_of(again.store.folder)
    assert len(keys) == len(set(keys)) == 30
    assert again.gather(jobs).answers == 0  # nothing left to do
    mine, reference = again.store.answers(), whole.store.answers()
    for job in jobs:  # greedy and seeded samples alike: the same answer whatever rows it shared a batch with
        assert mine[job.key].answer_ids == reference[job.key].answer_ids, job.key
    sampled = [mine[j.key].answer_ids for j in jobs if j.round]
    assert len({tuple(a) for a in sampled}) > len(sampled) // 2  # sampled answers differ from each other

    again.store.compact()
    compacted = AnswerStore(tmp_path / "parts", vocab_fingerprint(target.tokenizer))
    assert len(compacted.chunks()) == 1 and compacted.answers() == mine


def test_a_sample_range_selects_exactly_those_answers(tiny, tmp_path):
    """FILE@M-N (going on with what a collection added): sampled answers M..N, no greedy one;
    together with FILE@(M-1) it is FILE@N, answer for answer."""
    _, _, target, prompts, eos = tiny
    c = collector(target, eos, tmp_path / "store", tmp_path)
    items = load_prompts(prompts)
    late = PromptSource.parse(f"{prompts}@2-3")
    assert (late.samples, late.first, str(late)) == (3, 2, f"{prompts}@2-3")
    assert PromptSource.parse(f"{prompts}@3") == PromptSource(prompts, 3)
    for bad in ("@0-2", "@3-2", "@x", "@2-"):
        with pytest.raises(Exception, match="FILE@M-N"):
            PromptSource.parse(f"{prompts}{bad}")
    only = c.jobs(items, "train", late.samples, first=late.first)
    whole, before = c.jobs(items, "train", 3), c.jobs(items, "train", 1)
    assert len(only) == 2 * len(items) and all(j.round in (2, 3) and j.temperature > 0 for j in only)
    assert sorted(j.key for j in before + only) == sorted(j.key for j in whole)
    assert {j.key: j.temperature for j in only}.items() <= {j.key: j.temperature for j in whole}.items()


def test_store_keeps_token_ids_of_one_target_only(tiny, tmp_path):
    _, _, target, prompts, eos = tiny
    c = collector(target, eos, tmp_path / "store", tmp_path)
    c.gather(c.jobs(load_prompts(prompts)[:3], "train"))
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["vocab_fingerprint"] == vocab_fingerprint(target.tokenizer)
    with np.load(c.store.chunks()[0]) as z:
        assert z["tokens"].dtype == np.uint16 and set(z.files) == {"keys", "tokens", "prompt_len", "answer_len",
                                                                  "ended"}
    with pytest.raises(SpecUIError, match="another target"):
        AnswerStore(tmp_path / "store", "0123456789abcdef")
    c.store.chunks()[0].write_bytes(b"not a chunk")
    with pytest.raises(SpecUIError, match="delete it"):
        AnswerStore(tmp_path / "store", vocab_fingerprint(target.tokenizer)).keys()


def test_batched_teacher_topk_equals_one_forward_per_conversation(tiny, tmp_path):
    _, _, target, prompts, eos = tiny
    c = collector(target, eos, tmp_path / "store", tmp_path)
    jobs = c.jobs(load_prompts(prompts), "train", samples=1)
    data = c.answer_set(jobs, "teacher")
    assert data.ids == [j.key for j in jobs]
    model = target.model
    for prompt, answer, ids, logp in zip(data.prompt_ids, data.answer_ids, data.topk_ids, data.topk_logp):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
        top = logits.float().log_softmax(-1).topk(4, dim=-1)
        assert torch.allclose(logp.float(), top.values, atol=2e-3)
        assert bool((ids[:, 0] == top.indices[:, 0]).all())
    # the cache is resumable: more answers extend it, the ones computed are not recomputed
    again = c.answer_set(jobs + c.jobs(load_prompts(prompts), "train", samples=2)[-5:], "teacher")
    assert again.ids[: len(jobs)] == data.ids and len(again) == len(jobs) + 5
    assert [a.shape for a in teacher_topk(model, [c.store.answers()[jobs[0].key]], 4)[0]] == [
        (len(data.answer_ids[0]), 4)] * 2
    hard = c.answer_set(jobs, "never-written", labels="hard")  # the answer tokens themselves, no teacher pass
    assert hard.ids == data.ids and not (tmp_path / "never-written.pt").exists()
    assert all(ids[:, 0].tolist() == answer and float(logp.abs().max()) == 0.0
               for answer, ids, logp in zip(hard.answer_ids, hard.topk_ids, hard.topk_logp))


def test_collect_cli_with_a_measured_precision(tiny, tmp_path, capsys):
    root, folder, _, prompts, _ = tiny
    heldout = write_prompts(tmp_path / "heldout.jsonl", 3, "heldout", offset=3)
    argv = ["collect", "--target", str(folder), "--train-prompts", f"{prompts}@1", "--heldout-prompts", str(heldout),
            "--work", str(tmp_path / "work"), "--max-new-tokens", "8", "--batch-size", "4",
            "--collect-with", "auto", "--temperatures", "0.9"]
    assert train_main(argv) == 0
    err = capsys.readouterr().err
    assert "answers generated in" in err and "float32:" in err and "bfloat16:" in err
    assert re.search(r"collecting with (4|8|16|32|64|128) rows \(answer tokens/s: 4 rows \d+, 8 rows \d+", err)
    keys = set(chunk_keys_of(tmp_path / "work" / "answers"))
    assert len(keys) == 10 * 2 + 3 and "train/train-0/t0.9-s0" in keys and "heldout/heldout-0/greedy" in keys
    assert train_main(argv) == 0 and "answers generated in" not in capsys.readouterr().err  # nothing to do
    bad = argv[:-1] + ["0,-1"]
    assert train_main(bad) == 2 and "--temperatures" in capsys.readouterr().err


def test_collect_rows_double_while_they_gain(monkeypatch, capsys):
    import argparse

    from specui.train import collect_command

    rates = {8: 100.0, 16: 150.0, 32: 160.0, 64: 400.0}
    monkeypatch.setattr(collect_command, "batched_tokens_per_s", lambda _e, _p, rows, _n: rates[rows])
    assert collect_command.more_rows(None, [], 8, 100.0, 10) == 16  # 32 rows gain under 10%: stop there
    assert "16 rows 150, 32 rows 160" in capsys.readouterr().err
    rates.update({32: 170.0, 64: 190.0, 128: 300.0})
    assert collect_command.more_rows(None, [], 8, 100.0, 10) == 128  # never past MOST_ROWS
    capsys.readouterr()

    def no_room(_e, _p, rows, _n):
        if rows > 16:
            raise RuntimeError("out of memory")
        return rates[rows]

    monkeypatch.setattr(collect_command, "batched_tokens_per_s", no_room)
    assert collect_command.more_rows(None, [], 8, 100.0, 10) == 16
    assert "32 rows did not fit (RuntimeError)" in capsys.readouterr().err
    assert collect_command.rows_arg("auto") == 0 and collect_command.rows_arg("48") == 48
    for bad in ("0", "-3", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            collect_command.rows_arg(bad)


def chunk_keys_of(folder) -> list[str]:
    keys = []
    for path in sorted(folder.glob("chunk-*.npz")):
        with np.load(path) as z:
            keys += z["keys"].tolist()
    return keys


def test_target_written_requests_are_filtered_and_resumable(tiny, tmp_path, monkeypatch):
    from specui.train import questions

    _, _, target, prompts, eos = tiny
    held = [questions.words("How do I boil an egg so the yolk stays soft?")]
    shown = ["What is a good name for a cat?", "Give me a tip for sleeping better.", "How do I fold a shirt?"]
    assert questions.clean('New request: "Suggest three easy houseplants for a dark flat."', shown, held) == \
        "Suggest three easy houseplants for a dark flat."
    assert questions.clean("How do I fold a shirt?", shown, held) is None  # a copy of an example
    assert questions.clean("How can I boil an egg so the yolk stays soft?", shown, held) is None  # held-out-like
    assert questions.clean("ok", shown, held) is None
    assert questions.clean("Suggest three easy houseplants for a dark", shown, held, ended=False) is None
    assert questions.clean("First idea.\n\nSecond idea, another request.", shown, held) is None

    items = load_prompts(prompts)
    assert questions.requests(questions.single_turn(items), 3, seed=0, start=2) == \
        questions.requests(questions.single_turn(items), 5, seed=0)[2:]
    c = collector(target, eos, tmp_path / "q-store", tmp_path, max_new_tokens=12)
    # the tiny model writes word salad; its decoded reply stands for a usable request half the time
    decode = target.tokenizer.decode
    monkeypatch.setattr(target.tokenizer, "decode", lambda ids, **kw: (
        f"Please explain topic number {sum(ids)} in simple words." if sum(ids) % 2 else decode(ids, **kw)))
    monkeypatch.setattr(questions, "clean",
                        lambda reply, shown, held, ended: reply if reply.startswith("Please") else None)
    out = tmp_path / "generated.jsonl"
    first = questions.generate(c, items, [], out, 6)
    again = questions.generate(c, items, [], out, 4)  # asks for requests 6..9, keeps its earlier ones
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert first and again and len(rows) == first + again
    assert len({r["messages"][0]["content"] for r in rows}) == len(rows)
    assert json.loads(out.with_suffix(".state.json").read_text())["asked"] == 10
    assert all(r["id"].startswith("gen-") and r["category"] == "chat" for r in rows)
    # another series (output file or seed) asks its own requests: no reply of the first is reused
    before = set(c.store.keys())
    other = questions.generate(c, items, [], tmp_path / "other.jsonl", 4, seed=1)
    added = set(c.store.keys()) - before
    assert len(added) == 4 and all(k.startswith("questions-other-s1/") for k in added), (other, added)
