"""Float weights streamed once for all the tokens a verification scores: SpecUI's C++ kernel for
float32 and bfloat16 matrices on a CPU, chosen at load where it measures faster.

Why: torch's float kernels repack or re-convert the weights for products of more than two rows,
so on CPUs without bfloat16 matrix units scoring k tokens costs up to k times one (8 matrices of
8192x2048 in float32 on a 2-core Emerald Rapids Xeon: 22.2 / 25.0 / 46.8 / 67.0 ms for 1 / 2 / 4 /
8 rows), which is what keeps speculation from paying there. This kernel reads each weight once and
multiplies it into every row (20.6 / 25.1 / 31.3 / 38.3 ms for the same products).

What it computes (specui/weights/kernels/stream.cpp): y = x W^T in float32 (a bfloat16 weight is
widened exactly), each output summed in one fixed order whatever the number of rows, so a token's
output is bit for bit the same whether it is scored alone or with others (`batch_invariant`,
checked on the model's own matrix at load). A method is then exactly lossless against the model
(no near-ties between a 1-token and a k-token forward). Inputs of more than MAX_ROWS rows (a
prompt's prefill) go to torch's kernel, where the weights are reused across many rows anyway.

The kernel is built here on first use with this CPU's instructions (native.py: g++, ninja and
torch's headers, about 40 s, cached); where it cannot be built (no compiler, not x86-64 with
AVX2), `stream_unavailable()` says why and the model keeps torch's kernels."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from specui.weights.native import has_native, native, native_unavailable
from specui.weights.quantize import batch_invariant, replace_module, self_checked

MAX_ROWS = 32  # more rows (a prefill): torch's kernel
MIN_BYTES = 64 << 20  # smaller models' products are not bound by reading their weights: left alone
PROBE_ROWS = 8  # a verification's size: where the choice is measured, beside one token
GAIN = 0.9  # the kernel must be this much faster at PROBE_ROWS ...
SLACK = 1.1  # ... and no more than this much slower for one token
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
ENV = "SPECUI_STREAM_KERNEL"  # "0": never (to measure torch's kernels beside it)


def has_stream_kernel() -> bool:
    return has_native()


def stream_unavailable() -> str:
    return native_unavailable()


def stream_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, K) float32 times (N, K) float32 or bfloat16 -> (rows, N) float32. One torch operator
    (the kernel's own, module.cpp) for torch.compile: inductor calls the C++ kernel as it is."""
    return torch.ops.specui_native.stream_mm(x, weight)


class StreamLinear(torch.nn.Module):
    """A Linear whose products of up to MAX_ROWS rows run on the streaming kernel. It holds the
    Linear's own weight and bias (no copy: a head tied to the embeddings stays tied)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._mm = native()[0].stream_mm  # eagerly the kernel itself: a custom op's dispatch costs ~80 us a call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > MAX_ROWS or x.device.type != "cpu" or self.weight.dtype not in KERNEL_DTYPES:
            return torch.nn.functional.linear(x, self.weight, self.bias)  # a prefill, or a model cast or moved since
        flat = flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float().contiguous()
        out = stream_mm(flat, self.weight) if torch.compiler.is_compiling() else self._mm(flat, self.weight)
        out = out.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def servable(linear: torch.nn.Module) -> bool:
    """A plain CPU Linear in float32 or bfloat16 whose input width the kernel's vectors divide."""
    weight = getattr(linear, "weight", None)
    return (type(linear) is torch.nn.Linear and weight is not None and weight.device.type == "cpu"
            and weight.dtype in KERNEL_DTYPES and weight.is_contiguous()
            and linear.in_features % 16 == 0)


def _ms(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    start = time.perf_counter()
    product(x)
    return (time.perf_counter() - start) * 1e3


def _both_ms(linears: list[torch.nn.Linear], rows: int, repeats: int) -> tuple[float, float]:
    """(torch ms, kernel ms) for `rows` rows through each of `linears`: fastest of `repeats`,
    taking turns."""
    fast = [StreamLinear(m) for m in linears]
    xs = [torch.randn(rows, m.in_features, generator=torch.Generator().manual_seed(2)).to(m.weight.dtype)
          for m in linears]
    with torch.inference_mode():
        timed = [(sum(_ms(m, x) for m, x in zip(linears, xs)), sum(_ms(f, x) for f, x in zip(fast, xs)))
                 for _ in range(repeats + 1)][1:]  # the first: first touches
    return min(t for t, _ in timed), min(k for _, k in timed)


def _exact(probe: torch.nn.Linear) -> bool:
    """The kernel's product of `probe` passes the kernels' self-check and is batch-invariant."""
    fast = StreamLinear(probe)
    x = torch.randn(PROBE_ROWS, probe.in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return self_checked(fast, probe.weight, probe.bias) is not None and batch_invariant(fast, x)


def _decide(model: torch.nn.Module, group: list[tuple[str, torch.nn.Linear]], what: str, timer) -> str:
    """Measure one group of matrices (one of each shape), move them all where the kernel wins;
    the note of what was measured."""
    probes = list({tuple(m.weight.shape): m for _, m in group}.values())
    if not _exact(max(probes, key=lambda m: m.weight.numel())):
        return f"{what} on torch's kernels (the streaming kernel's products differ here)"
    one, many = (timer(probes, rows) for rows in (1, PROBE_ROWS))
    chosen = many[1] <= GAIN * many[0] and one[1] <= SLACK * one[0]
    if chosen:
        for name, linear in group:
            replace_module(model, name, StreamLinear(linear))
    kind = "on the streaming kernel" if chosen else "on torch's kernels"
    return (f"{what} {kind} ({PROBE_ROWS} tokens {many[1]:.1f} ms on the kernel vs {many[0]:.1f} on torch's, "
            f"one token {one[1]:.1f} vs {one[0]:.1f})")


def use_stream_kernel(model: torch.nn.Module, role: str = "model", repeats: int = 5, min_bytes: int = MIN_BYTES,
                      timer: Callable[[list[torch.nn.Linear], int], tuple[float, float]] | None = None,
                      ) -> str | None:
    """For the model's decoder matrices (one of each shape) and its output head apart, measure
    torch's kernel against the streaming kernel for one token and for PROBE_ROWS; where the
    kernel is GAIN faster at PROBE_ROWS and within SLACK for one token (and exact, and
    batch-invariant), that group moves to it. The note of what was measured, or None where there
    is nothing to decide (no servable matrix, a model under `min_bytes`). `timer(linears, rows)`:
    (torch ms, kernel ms) instead of measuring (tests)."""
    linears = [(name, m) for name, m in model.named_modules() if servable(m)]
    total = sum(m.weight.numel() * m.weight.element_size() for _, m in linears)
    if not linears or total < min_bytes:
        return None
    if os.environ.get(ENV) == "0":
        return f"{role} matrices on torch's kernels ({ENV}=0)"
    if not has_stream_kernel():
        return f"{role} matrices on torch's kernels ({stream_unavailable()})"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    groups = [([(n, m) for n, m in linears if m is not head], "decoder matrices"),
              ([(n, m) for n, m in linears if m is head], "output head")]
    timer = timer or (lambda probes, rows: _both_ms(probes, rows, repeats))
    said = [_decide(model, group, what, timer) for group, what in groups if group]
    return (f"{role} float products ({native()[0].instructions()} streaming kernel, the same output for a token "
            "scored alone or with others): " + "; ".join(said))
