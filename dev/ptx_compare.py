#!/usr/bin/env python3
"""Compare the PTX of every production kernel between two source trees, no GPU needed.

A refactor of the CUDA sources (files split, helpers moved, names of inlined device functions
changed) must leave the machine code of every kernel production launches as it was. This tool
compiles, in each tree, the kernel instantiations that the NEW tree's scripts/compile_check.py
lists as production (``compile_check.py --list``: one ``FILE<TAB>NAME`` line each), with NVRTC
for compute_90, exactly as the runtime does (``#include "x.cuh"`` of the source's folder inlined
once, ``-std=c++17``), and compares each kernel's PTX entry:

  * the entry's text, with comment lines and ``.loc`` / ``.file`` markers removed, and the
    function's index in its module taken out of its basic-block labels and local depot
    (``$L__BB12_5`` -> ``$L__BB_5``, ``__local_depot12`` -> ``__local_depot``): the index
    says where the kernel sits in its module, which the trees cut differently;
  * the module-scope declarations (``.global``, ``.shared``, ``.const``) the entry names, as
    text, with its in-entry ``.shared`` declarations, sorted (NVVM declares an inlined
    function's static shared array in the entry when one kernel of the module uses it, at
    module scope when several do).

NVRTC's PTX of some kernels varies from compile to compile of the same source (register
numbering and instruction order of the attention kernels; the base tree's own compiles differ
from each other): a kernel that differs at the first compile is compiled ``--repeats`` more
times in both trees (the same modules), and counts as the same when some base PTX and some new
PTX are identical.

In the base tree each kernel is found in whichever ``.cu`` of the cuda folder defines a
``__global__`` of that name, so the trees may cut the kernels into files differently. Kernels
are compiled file by file, all of a file's instantiations in one NVRTC program (as the runtime
compiles a module), so the tool takes a few minutes on two cores.

    python dev/ptx_compare.py --base /tmp/base --new . [--cache /tmp/base-ptx.json] [--arch compute_90]

Exit status 0 when every kernel is identical, 1 otherwise (the differing kernels are listed,
with the first differing lines of each).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

CUDA_SUBDIR = Path("daemons/compute/cuda")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_ENTRY = re.compile(r"^(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$][\w$]*)\s*\(", re.M)
_IDENT = re.compile(r"[A-Za-z_$][\w$]*")
_DECL = re.compile(r"^(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(?:global|shared|const)\b.*?([A-Za-z_$][\w$]*)\s*(?:\[|;|=).*$",
                   re.M)


def inline_source(path: Path, seen: set[str] | None = None) -> str:
    """The text of ``path`` with each ``#include "x.cuh"`` of its folder inlined once (the
    runtime's sources.kernel_source, restated so that any tree can be read)."""
    seen = set() if seen is None else seen
    out = []
    for line in path.read_text().splitlines():
        m = _INCLUDE.match(line)
        if m is None:
            out.append(line)
            continue
        header = path.parent / m.group(1)
        if m.group(1) not in seen:
            seen.add(m.group(1))
            out.append(inline_source(header, seen))
    return "\n".join(out) + "\n"


def compile_ptx(source: str, name: str, exprs: list[str], arch: str) -> tuple[str, dict[str, str]]:
    """(PTX, {name expression: lowered name}) of one NVRTC program."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17"])
        except nvrtc.NVRTCError as e:
            raise SystemExit(f"{name}: compile error {e}\n{nvrtc.getProgramLog(prog)}")
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        return nvrtc.getPTX(prog).decode() if isinstance(nvrtc.getPTX(prog), bytes) else nvrtc.getPTX(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


_MODULE_INDEX = [(re.compile(r"\$L__BB\d+_"), "$L__BB_"), (re.compile(r"__local_depot\d+"), "__local_depot")]


def canonical(lines: list[str]) -> list[str]:
    """``lines`` with the function's module index taken out of label and depot names, and its
    static shared arrays as one sorted list of declarations at the end, whether NVVM declared
    them in the entry (one kernel of the module uses the array) or at module scope (several do:
    an inlined function's ``__shared__``, e.g. rms_scale's, once two kernels of a module call it)."""
    out, decls = [], []
    for ln in lines:
        for pat, rep in _MODULE_INDEX:
            ln = pat.sub(rep, ln)
        if ln.startswith("[module] "):
            decls.append(ln.removeprefix("[module] "))
        elif ln.startswith(".shared ") and ln.endswith(";"):
            decls.append(ln)
        else:
            out.append(ln)
    return out + sorted(decls)


def _normalise(lines: list[str]) -> list[str]:
    keep = []
    for ln in lines:
        s = ln.strip()
        if not s or s.startswith("//") or s.startswith(".loc") or s.startswith(".file"):
            continue
        keep.append(s)
    return keep


def split_entries(ptx: str) -> dict[str, list[str]]:
    """Every kernel entry of a module: its normalised lines, then the module-scope declarations
    it names (sorted)."""
    decls = {m.group(1): m.group(0).strip() for m in _DECL.finditer(ptx)}
    out: dict[str, list[str]] = {}
    starts = list(_ENTRY.finditer(ptx))
    for m in starts:
        # the entry's body ends at the first line that is just "}" after its opening
        body_start = ptx.index("{", m.end())
        end = ptx.index("\n}", body_start) + 2
        lines = _normalise(ptx[m.start():end].splitlines())
        used = sorted(set(_IDENT.findall(ptx[body_start:end])) & decls.keys())
        out[m.group(1)] = lines + [f"[module] {decls[d]}" for d in used]
    return out


def production_list(tree: Path) -> list[tuple[str, str]]:
    """(file, name expression) of every production kernel, from the tree's compile_check.py."""
    res = subprocess.run([sys.executable, str(tree / "scripts" / "compile_check.py"), "--list"], capture_output=True,
                         text=True, check=True, cwd=tree)
    return [tuple(line.split("\t")) for line in res.stdout.splitlines() if "\t" in line]


