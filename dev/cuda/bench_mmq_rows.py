"""mmq at one and two rows of x: the lab's mmq_rows_kernel (``lab.mmq_rows``, mmq_kernel's bits
for the batch-invariant mode's one-row passes) at each --tiles (weight rows a CTA) against
mmq_kernel at the same rows (production ``mm.mmq``: what the batch-invariant mode runs there) and
the i16 matvec (the default mode's path there). Checks first that every tile gives mmq_kernel's
bits (the reason the kernel exists), then times them as CUDA graphs of 20 calls cycling over
copies of the matrix (L2-cold; bench_gemm_paths' timer), with the device's copy bandwidth
measured in the same run.

    python3 dev/cuda/bench_mmq_rows.py [--shapes 8b|70b] [--types Q4_K,Q5_K,Q6_K] [--tiles 8,16,32] [--out mmq_rows.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "scripts")]
import lab  # noqa: E402  (dev/cuda)
from bench_gemm_paths import SHAPES, _time_ms, _weight_copies  # noqa: E402

from ntx.daemons.compute.cuda import matvec as mv  # noqa: E402
from ntx.daemons.compute.cuda import mm as tc  # noqa: E402
from ntx.daemons.compute.cuda import runtime  # noqa: E402
from ntx.daemons.compute.probes import device_copy_gbps  # noqa: E402
from ntx.shared.quant_types import quant_type  # noqa: E402

CTX = runtime.standalone()


def main() -> None:
    from gguf import GGMLQuantizationType as QT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--tiles", default="8,16,32", help="weight rows a CTA of the rows kernel (lab.MMQ_ROWS_TILES)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tiles = [int(v) for v in args.tiles.split(",") if v]
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    copy_gbps = device_copy_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    rows, mismatches = [], 0
    for tname in args.types.split(","):
        qt = int(QT[tname])
        for n_rows, n_cols in SHAPES[args.shapes]:
            ws, nbytes = _weight_copies(qt, n_rows, n_cols, rng)
            launch = runtime.tuning().mmq_launch(1, n_rows, n_cols // 256 * 8)
            for B in range(1, lab.MMQ_ROWS_MAX_B + 1):
                x = cp.asarray(rng.standard_normal((B, n_cols), dtype=np.float32))
                out = cp.empty((B, n_rows), dtype=cp.float32)
                want = tc.mmq(CTX, ws[0], x)
                fits = [t for t in tiles
                        if lab.mmq_rows_smem_bytes(quant_type(qt), n_cols, B, 16, t) <= lab.MMQ_ROWS_MAX_SMEM]
                same = all(bool(cp.array_equal(lab.mmq_rows(CTX, ws[0], x, tile=t), want)) for t in fits)
                mismatches += not same
                ms = {**{f"rows_tile{t}": _time_ms(lambda i, t=t: lab.mmq_rows(CTX, ws[i % len(ws)], x, out, tile=t),
                                                   stream) for t in fits},
                      "mmq": _time_ms(lambda i: tc.mmq(CTX, ws[i % len(ws)], x, out), stream),
                      "i16": _time_ms(lambda i: mv.matvec(CTX, ws[i % len(ws)], x, out), stream)}
                row = {"type": tname, "shape": [n_rows, n_cols], "B": B, "launch_wr_wk_ks": list(launch),
                       "same_bits_as_mmq": same, "weight_bytes": nbytes, "copy_gbps": round(copy_gbps, 1),
                       "ms": {k: None if v is None else round(v, 4) for k, v in ms.items()}}
                rows.append(row)
                print(f"{tname} {n_rows}x{n_cols} B={B} (WR, WK, KS) {launch}: same bits {same}; ms "
                      + "  ".join(f"{k} {v:.4f} ({nbytes / v / 1e6:.0f} GB/s)" if v else f"{k} n/a"
                                  for k, v in ms.items()), flush=True)
            ws.clear()
            cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "mismatches": mismatches}, indent=1))
    if mismatches:
        raise SystemExit(f"{mismatches} shape(s) where mmq_rows_kernel's bits differ from mmq_kernel's")


if __name__ == "__main__":
    main()
