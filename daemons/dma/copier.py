"""How the dma daemon moves a layer from host memory into a device slot.

``CpuCopier``: device slots are shared-memory segments created by the compute daemon (the cpu
backend's "device memory"), so CI exercises every message and copy of the real flow.
``CudaCopier`` (``ntx.daemons.dma.cuda_copier``): device slots are compute's device buffers
opened through CUDA IPC, host memory is registered with cudaHostRegister, copies run on the
daemon's own non-blocking stream and complete before the slot is handed on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ntx.shared.shm import ShmSegment


class CpuCopier:
    kind = "cpu"

    def __init__(self, device_slots: list[Any]) -> None:
        self.segments = [ShmSegment.open(name) for name in device_slots]
        self.dst = [s.array() for s in self.segments]

    def register_host(self, seg: ShmSegment) -> None:
        """Nothing to pin on the cpu backend."""

    def copy(self, src: np.ndarray, slot: int) -> None:
        # src: [n] uint8 host bytes as a layer image -> device slot ``slot``; complete on return.
        np.copyto(self.dst[slot][: src.shape[0]], src)

    def close(self) -> None:
        self.dst = []
        for s in self.segments:
            s.close()


def make_copier(backend: str, device_slots: list[Any]):
    if backend == "cuda":
        from ntx.daemons.dma.cuda_copier import CudaCopier

        return CudaCopier(device_slots)
    return CpuCopier(device_slots)