def _kernel_ident(expr: str) -> str:
    return expr.split("<", 1)[0].strip()


def defining_files(tree: Path, ident: str) -> list[Path]:
    """The .cu files of the tree's cuda folder that define the __global__ ``ident``."""
    pat = re.compile(rf"__global__[^;{{]*?\b{re.escape(ident)}\s*\(", re.S)
    return [p for p in sorted((tree / CUDA_SUBDIR).glob("*.cu")) if pat.search(p.read_text())]


def locate(tree: Path, ident: str) -> Path:
    """The .cu of the tree's cuda folder that defines the __global__ ``ident``."""
    found = defining_files(tree, ident)
    if len(found) != 1:
        raise SystemExit(f"{tree}: kernel {ident} defined in {len(found)} files ({[p.name for p in found]})")
    return found[0]


def kernels_of(tree: Path, groups: dict[Path, list[str]], arch: str) -> dict[str, tuple[str, list[str]]]:
    """{name expression: (lowered name, normalised PTX)} for the tree's files and expressions."""
    out = {}
    for path, exprs in sorted(groups.items()):
        t0 = time.perf_counter()
        ptx, lowered = compile_ptx(inline_source(path), path.name, exprs, arch)
        entries = split_entries(ptx)
        for e in exprs:
            out[e] = (lowered[e], entries[lowered[e]])
        print(f"  {tree.name or tree}/{path.name}: {len(exprs)} kernels in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="the tree before (e.g. git archive ea8ac58)")
    ap.add_argument("--new", default=Path("."), type=Path, help="the tree after (default: this one)")
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--cache", type=Path, help="a JSON file keeping the base tree's PTX between runs")
    ap.add_argument("--repeats", type=int, default=4,
                    help="compile the files of the kernels that differ this many times more, in both trees: NVRTC's "
                         "PTX of some kernels (attention's) varies from run to run of the same source")
    a = ap.parse_args()
    new_tree, base_tree = a.new.resolve(), a.base.resolve()
    listed = production_list(new_tree)
    print(f"{len(listed)} production kernels listed by {new_tree}/scripts/compile_check.py --list", flush=True)
    new_groups: dict[Path, list[str]] = defaultdict(list)
    for fname, expr in listed:
        new_groups[new_tree / CUDA_SUBDIR / fname].append(expr)
    cached = json.loads(a.cache.read_text()) if a.cache and a.cache.exists() else {}
    base: dict[str, tuple[str, list[str]]] = {e: tuple(v) for e, v in cached.get("kernels", {}).items()}
    # kernels the base tree does not define (added by the change): listed, not compared
    added = [e for _, e in listed if e not in base and not defining_files(base_tree, _kernel_ident(e))]
    if added:
        print(f"{len(added)} kernels are new (the base defines none of {sorted({_kernel_ident(e) for e in added})})")
        listed = [(f, e) for f, e in listed if e not in added]
    missing = [e for _, e in listed if e not in base]
    if missing:
        base_groups: dict[Path, list[str]] = defaultdict(list)
        for e in missing:
            base_groups[locate(base_tree, _kernel_ident(e))].append(e)
        base.update(kernels_of(base_tree, base_groups, a.arch))
        if a.cache:
            a.cache.write_text(json.dumps({"base": str(base_tree), "arch": a.arch, "kernels": base}))
    new = kernels_of(new_tree, new_groups, a.arch)
    same, differ = 0, []
    for _, e in listed:
        (bname, bptx), (nname, nptx) = base[e], new[e]
        if bname == nname and canonical(bptx) == canonical(nptx):
            same += 1
        else:
            differ.append(e)
    varied, settled = set(), []
    if differ and a.repeats:
        # the same modules as above (every listed kernel of each file), compiled again
        again = {e for e in differ}
        base_files = {locate(base_tree, _kernel_ident(e)) for e in again}
        new_files = {new_tree / CUDA_SUBDIR / f for f, e in listed if e in again}
        base_groups = {p: [e for _, e in listed if locate(base_tree, _kernel_ident(e)) == p] for p in base_files}
        new_groups2 = {p: new_groups[p] for p in new_files}
        b_var = {e: {tuple(canonical(base[e][1]))} for e in again}
        n_var = {e: {tuple(canonical(new[e][1]))} for e in again}
        for _ in range(a.repeats):
            for var, got in ((b_var, kernels_of(base_tree, base_groups, a.arch)), (n_var, kernels_of(new_tree, new_groups2, a.arch))):
                for e in again:
                    var[e].add(tuple(canonical(got[e][1])))
        varied = {e for e in again if len(b_var[e]) > 1 or len(n_var[e]) > 1}
        settled = [e for e in differ if b_var[e] & n_var[e]]
        differ = [e for e in differ if e not in settled]
    for e in differ[:20]:
        (bname, bptx), (nname, nptx) = base[e], new[e]
        print(f"DIFFERS: {e} ({bname} / {nname}){' (its PTX varies from compile to compile)' if e in varied else ''}")
        for i, (x, y) in enumerate(zip(canonical(bptx), canonical(nptx))):
            if x != y:
                print(f"   line {i}: base: {x}\n   line {i}: new:  {y}")
                break
        else:
            print(f"   lengths {len(bptx)} / {len(nptx)}")
    print(f"{len(listed)} kernels compared ({a.arch}): {same} identical at the first compile"
          + (f", {len(settled)} more identical to one of the base's PTX over {a.repeats} more compiles of each tree "
             f"(NVRTC's output varied from compile to compile for {len(varied)} of them)" if settled else "")
          + f", {len(differ)} different")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
