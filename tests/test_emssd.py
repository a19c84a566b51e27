"""EMS-SD (seed 003): a batch of generations decoded speculatively together, each row
accepting its own number of tokens. Every row equals its own single-sequence greedy reply
(float32), under every padding layout, with prompts of very different lengths and rows
joining and leaving mid-batch; the unpadded cache never holds a padding token; sampled rows
keep the target's distribution."""

import itertools
import json

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama
from test_sampling_distribution import NEW, PROMPT, RUNS, TV_BOUND, VOCAB, exact, tv
from test_sampling_distribution import pair as sampling_pair  # noqa: F401 - a fixture

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.session import ModelSession
from specui.errors import SpecUIError

PADDINGS = ["unpad", "unpad-kv", "vanilla"]
# very different lengths: 2, 47 and 140 tokens
PROMPTS = [[1, 3], [1, *range(4, 50)], [1, *[(7 * i) % 60 + 3 for i in range(139)]], [1, 9, 8, 7, 6]]


@pytest.fixture(scope="module")
def engine32():
    target = tiny_llama(0, layers=3, dtype=torch.float32)
    draft = tiny_llama(1, layers=1, dtype=torch.float32)
    return Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])


def greedy(engine, prompt, n):
    return engine.generate(GenerationRequest(list(prompt), n), make_method("autoregressive")).run().output_ids


def emssd(engine, prompt, n, padding="unpad", gamma=3, sampling=None, adaptive=False):
    """A row of ems-sd; `adaptive` off by default: each step's gamma then is `gamma`, not chosen from the
    engine's measured costs, so which step a row finishes at (and the batch sizes) repeats on any machine."""
    request = GenerationRequest(list(prompt), n, sampling or SamplingConfig())
    return engine.generate(request, make_method("ems-sd", gamma=gamma, padding=padding, adaptive_gamma=adaptive))


def check_rows(batch, padding):
    """After a step: each row's cache holds every committed token but the newest (which the
    next step feeds), and under unpad / unpad-kv in slots [0, len) with no padding anywhere."""
    for session, rows in ((batch.decoder.target, [r.row.target for r in batch.running]),
                          (batch.decoder.draft, [r.row.draft for r in batch.running])):
        for running, row in zip(batch.running, rows):
            ids = running.generation.ctx.ids
            assert row.cached == ids[: len(row.cached)]
            if session is batch.decoder.target:
                assert len(row.cached) == len(ids) - 1
            if padding != "vanilla":
                assert row.slots == list(range(len(row.cached)))
        if padding != "vanilla":
            assert session.padding_slots() == 0


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-gamma", "measured-gamma"])
@pytest.mark.parametrize("padding", PADDINGS)
def test_every_row_equals_its_own_greedy_reply_with_joins_and_leaves(engine32, padding, adaptive):
    lengths = [30, 12, 25, 18]  # rows finish (leave) at different steps
    gens = [emssd(engine32, p, n, padding, adaptive=adaptive) for p, n in zip(PROMPTS, lengths)]
    batch = engine32.batch(gens[0].method)
    batch.join(gens[:2])
    steps = 0
    while batch.running:
        batch.step()
        check_rows(batch, padding)
        steps += 1
        if steps == 3:
            batch.join(gens[2:])  # join mid-batch, beside rows already decoding
    assert batch.sizes[0] == 2 and max(batch.sizes) >= 3
    if not adaptive:  # measured gammas: which step each row ends at follows the timings
        assert max(batch.sizes) == 4 and batch.sizes[-1] == 1
    for g, p, n in zip(gens, PROMPTS, lengths):
        assert g.output_ids == greedy(engine32, p, n)
    stats = batch.decoder.padding_stats()["target"]
    if padding == "unpad":
        assert stats["input_padding"] == 0 and stats["kv_padding"] == 0
    elif padding == "vanilla":
        assert stats["input_padding"] > 0 and stats["kv_padding"] > 0


@pytest.mark.parametrize("padding", PADDINGS)
def test_a_single_ems_sd_generation_is_greedy(engine32, padding):
    for p in PROMPTS[:2]:
        assert emssd(engine32, p, 20, padding).run().output_ids == greedy(engine32, p, 20)


