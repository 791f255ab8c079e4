"""The tensor-core matmuls for up to 64 rows of x (mm.cu, mmq.cu): weights read once for all rows.

  * ``mmq`` (the K-quants, MMQ_TYPES: Q4_K, Q5_K, Q6_K, rows of whole 256-column blocks): int8
    mma.sync on the i16 matvec's two planes of x (mmq.cu quantize_mmq_kernel, the arithmetic
    of quant2_group): every element within max|x_group| / 64516 (~2e-5 relative), every integer
    sum exact, scales applied in f32. The same activations as the i16 matvec gemm takes below
    mmq's rows.
  * ``mm`` (the other types ``mm_supported`` names: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16): f16
    mma.sync on an exact split of x (x_hi + x_lo) and the weights' small integers, scales and
    mins in f32: exact to f32 rounding, like the f32 matvec, so which of the two gemm takes for
    a batch size moves no result beyond the last bits.

Each call's launch (warps, split-K, tiles of 8 rows of x) is the device's table (tuning.py),
chosen once per weight format and rows (``mm_plan``, cached in the context). Scratch (x split
or quantized, split-K partial sums, tile counters) comes from the context; a captured call's
must exist before capture (the backend's arena; ``StandaloneScratch`` makes it on the first
eager call). dev/cuda keeps the f16 matmul of the K-quants (direct and shared-memory staged)
and the two-tiles-per-warp mmq, with their sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import instances
from ntx.daemons.compute.cuda.memory import (mm_cut, mm_scratch_bytes, mmq_planes_bytes, mmq_scratch_bytes,
                                             mmqx_smem_bytes, stage_row_bytes)
from ntx.daemons.compute.cuda.runtime import DEFAULT_SMEM_LIMIT, KernelContext, function, rows_and_out, stream_ctx
from ntx.daemons.compute.cuda.tuning import MAX_MM_ROWS
from ntx.shared.quant_types import QUANT_TYPES, QuantType, quant_type

__all__ = ["MAX_MM_ROWS", "MMQ_TYPES", "MM_STAGES", "MmPlan", "mm_plan", "mm", "mm_supported", "mmq", "mmq_supported",
           "mmq_quantize", "mmqx_smem_bytes", "staged_smem_bytes"]

# the types the int8 tensor-core matmul (mmq_kernel) decodes: the K-quants, staged through
# shared memory (QuantType.mm_staged)
MMQ_TYPES = frozenset(q.qtype for q in QUANT_TYPES.values() if q.mm_staged)
MM_STAGES = 4  # tensor_core.cuh MM_STAGES: block columns in flight per warp of the staged kernels


def mm_supported(qtype, n_cols: int) -> bool:
    """Whether the f16 tensor-core matmul (``mm``) takes this type at this row length (the
    K-quants take ``mmq``)."""
    q = quant_type(qtype)
    return not q.mm_staged and mm_cut(q, n_cols) is not None


def mmq_supported(qtype, n_cols: int) -> bool:
    """Whether the int8 tensor-core matmul (``mmq``) decodes this type at this row length."""
    return quant_type(qtype).qtype in MMQ_TYPES and n_cols % 256 == 0


def staged_smem_bytes(q: QuantType, warps: int, nt: int, mt: int = 1) -> int:
    """Dynamic shared memory of the staged kernels: each warp's MM_STAGES / MT stages of 16 MT
    rows (quant_traits.cuh MmStage: a block plus its misalignment, in words, rounded up to 16
    bytes), or the epilogue's reduction (warps x 16 MT rows x 8 NT floats), whichever is larger."""
    return max(warps * MM_STAGES * 16 * stage_row_bytes(q), warps * 16 * mt * 8 * nt * 4)


@dataclass(frozen=True)
class MmPlan:
    """One tensor-core matmul launch for a weight format at B rows of x: the kernel, its grid
    (row tiles, KS) and block, its dynamic shared memory, WR, and the scratch it takes."""

    kern: Any
    grid: tuple[int, int]
    block: tuple[int]
    smem: int
    wr: int
    scratch: dict[str, int]


