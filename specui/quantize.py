"""Weight-only int8 on CPU: every matrix stored as int8 rows with one scale per row and
multiplied by torch's int8 kernel (`torch._weight_int8pack_mm`, bfloat16 activations).

A decode step of a small model on a CPU is bound by reading its weights; int8 reads a
quarter of float32's bytes and half of bfloat16's. The draft ships its matrices this way
(specui/draft_model.py); `--quantization int8` does it to the target at load time
(symmetric per-row rounding of the loaded weights). The quantized target is the model the
methods are then lossless against."""

from __future__ import annotations

import torch


class Int8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W kept as int8 rows and one scale per row, computed by torch's
    weight-only int8 kernel in bfloat16."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.clone())  # a fresh, aligned allocation (the kernel needs it)
        self.register_buffer("scale", scale.reshape(-1).to(torch.bfloat16).clone())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(0))
        try:
            got = module(x)
        except (RuntimeError, NotImplementedError):  # the kernel refuses this build or shape
            return None
        want = x @ (module.weight.float() * module.scale.float()[:, None]).T
        if bias is not None:
            want = want + bias.float()
        return module if bool((got - want).abs().max() <= 0.02 * want.abs().max() + 1e-6) else None


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 rows, float32 scales) with W ~ rows * scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int8(model: torch.nn.Module) -> tuple[int, int]:
    """Swap every Linear the kernel can serve for an Int8Linear over its rounded weights
    (a tied output head gets its own int8 copy; the input embeddings stay). Returns
    (swapped, left as they were)."""
    swapped = kept = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        rows, scale = quantize_rows(module.weight)
        fast = Int8Linear.from_stored(rows, scale, module.weight.device, module.bias)
        if fast is None:
            kept += 1
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, fast)
        swapped += 1
    return swapped, kept