def test_unpadded_cache_matches_a_fresh_prefill(engine32):
    gens = [emssd(engine32, p, 15) for p in PROMPTS[:3]]
    batch = engine32.batch(gens[0].method)
    batch.join(gens)
    for _ in range(4):
        batch.step()
    session = batch.decoder.target
    for running in batch.running:
        row = running.row.target
        fresh = ModelSession(engine32.target.model)
        fresh.advance(row.cached, need=1)
        for (k, v), (k0, v0) in zip(session.kv(row), fresh.kv()):
            torch.testing.assert_close(k, k0[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, v0[0], atol=1e-5, rtol=1e-4)


def test_rows_leave_and_join_without_copying_the_whole_cache(engine32):
    """A leaving row's buffer row takes one from above the new count (no other row moves), a
    joining row reuses a freed buffer row (no reallocation), the caller's feed order need not
    be the session's, and every row's cache still matches a fresh prefill of its tokens."""
    from specui.engine.ragged import RaggedSession

    session = RaggedSession(engine32.target.model, padding="unpad")
    prompts = [list(p) for p in PROMPTS] + [[3, 7, 11, 13, 17]]
    rows = [session.add_row() for _ in prompts[:4]]
    session.advance([(row, p, 1) for row, p in zip(rows, prompts)])
    layer = session.cache.layers[0]
    buffer, kept = layer.kbuf.data_ptr(), layer.kbuf[3].clone()
    session.remove_rows([rows[0], rows[2]])
    assert session.rows == [rows[3], rows[1]] and layer.live == 2  # row 3 took the hole at 0
    assert torch.equal(layer.kbuf[0], kept)
    joining = [session.add_row(), session.add_row()]
    logits = session.advance([(joining[1], prompts[4], 1), (rows[1], prompts[1] + [9], 1),
                              (joining[0], prompts[2], 1)])
    for got, ids in zip(logits, (prompts[4], prompts[1] + [9], prompts[2])):  # in the caller's order
        torch.testing.assert_close(got, ModelSession(engine32.target.model).advance(ids), atol=1e-4, rtol=1e-4)
    assert layer.kbuf.data_ptr() == buffer and layer.kbuf.shape[0] == 4 and layer.live == 4
    for row in [rows[3], rows[1], *joining]:
        fresh = ModelSession(engine32.target.model)
        fresh.advance(row.cached, need=1)
        for (k, v), (k0, v0) in zip(session.kv(row), fresh.kv()):
            torch.testing.assert_close(k, k0[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, v0[0], atol=1e-5, rtol=1e-4)


def test_without_a_draft_rows_decode_autoregressively(engine32):
    gens = [emssd(engine32, p, 10, gamma=0) for p in PROMPTS[:3]]
    batch = engine32.batch(gens[0].method)
    assert batch.decoder.draft is None
    batch.join(gens)
    batch.run()
    for g, p in zip(gens, PROMPTS):
        assert g.output_ids == greedy(engine32, p, 10) and g.stats.drafted == 0


def test_a_cancelled_row_leaves_the_others_untouched(engine32):
    gens = [emssd(engine32, p, 24) for p in PROMPTS[:3]]
    batch = engine32.batch(gens[0].method)
    batch.join(gens)
    batch.step()
    gens[1].cancel.set()
    batch.run()
    assert gens[1].stats.finish_reason == "cancelled" and len(gens[1].output_ids) < 24
    for i in (0, 2):
        assert gens[i].output_ids == greedy(engine32, PROMPTS[i], 24)


def test_a_join_that_fails_fails_only_the_joining_rows(engine32, monkeypatch):
    gens = [emssd(engine32, p, 16) for p in PROMPTS[:3]]
    batch = engine32.batch(gens[0].method)
    batch.join(gens[:2])
    batch.step()
    real = batch.decoder.prefill
    monkeypatch.setattr(batch.decoder, "prefill", lambda rows: (_ for _ in ()).throw(RuntimeError("out of memory")))
    failed = []
    batch.join(gens[2:], on_error=lambda g, e: failed.append((g, str(e))))
    assert failed == [(gens[2], "out of memory")] and len(batch.running) == 2
    monkeypatch.setattr(batch.decoder, "prefill", real)
    batch.run()
    for i in (0, 1):
        assert gens[i].output_ids == greedy(engine32, PROMPTS[i], 16)


def test_bad_settings_are_refused(engine32):
    with pytest.raises(SpecUIError, match="padding"):
        make_method("ems-sd", padding="left")
    with pytest.raises(SpecUIError, match="only ems-sd"):
        engine32.batch(make_method("speculative"))


def test_sampled_rows_keep_the_target_distribution(sampling_pair):  # noqa: F811
    target, draft = sampling_pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    cfg = SamplingConfig(temperature=1.0)
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=NEW), 0)
    rows = 16
    for start in range(0, RUNS, rows):
        gens = [emssd(engine, PROMPT, NEW, gamma=2, sampling=SamplingConfig(1.0, seed=s), adaptive=True)
                for s in range(start, start + rows)]
        batch = engine.batch(gens[0].method)
        batch.join(gens)
        batch.run()
        for g in gens:
            counts[tuple(g.output_ids)] += 1
    assert tv({k: v / RUNS for k, v in counts.items()}, exact(target, cfg)) < TV_BOUND


