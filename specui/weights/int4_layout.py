"""How torch's int4 CPU kernel lays out its packed weights, read back on any CPU.

`aten._convert_weight_to_int4pack_for_cpu` packs an (N, K) matrix of 4-bit values into N K / 2
bytes in an order that depends on the vector width torch dispatched to: rows in blocks of 64
(AVX-512, AMX machines included) or 32 (AVX2 and builds without those kernels); inside a full
block, for each input column, byte d holds row d (low nibble) and row d + block / 2 (high), or
on builds without vector kernels rows 2d and 2d + 1; a last, partial block (N not a multiple of
the block) always pairs neighbouring rows. `find_layout` recognises which of these one packing
uses by unpacking it and comparing with the values packed. Where none matches (a torch that
packs another way), it learns the order by packing probe matrices whose values spell each
weight's index, 4 bits at a time: a permutation (4 bytes a weight, shared by the matrices of
one shape), exact by construction, and named as such wherever it is reported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Packer = Callable[[torch.Tensor], torch.Tensor]  # (N, K) int32 values 0..15 -> the kernel's packing
DESCRIBED = ((64, True), (32, True), (32, False), (64, False), (16, False))  # (rows a block, halves?)


@dataclass(frozen=True)
class Int4Layout:
    """One packing order: rows in blocks of `block`, each full block in halves (row d with row
    d + block / 2) or in pairs (rows 2d, 2d + 1); or a learned `order` (nibble i of the packing
    holds flat weight order[i])."""

    block: int = 0
    halves: bool = True
    order: torch.Tensor | None = None

    @property
    def name(self) -> str:
        if self.order is not None:
            return "learned by probing the packer"
        return f"{self.block}-row blocks, {'halves' if self.halves else 'row pairs'}"

    def unpack(self, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The (N, K) uint8 values 0..15 in `packed`."""
        n, k = shape
        flat = packed.reshape(-1)
        if self.order is not None:
            out = torch.empty(n * k, dtype=torch.uint8)
            out[self.order.long()] = nibbles(flat)
            return out.reshape(n, k)
        full = n // self.block
        parts = []
        if full:
            b = flat[: full * k * self.block // 2].reshape(full, k, self.block // 2)
            rows = (torch.cat([b & 15, b >> 4], -1) if self.halves
                    else torch.stack([b & 15, b >> 4], -1).reshape(full, k, self.block))
            parts.append(rows.transpose(1, 2).reshape(full * self.block, k))
        tail = n - full * self.block
        if tail:
            t = flat[full * k * self.block // 2:].reshape(k, tail // 2)
            parts.append(torch.stack([t & 15, t >> 4], -1).reshape(k, tail).T)
        return torch.cat(parts).reshape(n, k)


def nibbles(flat: torch.Tensor) -> torch.Tensor:
    """Bytes -> their 4-bit values, low nibble first."""
    return torch.stack([flat & 15, flat >> 4], -1).reshape(-1)


def learn_order(shape: tuple[int, int], pack: Packer) -> torch.Tensor | None:
    """Nibble i of `pack`'s output for a matrix of `shape` -> the flat index of the weight it
    holds, found by packing ceil(log16(N K)) probes (probe d holds digit d of each weight's
    index); None where the packing is not a permutation of the weights."""
    n, k = shape
    index = torch.arange(n * k, dtype=torch.int64)
    order = torch.zeros(n * k, dtype=torch.int64)
    digits = max(1, ((n * k - 1).bit_length() + 3) // 4)
    for d in range(digits):
        probe = ((index >> (4 * d)) & 15).to(torch.int32).reshape(n, k)
        found = nibbles(pack(probe).reshape(-1)).to(torch.int64)
        if found.numel() != n * k:
            return None
        order |= found << (4 * d)
    if order.max() >= n * k or torch.bincount(order, minlength=n * k).ne(1).any():
        return None
    return order.to(torch.int32)


def find_layout(packed: torch.Tensor, q: torch.Tensor, pack: Packer,
                learned: dict[tuple[int, int], torch.Tensor] | None = None) -> Int4Layout | None:
    """The layout of `packed` (the kernel's packing of `q`, (N, K) values 0..15): a described
    one if it reads `q` back exactly, else a learned order (kept in `learned` by shape for the
    next matrix of that shape); None where neither reads it back."""
    shape = (int(q.shape[0]), int(q.shape[1]))
    want = q.to(torch.uint8)
    if packed.numel() * 2 != want.numel():
        return None
    for block, halves in DESCRIBED:
        if shape[0] % block % 2:  # a partial block of an odd number of rows: no pairs
            continue
        layout = Int4Layout(block, halves)
        if torch.equal(layout.unpack(packed, shape), want):
            return layout
    learned = {} if learned is None else learned
    if shape not in learned:
        order = learn_order(shape, pack)
        if order is None:
            return None
        learned[shape] = order
    layout = Int4Layout(order=learned[shape])
    return layout if torch.equal(layout.unpack(packed, shape), want) else None
