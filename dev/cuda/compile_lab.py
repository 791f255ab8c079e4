#!/usr/bin/env python3
"""Compile the lab's kernels with NVRTC, no GPU needed (scripts/compile_check.py does production).

lab.cu at every instantiation lab.py launches (the dp4a and i16s matvecs at every rows-per-CTA
and pieces-per-trip of the sweeps, the staged f16 matmul of the K-quants), and the production
templates at the lab's arguments (the f32 matvec of every type and cut, the i16 matvec at every
configuration, mm of the K-quants read directly, mmq with two tiles a warp), mmq_rows.cu,
rows_split.cu and production's fixed_point.cu with its direct matvec at every lanes a row, each
source as the runtime compiles it. Exit status 1 on any compile error.

    python dev/cuda/compile_lab.py [--arch compute_90] [--quick]   # --quick: 64 instantiations a source
    python dev/cuda/compile_lab.py --only fixed_point.cu --arch sm_90 --sass-info   # one source; registers, spills
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parents[1] / "scripts")]

import lab  # noqa: E402
from compile_check import compile_one  # noqa: E402

from ntx.daemons.compute.cuda import instances, mm  # noqa: E402
from ntx.daemons.compute.cuda.sources import kernel_source  # noqa: E402
from ntx.daemons.compute.cuda.tuning import FX_LANES_PER_ROW, MV_ROWS_PER_CTA  # noqa: E402
from ntx.shared.quant_types import QUANT_TYPES  # noqa: E402

SWEEP = [(nr, u) for nr in MV_ROWS_PER_CTA for u in (1, 2)]  # (rows per CTA, pieces per trip) the sweeps take


def lab_names() -> dict[str, list[str]]:
    """{source: instantiations} of everything lab.py launches."""
    out: dict[str, list[str]] = {"lab.cu": [], "matvec.cu": [], "mm.cu": [], "mmq.cu": [], "mmq_rows.cu": [],
                                 "rows_split.cu": [], "fixed_point.cu": []}
    for q in QUANT_TYPES.values():
        qt = int(q.qtype)
        for cut in q.cuts:
            for nr, u in SWEEP:
                out["matvec.cu"] += instances.mv_names(qt, nr, u, cut)
        if q.dp4a:
            for nr, u in SWEEP:
                out["lab.cu"] += lab.dp4a_names(qt, nr, u) + lab.i16s_names(qt, nr, u)
                out["matvec.cu"] += instances.i16_names(qt, nr, u)
            out["rows_split.cu"] += lab.rows_split_names(qt)
        if q.mm_staged:
            out["lab.cu"] += lab.mms_names(qt)
            out["mm.cu"] += instances.mm_names(qt, "v2")
            out["mmq.cu"] += lab.mmq_names(qt, 2)
            out["mmq_rows.cu"] += [n for tile in lab.MMQ_ROWS_TILES for n in lab.mmq_rows_names(qt, tile)]
        if mm.mmq_supported(q.qtype, 256):  # production's, the direct matvec at every lanes a row included
            out["fixed_point.cu"] += [n for tpr in FX_LANES_PER_ROW for n in instances.fx_mv_names(qt, tpr)]
            out["fixed_point.cu"] += list(instances.fx_mvs_names(qt)) + list(instances.fx_mmq_names(qt))

    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--quick", action="store_true", help="the first 64 instantiations of each source only")
    ap.add_argument("--only", default=None, help="compile this source only (e.g. fixed_point.cu)")
    ap.add_argument("--sass-info", action="store_true", help="registers and spills per kernel (ptxas -v)")
    a = ap.parse_args()
    ok = True
    for source, names in lab_names().items():
        if a.only and source != a.only:
            continue
        path = {"lab.cu": lab.LAB_SOURCE, "mmq_rows.cu": lab.MMQ_ROWS_SOURCE,
                "rows_split.cu": lab.ROWS_SPLIT_SOURCE}.get(source, source)
        names = names[::max(1, len(names) // 64)][:64] if a.quick else names
        ok &= compile_one(source, a.arch, a.sass_info, names=names, source=kernel_source(path))
    print("ALL OK" if ok else "ERRORS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
