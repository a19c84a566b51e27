"""4-bit weights times 8-bit activations on a CPU (`--quantization w4a8`): int4's weights at
int8's cost to verify.

Why: torch's int4 kernel is built for one row. At the 1.7b stand-in it re-reads and re-converts
the weights for every few rows, so scoring 9 tokens costs about 4x one (README), and speculation
has little to save; w8a8 stays flat but reads twice the bytes. Here each input row is rounded to
int8 in groups of 32 (one scale each, llama.cpp's Q8 blocks) and multiplied with the 4-bit groups
on the CPU's int8 dot product (SpecUI's kernel, specui/weights/kernels/q4a8.cpp: AVX512-VNNI where
the CPU has it, AVX2's pairwise int8 products into int16 elsewhere on x86-64, a portable loop with
the same bits where neither is built), reading each weight once for all the rows. On the Xeon of
README, 24 matrices of 8192x2112 out of cache: 0.57 / 0.83 / 0.92 / 1.25 ms a matrix for 1 / 8 / 9
/ 16 rows, against torch's int4 kernel's 0.75 / 2.26 / 3.34 / 4.37. Where the CPU has AMX, 13 rows or
more go on its tiles (kernels/q4a8_amx.cpp, the same bits): 16 rows 1.37 against VNNI's 1.81 ms.

What it computes: w = d q + m per group of 32 inputs (a GGUF's Q4_0 / Q4_1 blocks exactly, else
rounded at load as int4 rounds them), with d and m in float16; a GGUF's matrices in more than 4 bits
(a Q4_K_M file's Q6_K ones, a Q8_0 file's every one) on 8-bit groups instead (specui.weights.q8a8);
the output head on w8a8's int8 rows (as int4 puts it on int8). Nothing mixes rows and every float
operation runs in one fixed order, so a token's output is the same scored alone or with others
(`batch_invariant`, checked on every matrix at load); with the rest of the model in float64
(`--dtype auto`, as for w8a8) greedy speculation stays token for token equal to autoregressive
decoding of this target."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from specui.weights.native import native
from specui.weights.q8a8 import Q8A8Linear, checked, grouped_forward
from specui.weights.quantize import (
    GROUP,
    build_from_groups,
    dequantize_groups,
    quantize_groups,
    swap_linears,
    unbuilt,
)
from specui.weights.w8a8 import FULL, REDUCED, W8A8Linear, full_range_exact, has_w8a8_kernel

ROWS = 16  # output rows a packed block (the kernel's vector of 16 float32 sums)


def w4a8_unavailable() -> str:
    """Why no matrix can go on the w4a8 kernel here ("" where it can)."""
    kernels, why = native()
    if kernels is None:
        return why
    return ""


def w4a8_vector() -> bool:
    """Whether the kernel runs a vector path here (AVX512-VNNI or AVX2; else the portable loop:
    the same bits, scalar speed, so quantization auto does not weigh w4a8)."""
    kernels = native()[0]
    return kernels is not None and bool(kernels.q4a8_vector())


def w4a8_path() -> str:
    """The path the kernel runs here, in words: "AVX512-VNNI", "AVX2" or "portable loop", and
    where the CPU has AMX ", AMX tiles from 13 rows"."""
    kernels = native()[0]
    if kernels is None:
        return "unavailable"
    amx_from = int(kernels.q4a8_amx_from())
    return str(kernels.q4a8_path()) + (f", AMX tiles from {amx_from} rows" if amx_from else "")


def w4a8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, K) float32 / float64 input times the packed 4-bit (n, K) weights -> (rows, n) in the
    input's dtype (float32 sums). One torch operator (the kernel's own, module.cpp) for torch.compile,
    which cannot trace into SpecUI's extension; C++ to C++, where a Python custom op cost ~35 us a call."""
    return torch.ops.specui_native.q4a8_mm(x, packed, scales, n)


