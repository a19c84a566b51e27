"""`python -m specui.bench.odd_prompts`: every lossless method against autoregressive decoding (DSBD
against beam search) on odd prompts at a few lengths; a difference or a crash is reported and
fails the run."""

from specui.bench import odd_prompts


def test_every_method_equals_its_reference_on_tiny_folders(tiny_dirs, capsys):
    target, draft, _ = tiny_dirs
    assert odd_prompts.main(["--target", str(target), "--draft", str(draft), "--lengths", "1,3,9"]) == 0
    out = capsys.readouterr().out
    methods = len(odd_prompts.METHODS.split(","))
    assert methods == 12
    assert f"0 of {(len(odd_prompts.ODD) + 2) * 3 * methods} replies differ or failed" in out


def test_methods_parse_with_their_parameters():
    from specui.bench.rows import parse_method

    specs = "speculative:3,tree:eagle-25,opt-tree:8@adaptive,mcsd,mcsd:4-2-1,mcsd:4,dsbd:3,lookup".split(",")
    assert [parse_method(spec) for spec in specs] == [
        ("speculative", {"gamma": 3}), ("tree", {"preset": "eagle-25"}),
        ("opt-tree", {"nodes": 8, "adaptive_nodes": True}), ("mcsd", {}),
        ("mcsd", {"k_config": "4,2,1"}), ("mcsd", {"width": 4}), ("dsbd", {"width": 3}), ("lookup", {})]


def test_a_difference_and_a_crash_are_reported(tiny_dirs, monkeypatch, capsys):
    target, draft, _ = tiny_dirs
    real = odd_prompts._reply

    def broken(engine, ids, n, name, params):
        if name == "lookup":
            raise RuntimeError("boom")
        out = real(engine, ids, n, name, params)
        return out[:-1] + [out[-1] + 1] if name == "speculative" else out

    monkeypatch.setattr(odd_prompts, "_reply", broken)
    code = odd_prompts.main(["--target", str(target), "--draft", str(draft), "--lengths", "2",
                             "--methods", "speculative:2,lookup,auto"])
    out = capsys.readouterr().out
    assert code == 1
    assert "code, 2 tokens, speculative {'gamma': 2}: differs from autoregressive at token 1" in out
    assert "lookup {}: RuntimeError: boom" in out and " auto {}" not in out
    cases = len(odd_prompts.ODD) + 2
    assert f"{2 * cases} of {3 * cases} replies differ or failed" in out
