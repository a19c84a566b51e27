"""torch's int4 CPU packing read back on every CPU class (issue 41): the layouts torch uses on
AVX-512 / AMX, AVX2 and builds without vector kernels, written out here from its packing rules,
each recognised and read back exactly, whatever machine runs the test; an unknown packing is
learned by probing; the real kernel's packing on this machine is read back too."""

from __future__ import annotations

import pytest
import torch

from specui.weights.int4_layout import Int4Layout, find_layout, learn_order
from specui.weights.quantize import Int4Linear, quantize_groups


def _pack_like_torch(q: torch.Tensor, block: int, vector: bool) -> torch.Tensor:
    """torch's weight_to_int4pack_kernel, written out: blocks of `block` rows; a full block on a
    vector build puts row d and row d + block / 2 in one byte (AVX-512's lanes 0|2 and 1|3 give
    the same order), a partial block or a build without vector kernels pairs rows 2d, 2d + 1."""
    n, k = q.shape
    out = []
    for start in range(0, n, block):
        rows = q[start:start + block].to(torch.uint8)  # (nb, K)
        nb = rows.shape[0]
        if vector and nb == block:
            low, high = rows[: nb // 2], rows[nb // 2:]
        else:
            low, high = rows[0::2], rows[1::2]
        out.append((low | (high << 4)).T.reshape(-1))  # for each column k: nb / 2 bytes
    return torch.cat(out)


CLASSES = {  # CPU class -> (rows a block, vector kernels)
    "AVX-512 / AMX (Zen 4, Sapphire Rapids)": (64, True),
    "AVX2 (Zen 3)": (32, True),
    "no vector kernels": (32, False),
}


def _q(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


@pytest.mark.parametrize("cpu", list(CLASSES))
@pytest.mark.parametrize("n", [16, 32, 48, 64, 96, 192, 576])
def test_every_cpu_classs_packing_is_read_back_exactly(cpu, n):
    block, vector = CLASSES[cpu]
    q = _q(n, 64, seed=n)
    packed = _pack_like_torch(q, block, vector)

    def never(_):
        raise AssertionError("a described layout needs no probing")

    layout = find_layout(packed, q, never)
    assert layout is not None and layout.order is None
    assert torch.equal(layout.unpack(packed, (n, 64)), q.to(torch.uint8))


def test_an_unknown_packing_is_learned_by_probing_and_shared_by_shape():
    perm = torch.randperm(96 * 64 // 2, generator=torch.Generator().manual_seed(1))

    def foreign(q: torch.Tensor) -> torch.Tensor:  # pairs of columns, bytes shuffled
        v = q.to(torch.uint8).reshape(-1)
        return (v[0::2] | (v[1::2] << 4))[perm]

    learned: dict = {}
    q = _q(96, 64, seed=5)
    layout = find_layout(foreign(q), q, foreign, learned)
    assert layout is not None and layout.name == "learned by probing the packer"
    assert torch.equal(layout.unpack(foreign(q), (96, 64)), q.to(torch.uint8))
    assert list(learned) == [(96, 64)]
    q2 = _q(96, 64, seed=6)
    assert find_layout(foreign(q2), q2, lambda _: pytest.fail("probed twice"), learned).order is learned[(96, 64)]


def test_a_packing_that_loses_weights_is_not_read():
    assert learn_order((32, 64), lambda q: torch.zeros(32 * 64 // 2, dtype=torch.uint8)) is None
    q = _q(32, 64)
    zeros = torch.zeros(32 * 64 // 2, dtype=torch.uint8)
    assert find_layout(zeros, q, lambda q: zeros) is None


def test_layouts_name_themselves():
    assert Int4Layout(64, True).name == "64-row blocks, halves"
    assert Int4Layout(32, False).name == "32-row blocks, row pairs"


@pytest.mark.parametrize("n", [32, 48, 96, 192])
def test_this_machines_kernel_packing_is_read_back(n):
    """Whatever CPU runs this: the real kernel's packing is recognised, dense weights exact."""
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        pytest.skip("this torch build has no int4 CPU kernel")
    w = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
    q, scale, low = quantize_groups(w)
    module = Int4Linear.from_groups(q, scale, low, torch.device("cpu"))
    assert module is not None and module.layout is not None
    assert torch.equal(module.layout.unpack(module.packed, (n, 64)), q)
