"""Kernel variants kept for exploration, outside the package: launchers of what the engine never
launches, for the sweeps (bench_gemm_paths.py, bench_matvec.py) and their tests
(test_lab_kernels.py). They take the runtime pieces of ntx (a ``KernelContext``, ``Weight``s)
and the production kernels' sources, so a variant is measured against exactly what production
runs.

  matvec(variant=...)   "v1"/"f32", "v2": the f32 matvec through a layout cut (production
                        takes it only for the float types, cut v1); "dp4a": x quantized to one
                        int8 plane (lab.cu mvq_kernel, ~0.3-0.5% relative: off the CPU
                        reference's tolerances, so never the engine's); "i16": the production
                        i16 product at any launch configuration; "i16s": the i16 product with x
                        staged in shared memory once per CTA (lab.cu mvq2s_kernel).
  mm(staged=...)        the f16 tensor-core matmul of every type mm decodes, the K-quants
                        included: through the shared-memory stage (lab.cu mms_kernel) or read
                        directly (production's mm_kernel at cut v2). Production takes mmq for them.
  mmq(config=...)       the int8 matmul at any (WR, WK, KS, MT), MT = 2 tiles of 16 rows a warp
                        included (production: MT = 1; two tiles lost on most shapes).
  mmq_rows(tile=...)    mmq at one or two rows of x with mmq_kernel's bits (mmq_rows.cu), for the
                        batch-invariant mode's one-row passes; no faster than mmq on the H200.
  gemm_dp4a             gemm with int8 activations: the dp4a matvec in chunks of 8 rows up to 64.
  matvec_rows_split     production's matvec_rows (the i16 matvec's bits at any rows) with K split
                        over 8 warps a CTA in the order's 8-lane subtrees (rows_split.cu); the
                        same bits on an H100, 1.6-5.2x faster than matvec_rows at 1-8 rows but
                        still 2.4-8.8x mmq past 8 (docs/PERFORMANCE.md): not taken to production.
  fx_matvec, fx_matvec_staged, fx_mmq
                        the batch-invariant mode's third road (fixed_point.cu): each 256-column
                        block's value in mmq's f32 steps, then summed as 64-bit fixed point, so
                        the order of the sums cannot change a row's bits: the matvec (1-8 rows;
                        a lane a block straight from global memory, or a lane a row from mmq's
                        staged walk) and mmq (1-64 rows) give a row the same bits while each
                        keeps its own order. Compiled here (NVRTC); not yet run on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import cupy as cp
import numpy as np

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import gemm, instances
from ntx.daemons.compute.cuda import matvec as mv
from ntx.daemons.compute.cuda import mm as tc
from ntx.daemons.compute.cuda.memory import mm_cut, mmq_planes_bytes
from ntx.daemons.compute.cuda.runtime import (DEFAULT_SMEM_LIMIT, KernelContext, check_f32, function, rows_and_out,
                                              sm_count, stream_ctx, tuning)
from ntx.daemons.compute.cuda.tuning import MAX_MATVEC_B, MAX_MM_ROWS, MV_MAX_WARPS, MV_ROWS_PER_CTA, MV_UNROLLS
from ntx.shared.quant_types import quant_type

LAB_SOURCE = Path(__file__).resolve().with_name("lab.cu")
MMQ_ROWS_SOURCE = Path(__file__).resolve().with_name("mmq_rows.cu")
ROWS_SPLIT_SOURCE = Path(__file__).resolve().with_name("rows_split.cu")
FIXED_POINT_SOURCE = Path(__file__).resolve().with_name("fixed_point.cu")
FX_LANES_PER_ROW = (8, 16, 32)  # fx_mv_kernel's TPR: lanes (blocks at once) a weight row
ROWS_SPLIT_WARPS = 8  # rows_split.cu's ROWS_SPLIT_WARPS: the warps of a CTA
ROWS_SPLIT_MAX_NW = 8  # rows_split.cu's ROWS_SPLIT_MAX_NW: the warps per CTA of the order it gives
MMQ_ROWS_MAX_B = 2  # rows of x mmq_rows_kernel takes (its NB)
MMQ_ROWS_TILES = (8, 16, 32)  # weight rows a CTA of mmq_rows_kernel (its R) compile_lab builds
MMQ_ROWS_MAX_SMEM = 227 << 10  # shared memory a CTA may take on sm_90
VARIANTS = ("v1", "v2", "f32", "dp4a", "i16", "i16s")
MMQ_TILES_PER_WARP = (1, 2)  # 16-row tiles one warp of mmq takes (mmq_kernel's MT)


# ------------------------------------------------------------------------------ instantiations
def dp4a_names(qt: int, nr: int, u: int) -> tuple[str, ...]:
    return tuple(f"mvq_kernel<{int(qt)},{b},{nr},{u}>" for b in instances.MATVEC_ROWS)


def i16s_names(qt: int, nr: int, u: int) -> tuple[str, ...]:
    return tuple(f"mvq2s_kernel<{int(qt)},{b},{nr},{u}>" for b in instances.MATVEC_ROWS)


def mms_names(qt: int) -> tuple[str, ...]:
    return tuple(f"mms_kernel<{int(qt)},{nt}>" for nt in instances.MM_TILES)


def mmq_names(qt: int, mt: int) -> tuple[str, ...]:
    return tuple(f"mmq_kernel<{int(qt)},{nt},{mt}>" for nt in instances.MM_TILES)


def rows_split_names(qt: int) -> tuple[str, ...]:
    return (f"mvq2_rows_split_kernel<{int(qt)}>",)


def fx_mv_names(qt: int, tpr: int) -> tuple[str, ...]:
    return tuple(f"fx_mv_kernel<{int(qt)},{b},{tpr}>" for b in instances.MATVEC_ROWS)


def fx_mvs_names(qt: int) -> tuple[str, ...]:
    return tuple(f"fx_mvs_kernel<{int(qt)},{b}>" for b in instances.MATVEC_ROWS)


def fx_mmq_names(qt: int) -> tuple[str, ...]:
    return tuple(f"fx_mmq_kernel<{int(qt)},{nt},1>" for nt in instances.MM_TILES)


def mmq_rows_names(qt: int, tile: int) -> tuple[str, ...]:
    return tuple(f"mmq_rows_kernel<{int(qt)},{b},{tile}>" for b in range(1, MMQ_ROWS_MAX_B + 1))


# ------------------------------------------------------------------------------ the dp4a matvec
def matvec_workspace_bytes(B: int, n_cols: int) -> int:
    """Bytes of the dp4a variant's activation workspace for x [B, n_cols]: int8 x [B, n_cols]
    (rounded up to 256 bytes), then f32 (d, d * sum) pairs [B, n_cols / 32]."""
    return -(-B * n_cols // 256) * 256 + B * (n_cols // 32) * 8


def matvec_workspace(B: int = MAX_MATVEC_B, n_cols: int = 0):
    """A device workspace for matvec(variant="dp4a", xq=) / quantize_x of up to B rows."""
    return cp.empty(matvec_workspace_bytes(B, n_cols), dtype=cp.uint8)


def _xq_views(ws, B: int, n_cols: int):
    need = matvec_workspace_bytes(B, n_cols)
    if not isinstance(ws, cp.ndarray) or ws.dtype != cp.uint8 or not ws.flags.c_contiguous:
        raise TypeError("xq must be a C-contiguous cupy uint8 array (matvec_workspace)")
    if ws.size < need:
        raise ValueError(f"xq holds {ws.size} bytes, x [{B}, {n_cols}] needs {need} (matvec_workspace_bytes)")
    if ws.data.ptr % 256:
        raise ValueError("xq must start on a 256-byte boundary")
    off = -(-B * n_cols // 256) * 256
    return ws[:B * n_cols], ws[off:off + B * (n_cols // 32) * 8]


def _quantize_launch(ctx: KernelContext, x, ws, B: int, n_cols: int):
    xq, ds = _xq_views(ws, B, n_cols)
    n4 = B * n_cols // 4
    ctx.launch(function(LAB_SOURCE, "quantize_x_kernel"), ((n4 + 255) // 256,), (256,), (x, xq, ds, np.int32(n4)))
    return xq, ds


def quantize_x(ctx: KernelContext, x, xq=None, *, stream=None):
    """The dp4a variant's activation quantization: x f32 [B, n_cols] (n_cols a multiple of 32)
    -> (q int8 [B, n_cols], ds f32 [B, n_cols / 32, 2]) views into the workspace xq (a new one
    when None): per group g of 32 columns, d = max|x| / 127, q = round(x / d) in [-127, 127],
    ds[b, g] = (d, d * sum of the group's q)."""
    if x.ndim == 1:
        x = x.reshape(1, -1)
    check_f32("x", x)
    B, n_cols = x.shape
    if n_cols % 32:
        raise ValueError(f"n_cols={n_cols} must be a multiple of 32")
    if x.data.ptr % 16:
        x = x.copy()
    ws = xq if xq is not None else matvec_workspace(B, n_cols)
    with stream_ctx(stream):
        q, ds = _quantize_launch(ctx, x, ws, B, n_cols)
    return q.view(cp.int8).reshape(B, n_cols), ds.view(cp.float32).reshape(B, n_cols // 32, 2)


# ------------------------------------------------------------------------------ the matvec variants
def i16s_stage_bytes(B: int, n_cols: int) -> int:
    """Shared memory of mvq2s_kernel's activation stage for x [B, n_cols]: both int8 planes and
    both (d, d * sum) arrays."""
    return 2 * B * n_cols + 2 * B * (n_cols // 32) * 8


_i16s_max_ctas: dict[tuple, int] = {}


def _i16s_grid(kern, qt: int, B: int, nr: int, nw: int, u: int, n_rows: int, stage: int) -> int:
    """CTAs of an i16s launch: as many as the device holds at once with this stage (occupancy of
    the compiled kernel times the SMs), at most one per row group. Raises the kernel's dynamic
    shared memory limit past the default 48 KiB where the stage needs it; a stage over the
    device's opt-in limit (227 KiB on the H200) is an error (use "i16")."""
    from cupy_backends.cuda.api import driver

    dev = cp.cuda.runtime.getDevice()
    key = (dev, int(qt), B, nr, nw, u, stage)
    max_ctas = _i16s_max_ctas.get(key)
    if max_ctas is None:
        rt = cp.cuda.runtime
        optin = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)
        if stage > optin:
            raise ValueError(f"the i16s matvec stages {stage} bytes of x, over the device's {optin} per CTA; use i16")
        if stage > DEFAULT_SMEM_LIMIT and kern.max_dynamic_shared_size_bytes < stage:
            kern.max_dynamic_shared_size_bytes = stage
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, 32 * nw, stage)
        max_ctas = _i16s_max_ctas[key] = max(1, per_sm) * rt.getDeviceProperties(dev)["multiProcessorCount"]
    return min(-(-n_rows // nr), max_ctas)


def _check_config(config) -> None:
    nr, nw, u = config
    if nr not in MV_ROWS_PER_CTA or not 1 <= nw <= MV_MAX_WARPS or u not in MV_UNROLLS:
        raise ValueError(f"matvec config {tuple(config)}: rows per CTA in {MV_ROWS_PER_CTA}, warps per CTA "
                         f"1..{MV_MAX_WARPS}, pieces per trip in {MV_UNROLLS}")


def matvec(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, variant: str = "i16", config=None, xq=None,
           planes=None):
    """out[b, r] = sum_c W[r, c] * x[b, c] through ``variant`` (the module doc) at ``config``
    (rows per CTA, warps per CTA, pieces per trip; default the device's table: tuning.mv for
    the f32 cuts, tuning.i16 for the integer products). xq: the dp4a workspace (default: the
    context's scratch); planes: the i16 variants' quantized x."""
    q = quant_type(w.qtype)
    qt = int(q.qtype)
    if variant not in VARIANTS:
        raise ValueError(f"unknown matvec variant {variant!r} (one of {', '.join(VARIANTS)})")
    if variant in ("dp4a", "i16", "i16s") and not q.dp4a:
        raise ValueError(f"the {variant} matvec variant does not exist for {q.name}")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "matvec")
    B = x.shape[0]
    if config is not None:
        _check_config(config)
    if variant in ("v1", "v2", "f32"):
        nr, nw, u = config or tuning().mv(q.qtype, B)
        cut = "v2" if variant == "v2" and "v2" in q.cuts and not (q.qtype == 8 and w.n_cols % 64) else "v1"
        names = instances.mv_names(qt, nr, u, cut)
        with stream_ctx(stream):
            ctx.launch(function("matvec.cu", names[B - 1], names), ((w.n_rows + nr - 1) // nr,), (32 * nw,),
                       (w.data, x, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes)))
        return out
    nr, nw, u = config or tuning().i16(q.qtype, B)
    with stream_ctx(stream):
        if variant == "dp4a":
            ws = xq if xq is not None else ctx.scratch("matvec (dp4a) x", matvec_workspace_bytes(B, w.n_cols))
            xqv, ds = _quantize_launch(ctx, x, ws, B, w.n_cols)
            names = dp4a_names(qt, nr, u)
            ctx.launch(function(LAB_SOURCE, names[B - 1], names), ((w.n_rows + nr - 1) // nr,), (32 * nw,),
                       (w.data, xqv, ds, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes)))
            return out
        xq1, ds1, xq2, ds2 = planes if planes is not None else mv.i16_quantize(ctx, x)
        args = (w.data, xq1, ds1, xq2, ds2, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes))
        if variant == "i16":
            names = instances.i16_names(qt, nr, u)
            ctx.launch(function("matvec.cu", names[B - 1], names), ((w.n_rows + nr - 1) // nr,), (32 * nw,),
                       args + (np.int32(0),))
        else:
            names = i16s_names(qt, nr, u)
            kern = function(LAB_SOURCE, names[B - 1], names)
            smem = i16s_stage_bytes(B, w.n_cols)
            grid = _i16s_grid(kern, qt, B, nr, nw, u, w.n_rows, smem)
            ctx.launch(kern, (grid,), (32 * nw,), args, shared_mem=smem)
    return out


# ------------------------------------------------------------------------------ the tensor-core matmuls
def _split_k(ctx: KernelContext, ks: int, B: int, n_rows: int, tiles: int):
    if ks == 1:
        return np.uint64(0), np.uint64(0)
    return (ctx.scratch("split-k partials", ks * B * n_rows * 4),
            ctx.scratch("split-k counters", tiles * 4, zero=True))


def _launch_staged(ctx: KernelContext, kern, grid, warps: int, smem: int, args) -> None:
    if smem > DEFAULT_SMEM_LIMIT and kern.max_dynamic_shared_size_bytes < smem:
        kern.max_dynamic_shared_size_bytes = smem
    ctx.launch(kern, grid, (32 * warps,), args, shared_mem=smem, matmul=True)


def mm(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, config=None, staged: bool = True):
    """The f16 tensor-core matmul (production mm.mm's arithmetic) for every type with an mm cut,
    the K-quants through the shared-memory stage (``staged``: lab.cu mms_kernel) or read
    directly (mm_kernel at cut v2). config: (WR, WK, KS) instead of the device's choice."""
    q = quant_type(w.qtype)
    qt = int(q.qtype)
    cut_steps = mm_cut(q, w.n_cols)
    if cut_steps is None:
        raise ValueError(f"the tensor-core matmul does not decode {q.name} rows of {w.n_cols} columns; use gemm")
    cut, n_steps = cut_steps
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MM_ROWS, "mm")
    B = x.shape[0]
    wr, wk, ks = config or tuning().mm_launch(B, w.n_rows, n_steps)
    tiles, nt = -(-w.n_rows // (16 * wr)), -(-B // 8)
    staged = staged and q.mm_staged and cut == "v2"
    with stream_ctx(stream):
        xs = ctx.scratch("mm x halves", B * w.n_cols * 4)
        n4 = B * w.n_cols // 4
        ctx.launch(function("mm.cu", "mm_split_x_kernel"), ((n4 + 255) // 256,), (256,),
                   (x, xs, np.int32(n4), np.int32(w.n_cols // 4), np.int32(B)))
        part, counts = _split_k(ctx, ks, B, w.n_rows, tiles)
        args = (w.data, xs, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes),
                np.int32(B), np.int32(wr))
        if staged:
            names = mms_names(qt)
            _launch_staged(ctx, function(LAB_SOURCE, names[nt - 1], names), (tiles, ks), wr * wk,
                           tc.staged_smem_bytes(q, wr * wk, nt), args)
        else:
            names = instances.mm_names(qt, cut)
            ctx.launch(function("mm.cu", names[nt - 1], names), (tiles, ks), (32 * wr * wk,), args, matmul=True)
    return out


def mmq(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, config=None, planes=None):
    """The int8 tensor-core matmul (production mm.mmq) at config (WR, WK, KS, MT) instead of the
    device's choice: WR * WK <= 8 warps, MT in (1, 2) tiles of 16 rows per warp (each x
    fragment serves MT tiles)."""
    q = quant_type(w.qtype)
    if not tc.mmq_supported(q.qtype, w.n_cols):
        raise ValueError(f"the int8 tensor-core matmul does not decode {q.name} rows of {w.n_cols} columns; use gemm")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MM_ROWS, "mmq")
    B = x.shape[0]
    wr, wk, ks, mt = config or (*tuning().mmq_launch(B, w.n_rows, w.n_cols // 256 * 8), 1)
    tiles, nt = -(-w.n_rows // (16 * mt * wr)), -(-B // 8)
    names = mmq_names(int(q.qtype), mt)
    with stream_ctx(stream):
        xq, xd = planes if planes is not None else tc.mmq_quantize(ctx, x)
        part, counts = _split_k(ctx, ks, B, w.n_rows, tiles)
        _launch_staged(ctx, function("mmq.cu", names[nt - 1], names), (tiles, ks), wr * wk,
                       tc.staged_smem_bytes(q, wr * wk, nt, mt),
                       (w.data, xq, xd, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                        np.int64(w.row_bytes), np.int32(B), np.int32(wr)))
    return out


def gemm_dp4a(ctx: KernelContext, w: Weight, x, out=None, *, stream=None):
    """gemm with int8 activations where the type has them: the dp4a matvec in chunks of 8 rows
    up to MAX_MM_ROWS, so every row gets the same products whatever the batch size; production
    gemm otherwise."""
    T = x.shape[0]
    if T > MAX_MM_ROWS or not quant_type(w.qtype).dp4a:
        return gemm.gemm(ctx, w, x, out, stream=stream)
    out = out if out is not None else cp.empty((T, w.n_rows), dtype=cp.float32)
    for i in range(0, T, MAX_MATVEC_B):
        j = min(i + MAX_MATVEC_B, T)
        matvec(ctx, w, x[i:j], out[i:j], stream=stream, variant="dp4a")
    return out


def mmq_rows_smem_bytes(q, n_cols: int, B: int, chains: int, tile: int) -> int:
    """Dynamic shared memory of mmq_rows_kernel (mmq_rows.cu): its tile's block headers ([tile]
    [blocks] 16 bytes; Q6_K also a float d each), x's (d2, sum) per group ([B][groups] float2),
    the t values ([B][tile][groups x (2 for Q6_K, else 1) + 1] f32), each chain's sum
    ([chains][B][tile] f32)."""
    q6 = q.block_bytes == 210  # Q6_K: a float d a block, a t value per 16-column half
    groups, blocks = n_cols // 32, n_cols // 256
    return (tile * blocks * (20 if q6 else 16) + 8 * B * groups + 4 * B * tile * (groups * (2 if q6 else 1) + 1)
            + 4 * chains * B * tile)


def mmq_rows(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, tile: int = 16, planes=None):
    """mmq for up to MMQ_ROWS_MAX_B rows of x with mmq_kernel's bits at the device's mmq launch
    (its chains: WK x KS) through mmq_rows_kernel (mmq_rows.cu), ``tile`` weight rows a CTA of
    8 warps. Same arguments as production mm.mmq."""
    q = quant_type(w.qtype)
    if not tc.mmq_supported(q.qtype, w.n_cols):
        raise ValueError(f"mmq_rows does not decode {q.name} rows of {w.n_cols} columns")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MMQ_ROWS_MAX_B, "mmq_rows")
    B = x.shape[0]
    _, wk, ks = tuning().mmq_launch(B, w.n_rows, w.n_cols // 256 * 8)
    names = mmq_rows_names(int(q.qtype), tile)
    smem = mmq_rows_smem_bytes(q, w.n_cols, B, wk * ks, tile)
    if smem > MMQ_ROWS_MAX_SMEM:
        raise ValueError(f"mmq_rows: {tile} rows a CTA of {w.n_cols} columns at B={B} need {smem} bytes of shared "
                         f"memory, over {MMQ_ROWS_MAX_SMEM}; take a smaller tile")
    with stream_ctx(stream):
        xq, xd = planes if planes is not None else tc.mmq_quantize(ctx, x)
        _launch_staged(ctx, function(MMQ_ROWS_SOURCE, names[B - 1], names), (-(-w.n_rows // tile),), 8,
                       smem,
                       (w.data, xq, xd, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes),
                        np.int32(B), np.int32(wk), np.int32(ks)))
    return out


def matvec_rows_split(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None, accumulate: bool = False,
                      nw: int | None = None):
    """Production's ``matvec.matvec_rows`` (same arguments, same bits: each row of x as the i16
    matvec gives it at ``nw`` warps per CTA) through mvq2_rows_split_kernel (rows_split.cu): a CTA
    of ROWS_SPLIT_WARPS warps takes 16 weight rows and 8 rows of x, its warps the order's 4 nw
    8-lane subtrees of K, warp 0 adding them in the order's nesting."""
    q = quant_type(w.qtype)
    if instances.matvec_kind(q) != "i16":
        raise ValueError(f"matvec_rows_split takes the types the i16 matvec takes, not {q.name}")
    nw = nw or ctx.tuning().i16(q.qtype, MAX_MATVEC_B)[1]
    if not 1 <= nw <= ROWS_SPLIT_MAX_NW:
        raise ValueError(f"matvec_rows_split: nw {nw} outside 1-{ROWS_SPLIT_MAX_NW}")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, mv.ROWS_MAX_B, "matvec_rows_split")
    B = x.shape[0]
    names = rows_split_names(int(q.qtype))
    with stream_ctx(stream):
        xq1, ds1, xq2, ds2 = planes if planes is not None else mv.i16_quantize(ctx, x)
        ctx.launch(function(ROWS_SPLIT_SOURCE, names[0], names), (-(-w.n_rows // 16), -(-B // 8)),
                   (32 * ROWS_SPLIT_WARPS,),
                   (w.data, xq1, ds1, xq2, ds2, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes),
                    np.int32(B), np.int32(nw), np.int32(accumulate)))
    return out


# ------------------------------------------------------------------------------ fixed-point sums
def fx_lanes_per_row(n_cols: int) -> int:
    """fx_mv_kernel's lanes a weight row: the fewest of FX_LANES_PER_ROW that take all of a row's
    256-column blocks at once (32 past 32 blocks: two or more blocks a lane)."""
    nb = n_cols // 256
    return next((t for t in FX_LANES_PER_ROW if nb <= t), FX_LANES_PER_ROW[-1])


def _fx_check(q, n_cols: int, what: str) -> None:
    if not tc.mmq_supported(q.qtype, n_cols):
        raise ValueError(f"{what} takes the types mmq takes (Q4_K, Q5_K, Q6_K) at a multiple of 256 columns, "
                         f"not {q.name} rows of {n_cols} columns")


def fx_matvec(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None, tpr: int | None = None):
    """out[b, r] = sum_c W[r, c] * x[b, c] for up to MAX_MATVEC_B rows of x through fx_mv_kernel
    (fixed_point.cu): a lane a 256-column block, ``tpr`` lanes a weight row (default
    fx_lanes_per_row), the blocks' values summed as 64-bit fixed point: each row's bits are
    fx_mmq's for that row at any number of rows. planes: the i16 matvec's planes of this x
    (matvec.i16_quantize, or what production's fused producers write)."""
    q = quant_type(w.qtype)
    _fx_check(q, w.n_cols, "fx_matvec")
    tpr = tpr or fx_lanes_per_row(w.n_cols)
    if tpr not in FX_LANES_PER_ROW:
        raise ValueError(f"fx_matvec: {tpr} lanes a row, not one of {FX_LANES_PER_ROW}")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "fx_matvec")
    B = x.shape[0]
    names = fx_mv_names(int(q.qtype), tpr)
    with stream_ctx(stream):
        xq1, ds1, xq2, ds2 = planes if planes is not None else mv.i16_quantize(ctx, x)
        ctx.launch(function(FIXED_POINT_SOURCE, names[B - 1], names), (-(-w.n_rows // (256 // tpr)),), (256,),
                   (w.data, xq1, ds1, xq2, ds2, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes)))
    return out


FX_MVS_MAX_WARPS = 8  # fx_mvs_kernel's warps a CTA (block columns of 32 rows walked at once)


def fx_mvs_smem_bytes(q, warps: int, B: int) -> int:
    """fx_mvs_kernel's dynamic shared memory: each warp's stages of 32 rows (mmq's walk at MT = 2),
    or the warps' 64-bit sums (warps x 32 rows x B x 8 bytes), whichever is larger."""
    return max(tc.staged_smem_bytes(q, warps, 1), warps * 32 * B * 8)


def fx_mvs_launch(n_rows: int, nb: int, warps: int | None = None) -> tuple[int, int]:
    """fx_mvs_kernel's (warps a CTA, KS) for a matrix of n_rows rows and nb block columns: about
    two CTAs a streaming multiprocessor (split-K where the row tiles are fewer), each warp at
    least two block columns where there are enough, warps fewer before CTAs are (so a small
    matrix is spread over the SMs rather than stacked on a few); ``warps`` given: only KS."""
    tiles = -(-n_rows // 32)
    ks_target = -(-2 * sm_count() // tiles)
    if warps is None:
        warps = max(1, min(FX_MVS_MAX_WARPS, nb // (2 * ks_target)))
    return warps, max(1, min(ks_target, nb // (2 * warps)))


def fx_matvec_staged(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None,
                     warps: int | None = None, splits: int | None = None):
    """fx_matvec's product and bits through fx_mvs_kernel: a CTA of ``warps`` warps takes 32
    weight rows, ``splits`` CTAs share their block columns (defaults: fx_mvs_launch); each warp
    stages its block columns as mmq does and each lane computes one row's blocks, every lane of
    a warp on the same columns of x. planes: the i16 matvec's planes of this x."""
    q = quant_type(w.qtype)
    _fx_check(q, w.n_cols, "fx_matvec_staged")
    if warps is not None and not 1 <= warps <= FX_MVS_MAX_WARPS:
        raise ValueError(f"fx_matvec_staged: {warps} warps a CTA, not 1-{FX_MVS_MAX_WARPS}")
    warps, ks = fx_mvs_launch(w.n_rows, w.n_cols // 256, warps)
    ks = splits or ks
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "fx_matvec_staged")
    B = x.shape[0]
    tiles = -(-w.n_rows // 32)
    names = fx_mvs_names(int(q.qtype))
    with stream_ctx(stream):
        xq1, ds1, xq2, ds2 = planes if planes is not None else mv.i16_quantize(ctx, x)
        if ks == 1:
            part, counts = np.uint64(0), np.uint64(0)
        else:
            part = ctx.scratch("fx split-k partials", ks * B * w.n_rows * 8)
            counts = ctx.scratch("split-k counters", tiles * 4, zero=True)
        _launch_staged(ctx, function(FIXED_POINT_SOURCE, names[B - 1], names), (tiles, ks), warps,
                       fx_mvs_smem_bytes(q, warps, B),
                       (w.data, xq1, ds1, xq2, ds2, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                        np.int64(w.row_bytes)))
    return out


def fx_quantize(ctx: KernelContext, x, *, stream=None):
    """fx_mmq's activations for x [B, n_cols] (B <= MAX_MM_ROWS): mm.mmq_quantize's layout, its
    group sums those of the i16 planes (fx_quantize_mmq_kernel), in the context's scratch."""
    B, n_cols = x.shape
    bp = 8 * -(-B // 8)
    with stream_ctx(stream):
        ws = ctx.scratch("fx mmq x planes", mmq_planes_bytes(B, n_cols))
        xq, xd = ws[:bp * n_cols * 2], ws[bp * n_cols * 2:]
        n4 = bp * n_cols // 4
        ctx.launch(function(FIXED_POINT_SOURCE, "fx_quantize_mmq_kernel"), ((n4 + 255) // 256,), (256,),
                   (x, xq, xd, np.int32(n_cols), np.int32(B), np.int32(bp)))
    return xq, xd


def fx_mmq_smem_bytes(q, warps: int, nt: int) -> int:
    """fx_mmq_kernel's dynamic shared memory: mmq's stages, or its epilogue's 64-bit sums (warps x
    16 rows x 8 NT x 8 bytes), whichever is larger."""
    return max(tc.staged_smem_bytes(q, warps, nt), warps * 16 * 8 * nt * 8)


def fx_mmq(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, config=None, planes=None):
    """mmq with fixed-point sums (fixed_point.cu fx_mmq_kernel) for up to MAX_MM_ROWS rows of x,
    at the device's mmq launch or config (WR, WK, KS): each row's bits are fx_matvec's of that
    row alone, whatever the split of K. planes: fx_quantize of this x."""
    q = quant_type(w.qtype)
    _fx_check(q, w.n_cols, "fx_mmq")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MM_ROWS, "fx_mmq")
    B = x.shape[0]
    wr, wk, ks = config or tuning().mmq_launch(B, w.n_rows, w.n_cols // 256 * 8)
    tiles, nt = -(-w.n_rows // (16 * wr)), -(-B // 8)
    names = fx_mmq_names(int(q.qtype))
    with stream_ctx(stream):
        xq, xd = planes if planes is not None else fx_quantize(ctx, x)
        if ks == 1:
            part, counts = np.uint64(0), np.uint64(0)
        else:
            part = ctx.scratch("fx split-k partials", ks * B * w.n_rows * 8)
            counts = ctx.scratch("split-k counters", tiles * 4, zero=True)
        _launch_staged(ctx, function(FIXED_POINT_SOURCE, names[nt - 1], names), (tiles, ks), wr * wk,
                       fx_mmq_smem_bytes(q, wr * wk, nt),
                       (w.data, xq, xd, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                        np.int64(w.row_bytes), np.int32(B), np.int32(wr)))
    return out