def mm_plan(ctx: KernelContext, w: Weight, B: int) -> MmPlan:
    """The plan of ``w``'s format and shape at B rows (mmq for the K-quants, else mm), made on
    first use and kept in ``ctx``."""
    key = ("mm", w.format_key, B, ctx.batch_invariant)
    plan = ctx.plans.get(key)
    if plan is None:
        q = quant_type(w.qtype)
        qt, nt = int(q.qtype), -(-B // 8)
        if q.mm_staged:
            if not mmq_supported(qt, w.n_cols):
                raise ValueError(f"the int8 tensor-core matmul does not decode {q.name} rows of {w.n_cols} columns; "
                                 "use gemm")
            staged_x, wr, wk, ns, ks = ctx.tuning().mmq_choice(q.qtype, B, w.n_rows, w.n_cols // 256)
            if staged_x:  # mmqx_kernel: x staged once per CTA of WR warps
                smem = mmqx_smem_bytes(q, nt, wr, ns)
                names = instances.mmqx_names(qt)
                kern = function("mmq.cu", names[nt - 1], names)
            else:
                smem = staged_smem_bytes(q, wr * wk, nt)
                kern = function("mmq.cu", f"mmq_kernel<{qt},{nt},1>", instances.mmq_names(qt))
            tiles = -(-w.n_rows // (16 * wr))
            if smem > DEFAULT_SMEM_LIMIT and kern.max_dynamic_shared_size_bytes < smem:
                kern.max_dynamic_shared_size_bytes = smem  # a per-function attribute, set once
            scratch = mmq_scratch_bytes(w.n_rows, w.n_cols, B, ks, tiles)
        else:
            cut = mm_cut(q, w.n_cols)
            if cut is None:
                raise ValueError(f"the tensor-core matmul does not decode {q.name} rows of {w.n_cols} columns; use gemm")
            wr, wk, ks = ctx.tuning().mm_launch(B, w.n_rows, cut[1])
            tiles = -(-w.n_rows // (16 * wr))
            smem = 0
            names = instances.mm_names(qt, cut[0])
            kern = function("mm.cu", names[nt - 1], names)
            scratch = mm_scratch_bytes(w.n_rows, w.n_cols, B, ks, tiles)
        plan = ctx.plans[key] = MmPlan(kern, (tiles, ks), (32 * wr * wk,), smem, wr, scratch)
    return plan


def _split_k(ctx: KernelContext, plan: MmPlan):
    """(partial sums, tile counters) of a split-K launch; null pointers without split-K."""
    if "split-k partials" not in plan.scratch:
        return np.uint64(0), np.uint64(0)
    return (ctx.scratch("split-k partials", plan.scratch["split-k partials"]),
            ctx.scratch("split-k counters", plan.scratch["split-k counters"], zero=True))


def mm(ctx: KernelContext, w: Weight, x, out=None, *, stream=None):
    """out[b, r] = sum_c W[r, c] * x[b, c] on the f16 tensor cores (see the module doc), for x:
    f32 [B, n_cols] (or [n_cols]), 1 <= B <= MAX_MM_ROWS; out: f32 [B, n_rows] (or [n_rows])."""
    q = quant_type(w.qtype)
    if q.mm_staged:
        raise ValueError(f"the f16 tensor-core matmul takes {q.name} through mmq; use gemm or mmq")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MM_ROWS, "mm")
    B = x.shape[0]
    plan = mm_plan(ctx, w, B)
    with stream_ctx(stream):
        xs = ctx.scratch("mm x halves", plan.scratch["mm x halves"])  # [n_cols / 4, B] uint4
        n4 = B * w.n_cols // 4
        ctx.launch(function("mm.cu", "mm_split_x_kernel"), ((n4 + 255) // 256,), (256,),
                   (x, xs, np.int32(n4), np.int32(w.n_cols // 4), np.int32(B)))
        part, counts = _split_k(ctx, plan)
        ctx.launch(plan.kern, plan.grid, plan.block, (w.data, xs, out, part, counts, np.int32(w.n_rows),
                                                      np.int32(w.n_cols), np.int64(w.row_bytes), np.int32(B),
                                                      np.int32(plan.wr)), matmul=True)
    return out


def mmq_quantize(ctx: KernelContext, x, *, stream=None, kernel: tuple[str, str] = ("mmq.cu", "quantize_mmq_kernel")):
    """mmq's activations for x [B, n_cols] (B <= MAX_MM_ROWS, 16-byte aligned): (xq, xd) of
    quantize_mmq_kernel in the context's scratch; pass them as mmq(..., planes=) to every matrix
    that multiplies this x. kernel: (source, name) of another quantizer of that layout
    (fixed_point.fx_quantize's)."""
    B, n_cols = x.shape
    bp = 8 * -(-B // 8)
    with stream_ctx(stream):
        ws = ctx.scratch("mmq x planes", mmq_planes_bytes(B, n_cols))
        xq, xd = ws[:bp * n_cols * 2], ws[bp * n_cols * 2:]
        n4 = bp * n_cols // 4
        ctx.launch(function(*kernel), ((n4 + 255) // 256,), (256,),
                   (x, xq, xd, np.int32(n_cols), np.int32(B), np.int32(bp)))
    return xq, xd


def mmq(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, planes=None):
    """out[b, r] = sum_c W[r, c] * x[b, c] on the int8 tensor cores (see the module doc), for
    x: f32 [B, n_cols] (or [n_cols]), 1 <= B <= MAX_MM_ROWS; out: f32 [B, n_rows] (or
    [n_rows]). planes: ``mmq_quantize`` of this x, to quantize x once for several matrices
    (``gemm.gemm_group``); then x is not read."""
    q = quant_type(w.qtype)
    if not mmq_supported(q.qtype, w.n_cols):
        raise ValueError(f"the int8 tensor-core matmul does not decode {q.name} rows of {w.n_cols} columns; use gemm")
    x, out = rows_and_out(x, out, w.n_rows, w.n_cols, MAX_MM_ROWS, "mmq")
    B = x.shape[0]
    plan = mm_plan(ctx, w, B)
    with stream_ctx(stream):
        xq, xd = planes if planes is not None else mmq_quantize(ctx, x)
        part, counts = _split_k(ctx, plan)
        ctx.launch(plan.kern, plan.grid, plan.block, (w.data, xq, xd, out, part, counts, np.int32(w.n_rows),
                                                      np.int32(w.n_cols), np.int64(w.row_bytes), np.int32(B),
                                                      np.int32(plan.wr)), shared_mem=plan.smem, matmul=True)
    return out
