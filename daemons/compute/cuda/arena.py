"""The cuda backend's device-memory arena: one allocation carved into a layout's named regions.

``memory.backend_layout`` lists what the backend keeps (the buckets' shared pass workspace, the
kernels' scratch, the head's buffers, the cuBLAS path's f16 weights); ``Arena`` allocates the
sum once and hands out views of its regions, so every pointer a CUDA graph captures stays
valid for the backend's life and the planner's figure (the same layout, summed) is what is
held. An eager pass above the buckets gets an arena of its own (``memory.eager_layout``), freed
with the pass. After the regions comes a pool of fixed-size blocks (``take_block`` /
``give_block``; empty today): where a paged KV cache takes its pages.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from ntx.daemons.compute.cuda.memory import Layout

__all__ = ["Arena", "ArenaScratch"]


class Arena:
    """One device allocation of ``layout.total_bytes``, zeroed (every region starts as the
    buffers always did; the ``zero`` regions, the tile counters, depend on it); ``view(name,
    shape, dtype)`` is a region as an array."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.memory = cp.zeros(max(layout.total_bytes, 1), dtype=cp.uint8)
        self.free_blocks = list(range(layout.n_blocks - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return int(self.memory.nbytes)

    def __contains__(self, name: str) -> bool:
        return name in self.layout.offsets

    def bytes(self, name: str) -> cp.ndarray:
        """Region ``name`` as uint8 [nbytes]."""
        off = self.layout.offsets[name]
        return self.memory[off : off + self.layout.region(name).nbytes]

    def view(self, name: str, shape: tuple[int, ...], dtype, part: bool = False) -> cp.ndarray:
        """Region ``name`` as a C-contiguous array of ``shape`` and ``dtype``, which must fill it,
        or with ``part`` its first bytes (a region several users share, each at its own size:
        the row buckets' pass workspace, ``memory.bucket_regions``)."""
        need = int(np.prod(shape)) * np.dtype(dtype).itemsize
        region = self.bytes(name)
        if need > region.size or (need != region.size and not part):
            raise ValueError(f"arena region {name} holds {region.size} bytes, {shape} {np.dtype(dtype).name} is {need}")
        return region[:need].view(dtype).reshape(shape)

    def take_block(self) -> cp.ndarray:
        """A free block of the pool (uint8 [block_bytes]); raises when none is left."""
        if not self.free_blocks:
            raise MemoryError(f"all {self.layout.n_blocks} arena blocks are in use")
        i = self.free_blocks.pop()
        off = self.layout.blocks_offset + i * self.layout.block_bytes
        return self.memory[off : off + self.layout.block_bytes]

    def give_block(self, block: cp.ndarray) -> None:
        i = (block.data.ptr - self.memory.data.ptr - self.layout.blocks_offset) // self.layout.block_bytes
        self.free_blocks.append(int(i))


class ArenaScratch:
    """A ``KernelContext.scratch`` backed by arenas: the region named by the purpose, first in
    the current eager pass's arena (``eager``), then in the kept one. A call that needs more
    than its region holds is an error naming both: the layout (memory.py) missed a shape."""

    def __init__(self, kept: Arena) -> None:
        self.kept = kept
        self.eager: Arena | None = None

    def __call__(self, purpose: str, nbytes: int, zero: bool = False) -> cp.ndarray:
        for arena in (self.eager, self.kept):
            if arena is not None and purpose in arena:
                region = arena.bytes(purpose)
                if nbytes > region.size:
                    raise ValueError(f"{purpose} needs {nbytes} bytes, its arena region holds {region.size} "
                                     "(memory.py's layout does not cover this product)")
                return region[:nbytes]
        raise KeyError(f"no arena region for {purpose} (memory.py's layout lists none)")
