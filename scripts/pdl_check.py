"""Check, in the SASS of every kernel, that nothing is read from in-stream memory before the
programmatic-launch wait (common.cuh pdl_wait; griddepcontrol.wait is ACQBULK in SASS).

With programmatic dependent launch (runtime.Launcher) a kernel starts while the kernel before it
still writes its inputs. ptxas treats non-coherent loads (__ldg, ld.global.nc: LDG...CONSTANT) as
reading memory that never changes and moves them above the wait: in the first GPU run with PDL
the f32 matvec's loads of x were issued before the wait and the SmolLM2 decode logits were wrong.
So the kernels read activations, caches and partial sums with coherent loads (__ldca, plain),
which ptxas keeps after the wait, and only the weights (constant for the pass) through the
non-coherent path. This script holds that up against the machine code, no GPU needed:

  * every global load before a kernel's first ACQBULK is a CONSTANT (non-coherent) load: only the
    matvec's first weight loads are issued there, on purpose;
  * there are no more of them than the PTX has before its griddepcontrol.wait (the loads the
    source puts there, the weights: reviewed), so ptxas hoisted nothing above the wait; and in
    the kernels whose first trip is peeled (matvec.cuh matvec_rows' PEEL: the fixed-point
    matvec), no fewer: ptxas sank none of those loads below the wait (in the loop, behind a
    first-trip flag, it kept 1-8 of a lane's 8-16 there);
  * every kernel has an ACQBULK, and no store comes before it.

It compiles each .cu as compile_check.py does (same instantiations) to an sm_90 cubin with an
NVRTC (the newest found, or --nvrtc) and disassembles it with nvdisasm (--nvdisasm; the pip
wheels nvidia-cuda-nvrtc and nvidia-cuda-nvdisasm carry both, no GPU or CUDA install needed):

    python scripts/pdl_check.py --nvrtc PATH/libnvrtc.so.13 --nvdisasm PATH/nvdisasm [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_check import names_for  # noqa: E402  (the instantiations production launches)

from ntx.daemons.compute.cuda.sources import SOURCES, kernel_source  # noqa: E402


def compile_sm90(lib: ctypes.CDLL, fname: str, names: list[str]) -> tuple[bytes, str]:
    """(cubin, ptx) of one source."""
    prog = ctypes.c_void_p()
    src = kernel_source(fname).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, fname.encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    for n in names:
        lib.nvrtcAddNameExpression(prog, n.encode())
    opts = [b"-std=c++17", b"-arch=sm_90"]
    if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"{fname}: compile error\n{log.value.decode()}")
    size = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, buf)
    psize = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(psize))
    pbuf = ctypes.create_string_buffer(psize.value)
    lib.nvrtcGetPTX(prog, pbuf)
    return buf.raw, pbuf.value.decode()


def ptx_loads_before_wait(ptx: str) -> dict[str, int]:
    """Per kernel: global loads before its first griddepcontrol.wait in the PTX."""
    out: dict[str, int] = {}
    for entry in re.split(r"\n(?=(?:\.visible |\.weak )?\.entry)", ptx):
        m = re.search(r"\.entry\s+(\S+)\(", entry)
        if not m:
            continue
        head = entry.split("griddepcontrol.wait")[0]
        out[m.group(1)] = len(re.findall(r"\bld\.global", head))
    return out


# the kernels that peel their first trip (matvec_rows<..., PEEL = true>: fixed_point.cu's
# fx_peel, the fixed-point matvec at one row of x), by mangled name
PEELED = re.compile(r"fx_mvqg?_kernelILi\d+ELi1E")
_FUNCTION = re.compile(r"^\s*\.text\.(\S+):|Function : (\S+)")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def check_sass(sass: str, ptx_before: dict[str, int]) -> tuple[int, list[str]]:
    """(kernels checked, problems) of one disassembly."""
    problems: list[str] = []
    n = 0
    name, waited, seen_wait, before = None, False, False, 0

    def close():
        if name is None:
            return
        if not seen_wait:
            problems.append(f"{name}: no ACQBULK (griddepcontrol.wait) at all")
        if before > ptx_before.get(name, 0):
            problems.append(f"{name}: {before} loads before the wait in SASS, {ptx_before.get(name, 0)} in PTX")
        elif before < ptx_before.get(name, 0) and PEELED.search(name):
            problems.append(f"{name}: only {before} of the {ptx_before.get(name, 0)} weight loads the PTX issues before "
                            "the wait stay there in SASS (ptxas sank the rest past it: less in flight at an early launch)")

    for line in sass.splitlines():
        m = _FUNCTION.search(line)
        if m:
            close()
            name, waited, seen_wait, before = m.group(1) or m.group(2), False, False, 0
            n += 1
            continue
        ins = _INSN.search(line)
        if name is None or not ins:
            continue
        op = ins.group(2)
        if op.startswith("ACQBULK"):
            waited = seen_wait = True
        elif not waited and (op.startswith("LDG") or op.startswith("LD.") or op == "LD"):
            before += 1
            if "CONSTANT" not in op:
                problems.append(f"{name}: coherent load before the wait: {line.strip()[:110]}")
        elif not waited and (op.startswith("STG") or op.startswith("ST.") or op.startswith("RED") or op.startswith("ATOMG")):
            problems.append(f"{name}: store before the wait: {line.strip()[:110]}")
    close()
    return n, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvrtc", required=True, help="path of libnvrtc.so (CUDA 12.8 or later)")
    ap.add_argument("--nvdisasm", required=True, help="path of an nvdisasm that reads that NVRTC's cubins")
    ap.add_argument("--quick", action="store_true", help="the first 200 instantiations of each source only")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.nvrtc)
    bad: list[str] = []
    for fname in SOURCES:
        names = names_for(fname)
        if a.quick:
            names = names[:200]
        t0 = time.perf_counter()
        binary, ptx = compile_sm90(lib, fname, names)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(binary)
            f.flush()
            sass = subprocess.run([a.nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        n, problems = check_sass(sass, ptx_loads_before_wait(ptx))
        print(f"== {fname}: {n} kernels, {len(problems)} problems ({time.perf_counter() - t0:.0f} s)")
        bad += problems
    for b in bad[:40]:
        print("  ", b)
    print("PDL ORDER OK" if not bad else f"{len(bad)} PROBLEMS")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
