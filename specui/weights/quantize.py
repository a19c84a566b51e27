"""Weight-only int8 and int4 on CPU, computed by torch's own kernels in bfloat16.

- int8: every matrix stored as int8 rows with one scale per row (`torch._weight_int8pack_mm`).
  The draft ships its matrices this way (specui/weights/draft.py).
- int4: every matrix of the decoder layers stored in 4-bit groups of 32 along the input, each
  group with its own scale and offset (`aten._weight_int4pack_mm_for_cpu`); a GGUF's Q4_0 /
  Q4_1 blocks are exactly such groups, so the file's own 4-bit weights are used as they are
  (specui/weights/gguf_blocks.py). The output head (and a GGUF's matrices in more than 4 bits, e.g. a
  Q4_K_M file's Q6_K ones) stay on int8 rows, as llama.cpp's quantizers keep them at higher precision.

A decode step on a CPU is bound by reading its weights: int8 reads a quarter of float32's bytes, int4 about a
sixth. `--quantization int8 | int4` apply them at load; every matrix passes a numerical self-check here first
(one the kernel refuses stays as it was). The quantized target is what the methods are lossless against.

Long inputs (a prompt's prefill): the kernels are built for a few rows; from some hundreds of rows a float32
matrix multiply is faster on many CPUs, so use_long_path measures, per model, whether a forward of LONG_ROWS
tokens a row computes faster with each matrix dequantized on the fly (the same weights, in float32) and turns
that on where it is. It only ever serves forwards that long (prefills), never the few-token steps and
verifications the methods compare."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specui.engine.host_memory import trim_heap
from specui.weights.int4_layout import Int4Layout, find_layout

GROUP = 32  # inputs per 4-bit group: a GGUF Q4_0 / Q4_1 block
LONG_ROWS = 256  # tokens a row from which a forward may compute dequantized (use_long_path)
LONG_GAIN = 0.9  # ... where measured at least 10% faster that way
CHECKED_ROWS = 512  # output rows a packed kernel's self-check compares in a larger matrix (sample_rows)
TRIM_EVERY = 8  # matrices packed between two heap trims (a 7B GGUF on w4a8: 8.7 GiB anonymous at the peak untrimmed)


class _Quantized(torch.nn.Module):
    """What Int8Linear and Int4Linear share: the long-input path, over each one's `dense()`
    (the (out, in) float32 weights its kernel computes with)."""

    long_rows: int | None = None  # set by use_long_path; None: always the kernel

    def _long(self, x: torch.Tensor) -> bool:
        return self.long_rows is not None and x.dim() >= 2 and x.shape[-2] >= self.long_rows

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.float(), self.dense()).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)


class Int8Linear(_Quantized):
    """y = x W^T (+ b) with W kept as int8 rows and one scale per row, computed by torch's
    weight-only int8 kernel in bfloat16."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.clone())  # a fresh, aligned allocation (the kernel needs it)
        self.register_buffer("scale", scale.reshape(-1).to(torch.bfloat16).clone())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dense(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._long(x):
            return self._dense_forward(x)
        if x.dtype == torch.bfloat16 and self.bias is None:  # decoding's case: no conversions (ops cost us each)
            return torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scale).view(
                x.shape[:-1] + (self.out_features,))
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scale).reshape(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    @classmethod
    def from_stored(cls, weight: torch.Tensor, scale: torch.Tensor, device: torch.device,
                    bias: torch.Tensor | None = None) -> Int8Linear | None:
        """The module over int8 rows, or None where the kernel cannot serve them: not CPU, a
        shape it gets wrong (in_features not a multiple of 32), or a product that fails the
        numerical self-check against the dequantized one on this machine."""
        if device.type != "cpu" or weight.shape[1] % 32 or not hasattr(torch, "_weight_int8pack_mm"):
            return None
        module = cls(weight, scale, bias)
        return self_checked(module, module.weight.float() * module.scale.float()[:, None], bias)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 rows, float32 scales) with W ~ rows * scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


