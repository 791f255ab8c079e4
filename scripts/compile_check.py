#!/usr/bin/env python3
"""Compile every CUDA source of the cuda backend with NVRTC, no GPU needed.

Compiles each .cu exactly as kernels.py does (headers inlined by sources.kernel_source) and
instantiates the templates kernels.py uses: for every supported type (shared/quant_types.py)
and each of its layout cuts, the f32 matvec at every launch configuration of every device entry
in tuning.py, the dp4a and i16 matvecs where the type has them (i16 and its x-staged variant
also at 8 rows per CTA, which scripts/bench_gemm_paths.py --sweep-mv launches), the
dequantizers, and the attention
variants (plain and tree-masked; the extern "C" kernels, kv_move among them, need no
instantiation). Prints NVRTC's log: errors, warnings, and with --sass-info (an sm_90 cubin through
ptxas) registers, stack and spills per kernel. Exit status 1 on any compile error.

    python scripts/compile_check.py [--arch compute_90] [--sass-info] [--all-configs]
"""

from __future__ import annotations

import argparse
import sys
import time

from cupy_backends.cuda.libs import nvrtc

from ntx.daemons.compute.cuda import tuning
from ntx.daemons.compute.cuda.sources import CUDA_DIR, kernel_source
from ntx.shared.quant_types import QUANT_TYPES

CUT_ID = {"v1": 1, "v2": 2}  # quant.cu CUT_V1, CUT_V2 (kernels.py _CUT_ID)
BATCH_SIZES = range(1, tuning.MAX_MATVEC_B + 1)
# the i16 matvec's widest CTAs (8 rows: the most accumulators, NR * B = 64), always compiled:
# scripts/bench_gemm_paths.py --sweep-mv launches them
I16_WIDE = {(max(tuning.MV_ROWS_PER_CTA), u) for u in (1, 2)}


def _launch_cuts(all_configs: bool) -> tuple[set, set]:
    """(rows per CTA, pieces per trip) pairs of the f32 and dp4a matvec that some device entry
    launches (the warps per CTA are a launch argument, not a template one); all_configs: every
    pair the kernels allow."""
    if all_configs:
        every = {(nr, u) for nr in tuning.MV_ROWS_PER_CTA for u in (1, 2)}
        return every, every
    mv = {(nr, u) for t in tuning.TUNINGS.values() for nr, _, u in t.all_mv_launches()}
    mvq = {(nr, u) for t in tuning.TUNINGS.values() for nr, _, u in t.all_mvq_launches()}
    return mv, mvq


def names_for(fname: str, all_configs: bool) -> list[str]:
    if fname == "quant.cu":
        mv_cfgs, mvq_cfgs = _launch_cuts(all_configs)
        out = []
        for q in QUANT_TYPES.values():
            qt = int(q.qtype)
            for cut in q.cuts:
                c = CUT_ID[cut]
                for nr, u in sorted(mv_cfgs):
                    out += [f"mv_kernel<{qt},{c},{b},{nr},{u}>" for b in BATCH_SIZES]
                out += [f"deq_kernel<{qt},{c},0>", f"deq_kernel<{qt},{c},1>"]
            if q.dp4a:
                for nr, u in sorted(mvq_cfgs):
                    out += [f"mvq_kernel<{qt},{b},{nr},{u}>" for b in BATCH_SIZES]
                for nr, u in sorted(mvq_cfgs | I16_WIDE):
                    out += [f"mvq2_kernel<{qt},{b},{nr},{u}>" for b in BATCH_SIZES]
                    out += [f"mvq2g_kernel<{qt},{b},{nr},{u}>" for b in BATCH_SIZES]
                    out += [f"mvq2s_kernel<{qt},{b},{nr},{u}>" for b in BATCH_SIZES]
            for cut, _, _ in q.mm_cuts:  # kernels._mm_names
                out += [f"mm_kernel<{qt},{CUT_ID[cut]},{nt},{tuning.MM_UNROLL}>"
                        for nt in range(1, tuning.MAX_MM_ROWS // 8 + 1)]
            if q.mm_staged:  # kernels._mms_names
                out += [f"mms_kernel<{qt},{nt}>" for nt in range(1, tuning.MAX_MM_ROWS // 8 + 1)]
                out += [f"mmq_kernel<{qt},{nt},{mt}>" for nt in range(1, tuning.MAX_MM_ROWS // 8 + 1)
                        for mt in tuning.MMQ_TILES_PER_WARP]  # _mmq_names
        return out
    if fname == "ops.cu":  # each attention variant plain and with a tree mask (kernels._attn_names)
        return [f"{k}<{g},{hd}>" for g in (1, 2, 3, 4, 8) for hd in (64, 128, 256) if g * hd <= 2048
                for k in ("attn_split_kernel", "attn_tree_split_kernel")]
    return []


def compile_one(name: str, arch: str, sass_info: bool, all_configs: bool) -> bool:
    src = kernel_source(name)
    names = names_for(name, all_configs)
    prog = nvrtc.createProgram(src, name, [], [])
    for n in names:
        nvrtc.addNameExpression(prog, n)
    opts = [f"-arch={arch}", "-std=c++17"]
    if sass_info:
        opts.append("--ptxas-options=-v")
    t0 = time.perf_counter()
    ok = True
    try:
        nvrtc.compileProgram(prog, opts)
    except nvrtc.NVRTCError as e:
        ok = False
        print(f"== {name}: COMPILE ERROR {e}")
    dt = time.perf_counter() - t0
    log = nvrtc.getProgramLog(prog).strip()
    print(f"== {name}: {'ok' if ok else 'FAILED'} ({len(names)} instantiations, {dt:.1f} s, {arch})")
    if log:
        if sass_info and ok:
            # keep the per-kernel resource lines short: name + registers/spills
            lines = log.splitlines()
            for ln in lines:
                if "spill" in ln and ("0 bytes spill stores, 0 bytes spill loads" not in ln):
                    print("   ", ln.strip())
                elif "Used" in ln:
                    print("   ", ln.strip())
                elif "Compiling entry" in ln or "Function properties" in ln:
                    print("   ", ln.strip())
        else:
            print(log)
    nvrtc.destroyProgram(prog)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--sass-info", action="store_true", help="compile to sm_90 cubin and print ptxas resource usage")
    ap.add_argument("--all-configs", action="store_true", help="every matvec (rows, unroll) variant")
    a = ap.parse_args()
    arch = "sm_90" if a.sass_info and a.arch == "compute_90" else a.arch
    ok = True
    for p in sorted(CUDA_DIR.glob("*.cu")):
        ok &= compile_one(p.name, arch, a.sass_info, a.all_configs)
    print("ALL OK" if ok else "ERRORS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
