#!/usr/bin/env python3
"""Write timing stand-ins of a cheaper fixed form of mmq ("the grid form") as variant folders
for bench_fx_variants.py, from production's sources as they are.

Why. The fixed form pays at 64 rows for what each block value becomes: a 64-bit integer
(`fx_of`: an FMUL, an F2I.S64 at a fraction of the FFMA rate, a 64-bit add) held in two
registers per output entry, on a kernel that is bound by its scalar steps and short of registers
(docs/PERFORMANCE.md, "Where it stands now"). In the grid form the block value is rounded to a
grid of 1 by one FADD of 1.5 * 2^23 (exact for |v| < 2^22), whose bits, less the constant's, are
the integer; it is added as an int32 (one IADD3 with the offset), one register per entry. Sums
of integers stay exact in any order, as the 64-bit ones do. The grid form needs what these
stand-ins leave out: the operands scaled so that the grid is fine enough and the sums stay in
range (a per-row power of two from the weight row's and x row's norms: |v| <= |w_b| |x_b|
blocks-wise, Cauchy-Schwarz), and the scale undone in the epilogue. Powers of two are exact, so
the kernel's steps are the same instructions; the stand-ins time that loop, and their values are
not the fixed form's (bench_fx_variants reports them DIFFERENT and times them).

    python3 dev/cuda/fx_grid.py DIR        # writes DIR/grid_int, _smem, _regs, DIR/grid_chain, DIR/grid_step,
                                           # DIR/grid_scaled, DIR/grid_scaled_lazy
    FX_VARIANTS="grid_int=DIR/grid_int grid_int_smem=DIR/grid_int_smem grid_int_regs=DIR/grid_int_regs grid_chain=DIR/grid_chain" \\
        FX_VARIANTS_ARGS="--types Q4_K,Q6_K --ts 8,32,64" bash scripts/device_check.sh --no-tests --fx-variants

grid_int keeps production's choice of where the sums wait (registers; shared memory for Q6_K
past 5 tiles); grid_int_smem keeps them in shared memory past 5 tiles for every type;
grid_int_regs in registers for every type (Q6_K's int32 sums fit there). grid_chain
is grid_int with each block value chained from the FADD's constant instead of from 0: every
step's FFMA then rounds to the grid (exact while the block's partial sums stay under its bound,
which Cauchy-Schwarz gives too), and the block's end takes the bits with no FADD. It rounds each
step, not each block: on SmolLM2's activations 2.4-2.8x the block-rounded grid's error, and
with header bounds as much as the 15-bit activations' own (dev/cuda/grid_precision.py --step 32
--chain). On the H100 it timed within 1% of grid_int (docs/PERFORMANCE.md). grid_step keeps
no block value at all: each step is rounded and added to the int32 sums as it comes (with
exponents from the steps' norms, as precise as the block-rounded grid: grid_precision.py --step
32), one register an entry as in mmq, for more instructions an entry; its sums in registers.
grid_scaled is grid_int with the conversion a real grid form would make: one FFMA of the block
value with the x row's 2^-e_x (shared memory) and the weight row's constant (registers), their
tables stood in for by bytes of x and W, loaded before the walk; grid_scaled_lazy loads them as
the first block begins instead (24th session, H100: slower, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

# sources.CUDA_DIR, found from here: this runs on a fresh device machine before
# scripts/device_check.sh makes `ntx` importable, so it needs nothing but the standard library
CUDA_DIR = Path(__file__).resolve().parents[2] / "daemons" / "compute" / "cuda"

# the grid form's conversion: the block value rounded to the grid by the FADD of 1.5 * 2^23, its
# bits less the constant's; chained (grid_chain), the block value already holds the constant
_FXG_OF = {False: "__device__ __forceinline__ int fxg_of(float v) { return __float_as_int(__fadd_rn(v, 12582912.f)) - 0x4B400000; }",
           True: "__device__ __forceinline__ int fxg_of(float v) { return __float_as_int(v) - 0x4B400000; }  // chained from 1.5 * 2^23"}
# (file, production's text, the stand-in's); each must match production exactly, or the stand-in
# would silently time something else
_SUM_TYPE = ("mmq.cu", "template <> struct MmqSum<true> { typedef long long T; };      // FX: 64-bit fixed point",
             "// the grid form: the block value rounded to the grid, its bits less the constant's\n{fxg_of}\n"
             "template <> struct MmqSum<true> { typedef int T; };  // the grid form: int32 sums")
_MM_VALUE = ("common.cuh", "__device__ __forceinline__ float mm_value(long long s) { return fx_value(s); }",
             "__device__ __forceinline__ float mm_value(long long s) { return fx_value(s); }\n"
             "__device__ __forceinline__ float mm_value(int s) { return __int2float_rn(s); }  // unscaled: timing only")
_PART = ("fixed_point.cu", "long long* __restrict__ part", "int* __restrict__ part")
_SHARED = {True: ("mmq.cu", "{ return QT == 14 && NT > 5; }", "{ return NT > 5; }"),  # every type past 5 tiles
           None: ("mmq.cu", "{ return QT == 14 && NT > 5; }", "{ return false; }")}  # none: all in registers
# (production's text, the stand-in's, how many times production has it) in mmq.cu:
# fx_mmq_kernel and fx_mmqx_kernel add their block values in three places
_BLOCK_ADDS = ("fx_of(bv", "fxg_of(bv", 3)
# the chained grid: the block value starts at the FADD's constant, so that every step's FFMA
# rounds it to the grid itself, and only the bits are left to take at the block's end
_CHAIN_START = ("[nt][3] = 0.f;", "[nt][3] = 12582912.f;", 2)
# the step grid: no block value; each step (a 32-column sub-block's, Q6_K's group of two) is
# rounded by the FADD and added to the int32 sums at once: one register an entry, as mmq's f32
# sum, for a FADD and an IADD3 an entry and step (the block values stay 0 and fold away)
_STEP_CHAINS = (("        auto chain = [&](int mt, int nt) -> float* {\n            if constexpr (FX) return bv[mt][nt];\n"
                 "            else return acc[mt][nt];\n        };",
                 "        auto chain = [&](int mt, int nt) -> T* { return acc[mt][nt]; };  // grid_step: steps into the sums", 1),
                ("        auto chain = [&](int nt) -> float* {\n            if constexpr (FX) return bv[nt];\n"
                 "            else return acc[nt];\n        };",
                 "        auto chain = [&](int nt) -> T* { return acc[nt]; };  // grid_step: steps into the sums", 1),
                ("float* ac = chain(", "T* ac = chain(", 4),
                ("ac[e] = fmaf((e & 1) ? dd.z : dd.x, u, ac[e]);",
                 "if constexpr (FX) ac[e] += fxg_of(((e & 1) ? dd.z : dd.x) * u); "
                 "else ac[e] = fmaf((e & 1) ? dd.z : dd.x, u, ac[e]);", 2))
_STEP_K45 = (re.compile(r"ac\[(\d)\] = fmaf\((s[ab] \* dd\.[xz]), (mmq_t\(c1\[\d\], c2\[\d\]\)), "
                        r"fmaf\((-m[ab]), (dd\.[yw]), ac\[\1\]\)\);"),
             r"if constexpr (FX) ac[\1] += fxg_of(fmaf(\2, \3, \4 * \5)); "
             r"else ac[\1] = fmaf(\2, \3, fmaf(\4, \5, ac[\1]));", 8)


# the scaled grid (grid_scaled): the block grid with the real conversion's operands. The block
# value stays as every kernel computes it now; one FFMA rounds it: fl(v * 2^-e_x + 1.5 * 2^(e_w + 2))
# has ulp 2^(e_w - 21), so its bits less the constant's are v / 2^(e_w + e_x - 21) rounded once
# (the product is exact inside the FFMA). 2^-e_x is the x row's (an entry's column: from shared
# memory, 8 NT of them a CTA), the constant the weight row's (an entry's row: in registers, 2 MT
# a thread, loaded once). The stand-in takes both from bytes that stand for the real tables (a
# byte of each weight row; the exponent bits of each x row's first group factor), so it times
# the loads, the registers and the FFMA, not the values. Left out: the epilogue's scale (one FMUL
# an output) and e_x's computation in fx_quantize.
_FXG_SCALED = ("__device__ __forceinline__ int fxg_of(float v, float sx, float cw) "
               "{ return __float_as_int(fmaf(v, sx, cw)) - __float_as_int(cw); }\n"
               "// stand-ins for the tables: a weight row's constant 1.5 * 2^(e_w + 2), an x row's 2^-e_x\n"
               "__device__ __forceinline__ float fxg_cw(const u8* w, int row, int n_rows, long long row_bytes) "
               "{ return __int_as_float(((130 + (w[(long long)min(row, n_rows - 1) * row_bytes] & 7)) << 23) | 0x400000); }\n"
               "__device__ __forceinline__ float fxg_sx(const float2* xd, int col) "
               "{ return __int_as_float((120 + (__float_as_int(xd[col].x) & 7)) << 23); }")
_SCALED_EDITS = (
    # mmq_body: the tables' stand-ins loaded before the walk
    ("mmq.cu", "    mm_staged_walk<QT, MT>(w, n_rows, row_bytes, blockIdx.x * 16 * MT * WR + 16 * MT * wr, kpart, nparts, n_cols / 256,",
     "    float* fxg_sxs = nullptr;  // grid_scaled: the x rows' 2^-e_x (shared memory, FX's kernels only)\n"
     "    float fxg_cws[MT][2];      // grid_scaled: the thread's weight rows' constants\n"
     "    if constexpr (FX) {\n"
     "        __shared__ float fxg_sx_table[8 * NT];\n"
     "        fxg_sxs = fxg_sx_table;\n"
     "        for (int i = threadIdx.x; i < 8 * NT; i += blockDim.x) fxg_sxs[i] = fxg_sx(xd, i);\n"
     "#pragma unroll\n"
     "        for (int mt = 0; mt < MT; mt++)\n"
     "#pragma unroll\n"
     "            for (int i = 0; i < 2; i++)\n"
     "                fxg_cws[mt][i] = fxg_cw(w, blockIdx.x * 16 * MT * WR + 16 * MT * wr + 16 * mt + gid + 8 * i, n_rows, row_bytes);\n"
     "        __syncthreads();\n"
     "    }\n"
     "    mm_staged_walk<QT, MT>(w, n_rows, row_bytes, blockIdx.x * 16 * MT * WR + 16 * MT * wr, kpart, nparts, n_cols / 256,", 1),
    ("mmq.cu", "+= fxg_of(bv[mt][nt][e]);", "+= fxg_of(bv[mt][nt][e], fxg_sxs[8 * nt + 2 * tig + (e & 1)], fxg_cws[mt][e >> 1]);", 2),
    # mmqx_body: likewise before the first stages are issued
    ("mmq.cu", "    for (int s = 0; s < NS - 1; s++) issue(kpart + s * KS, s);",
     "    for (int s = 0; s < NS - 1; s++) issue(kpart + s * KS, s);\n"
     "    float* fxg_sxs = nullptr;  // grid_scaled: the x rows' 2^-e_x (the walk's first __syncthreads orders it)\n"
     "    float fxg_cws[2];          // grid_scaled: the thread's weight rows' constants\n"
     "    if constexpr (FX) {\n"
     "        __shared__ float fxg_sx_table[8 * NT];\n"
     "        fxg_sxs = fxg_sx_table;\n"
     "        for (int i = tid; i < 8 * NT; i += NTH) fxg_sxs[i] = fxg_sx(xd, i);\n"
     "        fxg_cws[0] = fxg_cw(w, row0 + 16 * warp + gid, n_rows, row_bytes);\n"
     "        fxg_cws[1] = fxg_cw(w, row0 + 16 * warp + gid + 8, n_rows, row_bytes);\n"
     "    }", 1),
    ("mmq.cu", "acc[nt][e] += fxg_of(bv[nt][e]);", "acc[nt][e] += fxg_of(bv[nt][e], fxg_sxs[8 * nt + 2 * tig + (e & 1)], fxg_cws[e >> 1]);", 1))


# grid_scaled_lazy: grid_scaled with mmq_body's tables loaded without holding the walk back (in
# grid_scaled a CTA-wide fill and __syncthreads come before the first stages are issued: +2.7
# points on the 8-row pass): each warp keeps its own copy of the x rows' factors, its lanes load
# them and the row constants into registers as its first block begins (the stages already in
# flight) and store the factors at that block's end, where the conversion first needs them.
_LAZY_MMQ = ("mmq.cu", _SCALED_EDITS[0][1],
             "    float* fxg_sxs = nullptr;  // grid_scaled_lazy: this warp's copy of the x rows' 2^-e_x\n"
             "    float fxg_cws[MT][2];      // the thread's weight rows' constants\n"
             "    float fxg_pre[(8 * NT + 31) / 32];  // this lane's share of the factors, loaded at the first block\n"
             "    bool fxg_first = true;\n"
             "    if constexpr (FX) {\n"
             "        __shared__ float fxg_sx_table[8 * 8 * NT];  // 8 warps at most\n"
             "        fxg_sxs = fxg_sx_table + warp * 8 * NT;\n"
             "    }\n"
             "    mm_staged_walk<QT, MT>(w, n_rows, row_bytes, blockIdx.x * 16 * MT * WR + 16 * MT * wr, kpart, nparts, n_cols / 256,", 1)
_LAZY_LOAD = ("mmq.cu", "        float bv[MT][NT][4];  // FX: the block's values, chained from 0 (unused without FX)\n",
              "        float bv[MT][NT][4];  // FX: the block's values, chained from 0 (unused without FX)\n"
              "        if constexpr (FX) {\n"
              "            if (fxg_first) {\n"
              "#pragma unroll\n"
              "                for (int k = 0; k < (8 * NT + 31) / 32; k++) fxg_pre[k] = lane + 32 * k < 8 * NT ? fxg_sx(xd, lane + 32 * k) : 0.f;\n"
              "#pragma unroll\n"
              "                for (int mt = 0; mt < MT; mt++)\n"
              "#pragma unroll\n"
              "                    for (int i = 0; i < 2; i++)\n"
              "                        fxg_cws[mt][i] = fxg_cw(w, blockIdx.x * 16 * MT * WR + 16 * MT * wr + 16 * mt + gid + 8 * i, n_rows, row_bytes);\n"
              "            }\n"
              "        }\n", 1)
_LAZY_STORE = ("mmq.cu", "        if constexpr (FX) {\n#pragma unroll\n            for (int mt = 0; mt < MT; mt++)\n"
               "#pragma unroll\n                for (int nt = 0; nt < NT; nt++)\n#pragma unroll\n"
               "                    for (int e = 0; e < 4; e++) {\n",
               "        if constexpr (FX) {\n"
               "            if (fxg_first) {\n"
               "#pragma unroll\n"
               "                for (int k = 0; k < (8 * NT + 31) / 32; k++) if (lane + 32 * k < 8 * NT) fxg_sxs[lane + 32 * k] = fxg_pre[k];\n"
               "                __syncwarp();\n"
               "                fxg_first = false;\n"
               "            }\n"
               "#pragma unroll\n            for (int mt = 0; mt < MT; mt++)\n"
               "#pragma unroll\n                for (int nt = 0; nt < NT; nt++)\n#pragma unroll\n"
               "                    for (int e = 0; e < 4; e++) {\n", 1)


def _edit(fname: str, text: str, old: str, new: str, count: int | None = None) -> str:
    """text with old replaced by new, where production has old (``count`` times, if given); stops
    otherwise, naming what moved."""
    n = text.count(old)
    if n == 0 or (count is not None and n != count):
        raise SystemExit(f"fx_grid: {fname} has {old!r} {n} times, not {count or 'any'}; update dev/cuda/fx_grid.py")
    return text.replace(old, new)


def _step_grid(mmq: str) -> str:
    """mmq.cu's text with the step grid's edits (above); stops where production's text moved."""
    for old, new, n in _STEP_CHAINS:
        mmq = _edit("mmq.cu", mmq, old, new, n)
    mmq, n = _STEP_K45[0].subn(_STEP_K45[1], mmq)
    if n != _STEP_K45[2]:
        raise SystemExit(f"fx_grid: mmq.cu has {n} Q4_K/Q5_K steps, not {_STEP_K45[2]}; update dev/cuda/fx_grid.py")
    return mmq


