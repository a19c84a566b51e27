"""int8 weights and int8 activations on a CPU (`--quantization w8a8`): the matrix product that
stays flat as a verification scores more tokens.

Why: on CPUs without a bfloat16 dot product (AVX2, AVX-512 before Cooper Lake) torch's float
and weight-only kernels repack or re-convert the weights for every product of more than two
rows, so scoring k tokens costs up to k times one (README: 2.9x for 8 rows of an 8192x2048
matrix in float32 on a Cascade Lake Xeon, 5.3x in bfloat16). An int8 x int8 product on oneDNN's
prepacked weights (VNNI where the CPU has it) reads each weight once for all the rows: the
same 8 matrices cost 10.8 / 11.0 / 13.3 / 17.4 ms for 1 / 4 / 8 / 16 rows there, against 27 ms
for one row in float32.

What it computes, so that a method stays lossless against it: each row x of the input is
rounded on its own, q = round(x * Q / max|x|) (Q = 127, or 63 where the kernel saturates the
full range, measured by `full_range_exact`), the product of q with the int8 rows of W is exact
in int32, and y = (q W_q^T) * w_scale * max|x| / Q. Nothing mixes rows, so a token's output is
the same whether it is scored alone or with others: `batch_invariant` checks exactly that on
every matrix at load, and one that fails keeps its previous form. The rounding of activations
makes this a new function of the weights (like int4's), lossy against float32; speculation is
then lossless against this quantized target, as with every quantization."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from specui.weights.native import native
from specui.weights.quantize import AGREE, batch_invariant, quantize_rows, self_checked, swap_linears

FULL, REDUCED = 127, 63  # activation levels each side of the zero point: 8 bits, or 7 where the kernel saturates


def has_w8a8_kernel() -> bool:
    """Whether this torch build has oneDNN's int8 linear and its weight packer."""
    onednn = getattr(torch.ops, "onednn", None)
    return (torch.backends.mkldnn.is_available() and onednn is not None
            and hasattr(onednn, "qlinear_pointwise") and hasattr(onednn, "qlinear_prepack"))


@torch.library.custom_op("specui::w8a8_mm", mutates_args=())
def w8a8_mm(qx: torch.Tensor, zero: int, packed: torch.Tensor, w_scale: torch.Tensor,
            w_zero: torch.Tensor) -> torch.Tensor:
    """(rows, K) uint8 activations around `zero` times the prepacked int8 (N, K) weights ->
    (rows, N) float32 = (qx - zero) W_q^T * w_scale. One op to torch.compile: its prepacked
    weights are an opaque oneDNN tensor that inductor cannot trace through."""
    return _onednn(qx, zero, packed, w_scale, w_zero)


def _onednn(qx: torch.Tensor, zero: int, packed: torch.Tensor, w_scale: torch.Tensor,
            w_zero: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(qx, 1.0, zero, packed, w_scale, w_zero, None, 1.0, 0,
                                              torch.float32, "none", [], "")


@w8a8_mm.register_fake
def _(qx, zero, packed, w_scale, w_zero):
    return qx.new_empty((qx.shape[0], w_scale.shape[0]), dtype=torch.float32)


def _product(qx: torch.Tensor, zero: int, w: torch.Tensor) -> torch.Tensor:
    """The same product, one-off (w: (N, K) int8, unpacked): for the saturation probe."""
    packed = torch.ops.onednn.qlinear_prepack(w, None)
    ones, zeros = torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.int32)
    return w8a8_mm(qx, zero, packed, ones, zeros)


def levels_here() -> int:
    """The activation levels this CPU's kernel computes exactly: FULL with a VNNI dot product,
    REDUCED where it sums pairs of products in int16 (AVX2 without VNNI) and 8 bits saturate."""
    return FULL if full_range_exact() else REDUCED


@functools.cache  # the CPU's answer does not change within a process
def full_range_exact() -> bool:
    """Whether the kernel computes 8-bit activations exactly here: the worst case (every
    activation 255 around zero point 0, every weight 127) is exact with a VNNI dot product and
    saturates where pairs of products are summed in int16 (AVX2 without VNNI)."""
    k = 256
    got = _product(torch.full((2, k), 255, dtype=torch.uint8), 0, torch.full((8, k), 127, dtype=torch.int8))
    return bool((got == 255 * 127 * k).all())


