"""Energy and peak memory of one bench reply on CUDA.

Energy: NVML's total-energy counter of the GPU (millijoules since the driver loaded, Volta and
later), read through ctypes from the driver's own libnvidia-ml (no Python package needed)
before and after the reply. Peak memory: torch's peak allocated bytes on the device, reset
before the reply. On a CPU, or where NVML cannot be opened, both are None and the bench says
"not measured".
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

NVML_LIBRARIES = ("libnvidia-ml.so.1", "libnvidia-ml.so", "nvml.dll")


class EnergyCounter:
    """Millijoules used by one GPU so far (NVML), or unavailable with the reason."""

    def __init__(self, index: int = 0) -> None:
        self.problem: str | None = None
        self._lib = self._handle = None
        for name in NVML_LIBRARIES:
            try:
                self._lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if self._lib is None:
            self.problem = "NVML library not found"
            return
        handle = ctypes.c_void_p()
        if self._lib.nvmlInit_v2() != 0 or self._lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            self.problem = "NVML could not open the GPU"
            return
        self._handle = handle
        if self.read_mj() is None:
            self.problem = "this GPU has no NVML energy counter"

    def read_mj(self) -> int | None:
        if self._handle is None:
            return None
        value = ctypes.c_ulonglong()
        if self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(value)) != 0:
            return None
        return int(value.value)


@dataclass
class Reading:
    joules: float | None = None
    peak_mb: float | None = None


class ReplyMeter:
    """Wraps a reply: `start()` before it, `stop()` after it -> Reading (None on a CPU)."""

    def __init__(self, device: torch.device | None) -> None:
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.counter = EnergyCounter(device.index or 0) if self.cuda else None
        self._start_mj: int | None = None

    @property
    def note(self) -> str:
        if not self.cuda:
            return "not measured (CPU)"
        return f"not measured ({self.counter.problem})" if self.counter.problem else "measured (NVML)"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start_mj = self.counter.read_mj()

    def stop(self) -> Reading:
        if not self.cuda:
            return Reading()
        torch.cuda.synchronize()
        end = self.counter.read_mj()
        joules = (end - self._start_mj) / 1000 if end is not None and self._start_mj is not None else None
        return Reading(joules, torch.cuda.max_memory_allocated() / 2**20)
