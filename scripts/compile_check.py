#!/usr/bin/env python3
"""Compile every CUDA source of the cuda backend with NVRTC, no GPU needed.

Compiles each .cu exactly as kernels.py does (headers inlined by sources.kernel_source) and
instantiates the templates that kernels.py uses (the default matvec configurations for every
type and batch size, the dequantizers, the attention variants) and prints NVRTC's log: errors,
warnings, and with --sass-info (an sm_90 cubin through ptxas) registers, stack and spills per
kernel. Exit status 1 on any compile error.

    python scripts/compile_check.py [--arch compute_90] [--sass-info] [--all-configs]
"""

from __future__ import annotations

import argparse
import sys
import time

from cupy_backends.cuda.libs import nvrtc

from ntx.daemons.compute.cuda.sources import CUDA_DIR, kernel_source

QTYPES = [0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30]


def _defaults():
    # read the default matvec configs without importing cupy's runtime parts (no GPU here)
    src = (CUDA_DIR / "kernels.py").read_text()
    start = src.index("_MV_DEFAULT = ")
    end = src.index("}", start) + 1
    ns: dict = {}
    exec(src[start:end], ns)
    return ns["_MV_DEFAULT"]


def names_for(fname: str, all_configs: bool) -> list[str]:
    if fname == "quant.cu":
        cfgs = {(nr, u) for nr, _, u in _defaults().values()}
        if all_configs:
            cfgs = {(nr, u) for nr in (1, 2, 4) for u in (1, 2)}
        out = []
        for qt in QTYPES + [108, 112, 113, 114]:  # + the v2 (lane-contiguous) matvec variants
            for nr, u in sorted(cfgs):
                out += [f"mv_kernel<{qt},{b},{nr},{u}>" for b in range(1, 9)]
            if qt < 100 or qt in (112, 113):  # the v2 cut dequantizes Q4_K / Q5_K
                out += [f"deq_kernel<{qt},0>", f"deq_kernel<{qt},1>"]
        return out
    if fname == "ops.cu":
        return [f"attn_split_kernel<{g},{hd}>" for g in (1, 2, 3, 4, 8) for hd in (64, 128, 256) if g * hd <= 2048]
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