AGREE = 0.02  # of the largest magnitude: the kernels' bfloat16 rounding, or 8-bit activations'


def agrees(got: torch.Tensor, want: torch.Tensor, tolerance: float = AGREE) -> bool:
    """Whether a product matches the one it stands for within `tolerance` of its largest magnitude (self-checks)."""
    return bool((got - want).abs().max() <= tolerance * want.abs().max() + 1e-6)


def self_checked(module: torch.nn.Module, want_weight: torch.Tensor, bias: torch.Tensor | None,
                 tolerance: float = AGREE, rows: torch.Tensor | None = None) -> torch.nn.Module | None:
    """`module` if its product with a random input matches x W^T (+ b) for the weight it should hold
    (`rows`: only those outputs, `want_weight` those rows); None where the kernel refuses or errs here."""
    x = torch.randn(5, want_weight.shape[1], generator=torch.Generator().manual_seed(0))
    try:
        got = module(x)
    except (RuntimeError, NotImplementedError):  # the kernel refuses this build or shape
        return None
    want = x @ want_weight.float().T
    if bias is not None:
        want = want + (bias if rows is None else bias[rows]).float()
    return module if agrees(got if rows is None else got[:, rows], want, tolerance) else None


def sample_rows(n: int) -> torch.Tensor:
    """The output rows a packed kernel's self-check compares: all of a small matrix, else CHECKED_ROWS
    spread over it, first and last included (each block of rows runs the same code; a whole dense copy
    cost a 7B load a sixth of its time)."""
    return torch.arange(n) if n <= CHECKED_ROWS else torch.linspace(0, n - 1, CHECKED_ROWS).round().long().unique()


