"""Matrix-vector products for up to 8 rows of x (matvec.cu), and the i16 activations they read.

out[b, r] = sum_c W[r, c] * x[b, c] for W a ``Weight`` (its GGUF bytes on the device) and x f32
[B, n_cols], B <= 8: the weights are read once for all B rows. The product follows the type:

  * the block-quantized types (QuantType.dp4a): the i16 matvec (mvq2_kernel). x enters as two
    int8 planes, x ~= d * q1 + d2 * q2 per group of 32 columns (d = max|x| / 127, d2 = d / 254:
    the second plane quantizes what the first leaves), each dotted with the weights' integers:
    every element within max|x_group| / 64516 (15 bits), ~2e-5 relative; one read of the
    weights, two dp4a products per piece. The planes come from ``i16_quantize``, or from the
    kernel before the product (the fused norm, swiglu and attention combine write them).
  * the float types (F32, F16, BF16): the f32 matvec (mv_kernel, layout cut v1): f32 arithmetic
    throughout (relative error ~1e-6).

The launch configuration (rows per CTA, warps per CTA, pieces per trip) is the device's table
(tuning.py), chosen once per weight format and B (``matvec_plan``, cached in the context).

``matvec_rows`` gives any number of rows of x the i16 matvec's bits at a given warps per CTA
(matvec_rows.cu, on the int8 tensor cores): the batch-invariant mode's product past 8 rows.
dev/cuda keeps the other variants (other cuts, the one-plane dp4a product, x staged in shared
memory) and their sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import instances
from ntx.daemons.compute.cuda.memory import i16_plane_bytes, i16_planes_bytes
from ntx.daemons.compute.cuda.runtime import KernelContext, function, rows_and_out, stream_ctx
from ntx.daemons.compute.cuda.tuning import MAX_MATVEC_B, ROWS_MAX_WARPS, ROWS_TILES
from ntx.shared.quant_types import quant_type

__all__ = ["MAX_MATVEC_B", "MatvecPlan", "matvec_plan", "matvec", "matvec_i16_group", "matvec_rows", "i16_planes",
           "i16_quantize"]

ROWS_MAX_B = 4096  # rows of x one matvec_rows launch takes (a grid dimension of B / 8 NT WA CTAs)


@dataclass(frozen=True)
class MatvecPlan:
    """How a matvec of B rows runs for one weight format: the i16 or the f32 product, its
    kernel (and the three-matrix kernel of the i16 one), grid, block and rows per CTA."""

    i16: bool
    kern: Any
    group_kern: Any
    grid: tuple[int]
    block: tuple[int]
    rows_per_cta: int


def matvec_plan(ctx: KernelContext, w: Weight, B: int) -> MatvecPlan:
    """The plan of ``w``'s format and shape at B rows, made on first use and kept in ``ctx``."""
    key = ("matvec", w.format_key, B, ctx.batch_invariant)
    plan = ctx.plans.get(key)
    if plan is None:
        q = quant_type(w.qtype)
        qt = int(q.qtype)
        if instances.matvec_kind(q) == "i16":
            nr, nw, u = ctx.tuning().i16(q.qtype, B)
            names = instances.i16_names(qt, nr, u)
            kern = function("matvec.cu", f"mvq2_kernel<{qt},{B},{nr},{u}>", names)
            group = function("matvec.cu", f"mvq2g_kernel<{qt},{B},{nr},{u}>", names)
        else:
            nr, nw, u = ctx.tuning().mv(q.qtype, B)
            kern = function("matvec.cu", instances.mv_names(qt, nr, u)[B - 1], instances.mv_names(qt, nr, u))
            group = None
        plan = ctx.plans[key] = MatvecPlan(instances.matvec_kind(q) == "i16", kern, group,
                                           ((w.n_rows + nr - 1) // nr,), (32 * nw,), nr)
    return plan


def _plane_views(ws, B: int, n_cols: int):
    """(xq, ds) of one plane in ``ws``: int8 [B, n_cols] at 0, (d, d * sum) pairs after it at
    the next 256-byte boundary."""
    if ws.data.ptr % 256:
        raise ValueError("an i16 plane must start on a 256-byte boundary")
    off = -(-B * n_cols // 256) * 256
    return ws[:B * n_cols], ws[off:off + B * (n_cols // 32) * 8]


def i16_planes(ctx: KernelContext, B: int, n_cols: int):
    """The context's i16 activation planes for x [B, n_cols], (xq, ds, xq2, ds2): plane 1 at 0
    of its scratch, plane 2 at ``i16_plane_bytes``. One scratch, reused: each quantization's
    products run before the next one in the stream."""
    ws = ctx.scratch("i16 planes", i16_planes_bytes(B, n_cols))
    off = i16_plane_bytes(B, n_cols)
    return (*_plane_views(ws[:off], B, n_cols), *_plane_views(ws[off:], B, n_cols))


def i16_quantize(ctx: KernelContext, x, *, stream=None):
    """The i16 matvec's activations for x [B, n_cols] (B <= MAX_MATVEC_B, 16-byte aligned):
    quantize_x2_kernel into the context's scratch; pass them as matvec(..., planes=) to every
    matrix that multiplies this x."""
    B, n_cols = x.shape
    n4 = B * n_cols // 4
    with stream_ctx(stream):
        planes = i16_planes(ctx, B, n_cols)
        ctx.launch(function("matvec.cu", "quantize_x2_kernel"), ((n4 + 255) // 256,), (256,), (x, *planes, np.int32(n4)))
        return planes


def matvec(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None, accumulate: bool = False):
    """out[b, r] = sum_c W[r, c] * x[b, c] (see the module doc). x: f32 [B, n_cols] (or
    [n_cols]), B <= 8; out: f32 [B, n_rows] (or [n_rows] for a 1-D x).

    planes: the i16 product's quantized x (``i16_quantize`` of this x), to quantize x once for
      several matrices (``gemm.gemm_group``); then x is not read.
    accumulate: out += the product instead of out = (the i16 product only: a layer's residual
      add fused into its last product; ``gemm.gemm`` does it for every path)."""
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "matvec")
    plan = matvec_plan(ctx, w, x.shape[0])
    if accumulate and not plan.i16:
        raise ValueError("matvec accumulates only on the i16 product; use gemm(accumulate=True)")
    with stream_ctx(stream):
        if plan.i16:
            xq1, ds1, xq2, ds2 = planes if planes is not None else i16_quantize(ctx, x)
            ctx.launch(plan.kern, plan.grid, plan.block, (w.data, xq1, ds1, xq2, ds2, out, np.int32(w.n_rows),
                                                          np.int32(w.n_cols), np.int64(w.row_bytes),
                                                          np.int32(accumulate)))
        else:
            ctx.launch(plan.kern, plan.grid, plan.block, (w.data, x, out, np.int32(w.n_rows), np.int32(w.n_cols),
                                                          np.int64(w.row_bytes)))
    return out


def matvec_i16_group(ctx: KernelContext, x, parts, planes, stream=None) -> list:
    """The i16 products of x with two or three matrices of one format's type (parts: (weight,
    out) each) in one mvq2g_kernel launch, each matrix's rows as ``matvec`` computes them (the
    same launch shape)."""
    plan = matvec_plan(ctx, parts[0][0], x.shape[0])
    return launch_group(ctx, plan.group_kern, plan.block, plan.rows_per_cta, x, parts, planes, stream)


def launch_group(ctx: KernelContext, kern, block, nr: int, x, parts, planes, stream=None) -> list:
    """One launch of a three-matrix i16-planes kernel (mvq2g_kernel, fixed_point.cu's
    fx_mvqg_kernel: matvec.cuh matvec_part) over parts ((weight, out) each, two or three), NR
    rows a CTA; returns the outs."""
    ws, outs, rows, rbs, ends = [], [], [], [], []
    for w, out in parts:
        _, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MATVEC_B, "matvec")
        ws.append(w.data)
        outs.append(out)
        rows.append(w.n_rows)
        rbs.append(w.row_bytes)
        ends.append((ends[-1] if ends else 0) + -(-w.n_rows // nr))
    if len(ws) == 2:  # an unused third segment: no CTA reaches it
        ws.append(ws[0])
        outs.append(outs[0])
        rows.append(0)
        rbs.append(0)
        ends.append(ends[-1])
    xq1, ds1, xq2, ds2 = planes
    args = (*ws, *outs, *(np.int32(r) for r in rows), np.int32(ends[0]), np.int32(ends[1]),
            *(np.int64(rb) for rb in rbs), xq1, ds1, xq2, ds2, np.int32(parts[0][0].n_cols))
    with stream_ctx(stream):
        ctx.launch(kern, (ends[2],), block, args)
    return outs[:len(parts)]


def matvec_rows(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None, accumulate: bool = False,
                nw: int | None = None, nt: int | None = None):
    """out[b, r] = sum_c W[r, c] * x[b, c] for any number of rows of x (up to ROWS_MAX_B; the
    block-quantized types), each row with the bits ``matvec`` gives it at ``nw`` warps per CTA
    (default: the context's table's launch at 8 rows of the type, the one warps-per-CTA of the
    batch-invariant table), alone or beside any other rows: mvq2_rows_kernel, ``nt`` tiles of 8
    rows of x a warp (default the table's rows_nt), up to ROWS_MAX_WARPS warps a CTA over the
    rows of x (they share the CTA's 16 weight rows through L1).

    planes: x's i16 planes (``i16_quantize``), as ``matvec`` takes them; accumulate: out += the
    product, with the bits of matvec(accumulate=True)."""
    key = ("matvec_rows", w.format_key, nw, nt)
    plan = ctx.plans.get(key)
    if plan is None:  # (kernel, tiles, warps), made on first use and kept in ctx as matvec_plan's are
        q = quant_type(w.qtype)
        if instances.matvec_kind(q) != "i16":
            raise ValueError(f"matvec_rows takes the types the i16 matvec takes, not {q.name}")
        tiles = nt or ctx.tuning().rows_nt
        if tiles not in ROWS_TILES:
            raise ValueError(f"matvec_rows: nt must be one of {ROWS_TILES}, not {tiles}")
        qt = int(q.qtype)
        kern = function("matvec_rows.cu", f"mvq2_rows_kernel<{qt},{tiles}>", instances.rows_names(qt))
        plan = ctx.plans[key] = (kern, tiles, nw or ctx.tuning().i16(q.qtype, MAX_MATVEC_B)[1])
    kern, nt, nw = plan
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, ROWS_MAX_B, "matvec_rows")
    B = x.shape[0]
    wa = min(ROWS_MAX_WARPS, -(-B // (8 * nt)))
    with stream_ctx(stream):
        xq1, ds1, xq2, ds2 = planes if planes is not None else i16_quantize(ctx, x)
        ctx.launch(kern, (-(-w.n_rows // 16), -(-B // (8 * nt * wa))), (32 * wa,),
                   (w.data, xq1, ds1, xq2, ds2, out, np.int32(w.n_rows), np.int32(w.n_cols), np.int64(w.row_bytes),
                    np.int32(B), np.int32(nw), np.int32(accumulate)))
    return out
