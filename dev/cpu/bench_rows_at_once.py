"""A product of T rows at once against T one-row products, Q4_K, Q6_K, Q5_K and Q8_0 4096x14336, in one
process, interleaved (min of 30 each): what taking rows together through the weights saves
(``cpu_kernels._block16_vnni_rows``, ``_quads4_c6v_rows``, ``_quads4_vnni_rows``: the VNNI layouts).

    NUMBA_NUM_THREADS=1 python dev/cpu/bench_rows_at_once.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import synth_gguf as sg  # noqa: E402

from ntx.daemons.compute import cpu_kernels as ck  # noqa: E402

N_ROWS, N_COLS = 4096, 14336
ROUNDS = 30


def main() -> None:
    for qt in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q8_0):
        block_elems, _ = GGML_QUANT_SIZES[qt]
        raw = sg.make_blocks(qt, N_ROWS * N_COLS // block_elems, 0.05, np.random.default_rng(0)).reshape(-1)
        mats = [ck.pack(raw, qt, N_ROWS, N_COLS) for _ in range(4)]  # four copies: read from memory, not cache
        for T in (2, 3, 4, 8, 9):
            x = np.random.default_rng(1).standard_normal((T, N_COLS)).astype(np.float32)  # x: [T, K]
            out, one = np.empty((T, N_ROWS), np.float32), np.empty((1, N_ROWS), np.float32)
            ck.matmul(mats[0], x, out)
            ck.matmul(mats[0], x[:1], one)
            together_s, apart_s = [], []
            for r in range(ROUNDS):
                t0 = time.perf_counter()
                ck.matmul(mats[r % 4], x, out)
                together_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(T):
                    ck.matmul(mats[r % 4], x[i:i + 1], one)
                apart_s.append(time.perf_counter() - t0)
            row_s = min(apart_s) / T
            print(f"{qt.name} {T} rows ({ck.pack(raw, qt, N_ROWS, N_COLS).form}): together {1e3 * min(together_s):.2f} ms = "
                  f"{min(together_s) / row_s:.2f}x one row's; one row at a time {1e3 * min(apart_s):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