class W8A8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W as int8 rows (one scale per row) prepacked for oneDNN, and each
    input row rounded to `levels` steps each side of zero by its own largest magnitude."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 levels: int = FULL) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.levels, self.zero = levels, levels + 1
        self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(weight.contiguous(), None))
        self.register_buffer("w_scale", scale.reshape(-1).float().clone())
        self.register_buffer("w_zero", torch.zeros(self.out_features, dtype=torch.int32))
        # the weights' scales over the activations' levels (the product then needs only each row's largest
        # magnitude); not a buffer, so a model cast to float64 leaves it in float32, as oneDNN takes it
        self.product_scale = (self.w_scale / levels).float()
        # the levels and the zero point as tensors that follow the model's dtype (one op each where a Python
        # number costs two, and no conversion); not saved with the model
        self.register_buffer("levels_t", torch.tensor(float(levels)), persistent=False)
        self.register_buffer("zero_t", torch.tensor(float(self.zero)), persistent=False)
        self.rows: torch.Tensor | None = weight.clone()  # for dense() while self-checked, then dropped (memory)
        # SpecUI's kernels for the rounding before the product and the scaling after it (one pass each, the
        # same bits as the torch ops in forward); None where they could not be built here
        kernels = native()[0]
        self._native = None if kernels is None else (kernels.round_rows, kernels.scale_rows)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dense(self) -> torch.Tensor:
        if self.rows is None:
            raise ValueError("this module's int8 rows were dropped after its self-check")
        return self.rows.float() * self.w_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()  # rounded in float64 where given
        compiling = torch.compiler.is_compiling()
        fused = self._native is not None and not compiling  # inductor fuses the torch ops below itself
        if fused:  # one pass of SpecUI's kernel: the same bits as the ops below, 5-20x faster eagerly
            qx, top = self._native[0](flat.contiguous(), float(self.levels), float(self.zero))
        else:  # every op here costs ~10 us eagerly, 211 times a token: as few as the arithmetic allows
            top = torch.linalg.vector_norm(flat, float("inf"), dim=-1, keepdim=True).clamp_min_(1e-30)  # max |x|
            # zero + x * levels / top, rounded (the zero point is even: the same as rounding first, then adding it)
            qx = torch.addcmul(self.zero_t, flat, torch.div(self.levels_t, top)).round_().to(torch.uint8)
        if compiling:  # one op inductor calls as it is (the same product)
            product = w8a8_mm(qx, self.zero, self.packed, self.product_scale, self.w_zero)
        else:  # eagerly the op itself: the custom op's dispatch costs ~80 us a call (16 ms a 1.7b token)
            product = _onednn(qx, self.zero, self.packed, self.product_scale, self.w_zero)
        out = self._native[1](product, top) if fused else product * top
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    levels: int | None = None) -> W8A8Linear | None:
        """The module over `weight` rounded to int8 rows (activations to `levels`, by default
        what this CPU computes exactly: levels_here), or None where the kernel cannot serve
        it: not CPU, no kernel, a shape it refuses, a product that is not close to x W^T, or one
        whose rows depend on each other (see batch_invariant)."""
        if weight.device.type != "cpu" or not has_w8a8_kernel():
            return None
        return cls.from_rows(*quantize_rows(weight), bias, levels)

    @classmethod
    def from_rows(cls, rows: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  levels: int | None = None) -> W8A8Linear | None:
        """The module over int8 rows as they are (w = rows * scale, one scale a row: a draft's
        stored head), checked as from_weight checks; None where the kernel cannot serve them."""
        if rows.device.type != "cpu" or not has_w8a8_kernel():
            return None
        try:
            module = cls(rows, scale, bias, levels_here() if levels is None else levels)
        except (RuntimeError, NotImplementedError):  # the packer refuses this build or shape
            return None
        x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(0))
        tolerance = AGREE * FULL / module.levels  # 7-bit activations round twice as coarsely as 8-bit ones
        if self_checked(module, module.dense(), bias, tolerance) is None or not batch_invariant(module, x):
            return None
        module.rows = None
        return module


def quantize_w8a8(model: torch.nn.Module,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
    """Swap every Linear of `model` (its output head included) for a W8A8Linear where the kernel
    serves it; counts "w8a8" and "kept". `progress(done, total)` as each matrix starts."""
    counts = {"w8a8": 0, "kept": 0}
    if not has_w8a8_kernel():
        counts["kept"] = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        return counts
    levels = levels_here()
    swap_linears(model, lambda _name, m: (W8A8Linear.from_weight(m.weight.detach(), m.bias, levels), "w8a8"),
                 counts, progress)
    counts["levels"] = levels
    return counts

