"""What the float steps cost in the c4v product at a few rows: production's ``_mm_c4v`` against
a copy that makes the same integer sums and skips the float steps after them (its output is
wrong; only its time counts). Q4_K 4096x14336, four copies in turn (from memory, not cache),
min of 20, in one process.

Why. A product of T rows costs far more than one row's (8 rows: 4-5x on one thread), and a
verify pass of a few rows on the cpu tier pays it. Every 32 weights a row takes six float steps
(the scale products, the activation's scale, the offset) to keep its bits those of a row alone
and of ``_mm_c4``. Per-256 activation scales (llama.cpp's q8_K, for the K-quants) would take
seven in eight of those steps away, but change the bits; this measures what they could save.

    NUMBA_NUM_THREADS=1 python dev/cpu/bench_float_steps.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import synth_gguf as sg  # noqa: E402

from ntx.daemons.compute import cpu_kernels as ck  # noqa: E402

N_ROWS, N_COLS = 4096, 14336
ROUNDS = 20


@njit(parallel=True, nogil=True, fastmath=False, boundscheck=False)
def _integer_sums_only(q, xq, out):  # pragma: no cover - compiled
    # production's _mm_c4v with its float steps left out: the same intrinsics, loads and stores
    n_groups, nb, n_chunks = q.shape[0], q.shape[1], q.shape[2]
    R = n_chunks * 16
    T, N = out.shape
    K = xq.shape[1]
    q_base, x_base = q.ctypes.data, xq.ctypes.data
    for g in prange(n_groups):
        acc = np.empty(8 * R, np.int32)
        acc_base = acc.ctypes.data
        t = 0
        while t < T:
            n = ck._rows_at_once(T - t)
            for b in range(nb):
                w0 = q_base + ((g * nb + b) * n_chunks) * 256
                x0 = x_base + t * K + b * 32
                if n == 8:
                    for c in range(n_chunks):
                        ck._block16_vnni_8(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                elif n == 4:
                    for c in range(n_chunks):
                        ck._block16_vnni_4(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                elif n == 3:
                    for c in range(n_chunks):
                        ck._block16_vnni_3(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                elif n == 2:
                    for c in range(n_chunks):
                        ck._block16_vnni_2(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                else:
                    for c in range(n_chunks):
                        ck._block16_vnni_1(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
            for u in range(n):
                for r in range(min(R, N - g * R)):
                    out[t + u, g * R + r] = np.float32(acc[u * R + r])
            t += n


def main() -> None:
    if not ck.VNNI:
        sys.exit("this host has no AVX-512 VNNI: the c4v product does not run here")
    block_elems, _ = GGML_QUANT_SIZES[QT.Q4_K]
    raw = sg.make_blocks(QT.Q4_K, N_ROWS * N_COLS // block_elems, 0.05, np.random.default_rng(0)).reshape(-1)
    mats = [ck.pack(raw, QT.Q4_K, N_ROWS, N_COLS) for _ in range(4)]
    assert mats[0].form == "c4v"
    one_row_s = None
    for T in (1, 2, 4, 8, 16):
        qx = ck.QuantizedActivations(np.random.default_rng(1).standard_normal((T, N_COLS)).astype(np.float32))
        out = np.empty((T, N_ROWS), np.float32)
        mats[0].product(qx, out)
        _integer_sums_only(mats[0].q, qx.xq, out)
        whole_s, ints_s = [], []
        for r in range(ROUNDS):
            m = mats[r % 4]
            t0 = time.perf_counter()
            m.product(qx, out)
            whole_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _integer_sums_only(m.q, qx.xq, out)
            ints_s.append(time.perf_counter() - t0)
        whole, ints = min(whole_s), min(ints_s)
        one_row_s = one_row_s or whole
        print(f"Q4_K {T:2d} rows: product {1e3 * whole:.2f} ms ({whole / one_row_s:.2f}x one row's), integer sums alone "
              f"{1e3 * ints:.2f} ms: the float steps are {100 * (1 - ints / whole):.0f}% of it", flush=True)


if __name__ == "__main__":
    main()
