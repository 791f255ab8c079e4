"""The K-quants' products with order-free sums (fixed_point.cu): the batch-invariant mode's
fixed-point form (``KernelOptions.invariant_fixed``).

Why. A row's f32 sum follows the order its steps are added in, so the mode's other forms keep one
kernel's order at every row count and pay where that kernel is slow: mmq at one row (+66%), the
matvec past 8 (+231% at 64; docs/PERFORMANCE.md, "The batch-invariant mode: its cost"). Here
every kernel computes the same f32 value for each 256-column block of a weight row and each row
of x (mmq's per-sub-block steps chained from 0 over the block's 8 sub-blocks) and adds the
values as 64-bit integers in units of 2^-32, exact in any order. So the matvec (up to
``KernelTuning.fx_matvec_rows`` rows) and mmq (from there) give a row the same bits, each in its
own fast order.

  * ``fx_matvec``: up to 8 rows of x as the i16 planes (``matvec.i16_quantize``, or what the
    fused producers write: rmsnorm_q2, swiglu_q2, the attention combine), through the kernel
    the table's ``fx_matvec_kernel`` names: "pieces" (fx_mvq_kernel, the default: the i16
    matvec's launch, pieces and loads, 8 lanes a block whose integer sums meet by shuffles and
    whose block value is chained across them; ``fx_matvec_group`` runs two or three matrices of
    one type in one launch, and it adds into out as the i16 matvec does), "staged"
    (fx_mvs_kernel: a CTA takes 32 weight rows, mmq's staged walk brings their blocks in, a lane
    computes one row's blocks; split-K where the row tiles are few,
    ``KernelTuning.fx_mvs_launch``) or "direct" (fx_mv_kernel: a lane a block, straight from
    global memory). The last two are kept to measure against (dev/cuda/bench_gemm_paths.py).
  * ``fx_mmq``: up to MAX_MM_ROWS rows, mmq's launch with 64-bit sums, on x quantized by
    ``fx_quantize`` (mmq's layout with the i16 planes' group sums: the min term's operand must be
    the same in both kernels).

Range: a block value must stay under 2^31 in magnitude (the conversion saturates past it; a
block of 256 products of |x| < 2^10 and the K-quants' scales stays far below), and a block value
that is NaN adds 0: the mode's results are within nb * 2^-33 of the f32 chain's sum of the same
block values for a row of nb blocks.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import instances
from ntx.daemons.compute.cuda import matvec as mv
from ntx.daemons.compute.cuda import norm_rope_kv as nrk
from ntx.daemons.compute.cuda.mm import mmq_quantize, mmq_supported, mmqx_smem_bytes, staged_smem_bytes
from ntx.daemons.compute.cuda.runtime import (DEFAULT_SMEM_LIMIT, KernelContext, check_f32, function, rows_and_out,
                                              stream_ctx)
from ntx.daemons.compute.cuda.tuning import (FX_LANES_PER_ROW, FX_MVS_MAX_WARPS, MAX_MATVEC_B, MAX_MM_ROWS, MV_MAX_WARPS,
                                             MV_ROWS_PER_CTA, MV_UNROLLS)
from ntx.shared.quant_types import quant_type

__all__ = ["SOURCE", "fx_lanes_per_row", "fx_mvs_smem_bytes", "fx_mmq_shared_sums", "fx_mmq_smem_bytes", "fx_matvec",
           "fx_matvec_pieces", "fx_matvec_group", "fx_matvec_direct", "fx_matvec_staged", "fx_quantize", "fx_mmq"]

SOURCE = "fixed_point.cu"


def fx_mvs_smem_bytes(q, warps: int, B: int) -> int:
    """fx_mvs_kernel's dynamic shared memory: each warp's stages of 32 rows (mmq's walk at MT = 2),
    or the warps' 64-bit sums (warps x 32 rows x B x 8 bytes), whichever is larger."""
    return max(staged_smem_bytes(q, warps, 1), warps * 32 * B * 8)


def fx_mmq_shared_sums(qtype, nt: int) -> bool:
    """Whether fx_mmq_kernel at NT tiles of 8 x rows keeps its 64-bit sums in shared memory while
    it walks the blocks (mmq.cu mmq_fx_shared_sums, which this mirrors: Q6_K past 5 tiles, where
    in registers they left ptxas none to load x ahead with; docs/PERFORMANCE.md)."""
    return int(qtype) == int(QT.Q6_K) and nt > 5


def fx_mmq_smem_bytes(q, warps: int, nt: int) -> int:
    """fx_mmq_kernel's dynamic shared memory: mmq's stages, or its epilogue's 64-bit sums (warps x
    16 rows x 8 NT x 8 bytes), whichever is larger; then, where the kernel keeps its sums in
    shared memory (``fx_mmq_shared_sums``), each thread's 4 NT of them."""
    base = max(staged_smem_bytes(q, warps, nt), warps * 16 * 8 * nt * 8)
    return base + (32 * warps * 4 * nt * 8 if fx_mmq_shared_sums(q.qtype, nt) else 0)


def fx_lanes_per_row(n_cols: int) -> int:
    """fx_mv_kernel's lanes a weight row: the fewest of FX_LANES_PER_ROW that take all of a row's
    256-column blocks at once (32 past 32 blocks: two or more blocks a lane)."""
    nb = n_cols // 256
    return next((t for t in FX_LANES_PER_ROW if nb <= t), FX_LANES_PER_ROW[-1])


def _check(w: Weight, what: str) -> None:
    if not mmq_supported(w.qtype, w.n_cols):
        raise ValueError(f"{what} takes the types mmq takes (Q4_K, Q5_K, Q6_K) at a multiple of 256 columns, "
                         f"not {quant_type(w.qtype).name} rows of {w.n_cols} columns")


def _launch_staged(ctx: KernelContext, kern, grid, warps: int, smem: int, args) -> None:
    if smem > DEFAULT_SMEM_LIMIT and kern.max_dynamic_shared_size_bytes < smem:
        kern.max_dynamic_shared_size_bytes = smem  # a per-function attribute, set once
    ctx.launch(kern, grid, (32 * warps,), args, shared_mem=smem, matmul=True)


def _split_k(ctx: KernelContext, ks: int, B: int, n_rows: int, tiles: int):
    """(64-bit partial sums [ks, B, n_rows], tile counters) of a split-K launch; null pointers
    without split-K. The counters are mmq's and mm's (each launch's last CTA resets its own)."""
    if ks == 1:
        return np.uint64(0), np.uint64(0)
    return (ctx.scratch("fx split-k partials", ks * B * n_rows * 8),
            ctx.scratch("split-k counters", tiles * 4, zero=True))


def fx_matvec(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None, accumulate: bool = False):
    """out[b, r] = sum_c W[r, c] * x[b, c] for up to MAX_MATVEC_B rows of x with fixed-point
    sums: the device table's matvec (``fx_matvec_kernel``: ``fx_matvec_pieces``,
    ``fx_matvec_staged`` or ``fx_matvec_direct``). planes: the i16 planes of this x
    (``matvec.i16_quantize``, or a fused producer's). accumulate: out += the product, the same
    f32 addition as ``add``: in the pieces kernel's epilogue, the others' through a scratch
    product and ``add`` (as ``gemm`` adds off the matvecs)."""
    kind = ctx.tuning().fx_matvec_kernel
    if kind == "pieces":
        return fx_matvec_pieces(ctx, w, x, out, stream=stream, planes=planes, accumulate=accumulate)
    product = fx_matvec_staged if kind == "staged" else fx_matvec_direct
    if not accumulate:
        return product(ctx, w, x, out, stream=stream, planes=planes)
    check_f32("out", out, (x.shape[0], w.n_rows) if x.ndim == 2 else (w.n_rows,))
    with stream_ctx(stream):
        tmp = ctx.scratch("gemm accumulate", out.size * 4).view(cp.float32).reshape(out.shape)
        product(ctx, w, x, tmp, planes=planes)
        return nrk.add(ctx, out, tmp, out=out)


def fx_matvec_pieces(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None,
                     accumulate: bool = False, launch: tuple[int, int, int] | None = None):
    """``fx_matvec`` through fx_mvq_kernel: the i16 matvec's launch (``KernelTuning.fx_mvq``: NR
    rows a CTA, its warps, U pieces a lane) and its pieces, 8 lanes a block; the lanes of a
    sub-block add their integer sums by shuffles and the block value is chained across them.
    accumulate: out += the product, in the kernel's epilogue (the same f32 addition as ``add``).
    launch: (NR, warps, U) instead of the table's (the bits are the same at every launch)."""
    _check(w, "fx_matvec")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "fx_matvec")
    B = x.shape[0]
    nr, nw, u = launch or ctx.tuning().fx_mvq(w.qtype, B, w.n_rows)
    if nr not in MV_ROWS_PER_CTA or u not in MV_UNROLLS or not 1 <= nw <= MV_MAX_WARPS:
        raise ValueError(f"fx_matvec: launch {(nr, nw, u)}, not rows a CTA in {MV_ROWS_PER_CTA}, 1-{MV_MAX_WARPS} "
                         f"warps, pieces a trip in {MV_UNROLLS}")
    names = instances.fx_mvq_names(w.qtype, nr, u)
    with stream_ctx(stream):
        xq1, ds1, xq2, ds2 = planes if planes is not None else mv.i16_quantize(ctx, x)
        ctx.launch(function(SOURCE, names[B - 1], names), (-(-w.n_rows // nr),), (32 * nw,),
                   (w.data, xq1, ds1, xq2, ds2, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes),
                    np.int32(accumulate)))
    return out


def fx_matvec_group(ctx: KernelContext, x, parts, planes, stream=None) -> list:
    """``fx_matvec_pieces`` of x with two or three matrices of one K-quant type (parts: (weight,
    out) each) in one fx_mvqg_kernel launch (mvq2g_kernel's split of the CTAs), each matrix's
    rows the bits ``fx_matvec`` gives them; planes: x's i16 planes. Returns the outs."""
    for w, _ in parts:
        _check(w, "fx_matvec_group")
    qt = parts[0][0].qtype
    if any(w.qtype != qt for w, _ in parts) or not 2 <= len(parts) <= 3:
        raise ValueError("fx_matvec_group takes two or three matrices of one type")
    B = x.shape[0]
    nr, nw, u = ctx.tuning().fx_mvq(qt, B, sum(w.n_rows for w, _ in parts))
    names = instances.fx_mvq_names(qt, nr, u)
    return mv.launch_group(ctx, function(SOURCE, names[MAX_MATVEC_B + B - 1], names), (32 * nw,), nr, x, parts,
                           planes, stream)


def fx_matvec_direct(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None,
                     tpr: int | None = None):
    """``fx_matvec`` through fx_mv_kernel: a lane a 256-column block, ``tpr`` lanes a weight row
    (default fx_lanes_per_row), read straight from global memory."""
    _check(w, "fx_matvec")
    tpr = tpr or fx_lanes_per_row(w.n_cols)
    if tpr not in FX_LANES_PER_ROW:
        raise ValueError(f"fx_matvec: {tpr} lanes a row, not one of {FX_LANES_PER_ROW}")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "fx_matvec")
    B = x.shape[0]
    names = instances.fx_mv_names(w.qtype, tpr)
    with stream_ctx(stream):
        xq1, ds1, xq2, ds2 = planes if planes is not None else mv.i16_quantize(ctx, x)
        ctx.launch(function(SOURCE, names[B - 1], names), (-(-w.n_rows // (256 // tpr)),), (256,),
                   (w.data, xq1, ds1, xq2, ds2, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes)))
    return out


def fx_matvec_staged(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None,
                     warps: int | None = None, splits: int | None = None):
    """``fx_matvec`` through fx_mvs_kernel: a CTA of ``warps`` warps takes 32 weight rows and
    ``splits`` CTAs share their block columns (defaults: the table's ``fx_mvs_launch``); each
    warp stages its block columns as mmq does and each lane computes one row's blocks, every
    lane of a warp on the same columns of x."""
    _check(w, "fx_matvec")
    q = quant_type(w.qtype)
    if warps is not None and not 1 <= warps <= FX_MVS_MAX_WARPS:
        raise ValueError(f"fx_matvec: {warps} warps a CTA, not 1-{FX_MVS_MAX_WARPS}")
    warps, ks = ctx.tuning().fx_mvs_launch(w.n_rows, w.n_cols // 256, warps)
    ks = splits or ks
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "fx_matvec")
    B = x.shape[0]
    tiles = -(-w.n_rows // 32)
    names = instances.fx_mvs_names(w.qtype)
    with stream_ctx(stream):
        xq1, ds1, xq2, ds2 = planes if planes is not None else mv.i16_quantize(ctx, x)
        part, counts = _split_k(ctx, ks, B, w.n_rows, tiles)
        _launch_staged(ctx, function(SOURCE, names[B - 1], names), (tiles, ks), warps, fx_mvs_smem_bytes(q, warps, B),
                       (w.data, xq1, ds1, xq2, ds2, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                        np.int64(w.row_bytes)))
    return out


def fx_quantize(ctx: KernelContext, x, *, stream=None):
    """fx_mmq's activations for x [B, n_cols] (B <= MAX_MM_ROWS, 16-byte aligned):
    ``mm.mmq_quantize``'s layout with the i16 planes' group sums (fx_quantize_mmq_kernel), in
    the context's scratch; pass them as fx_mmq(..., planes=) to every matrix of this x."""
    return mmq_quantize(ctx, x, stream=stream, kernel=(SOURCE, "fx_quantize_mmq_kernel"))


def fx_mmq(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, config=None, planes=None):
    """mmq with fixed-point sums for up to MAX_MM_ROWS rows of x: fx_mmqx_kernel where the
    device's table says (``KernelTuning.mmq_choice``), else fx_mmq_kernel at the device's mmq
    launch or ``config`` (WR, WK, KS). Each row's bits are fx_matvec's of that row alone,
    whatever the kernel and the split of K. planes: ``fx_quantize`` of this x."""
    _check(w, "fx_mmq")
    q = quant_type(w.qtype)
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MM_ROWS, "fx_mmq")
    B = x.shape[0]
    nt = -(-B // 8)
    if config:
        staged_x, (wr, wk, ks), ns = False, config, 0
    else:
        staged_x, wr, wk, ns, ks = ctx.tuning().mmq_choice(w.qtype, B, w.n_rows, w.n_cols // 256)
    if staged_x:  # fx_mmqx_kernel: x staged once per CTA (the same block values)
        names, smem = instances.fx_mmqx_names(w.qtype), mmqx_smem_bytes(q, nt, wr, ns, 8)
    else:
        names, smem = instances.fx_mmq_names(w.qtype), fx_mmq_smem_bytes(q, wr * wk, nt)
    tiles = -(-w.n_rows // (16 * wr))
    with stream_ctx(stream):
        xq, xd = planes if planes is not None else fx_quantize(ctx, x)
        part, counts = _split_k(ctx, ks, B, w.n_rows, tiles)
        _launch_staged(ctx, function(SOURCE, names[nt - 1], names), (tiles, ks), wr * wk, smem,
                       (w.data, xq, xd, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                        np.int64(w.row_bytes), np.int32(B), np.int32(wr)))
    return out
