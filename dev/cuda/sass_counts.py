#!/usr/bin/env python3
"""Static SASS instruction counts of kernels, production's beside variant folders', no GPU needed.

A kernel bound by its scalar steps (mmq at 64 rows: docs/PERFORMANCE.md) costs about what it
issues, so the opcode counts of a variant's machine code against production's are a prediction
to check before a device call, and an explanation after it: the fixed form's F2I conversions,
its 64-bit adds, its spills (LDL/STL). Counts are static (each instruction once, loops as
unrolled), not executed. Compiles each source as the runtime does (sources.kernel_source, a
variant's headers found in its folder first) to an sm_90 cubin with an NVRTC of CUDA 12.8 or
later and disassembles it with nvdisasm, as scripts/pdl_check.py does (the pip wheels
nvidia-cuda-nvrtc and nvidia-cuda-nvdisasm carry both).

    python3 dev/cuda/sass_counts.py --nvrtc PATH/libnvrtc.so.13 --nvdisasm PATH/nvdisasm \\
        --source fixed_point.cu --kernel 'fx_mmq_kernel<12,8,1>@mmq_kernel<12,8,1>' \\
        grid_int=DIR/grid_int [NAME=DIR ...]

KERNEL@REF adds REF, compiled from production's source, as the first column (the kernel the
variant is weighed against).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "scripts"))
from pdl_check import _FUNCTION, _INSN, compile_sm90  # noqa: E402  (its compile, and its reading of nvdisasm's text)

from ntx.daemons.compute.cuda.sources import CUDA_DIR  # noqa: E402

OPCODES = ("IMMA", "HMMA", "FFMA", "FADD", "FMUL", "IMAD", "IADD3", "F2I", "I2F", "MOV", "SHF", "LOP3", "PRMT",
           "LDG", "LDS", "STS", "LDL", "STL")


def opcode_counts(lib: ctypes.CDLL, nvdisasm: str, source: Path, name: str) -> collections.Counter:
    """Opcode (without modifiers) -> instructions of ``name``'s function alone, compiled from
    ``source`` (the cubin holds the source's extern "C" kernels too)."""
    binary, _ = compile_sm90(lib, str(source), [name])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    # a template's symbol is its mangled name (_Z, the name's length, the name, I, the arguments),
    # an extern "C" kernel's its own
    base = name.split("<")[0]
    mine = (lambda sym: sym.startswith(f"_Z{len(base)}{base}I")) if "<" in name else (lambda sym: sym == base)
    functions: dict[str, collections.Counter] = {}
    counts = None
    for line in sass.splitlines():
        m = _FUNCTION.search(line)
        if m:
            sym = m.group(1) or m.group(2)
            counts = functions.setdefault(sym, collections.Counter()) if mine(sym) else None
            continue
        ins = _INSN.search(line)
        if counts is not None and ins:
            counts[ins.group(2).split(".")[0]] += 1
    if len(functions) != 1:
        raise SystemExit(f"{source}: {len(functions)} functions named like {base} in the cubin")
    return next(iter(functions.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", help="NAME=DIR: a folder with its own SOURCE (and headers)")
    ap.add_argument("--nvrtc", required=True, help="path of libnvrtc.so (CUDA 12.8 or later)")
    ap.add_argument("--nvdisasm", required=True, help="path of an nvdisasm that reads that NVRTC's cubins")
    ap.add_argument("--source", default="fixed_point.cu", help="the source file (production's name)")
    ap.add_argument("--kernel", action="append", required=True, help="an instantiation, or KERNEL@REF")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.nvrtc)
    columns = [("production", CUDA_DIR / a.source)]
    for v in a.variants:
        label, _, d = v.partition("=")
        src = Path(d).resolve() / a.source
        if not src.is_file():
            raise SystemExit(f"{v}: no {a.source} in {d}")
        columns.append((label, src))
    for spec in a.kernel:
        name, _, ref = spec.partition("@")
        counts = {}
        if ref:
            counts[ref.split("<")[0]] = opcode_counts(lib, a.nvdisasm, CUDA_DIR / a.source, ref)
        for label, src in columns:
            counts[label] = opcode_counts(lib, a.nvdisasm, src, name)
        width = max(12, *(len(k) + 2 for k in counts))
        print(f"== {name}")
        print("opcode".ljust(8) + "".join(k.rjust(width) for k in counts))
        for op in OPCODES:
            print(op.ljust(8) + "".join(str(c.get(op, 0)).rjust(width) for c in counts.values()))
        print("all".ljust(8) + "".join(str(sum(c.values())).rjust(width) for c in counts.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
