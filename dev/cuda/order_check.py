#!/usr/bin/env python3
"""The order mvq2_rows_kernel adds a row's pieces in, against the i16 matvec's, in numpy float32
(no GPU): the matvec's lanes each chain their pieces (p = L, L + S, ...; S = 32 nw), each warp's
butterfly (xor 16, 8, 4, 2, 1) is read by lane 0, the warps are added in turn from 0; the lab
kernel walks the lanes of each warp in bit-reversed order, each lane's chain whole, pairing
them as the butterfly does (t1..t4). Random pieces spanning many magnitudes; exit status 1 on
any bit that differs. A plain left-to-right sum differs from the matvec's in most trials, so the
check can tell orders apart. The lab's split of that walk over warps (rows_split.cu) is checked
the same way.

    python dev/cuda/order_check.py
"""

from __future__ import annotations

import sys

import numpy as np

f32 = np.float32


def matvec_order(v: np.ndarray, nw: int) -> np.float32:
    S = 32 * nw
    lanes = np.zeros(S, dtype=f32)
    for L in range(S):
        acc = f32(0)
        for p in range(L, len(v), S):
            acc = f32(acc + v[p])
        lanes[L] = acc
    total = f32(0)
    for w in range(nw):
        lv = lanes[32 * w:32 * (w + 1)].copy()
        for o in (16, 8, 4, 2, 1):
            lv = np.array([f32(lv[i] + lv[i ^ o]) for i in range(32)], dtype=f32)
        total = f32(total + lv[0])
    return total


def _pair(v: np.ndarray, ws: int, k: int, S: int) -> np.float32:
    """Step k of warp slot ws's walk: lane __brev(k) >> 27's chain plus its butterfly twin's
    (lane + 16), each chained over its pieces p = 32 ws + lane, + S, ..."""
    lane = int(f"{k:05b}"[::-1], 2)  # __brev(k) >> 27
    a = b = f32(0)
    for p in range(32 * ws + lane, len(v), S):
        a = f32(a + v[p])
    for p in range(32 * ws + lane + 16, len(v), S):
        b = f32(b + v[p])
    return f32(a + b)


def kernel_order(v: np.ndarray, nw: int) -> np.float32:
    S, total = 32 * nw, f32(0)
    held = [f32(0)] * 4  # the kernel's t1..t4: a pair of lanes, 4, 8, 16 lanes waiting for their twin
    for ws in range(nw):
        for k in range(0, 32, 2):
            x = _pair(v, ws, k, S)
            for level in range(4):  # k's bits 1-4: the first of a pair waits, the second joins it
                if not k & (2 << level):
                    held[level] = x
                    break
                x = f32(held[level] + x)
            else:
                total = f32(total + x)  # the warp's sum, after the warps before it
    return total


def split_order(v: np.ndarray, nw: int) -> np.float32:
    """The lab's mvq2_rows_split_kernel (rows_split.cu): each warp slot's four 8-lane subtrees
    (steps k = 8 grp .. 8 grp + 7 of the walk above) computed apart, then added by one warp as
    (G0 + G1) + (G2 + G3), slot by slot from 0."""
    S, total = 32 * nw, f32(0)
    for ws in range(nw):
        G = []
        for grp in range(4):
            held = [f32(0)] * 2
            for k in range(8 * grp, 8 * grp + 8, 2):
                x = _pair(v, ws, k, S)
                for level in range(2):
                    if not k & (2 << level):
                        held[level] = x
                        break
                    x = f32(held[level] + x)
                else:
                    G.append(x)
        total = f32(total + f32(f32(G[0] + G[1]) + f32(G[2] + G[3])))
    return total


def main() -> int:
    rng = np.random.default_rng(1)
    bad = bad_split = differs = trials = 0
    for n in (3, 16, 128, 448, 1000):
        for nw in (1, 2, 4, 8):
            for _ in range(20):
                v = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 3)).astype(f32)
                want = matvec_order(v, nw)
                bad += want.tobytes() != kernel_order(v, nw).tobytes()
                bad_split += want.tobytes() != split_order(v, nw).tobytes()
                plain = f32(0)
                for x in v:
                    plain = f32(plain + x)
                differs += want.tobytes() != plain.tobytes()
                trials += 1
    print(f"{trials} trials: the kernel's order differs from the matvec's in {bad}, the split kernel's "
          f"(dev/cuda/rows_split.cu) in {bad_split}; a plain sum in {differs}")
    return 1 if bad or bad_split or differs < trials // 2 else 0


if __name__ == "__main__":
    sys.exit(main())