def pack_groups(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit groups (q (N, K) in 0..15, scale and low (N, K / GROUP)) in the kernel's order:
    (packed uint8, float16 scales), the rows padded to a multiple of ROWS with zero groups."""
    n, k = q.shape
    pad = -n % ROWS
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale, low = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])]), torch.cat(
            [low, low.new_zeros(pad, low.shape[1])])
    blocks, groups = (n + pad) // ROWS, k // GROUP
    # (block, row, group, quad of 4 inputs, input) -> (block, group, quad, row, input)
    quads = q.to(torch.uint8).reshape(blocks, ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)
    packed = (quads[:, :, 0:4] | (quads[:, :, 4:8] << 4)).contiguous().reshape(-1)
    both = torch.stack([scale.reshape(blocks, ROWS, groups), low.reshape(blocks, ROWS, groups)], 0)
    return packed, both.permute(1, 3, 0, 2).contiguous().to(torch.float16).reshape(-1)


class W4A8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W in 4-bit groups of GROUP inputs (w = d q + m, d and m float16) and
    each input row rounded to int8 by groups of GROUP, on SpecUI's kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        packed, scales = pack_groups(q, scale, low)
        self.register_buffer("packed", packed)
        # the float16 scales' bits as int16: a model cast to float64 (the rest of a w4a8 model) leaves them as they are
        self.register_buffer("scales", scales.view(torch.int16))
        # the groups as the kernel holds them (float16 scales), for dense() while self-checked, then dropped
        self.groups: tuple[torch.Tensor, ...] | None = (q, scale.half().float(), low.half().float())
        self._mm = native()[0].q4a8_mm
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight the kernel holds, as float32 (`rows`: only those)."""
        if self.groups is None:
            raise ValueError("this module's 4-bit groups were dropped after its self-check")
        return dequantize_groups(*(self.groups if rows is None else (part[rows] for part in self.groups)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_forward(self, x, w4a8_mm)

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                    bias: torch.Tensor | None = None) -> W4A8Linear | None:
        """The module over 4-bit groups, or None where the kernel cannot serve them: no kernel
        here, K not a multiple of GROUP, a product not close to x W^T, or rows that depend on
        each other."""
        if w4a8_unavailable() or q.shape[1] % GROUP or q.device.type != "cpu":
            return None
        module = cls(q, scale, low, bias)
        if not checked(module, bias):
            return None
        module.groups = None
        return module


def quantize_w4a8(model: torch.nn.Module, groups: Mapping | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  wide: Mapping[str, torch.Tensor] | None = None) -> dict[str, int]:
    """Swap every Linear of `model` for a W4A8Linear (from `groups[name]` where given, e.g. a GGUF's
    own 4-bit blocks, else rounded from its weight), those in `wide` (a GGUF's matrices in more than
    4 bits: name -> its float weight) for a Q8A8Linear (8-bit groups, specui.weights.q8a8), the output
    head for a W8A8Linear (int8 rows times 8-bit activations on oneDNN) where that product is exact
    here, else for a Q8A8Linear; counts "w4a8", "from_file", "eight_bit" (of wide), "w8a8" or "q8a8"
    (the head) and "kept". `progress(done, total)` as each starts."""
    groups = groups if groups is not None else {}
    wide = wide if wide is not None else {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    counts = {"w4a8": 0, "from_file": 0, "eight_bit": 0, "w8a8": 0, "q8a8": 0, "kept": 0}

    def make(name: str, module: torch.nn.Linear) -> tuple[torch.nn.Module | None, str]:
        if module is head:
            return _head(module)
        if name in wide:
            return _eight_bit(module, wide[name])
        if module.in_features % GROUP:  # the kernel takes whole groups of inputs
            return None, "w4a8"
        given = groups.get(name)
        fast = W4A8Linear.from_groups(*(given or quantize_groups(module.weight)), module.bias)
        counts["from_file"] += int(fast is not None and given is not None)
        if fast is None:  # a matrix never built in float (a stand-in's, a packed GGUF's): its values
            build_from_groups(module, given)
        return fast, "w4a8"

    return swap_linears(model, make, counts, progress)


def _eight_bit(module: torch.nn.Linear, weight: torch.Tensor) -> tuple[torch.nn.Module | None, str]:
    """A matrix the file holds in more than 4 bits, on 8-bit groups; where the kernel cannot take it,
    its float weight put in place (a matrix loaded unbuilt gets its values) and rounded to 4 bits."""
    fast = Q8A8Linear.from_weight(weight.float(), module.bias)
    if fast is not None:
        return fast, "eight_bit"
    if unbuilt(module.weight):
        module.weight = torch.nn.Parameter(weight.to(module.weight.dtype), requires_grad=False)
    if module.in_features % GROUP:  # neither kernel takes it: left as it is, its values in place
        return None, "w4a8"
    return W4A8Linear.from_groups(*quantize_groups(module.weight), module.bias), "w4a8"


def _head(module: torch.nn.Linear) -> tuple[torch.nn.Module | None, str]:
    """The output head's module and its kind: w8a8's int8 rows where oneDNN takes 8-bit activations
    exactly here (VNNI); else 8-bit groups (AVX2: oneDNN would round the activations to 7 bits, which
    a real head's outlier rows fail the self-check with), w8a8's 7 bits where those cannot be built."""
    weight = module.weight.detach().float()
    if has_w8a8_kernel() and full_range_exact():
        return W8A8Linear.from_weight(weight, module.bias, FULL), "w8a8"
    grouped = Q8A8Linear.from_weight(weight, module.bias)
    if grouped is not None:
        return grouped, "q8a8"
    return (W8A8Linear.from_weight(weight, module.bias, REDUCED) if has_w8a8_kernel() else None), "w8a8"