def test_cli_decodes_repeated_prompts_as_one_batch(tiny_dirs, capsys):
    from specui.cli import build_parser, run_cli

    target, draft, _ = tiny_dirs
    prompts = ["w1 w2 w3", "w9", "w4 w5 w6 w7 w8 w10 w11 w12"]
    base = ["--cli", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "12", "--json",
            "--dtype", "float32", "--gamma", "3"]
    singles = []
    for p in prompts:
        assert run_cli(build_parser().parse_args([*base, "--method", "autoregressive", "--prompt", p])) == 0
        singles.append(json.loads(capsys.readouterr().out)["reply"])
    for padding in ("unpad", "vanilla"):
        args = [*base, "--method", "ems-sd", "--padding", padding]
        for p in prompts:
            args += ["--prompt", p]
        assert run_cli(build_parser().parse_args(args)) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["prompt"] for r in records] == prompts
        assert [r["text"] for r in records] == singles
        assert all(r["stats"]["method"] == "ems-sd" and r["batch"]["size"] == 3 for r in records)
        assert (records[0]["batch"]["target"]["padding_ratio"] == 0) == (padding == "unpad")
    args = [*base, "--method", "speculative"]  # other methods: one after another, the same lines
    for p in prompts:
        args += ["--prompt", p]
    assert run_cli(build_parser().parse_args(args)) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["text"] for r in records] == singles and "batch" not in records[0]


def test_a_request_that_cannot_fit_is_refused_and_the_batch_goes_on(engine32, monkeypatch):
    import specui.engine.methods.emssd as emssd_module

    gens = [emssd(engine32, p, 12) for p in PROMPTS[:3]]
    batch = engine32.batch(gens[0].method)
    batch.join(gens[:2])
    batch.step()
    monkeypatch.setattr(emssd_module, "free_memory", lambda device: 1 << 10)  # 1 KB free
    refused = []
    batch.join(gens[2:], on_error=lambda g, e: refused.append(str(e)))
    assert len(refused) == 1 and "MB are free" in refused[0] and len(batch.running) == 2
    monkeypatch.undo()
    batch.run()
    assert [g.output_ids for g in gens[:2]] == [greedy(engine32, p, 12) for p in PROMPTS[:2]]


def test_batch_bench_writes_every_row(tiny_dirs, tmp_path):
    from specui.bench.batch import KINDS, PEER, main

    target, draft, _ = tiny_dirs
    out = tmp_path / "bench"
    assert main(["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--batch-sizes", "1,3",
                 "--max-new-tokens", "6", "--limit", "3", "--repeats", "1", "--history-turns", "1",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["batch_size"], r["method"]) for r in rows} == {(b, m) for b in (1, 3) for m in [*KINDS, PEER]}
    at3 = {r["method"]: r for r in rows if r["batch_size"] == 3}
    assert at3["ems-sd"]["padding_ratio"] == 0 and at3["vanilla speculative (padded)"]["padding_ratio"] > 0
    assert all(r["rows_differing_from_autoregressive"] == 0 for r in rows if r["method"] != PEER)  # float32
    assert (out / "batch.html").exists()


def ragged_logits(model, kernel: str, flex=None) -> tuple[list[torch.Tensor], list[str]]:
    """Three rows of different lengths fed ragged chains for three steps; every step's logits."""
    from specui.engine.ragged import RaggedSession

    session = RaggedSession(model, padding="unpad", kernel=kernel)
    if flex is not None:
        session._flex = flex
    rows = [session.add_row() for _ in PROMPTS[:3]]
    ids = [list(p) for p in PROMPTS[:3]]
    out = []
    for step in range(3):
        feeds = [(row, ids[r] + [5] * (r + step % 2), 1 + r) for r, row in enumerate(rows)]
        logits = session.advance(feeds)
        out += logits
        for r, row in enumerate(rows):
            ids[r].append(int(logits[r][0].argmax()))
            row.commit(ids[r])
    return out, session.notes


def test_the_gpu_kernel_flex_attention_gives_the_same_logits(engine32):
    model = engine32.target.model
    sdpa, _ = ragged_logits(model, "sdpa")
    flex, notes = ragged_logits(model, "flex")  # FlexAttention with the block mask, eager on the CPU
    assert not notes
    for a, b in zip(sdpa, flex, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    fallen, notes = ragged_logits(model, "flex", flex=broken)  # falls back to SDPA, says so, same logits
    assert len(notes) == 1 and "FlexAttention failed" in notes[0]
    for a, b in zip(sdpa, fallen, strict=True):
        torch.testing.assert_close(a, b)
