"""CUDA graphs of static-shape forwards (engine/capture.py's "graphs" mode): one graph per
(bucket, window), its static inputs, and what captures it."""

from __future__ import annotations

from collections.abc import Callable

import torch


class Graph:
    """One captured shape: its static inputs, the replay and its output."""

    def __init__(self, bucket: int, window: int, device: torch.device, mask_dtype: torch.dtype) -> None:
        self.ids = torch.zeros((1, bucket), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, bucket), dtype=torch.long, device=device)
        self.mask = torch.zeros((1, 1, bucket, window), dtype=mask_dtype, device=device)
        self.replay: Callable[[], None] | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # a hidden-state forward's second output


class CudaGraphs:
    """Captures a forward as a CUDA graph; every graph of one model shares a memory pool."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Warm up on a side stream (the forward writes this step's own slots, which the replay
        writes again), capture; returns (replay, the output it refreshes)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.pool = graph.pool()
        return graph.replay, out
