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
    from specui.weights.native import has_native

    rates = [line for line in out.splitlines() if "G multiply-adds/s (of the roof)" in line]
    if not has_native():
        assert "roof" not in out
        return
    roof = re.search(r"int8 dot-product roof \((AVX512-VNNI|AVX2|portable loop), on registers, every thread\): "
                     r"([\d.]+) G multiply-adds/s", out)
    assert roof and float(roof.group(2)) > 0
    int8 = [line for line in rows if line.split("ms for rows")[0].split(maxsplit=1)[1].strip() in gemm.INT8_WAYS]
    assert len(rates) == len(int8) > 0  # w4a8's (and w8a8's where oneDNN has it) rate under its timings
    for line in rates:
        cells = re.findall(r"(\d+): +([\d.]+) \((\d+)%\)", line)
        # tiny matrices: a rate may print as 0.00 where a call's fixed cost dominates (oneDNN's, on a Xeon)
        assert [int(n) for n, _, _ in cells] == [1, 3, 8] and all(float(r) >= 0 for _, r, _ in cells)


def test_the_roof_computes_and_counts_every_threads_products():
    """The roof's loop (kernels/roof.cpp) computes every product it counts, on every thread: its
    checksum is the closed form of the sums it runs (so no product was folded away), and its count
    is threads x steps x the products a step of its instructions makes."""
    import pytest
    import torch

    from specui.weights.native import native

    module, _ = native()
    if module is None:
        pytest.skip("SpecUI's kernels are not built here")
    with pytest.raises(RuntimeError, match="steps must be positive"):
        module.int8_dot_roof(0)
    path, steps = module.q4a8_path(), 10
    chains = 24 if path == "AVX512-VNNI" else 12  # the sums AVX2's 16 registers hold beside the operands
    # per step and sum: lanes x products a lane, and what a lane adds (unsigned 3 + t times signed -2)
    lanes, per_lane = {"AVX512-VNNI": (16, 4), "AVX2": (16, 2), "portable loop": (1, 1)}[path]
    for threads in sorted({1, torch.get_num_threads()}):
        previous = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            macs, seconds, checksum = module.int8_dot_roof(steps)
        finally:
            torch.set_num_threads(previous)
        assert macs == threads * steps * chains * lanes * per_lane and seconds > 0
        want = sum(lanes * (c + t) - lanes * steps * per_lane * 2 * (3 + t)
                   for t in range(threads) for c in range(chains))
        assert checksum == want, (path, threads)


def test_packed_products_equal_plain_ones():
    import torch

    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    want = torch.nn.functional.linear(x, w)
    ways = gemm.ways([w])
    for way, run in ways.items():
        if way in ("w8a8", "int4", "w4a8", "w4a8 VNNI", "q8a8"):  # the weights rounded (the int8 ways' inputs too)
            bound = 0.2 if way in ("int4", "w4a8", "w4a8 VNNI") else 0.02  # 4 bits, or 8
            assert (run(x)[0].float() - want).abs().max() <= bound * want.abs().max()
            continue
        torch.testing.assert_close(run(x)[0], want, atol=1e-4, rtol=1e-4, msg=way)
    from specui.weights.quantize import has_int4_kernel
    from specui.weights.w4a8 import w4a8_unavailable
    from specui.weights.w8a8 import has_w8a8_kernel

    assert ("w8a8" in ways) == has_w8a8_kernel() and ("int4" in ways) == has_int4_kernel()
    assert ("w4a8" in ways) == (not w4a8_unavailable()) and ("q8a8" in ways) == ("w4a8" in ways)


def test_ways_picks_the_ways_timed(capsys):
    assert gemm.main(["--shape", "64x32", "--megabytes", "1", "--rows", "1,2", "--dtypes", "float32",
                      "--ways", "plain"]) == 0
    out = capsys.readouterr().out
    timed = [line.split("ms for rows")[0].split(maxsplit=1)[1].strip() for line in out.splitlines()
             if " ms for rows " in line]
    assert timed == ["plain"] and "timed in turns" in out
