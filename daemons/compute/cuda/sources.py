"""The CUDA sources of the cuda backend as NVRTC compiles them, headers inlined.

Each ``.cu`` of this folder includes its headers (``common.cuh``, ``quant_traits.cuh``, ...)
through ``#include "x.cuh"`` lines. NVRTC could find them through ``-I``, but cupy caches
compiled modules by the source text: a change in a header alone would then load a stale
module. Inlining each included header (once, with ``#line`` markers so compile errors name the
right file and line) puts the header's text in the cache key. The runtime (``runtime.module``)
and scripts/compile_check.py both compile what ``kernel_source`` returns, so the check compiles
exactly what runs. A source outside this folder (dev/cuda's lab) finds its headers beside it
first, then here. Imports without cupy.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CUDA_DIR", "SOURCES", "kernel_source"]

CUDA_DIR = Path(__file__).resolve().parent
# the kernel sources of the package, by family (each beside its launchers: matvec.cu / matvec.py ...)
SOURCES = ("matvec.cu", "matvec_rows.cu", "mm.cu", "mmq.cu", "fixed_point.cu", "dequant.cu", "norm_rope_kv.cu",
           "attention.cu", "selection.cu")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def kernel_source(name: str | Path) -> str:
    """The text of ``name`` (a file of CUDA_DIR, or a path) with every ``#include "x.cuh"``
    inlined once, the header found beside the including file or in CUDA_DIR."""
    path = Path(name) if Path(name).is_absolute() else CUDA_DIR / name
    return _expand(path, set())


def _expand(path: Path, seen: set[str]) -> str:
    out: list[str] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m is None:
            out.append(line)
            continue
        header = m.group(1)
        found = next((d / header for d in (path.parent, CUDA_DIR) if (d / header).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{path.name}:{n}: included header {header} is not in {path.parent}")
        if header not in seen:
            seen.add(header)
            out += [f'#line 1 "{header}"', _expand(found, seen), f'#line {n + 1} "{path.name}"']
    return "\n".join(out) + "\n"
