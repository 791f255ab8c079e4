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

The fixed-point products (the batch-invariant mode's fixed form) began here and are production's
now: daemons/compute/cuda/fixed_point.py (both matvecs, direct and staged, and mmq).
"""

from __future__ import annotations

from pathlib import Path

import cupy as cp
import numpy as np

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import gemm, instances
from ntx.daemons.compute.cuda import matvec as mv
from ntx.daemons.compute.cuda import mm as tc
from ntx.daemons.compute.cuda.memory import mm_cut
from ntx.daemons.compute.cuda.runtime import (DEFAULT_SMEM_LIMIT, KernelContext, check_f32, function, rows_and_out,
                                              stream_ctx, tuning)
from ntx.daemons.compute.cuda.tuning import MAX_MATVEC_B, MAX_MM_ROWS, MV_MAX_WARPS, MV_ROWS_PER_CTA, MV_UNROLLS
from ntx.shared.quant_types import quant_type

LAB_SOURCE = Path(__file__).resolve().with_name("lab.cu")
MMQ_ROWS_SOURCE = Path(__file__).resolve().with_name("mmq_rows.cu")
ROWS_SPLIT_SOURCE = Path(__file__).resolve().with_name("rows_split.cu")
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
