"""8-bit weight groups times 8-bit activation groups on a CPU: a GGUF's decoder matrices in more than 4
bits under w4a8, and a w4a8 model's output head where oneDNN's int8 product cannot take 8-bit
activations exactly (AVX2 without VNNI).

Why: w4a8 puts its output head (the bundled model's 49152 x 576, the largest matrix it has) on w8a8's
int8 rows. Where the CPU sums pairs of int8 products in int16 (AVX2, no VNNI) oneDNN saturates, so w8a8 falls back to
7-bit activations, which the bundled head's outlier rows do not pass the self-check with, and the
head stayed in float32: 113 MB read a token, 15 ms of a 35 ms token on a 2-core Zen 3. Here the
weights are llama.cpp's Q8_0 blocks (w = d q per group of 32 inputs, d float16, q in -127..127; the
bundled GGUF stores its head so, and these are those blocks exactly) and each input row is rounded
to int8 by groups of 32 as for w4a8, on SpecUI's kernel (specui/weights/kernels/q8a8.cpp:
AVX512-VNNI or AVX2, or a portable loop with the same bits): 28 MB a token. w4a8 also puts a GGUF's
decoder matrices in more than 4 bits here (a Q4_K_M file's Q6_K ones: gguf_blocks.EIGHT_BIT).

Nothing mixes rows and every float operation runs in one fixed order, so a token's output is the
same scored alone or with others."""

from __future__ import annotations

import torch

from specui.weights.native import native
from specui.weights.quantize import GROUP, batch_invariant, sample_rows, self_checked

ROWS = 8  # output rows a packed block (the kernel's vector of 8 float32 sums)
LEVELS = 127


def q8a8_vector() -> bool:
    """Whether the kernel runs a vector path here (AVX512-VNNI or AVX2; else the portable loop: the same
    bits, scalar speed)."""
    kernels = native()[0]
    return kernels is not None and bool(kernels.q8a8_vector())


def q8a8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, K) float32 / float64 input times the packed 8-bit (n, K) weights -> (rows, n) in the
    input's dtype (float32 sums). One torch operator (the kernel's own, module.cpp) for torch.compile."""
    return torch.ops.specui_native.q8a8_mm(x, packed, scales, n)


def grouped_forward(module: torch.nn.Module, x: torch.Tensor, op) -> torch.Tensor:
    """A group kernel's module (packed, scales, _mm, bias, in / out_features) applied to x: float32
    or float64 rows into the kernel, the output in x's dtype. Compiled, the kernel's torch operator
    `op`; eagerly the kernel itself (even a C++ operator's dispatch costs a few us a call)."""
    flat = x.reshape(-1, module.in_features)
    flat = (flat if flat.dtype in (torch.float32, torch.float64) else flat.float()).contiguous()
    mm = op if torch.compiler.is_compiling() else module._mm
    out = mm(flat, module.packed, module.scales, module.out_features)
    out = out.view(*x.shape[:-1], module.out_features).to(x.dtype)
    return out if module.bias is None else out + module.bias.to(x.dtype)


def checked(module: torch.nn.Module, bias: torch.Tensor | None) -> bool:
    """The load-time checks of a group kernel's module (its dense(rows), in / out_features): its product
    matches x W^T on sampled rows, and each row comes out the same scored alone or with others (and
    among 16 rows: the 4-bit kernel's AMX tiles take 13 or more where the CPU has them)."""
    x = torch.randn(16, module.in_features, generator=torch.Generator().manual_seed(0)).double()
    rows = sample_rows(module.out_features)
    return (self_checked(module, module.dense(rows), bias, rows=rows) is not None and batch_invariant(module, x[:5])
            and torch.equal(module(x)[:5], module(x[:5])))


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks of `weight` (N, K), as llama.cpp rounds them: d = max|w| / 127 per group of 32
    (in float16), q = round(w / d) in -127..127. A weight dequantized from Q8_0 blocks comes back
    to the same blocks. Returns (q int8 (N, K), d (N, K / GROUP) float32 holding float16 values)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    d = (w.abs().amax(-1) / LEVELS).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(w * inv[..., None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return q.reshape(n, k), d


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups in the kernel's order: (packed int8, float16 scales), the rows padded to a
    multiple of ROWS with zero groups."""
    n, k = q.shape
    pad = -n % ROWS
    if pad:
        q, d = torch.cat([q, q.new_zeros(pad, k)]), torch.cat([d, d.new_zeros(pad, d.shape[1])])
    blocks, groups = (n + pad) // ROWS, k // GROUP
    # (block, row, group, quad of 4 inputs, input) -> (block, group, quad, row, input)
    packed = q.reshape(blocks, ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4).contiguous().reshape(-1)
    scales = d.reshape(blocks, ROWS, groups).permute(0, 2, 1).contiguous().to(torch.float16).reshape(-1)
    return packed, scales


class Q8A8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W in 8-bit groups of GROUP inputs (w = d q, d float16) and each input
    row rounded to int8 by groups of GROUP, on SpecUI's kernel."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        packed, scales = pack_q8(q, d)
        self.register_buffer("packed", packed)
        # the float16 scales' bits as int16: a model cast to float64 leaves them as they are
        self.register_buffer("scales", scales.view(torch.int16))
        self.groups: tuple[torch.Tensor, torch.Tensor] | None = (q, d)  # for dense() while self-checked
        self._mm = native()[0].q8a8_mm
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight the kernel holds, as float32 (`rows`: only those)."""
        if self.groups is None:
            raise ValueError("this module's 8-bit groups were dropped after its self-check")
        q, d = self.groups if rows is None else (self.groups[0][rows], self.groups[1][rows])
        return (q.float().reshape(q.shape[0], -1, GROUP) * d[..., None]).reshape(q.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_forward(self, x, q8a8_mm)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q8A8Linear | None:
        """The module over `weight` in Q8_0 blocks, or None where the kernel cannot serve it: no
        kernel here, K not a multiple of GROUP, not on the CPU, a product not close to x W^T, or
        rows that depend on each other."""
        if native()[0] is None or weight.shape[1] % GROUP or weight.device.type != "cpu":
            return None
        module = cls(*quantize_q8(weight), bias)
        if not checked(module, bias):
            return None
        module.groups = None
        return module
