"""Matrix products without the padding of a rows forward.

A RowSession forward (beam rows: beam search, DSBD's forests, a tree per beam) is a (rows, width)
batch in which rows with fewer pending nodes are padded to the widest. Every token is its own
row of every matrix product, so padding costs what a real token costs, and on kernels whose time
grows with the rows (a CPU's 4-bit x 8-bit product reads its weights once per 12 rows) it
costs more: DSBD's 10 real tokens padded to 2 x 7 took 167 ms at the 1.7b stand-in where 2 x 6
took 114. Only attention mixes tokens; the products, norms and activations are per token. So,
for one forward, every MLP block and every other linear-like module (a leaf with `in_features` /
`out_features`: nn.Linear and SpecUI's quantized linears) is handed only the real tokens and its
output is scattered back into the padded shape, zeros at the padding. A padding token then has
zero queries, keys and values (it attends to itself only, and nobody attends to it), so the real
tokens' results are those of the padded forward: bit for bit on row-exact kernels (w4a8 / w8a8,
tests/test_unpadded.py), and up to the kernel's own rounding of a different row count elsewhere.
Eager forwards only: a compiled rows forward keeps its padded shape (one compile serves them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def token_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's per-token parts that hold its matrix products: each MLP block whole (a module
    whose class name ends in MLP: its products and activation on the real tokens, one gather and
    one scatter), and every other leaf with in_features and out_features (attention projections,
    the output layer, a feature draft's mixing layer)."""
    found, inside = [], ""
    for name, m in model.named_modules():
        if inside and name.startswith(inside):
            continue
        if type(m).__name__.endswith("MLP") and next(m.children(), None) is not None:
            found.append(m)
            inside = name + "."
        elif hasattr(m, "in_features") and hasattr(m, "out_features") and next(m.children(), None) is None:
            found.append(m)
    return found


@contextmanager
def real_tokens_only(modules: list[torch.nn.Module], shape: tuple[int, int], keep: torch.Tensor) -> Iterator[None]:
    """Inside, the `modules` (token_modules(model)) compute only the tokens at `keep` (flat indices
    into the (rows, width) = `shape` batch); their outputs come back padded with zeros. Inputs of
    another shape (a module called on something else) pass untouched. Modules handed the same
    input one after another (an attention block's query, key and value projections) share one
    gather."""
    gathered: dict[int, bool] = {}
    last: list = [None, None]  # the last input gathered, and its real tokens

    def before(module, args):
        x = args[0]
        if not isinstance(x, torch.Tensor) or tuple(x.shape[:-1]) != shape:
            gathered[id(module)] = False
            return None
        gathered[id(module)] = True
        if last[0] is not x:
            last[0], last[1] = x, x.reshape(-1, x.shape[-1]).index_select(0, keep)[None]
        return (last[1], *args[1:])

    def after(module, _args, out):
        if not gathered.pop(id(module), False):
            return None
        full = out.new_zeros((shape[0] * shape[1], out.shape[-1]))
        full.index_copy_(0, keep, out[0])
        return full.view(*shape, out.shape[-1])

    hooks = []
    try:
        for m in modules:
            hooks.append(m.register_forward_pre_hook(before))
            hooks.append(m.register_forward_hook(after))
        yield
    finally:
        for h in hooks:
            h.remove()
