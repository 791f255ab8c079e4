"""Measurements of the machine the benchmarks compare with, importable anywhere (cupy on call).

``device_copy_gbps``: the device-to-device copy bandwidth, the reference every GPU benchmark
compares with. A kernel or a decode step that reads weights cannot beat the device's own copy
(DRAM read and write), so ``ntxctl bench`` (ctl/bench.py), scripts/bench_decode.py,
scripts/bench_kernels.py, scripts/profile_pass.py and dev/cuda's sweeps report their GB/s beside
this figure, measured in the same run by this one function. It lives here, not in the cuda
backend's package, so that ctl reaches no cuda internals.
"""

from __future__ import annotations

__all__ = ["device_copy_gbps"]


def device_copy_gbps(nbytes: int = 1 << 30, iters: int = 10) -> float:
    """GB/s (1e9 bytes, read + written) of ``iters`` copies of ``nbytes`` between two buffers
    of the current device, timed with CUDA events after one untimed copy."""
    import cupy as cp

    src = cp.ones(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    cp.copyto(dst, src)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        cp.copyto(dst, src)
    stop.record()
    stop.synchronize()
    elapsed_s = cp.cuda.get_elapsed_time(start, stop) / 1e3
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes * iters / elapsed_s / 1e9