def batch_invariant(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether each row of module(x) equals that row computed alone, bit for bit: what makes
    scoring k tokens in one forward give each the logits it gets alone."""
    together = module(x)
    return all(torch.equal(module(x[i:i + 1])[0], together[i]) for i in range(x.shape[0]))


def replace_module(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Put `new` where `root`'s submodule `name` (a dotted path, as named_modules gives) was."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def swap_linears(model: torch.nn.Module, make: Callable[[str, torch.nn.Linear], tuple[torch.nn.Module | None, str]],
                 counts: dict[str, int], progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
    """Put make(name, linear) -> (its replacement or None, the kind to count it under) in place of
    every Linear of `model`, counting each kind in `counts` and the Linears left as they were
    under "kept"; `progress(done, total)` as each matrix starts. The loop of every quantization."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for done, (name, module) in enumerate(linears):
        if progress is not None:
            progress(done, len(linears))
        fast, used = make(name, module)
        if done % TRIM_EVERY == TRIM_EVERY - 1:  # the transients' holes between the packed weights back to the system
            trim_heap()
        if fast is None:
            counts["kept"] += 1
            continue
        replace_module(model, name, fast)
        counts[used] += 1
    return counts


class Int4Linear(_Quantized):
    """y = x W^T (+ b) with W in 4-bit groups of GROUP inputs, w = q * scale + low (q in
    0..15, one scale and low per group), computed by torch's int4 CPU kernel in bfloat16."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None, layout: Int4Layout | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, scales_zeros.shape[1]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.layout = layout  # the kernel's packing order as found here (int4_layout.py); None: unknown
        # the kernel's overload resolved once: a call through the op packet costs about 1 us more
        self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dense(self) -> torch.Tensor:
        if self.layout is None:
            raise ValueError("the int4 kernel's packing was not recognised here: no dense weights")
        q = self.layout.unpack(self.packed, (self.out_features, self.in_features))
        q = q.float().reshape(self.out_features, -1, GROUP)
        sz = self.scales_zeros.float().transpose(0, 1)  # (N, K / GROUP, 2): the kernel's own bfloat16 values
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._long(x):
            return self._dense_forward(x)
        if x.dtype == torch.bfloat16 and self.bias is None:  # decoding's case: no conversions (ops cost us each)
            return self._mm(x.reshape(-1, self.in_features), self.packed, GROUP, self.scales_zeros).view(
                x.shape[:-1] + (self.out_features,))
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self._mm(flat, self.packed, GROUP, self.scales_zeros)
        out = out.reshape(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, device: torch.device,
                    bias: torch.Tensor | None = None,
                    learned: dict[tuple[int, int], torch.Tensor] | None = None) -> Int4Linear | None:
        """The module over 4-bit groups (q (N, K) in 0..15, scale and low (N, K / GROUP)), or
        None where the kernel cannot serve them: not CPU, K not a multiple of GROUP, a shape
        the kernel refuses, or a product that fails the self-check against q * scale + low.
        `learned`: packing orders learned by shape (int4_layout.py), shared between matrices."""
        if device.type != "cpu" or q.shape[1] % GROUP or not has_int4_kernel():
            return None
        try:
            packed = _pack_int4(q.to(torch.int32))
        except (RuntimeError, NotImplementedError):  # the kernel refuses this build or shape
            return None
        # the kernel computes (q - 8) * scale + zero: zero = low + 8 * scale
        scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        module = cls(packed, scales_zeros, q.shape[1], bias, find_layout(packed, q, _pack_int4, learned))
        return self_checked(module, dequantize_groups(q, scale, low), bias)


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of GROUP inputs: (q (N, K) in 0..15, scale, low (N, K / GROUP))
    with w ~ q * scale + low, low the group's minimum and scale its range / 15."""
    w = weight.detach().float()
    groups = w.reshape(w.shape[0], -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(w.shape), scale, low


def pack4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) bytes, even columns in the low nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def has_int4_kernel() -> bool:
    """Whether this torch build has the int4 CPU kernel and its packer."""
    ops = ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    return all(hasattr(torch.ops.aten, op) for op in ops)


def int4_unavailable() -> str:
    """Why no matrix went to the int4 kernel here (for the load's note)."""
    if not has_int4_kernel():
        return f"torch {torch.__version__} has no int4 CPU kernel"
    return (f"torch's int4 kernel refused the matrices or failed its self-check on this CPU "
            f"({torch.backends.cpu.get_cpu_capability()}); `python app.py --doctor` shows which")


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int32 values 0..15 -> torch's int4 CPU packing of them (raises where refused)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    groups = q.float().reshape(q.shape[0], -1, GROUP)
    return (groups * scale[..., None] + low[..., None]).reshape(q.shape)


def unbuilt(weight: torch.Tensor) -> bool:
    """Whether a weight was left unbuilt (a stand-in's `build(..., lazy=...)`, a GGUF loaded packed:
    specui.weights.gguf_packed): one zero, broadcast; its values are the groups it is packed from."""
    return weight.dim() > 0 and all(stride == 0 for stride in weight.stride())


def build_from_groups(module: torch.nn.Linear, given: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """Give an unbuilt matrix its values back as a float matrix (from `given`, its groups) where no
    4-bit kernel took it, so whatever computes it instead reads its real weights."""
    if given is not None and unbuilt(module.weight):
        weight = dequantize_groups(*given).to(module.weight.dtype)
        module.weight = torch.nn.Parameter(weight, requires_grad=False)


def quantize_model(model: torch.nn.Module, kind: str = "int8",
                   groups: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   wide: frozenset[str] = frozenset()) -> dict[str, int]:
    """Swap every Linear a kernel can serve for an Int8Linear (kind "int8"; under "int4" the head and
    `wide`'s matrices: a GGUF's in more than 4 bits, never re-rounded to 4) or an Int4Linear (kind
    "int4": the rest; from `groups[name]`, e.g. a GGUF's own blocks, else from the weight). A tied head
    gets its own copy. Counts: "int8", "int4", "from_file" (of int4), "eight_bit" (of int8, `wide`'s),
    "kept". `progress(done, total)` as each matrix starts (a stand-in's hundreds take a while)."""
    groups = groups or {}
    learned: dict[tuple[int, int], torch.Tensor] = {}  # int4 packing orders learned on this machine, by shape
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    counts = {"int8": 0, "int4": 0, "from_file": 0, "eight_bit": 0, "kept": 0}

    def make(name: str, module: torch.nn.Linear) -> tuple[torch.nn.Module | None, str]:
        if kind == "int4" and module is not head and name not in wide:
            given = groups.get(name)
            fast = Int4Linear.from_groups(*(given or quantize_groups(module.weight)), module.weight.device,
                                          module.bias, learned)
            counts["from_file"] += int(fast is not None and given is not None)
            if fast is not None:
                return fast, "int4"
            build_from_groups(module, given)
        eight = Int8Linear.from_stored(*quantize_rows(module.weight), module.weight.device, module.bias)  # None: kept
        counts["eight_bit"] += int(eight is not None and kind == "int4" and name in wide)
        return eight, "int8"

    return swap_linears(model, make, counts, progress)


def _both_ms(module: _Quantized, x: torch.Tensor) -> tuple[float, float]:
    """(ms of one forward on the kernel, ms of one dequantized)."""
    start = time.perf_counter()
    module(x)
    middle = time.perf_counter()
    module._dense_forward(x)
    return (middle - start) * 1000, (time.perf_counter() - middle) * 1000


@torch.inference_mode()
def use_long_path(model: torch.nn.Module, role: str = "model", rows: int = LONG_ROWS, repeats: int = 3,
                  timer: Callable[[_Quantized, torch.Tensor], tuple[float, float]] | None = None) -> str | None:
    """Measure, for each kind of quantized matrix in `model` (not its output head, which long
    inputs use for their last token only), a forward of `rows` rows on the kernel against the
    same weights dequantized to float32; where the latter is LONG_GAIN faster (and gives the
    same products), forwards of at least `rows` tokens a row compute that way. The note of
    what was measured, or None where the model has no quantized matrix. `timer(module, x)`:
    (kernel ms, dequantized ms) for one forward each, instead of measuring (tests)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    said = []
    for kind in (Int4Linear, Int8Linear):
        modules = [m for m in model.modules() if isinstance(m, kind) and m is not head]
        name = "int4" if kind is Int4Linear else "int8"
        layouts = ""
        if kind is Int4Linear:
            unread = sum(m.layout is None for m in modules)
            modules = [m for m in modules if m.layout is not None]
            layouts = "; packing read back as " + ", ".join(sorted({m.layout.name for m in modules})) if modules else ""
            if unread:
                said.append(f"{unread} int4 matrices always on the kernel (its packing on this CPU, "
                            f"{torch.backends.cpu.get_cpu_capability()}, was not recognised)")
        if not modules:
            continue
        probe = max(modules, key=lambda m: m.in_features * m.out_features)
        probe.long_rows = None
        x = torch.randn(rows, probe.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        kernel_out, dense_out = probe(x).float(), probe._dense_forward(x).float()
        if not agrees(dense_out, kernel_out):
            said.append(f"{name} matrices on the kernel (dequantized, its products differ here)")
            continue
        timed = [(timer or _both_ms)(probe, x) for _ in range(repeats)]
        kernel_ms, dense_ms = min(k for k, _ in timed), min(d for _, d in timed)  # taking turns, fastest of each
        faster = dense_ms < LONG_GAIN * kernel_ms
        for m in modules:
            m.long_rows = rows if faster else None
        how = "dequantized to float32" if faster else "on the kernel"
        said.append(f"{len(modules)} {name} matrices {how} for inputs of {rows}+ tokens "
                    f"({dense_ms:.1f} ms dequantized vs {kernel_ms:.1f} ms on the kernel, "
                    f"{rows} rows of a {probe.out_features}x{probe.in_features} matrix{layouts})")
    return f"{role} long inputs: " + "; ".join(said) if said else None
