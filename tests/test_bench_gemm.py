"""`python -m specui.bench.gemm`: every way this torch offers is timed for every row count, each
against one row's cost, with the CPU named."""

import re

from specui.bench import gemm


def test_every_way_and_row_count_is_timed(capsys):
    assert gemm.main(["--shape", "64x32", "--megabytes", "1", "--rows", "1,3,8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu: ") and "128 matrices of 64x32" in out
    rows = [line for line in out.splitlines() if " ms for rows " in line]
    ways = {(line.split()[0], line.split("ms for rows")[0].split(maxsplit=1)[1].strip()) for line in rows}
    assert ("float32", "plain") in ways and ("bfloat16", "plain") in ways
    for line in rows:
        cells = re.findall(r"(\d+): +([\d.]+) \(([\d.]+)x\)", line)
        assert [int(n) for n, _, _ in cells] == [1, 3, 8]
        assert cells[0][2] == "1.00" and all(float(ms) > 0 for _, ms, _ in cells)


def test_packed_products_equal_plain_ones():
    import torch

    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    want = torch.nn.functional.linear(x, w)
    ways = gemm.ways([w])
    for way, run in ways.items():
        if way in ("w8a8", "int4", "w4a8"):  # a rounding of the weights (and of w8a8's / w4a8's inputs): close
            assert (run(x)[0].float() - want).abs().max() <= (0.02 if way == "w8a8" else 0.2) * want.abs().max()
            continue
        torch.testing.assert_close(run(x)[0], want, atol=1e-4, rtol=1e-4, msg=way)
    from specui.weights.quantize import has_int4_kernel
    from specui.weights.w4a8 import w4a8_unavailable
    from specui.weights.w8a8 import has_w8a8_kernel

    assert ("w8a8" in ways) == has_w8a8_kernel() and ("int4" in ways) == has_int4_kernel()
    assert ("w4a8" in ways) == (not w4a8_unavailable())
