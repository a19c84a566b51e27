"""A forward's token ids and positions on a CPU, written into tensors kept from one forward to the
next instead of a new tensor each time.

Right after a compiled forward has streamed the weights through the caches, every small op the
step runs is slow: `torch.tensor([[id]])` took about 50 us there against 3 in a loop, and a
decoding step built two such tensors (the new token's id, its position). Writing the values
through a kept tensor's numpy view costs a few microseconds even then; autoregressive decoding
measured in one process, the two ways alternating (bundled pair, compiled w4a8, 2-core AMD EPYC
Zen 3): 0.535 -> 0.456 ms a token outside the forwards (5.8% -> 5.1% of a step; README).

Each row is read only by the forward it was written for (on a CPU a forward has finished when it
returns), so the next forward may overwrite it. Rows are kept per length and per inference mode:
a tensor made in inference mode is an inference tensor, and a compiled forward's guards tell the
two kinds apart, so a row is always of the kind `torch.tensor` would have made at that call."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostIds:
    """(1, m) int64 CPU tensors for m up to `most`, one per (m, inference mode), refilled per call."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._rows: dict[tuple[int, bool], tuple[torch.Tensor, object]] = {}

    def row(self, values: Sequence[int]) -> torch.Tensor:
        """`torch.tensor([values], dtype=torch.long)`'s equal on the CPU, in a kept tensor where
        len(values) is 1 to `most` (a new one otherwise); valid until the next call for that length."""
        m = len(values)
        if not 0 < m <= self.most:
            return torch.tensor([list(values)], dtype=torch.long)
        key = (m, torch.is_inference_mode_enabled())
        kept = self._rows.get(key)
        if kept is None:
            tensor = torch.zeros((1, m), dtype=torch.long)
            kept = self._rows[key] = (tensor, tensor.numpy())
        kept[1][0] = values
        return kept[0]
