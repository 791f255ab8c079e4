"""Which path is faster for T > 8 rows against one quantized matrix: matvec in chunks of 8 rows
(weights read ceil(T/8) times, dequantized in registers) or dequantize-to-f16 + cuBLAS GEMM
(weights read once, an f16 copy written and read)? It decides ``gemm_chunked_max_t`` and
``gemm_chunked_max_bytes`` of the device's entry in daemons/compute/cuda/tuning.py, up to which
``kernels.gemm`` loops matvec: batched decode of 9..64 sequences and short prompts run through it
on every streamed layer.

    python3 scripts/bench_gemm_paths.py [--types Q4_K,Q8_0] [--out gemm_paths.json]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np

from ntx.daemons.compute.cuda import kernels as K
from ntx.shared.quant_types import quant_type, tensor_nbytes
from synth_gguf import make_blocks  # scripts/synth_gguf, next to this script

SHAPES = [(28672, 8192), (8192, 8192), (8192, 28672), (1024, 8192)]  # 70B ffn up, q/o, down, k/v
TS = [8, 9, 16, 24, 32, 48, 64]


def _time_ms(fn, iters: int = 10) -> float:
    fn()
    cp.cuda.Device().synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from gguf import GGMLQuantizationType as QT

    rng = np.random.default_rng(0)
    rows = []
    for tname in args.types.split(","):
        qt = int(QT[tname])
        for n_rows, n_cols in SHAPES:
            nbytes = tensor_nbytes(qt, (n_rows, n_cols))
            nblocks = n_rows * n_cols // quant_type(qt).block_elems
            w = cp.asarray(make_blocks(qt, nblocks, 0.02, rng).reshape(-1))
            assert w.nbytes == nbytes
            for T in TS:
                x = cp.asarray(rng.standard_normal((T, n_cols), dtype=np.float32))
                out = cp.empty((T, n_rows), dtype=cp.float32)

                def chunked():
                    for i in range(0, T, K.MAX_MATVEC_B):
                        j = min(i + K.MAX_MATVEC_B, T)
                        K.matvec(w, qt, n_rows, n_cols, x[i:j], out=out[i:j])

                def dequant_gemm():
                    K.gemm_dequant(w, qt, n_rows, n_cols, x, out=out)

                row = {"type": tname, "shape": [n_rows, n_cols], "T": T, "weight_bytes": nbytes,
                       "chunked_matvec_ms": round(_time_ms(chunked), 4),
                       "dequant_gemm_ms": round(_time_ms(dequant_gemm), 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del w
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
