"""`python -m specui.bench.amx`: a whole forward timed with the 4-bit kernel's AMX tiles and its VNNI
loop in turns (where the CPU has AMX; the VNNI loop alone elsewhere), each token count printed."""

import re

import pytest

from specui.bench import amx
from specui.weights.native import native


def test_each_token_count_is_timed_on_each_path_here(tiny_dirs, capsys):
    kernels, why = native()
    if kernels is None:
        pytest.skip(f"SpecUI's kernels are not built here: {why}")
    target, _, _ = tiny_dirs
    assert amx.main(["--target", str(target), "--tokens", "1,2,13", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"[1-9]\d* w4a8 matrices", out)
    lines = [line for line in out.splitlines() if "tokens after 64" in line]
    assert [int(line.split()[0]) for line in lines] == [1, 2, 13]
    has_amx = bool(kernels.q4a8_amx_from())
    assert ("AMX tiles from" in out) == has_amx
    loop = kernels.q4a8_path()  # the vector loop's name here: AVX512-VNNI, AVX2 or portable loop
    for line in lines:
        assert re.search(re.escape(loop) + r" +[\d.]+ ms", line) and (f"{loop} / AMX" in line) == has_amx
