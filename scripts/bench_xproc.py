"""Does a copy issued by another process hold back this process's kernels?

The question behind the pipeline's status: in a streamed 70B run the compute daemon's layer work
(about 0.2 ms of GPU time) took about 5 ms of wall time while the dma daemon copied layers over
PCIe from its own CUDA context. This script measures it directly, on one GPU:

- *compute*: this process, every ``--gap-ms``, launches a layer's worth of kernels (a few small
  launches and one read of ``--read-mib`` of device memory) and waits for them; we record the
  wall time of each such burst.
- *copier*: a second process (or a second stream of this process, ``same``) copies
  ``--copy-mib`` from pinned host memory into a device buffer allocated by this process (CUDA
  IPC, exactly the dma daemon's path), in pieces of ``chunk`` bytes queued back to back, then
  waits, and again, for the whole measurement.

Modes: ``alone`` (no copier), ``xproc:<chunk MiB>`` (another process), ``same:<chunk MiB>``
(a thread of this process on its own non-blocking stream). Prints one JSON line per mode:
burst p50/p90 in ms and the copier's GB/s.

    python3 scripts/bench_xproc.py --modes alone,xproc:0,xproc:64,xproc:8,xproc:2,same:0
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import threading
import time

_MEMCPY_H2D = 1


def _copy_loop(dst_ptr: int, host_ptr: int, nbytes: int, chunk_bytes: int, stream, stop, result: list) -> None:
    import cupy as cp

    chunk = chunk_bytes or nbytes
    done_bytes, t0 = 0, time.perf_counter()
    while not stop.is_set():
        for off in range(0, nbytes, chunk):
            n = min(chunk, nbytes - off)
            cp.cuda.runtime.memcpyAsync(dst_ptr + off, host_ptr + off, n, _MEMCPY_H2D, stream.ptr)
        stream.synchronize()
        done_bytes += nbytes
    result.append(done_bytes / (time.perf_counter() - t0) / 1e9)


def _copier_process(handle: bytes, nbytes: int, chunk_bytes: int, ready, stop, out_q) -> None:
    import cupy as cp

    cp.cuda.Device(0).use()
    dst = cp.cuda.runtime.ipcOpenMemHandle(handle)
    host = cp.cuda.alloc_pinned_memory(nbytes)
    stream = cp.cuda.Stream(non_blocking=True)
    result: list = []
    ready.set()
    _copy_loop(dst, host.ptr, nbytes, chunk_bytes, stream, stop, result)
    cp.cuda.runtime.ipcCloseMemHandle(dst)
    out_q.put(result[0])


def _bursts(read_buf, small, seconds: float, gap_s: float, stream) -> list[float]:
    import cupy as cp

    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        time.sleep(gap_s)
        t0 = time.perf_counter()
        with stream:
            for _ in range(12):
                small *= 1.0001
            read_buf.sum(dtype=cp.float32)
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="alone,xproc:0,xproc:64,xproc:8,xproc:2,same:0")
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--read-mib", type=int, default=256)
    ap.add_argument("--gap-ms", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    nbytes = args.copy_mib << 20
    dst_mem = cp.cuda.Memory(nbytes)
    handle = bytes(cp.cuda.runtime.ipcGetMemHandle(dst_mem.ptr))
    read_buf = cp.ones((args.read_mib << 20) // 2, dtype=cp.float16)
    small = cp.ones(4096, dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    _bursts(read_buf, small, 0.3, 0.001, stream)  # warm up, compile
    ctx = mp.get_context("spawn")
    rows = []
    for mode in args.modes.split(","):
        kind, _, chunk = mode.partition(":")
        chunk_bytes = int(chunk or 0) << 20
        copy_gbps = None
        if kind == "alone":
            times = _bursts(read_buf, small, args.seconds, args.gap_ms / 1e3, stream)
        elif kind == "xproc":
            ready, stop, q = ctx.Event(), ctx.Event(), ctx.Queue()
            p = ctx.Process(target=_copier_process, args=(handle, nbytes, chunk_bytes, ready, stop, q))
            p.start()
            ready.wait(60)
            time.sleep(0.2)
            times = _bursts(read_buf, small, args.seconds, args.gap_ms / 1e3, stream)
            stop.set()
            copy_gbps = q.get(timeout=60)
            p.join(30)
        elif kind == "same":
            host = cp.cuda.alloc_pinned_memory(nbytes)
            cstream = cp.cuda.Stream(non_blocking=True)
            stop, result = threading.Event(), []
            th = threading.Thread(target=_copy_loop, args=(dst_mem.ptr, host.ptr, nbytes, chunk_bytes, cstream, stop, result))
            th.start()
            time.sleep(0.2)
            times = _bursts(read_buf, small, args.seconds, args.gap_ms / 1e3, stream)
            stop.set()
            th.join()
            copy_gbps = result[0]
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        t = np.array(times) * 1e3
        row = {"mode": mode, "bursts": len(t), "burst_p50_ms": round(float(np.median(t)), 3),
               "burst_p90_ms": round(float(np.percentile(t, 90)), 3), "burst_max_ms": round(float(t.max()), 3),
               "copy_gbps": round(copy_gbps, 2) if copy_gbps else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
