"""The CUDA sources of the cuda backend as NVRTC compiles them, headers inlined.

``ops.cu`` and ``quant.cu`` share ``common.cuh`` through an ``#include "common.cuh"`` line.
NVRTC could find the header through ``-I``, but cupy caches compiled modules by the source
text: a change in the header alone would then load a stale module. Inlining each included
header (once, with ``#line`` markers so compile errors name the right file and line) puts the
header's text in the cache key. kernels.py and scripts/compile_check.py both compile what
``kernel_source`` returns, so the check compiles exactly what runs. Imports without cupy.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CUDA_DIR", "kernel_source"]

CUDA_DIR = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def kernel_source(name: str) -> str:
    """The text of CUDA_DIR/name with every ``#include "x.cuh"`` of this directory inlined."""
    return _expand(name, set())


def _expand(name: str, seen: set[str]) -> str:
    out: list[str] = []
    for n, line in enumerate((CUDA_DIR / name).read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m is None:
            out.append(line)
            continue
        header = m.group(1)
        if not (CUDA_DIR / header).is_file():
            raise FileNotFoundError(f"{name}:{n}: included header {header} is not in {CUDA_DIR}")
        if header not in seen:
            seen.add(header)
            out += [f'#line 1 "{header}"', _expand(header, seen), f'#line {n + 1} "{name}"']
    return "\n".join(out) + "\n"
