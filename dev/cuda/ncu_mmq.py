"""One launch each of mmq_kernel and fx_mmq_kernel (the batch-invariant mode's fixed-point mmq)
at the 8B's gate/up (Q4_K, 14336 x 4096) and down (Q6_K, 4096 x 14336) shapes, for a profiler to
read: where fixed-point mmq loses at 64 rows (docs/PERFORMANCE.md, "The first trip's loads",
the ncu paragraph). Each call is eager and the first of its kernel, so ``ncu -k`` catches them
without skipping; random weights and x (speed, not values).

On the device machine, after ``bash scripts/device_check.sh --no-tests --no-bench`` (the wheels
and the ntx namespace in /tmp), from /tmp (the repository root's ntx/ would shadow the namespace):

    PYTHONPATH=/tmp/nsroot:/tmp/site /usr/local/cuda/bin/ncu --clock-control none \\
        -k regex:"^(fx_)?mmq_kernel" --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats \\
        python3 REPO/dev/cuda/ncu_mmq.py REPO [--rows 64]

``--clock-control none`` leaves the GPU's clocks alone (ncu's default holds the SM clock at base
while it profiles; the one run so far, 2026-12-06 on an H100, did, at 1.43 GHz).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy as cp
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", type=Path, help="the repository root (for scripts/synth_gguf)")
    ap.add_argument("--rows", type=int, default=64, help="rows of x (1-64)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo / "scripts"))
    from gguf import GGMLQuantizationType as QT
    from synth_gguf import make_blocks

    from ntx.daemons.compute.cuda import fixed_point, gemm, mm, runtime

    ctx = runtime.standalone()
    rng = np.random.default_rng(0)
    for qt, (n_rows, n_cols) in [(QT.Q4_K, (14336, 4096)), (QT.Q6_K, (4096, 14336))]:
        raw = make_blocks(int(qt), n_rows * n_cols // 256, 0.02, rng).reshape(-1)
        w = gemm.weight(cp.asarray(raw), int(qt), n_rows, n_cols)
        x = cp.asarray(rng.standard_normal((args.rows, n_cols), dtype=np.float32))
        out = cp.empty((args.rows, n_rows), cp.float32)
        mm.mmq(ctx, w, x, out=out)
        fixed_point.fx_mmq(ctx, w, x, out=out)
        cp.cuda.Device().synchronize()
    print("done")


if __name__ == "__main__":
    main()
