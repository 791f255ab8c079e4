"""Can a wide pass multiply a cpu-tier layer's matrices straight from page-locked host memory
(mapped into the device's address space: each weight crosses the link once, as the kernel reads
it), instead of copying the layer into a staging buffer first? The staging buffer costs the
plan one resident layer of VRAM. For 70B shapes at T rows this times ``gemm.gemm`` with the
weights in device memory, mapped from host memory, and a pinned copy of the same bytes (the
link's figure in the same run): GB/s of weight bytes. On the H200 (2026-12-03,
docs/results/mapped-weights-h200.json) the kernels read mapped memory at 37-40 GB/s against the
copy's 51-54, the same bits: copying first stays (cuda/backend.py ``layer_from_host``).

    python3 dev/cuda/bench_mapped_weights.py [--ts 8,16,32,64] [--out mapped.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "scripts")]
from synth_gguf import make_blocks  # noqa: E402  (scripts/synth_gguf)

from ntx.daemons.compute.cuda import gemm, runtime  # noqa: E402
from ntx.shared.align import aligned_empty  # noqa: E402
from ntx.shared.quant_types import quant_type, tensor_nbytes  # noqa: E402

SHAPES = [(QT.Q4_K, 8192, 8192), (QT.Q4_K, 28672, 8192), (QT.Q6_K, 8192, 28672)]


def _time_s(fn, reps: int = 5) -> float:
    fn()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ts", default="8,16,32,64")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ctx = runtime.standalone()
    rows = []
    for qt, n, k in SHAPES:
        nbytes = tensor_nbytes(qt, (n, k))
        host = aligned_empty(nbytes)
        host[:] = make_blocks(qt, n * k // quant_type(qt).block_elems, 0.02, rng).reshape(-1).view(np.uint8)
        cp.cuda.runtime.hostRegister(host.ctypes.data, nbytes, 2)  # cudaHostRegisterMapped
        dptr = host.ctypes.data  # the device reads registered memory at its host address (UVA, sm_90)
        mapped_raw = cp.ndarray((nbytes,), dtype=cp.uint8,
                                memptr=cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(dptr, nbytes, host), 0))
        dev_raw = cp.asarray(host)
        w_dev, w_map = gemm.weight(dev_raw, qt, n, k), gemm.weight(mapped_raw, qt, n, k)
        copy_s = _time_s(lambda: cp.cuda.runtime.memcpy(dev_raw.data.ptr, host.ctypes.data, nbytes, 1))
        for t in (int(s) for s in args.ts.split(",")):
            x = cp.asarray(rng.standard_normal((t, k), dtype=np.float32))
            same = bool(cp.array_equal(gemm.gemm(ctx, w_dev, x), gemm.gemm(ctx, w_map, x)))
            dev_s = _time_s(lambda: gemm.gemm(ctx, w_dev, x))
            map_s = _time_s(lambda: gemm.gemm(ctx, w_map, x))
            row = {"type": QT(qt).name, "shape": [n, k], "T": t, "path": gemm.path(ctx, w_dev, t), "bytes": nbytes,
                   "device_gbps": nbytes / dev_s / 1e9, "mapped_gbps": nbytes / map_s / 1e9,
                   "pinned_copy_gbps": nbytes / copy_s / 1e9, "same_bits": same}
            rows.append(row)
            print(f"{row['type']} {n}x{k} T={t:3d} {row['path']:8s} device {row['device_gbps']:7.1f} GB/s  mapped "
                  f"{row['mapped_gbps']:5.1f} GB/s  pinned copy {row['pinned_copy_gbps']:5.1f} GB/s  same bits {same}",
                  flush=True)
        del w_dev, w_map, dev_raw, mapped_raw
        cp.cuda.runtime.hostUnregister(host.ctypes.data)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
