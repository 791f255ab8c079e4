#!/usr/bin/env python3
"""Compile every CUDA source of the cuda backend with NVRTC, no GPU needed.

Compiles each .cu of daemons/compute/cuda exactly as the runtime does (headers inlined by
sources.kernel_source) with every template instantiation production launches
(instances.production: for every supported type, its matvec at every launch configuration of
every device entry in tuning.py, its dequantizer, its tensor-core matmul, and the attention
shapes of instances.ATTENTION_SHAPES; the extern "C" kernels need no instantiation). Prints
NVRTC's log: errors, warnings, and with --sass-info (an sm_90 cubin through ptxas) registers,
stack and spills per kernel. Exit status 1 on any compile error. --list prints the
instantiations (``FILE<TAB>NAME``, extern "C" kernels by name) and compiles nothing:
dev/ptx_compare.py compares exactly those. The kernel variants of dev/cuda have their own
check (dev/cuda/compile_lab.py).

    python scripts/compile_check.py [--arch compute_90] [--sass-info] [--list]
"""

from __future__ import annotations

import argparse
import sys
import time

from ntx.daemons.compute.cuda.instances import extern_kernels, production
from ntx.daemons.compute.cuda.sources import SOURCES, kernel_source


def names_for(fname: str) -> list[str]:
    """Every instantiation of ``fname`` production compiles, each once, in module order."""
    return list(dict.fromkeys(n for names in production().get(fname, []) for n in names))


def compile_one(name: str, arch: str, sass_info: bool, names: list[str] | None = None, source: str | None = None) -> bool:
    """Compile ``name`` (a source of the package, or ``source``'s text) with ``names``
    instantiated (default: ``names_for(name)``); print the outcome and NVRTC's log."""
    from cupy_backends.cuda.libs import nvrtc

    src = source if source is not None else kernel_source(name)
    names = names_for(name) if names is None else names
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
            for ln in log.splitlines():
                if "spill" in ln and ("0 bytes spill stores, 0 bytes spill loads" not in ln):
                    print("   ", ln.strip())
                elif "Used" in ln or "Compiling entry" in ln or "Function properties" in ln:
                    print("   ", ln.strip())
        else:
            print(log)
    nvrtc.destroyProgram(prog)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--sass-info", action="store_true", help="compile to sm_90 cubin and print ptxas resource usage")
    ap.add_argument("--list", action="store_true", help="print FILE<TAB>NAME of every production kernel; compile nothing")
    a = ap.parse_args()
    if a.list:
        externs = extern_kernels()
        for fname in SOURCES:
            for n in names_for(fname) + list(externs.get(fname, ())):
                print(f"{fname}\t{n}")
        return 0
    arch = "sm_90" if a.sass_info and a.arch == "compute_90" else a.arch
    ok = True
    for fname in SOURCES:
        ok &= compile_one(fname, arch, a.sass_info)
    print("ALL OK" if ok else "ERRORS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