def write_variant(dest: Path, shared_every_type: bool | None, chain: bool = False, step: bool = False,
                  scaled: bool = False, lazy: bool = False) -> Path:
    """One variant folder: production's fixed_point.cu, mmq.cu and headers (every header, so that
    each include finds this folder's copy first: sources.kernel_source looks beside the including
    file), edited. ``shared_every_type``: True, the sums in shared memory past 5 tiles for every
    type; False, production's choice (Q6_K's only); None, in registers for every type.
    ``chain``: the block values chained from the FADD's constant (the chained grid: no FADD a
    block; each step rounds). ``step``: each step rounded and added to the sums, no block value
    (the step grid; with ``shared_every_type`` None). ``scaled``: the block grid's conversion
    with the real operands (_FXG_SCALED); ``lazy``: with ``scaled``, mmq_body's tables loaded as
    grid_scaled_lazy loads them. Returns the folder."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in [*CUDA_DIR.glob("*.cuh"), CUDA_DIR / "mmq.cu", CUDA_DIR / "fixed_point.cu"]:
        shutil.copy(f, dest / f.name)
    sum_type = (_SUM_TYPE[0], _SUM_TYPE[1], _SUM_TYPE[2].replace("{fxg_of}", _FXG_SCALED if scaled else _FXG_OF[chain]))
    for fname, old, new in [sum_type, _MM_VALUE, _PART] + ([_SHARED[shared_every_type]] if shared_every_type is not False else []):
        (dest / fname).write_text(_edit(fname, (dest / fname).read_text(), old, new))
    mmq = _edit("mmq.cu", (dest / "mmq.cu").read_text(), *_BLOCK_ADDS)
    if chain:
        mmq = _edit("mmq.cu", mmq, *_CHAIN_START)
    if scaled:
        for fname, old, new, n in (_LAZY_MMQ, *_SCALED_EDITS[1:]) if lazy else _SCALED_EDITS:
            mmq = _edit(fname, mmq, old, new, n)
        if lazy:
            for fname, old, new, n in (_LAZY_LOAD, _LAZY_STORE):
                mmq = _edit(fname, mmq, old, new, n)
    (dest / "mmq.cu").write_text(_step_grid(mmq) if step else mmq)
    if shared_every_type:
        # production sizes shared sums for Q6_K only (fixed_point.fx_mmq_smem_bytes): Q4_K and
        # Q5_K's 4 int32 entries a thread per 8-row tile of x come on top (bench_fx_variants)
        (dest / "smem_bytes_per_thread_tile").write_text("Q4_K:16 Q5_K:16\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="where the variant folders go")
    a = ap.parse_args(argv)
    for name, shared, chain, step in (("grid_int", False, False, False), ("grid_int_smem", True, False, False),
                                      ("grid_int_regs", None, False, False), ("grid_chain", False, True, False),
                                      ("grid_step", None, False, True)):
        print(write_variant(a.dir / name, shared, chain, step))
    print(write_variant(a.dir / "grid_scaled", False, scaled=True))
    print(write_variant(a.dir / "grid_scaled_lazy", False, scaled=True, lazy=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
