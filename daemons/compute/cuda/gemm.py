"""Matrix products by rows of x: which kernel multiplies a matrix, chosen once per weight format
and row count, and the fused entry points of a layer (a norm or a swiglu and the products of its
output).

``weight`` makes the ``Weight`` every product takes: a matrix's GGUF bytes on the device, its
type, shape and row bytes, checked once (a resident layer when it is prepared, a streamed layer
each pass it arrives). ``gemm`` looks its path up by the weight's format and the rows of x
(``memory.gemm_path``, kept in the context's plans after the first call; the warm-up makes that
call for every bucket before any request):

  * up to MAX_MM_ROWS rows, one capturable launch sequence (no cuBLAS, which cupy cannot
    capture): the K-quants take the int8 tensor-core matmul ``mm.mmq`` from the device's
    mmq_min_rows rows, the other types ``mm.mm`` from mm_min_rows where it decodes them; below
    that (and for F32 and BF16) the matvec (``matvec.py``: the i16 product for block-quantized
    types, ~2e-5, f32 for the float types), in chunks of 8 rows;
  * more rows: ``gemm_dequant`` (an f16 copy of W and cuBLAS), eager passes only.

In the batch-invariant mode (``KernelOptions.batch_invariant``: the context's table is
``tuning.batch_invariant``'s) a format takes one path at every row count
(``memory.invariant_path``): mmq for the K-quants, mm for the other types it decodes, the
matvec for the rest, in chunks of MAX_MM_ROWS (MAX_MATVEC_B) rows beyond those, never cuBLAS,
so that a row's products are the same bits whatever rows share its pass. In its rows form
(``KernelOptions.invariant_rows``) the block-quantized types take the i16 matvec up to 8 rows
and ``matvec.matvec_rows`` (the matvec's order on the tensor cores) past that, in launches of
MAX_MM_ROWS rows. In its fixed form (``KernelOptions.invariant_fixed``) the K-quants' sums are
64-bit fixed point, the same bits in any order (``fixed_point.py``): the fixed-point matvec
("fxmv", on the i16 planes) up to the table's fx_matvec_rows rows, fixed-point mmq ("fxmmq")
past them.

The products of one x — a layer's q, k and v, its gate and up — go through ``gemm_group``,
which quantizes x once for all the products that take the same quantized x, and runs the i16
products of one type as one launch.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import fixed_point as fp
from ntx.daemons.compute.cuda import matvec as mv
from ntx.daemons.compute.cuda import mm as tc
from ntx.daemons.compute.cuda import norm_rope_kv as nrk
from ntx.daemons.compute.cuda.dequant import dequantize_f16
from ntx.daemons.compute.cuda.memory import dequant_chunk_rows, gemm_path
from ntx.daemons.compute.cuda.runtime import KernelContext, aligned_x, check_f32, out_array, stream_ctx
from ntx.daemons.compute.cuda.tuning import MAX_MATVEC_B, MAX_MM_ROWS
from ntx.shared.quant_types import quant_type, row_nbytes

__all__ = ["weight", "path", "takes_i16_planes", "product_of_planes", "gemm", "gemm_dequant", "gemm_group",
           "norm_gemm_group", "swiglu_gemm_add"]

# the paths that read x as the i16 planes: what the fused producers (rmsnorm_q2, swiglu_q2, the
# attention combine) write beside their output, one launch fewer than an op and a quantization
I16_PLANE_PATHS = ("i16", "fxmv")


def weight(raw, qtype, n_rows: int, n_cols: int) -> Weight:
    """The ``Weight`` of W [n_rows, n_cols] stored as ``qtype`` in ``raw`` (a C-contiguous
    uint8 device array of the tensor's GGUF bytes, no repacking), checked once: the row length
    the kernels take, the bytes there, and the alignment their loads need."""
    q = quant_type(qtype)
    col_mult, align = q.kernel_col_multiple, q.kernel_align_bytes
    if not isinstance(raw, cp.ndarray) or raw.dtype != cp.uint8 or not raw.flags.c_contiguous:
        raise TypeError("a weight must be a C-contiguous cupy uint8 array of the tensor's GGUF bytes")
    if n_cols % col_mult:
        raise ValueError(f"{q.name}: n_cols={n_cols} must be a multiple of {col_mult}")
    rb = row_nbytes(q.qtype, n_cols)
    if raw.size < n_rows * rb:
        raise ValueError(f"the weight holds {raw.size} bytes, {q.name} [{n_rows}, {n_cols}] needs {n_rows * rb}")
    if raw.data.ptr % align or rb % align:
        raise ValueError(f"{q.name} weights must start on a {align}-byte boundary (address {raw.data.ptr:#x}, row {rb} B)")
    return Weight(int(q.qtype), int(n_rows), int(n_cols), rb, raw)


def path(ctx: KernelContext, w: Weight, T: int) -> str:
    """The path gemm takes for T rows of x against ``w`` (``memory.gemm_path`` on the device's
    table, or its batch-invariant form), chosen once per format, T and mode and kept in the
    context."""
    key = ("gemm", w.format_key, T, ctx.batch_invariant)
    p = ctx.plans.get(key)
    if p is None:
        p = ctx.plans[key] = gemm_path(quant_type(w.qtype), w.n_cols, T, ctx.tuning())
    return p


def takes_i16_planes(ctx: KernelContext, w: Weight, T: int) -> bool:
    """Whether the product of T rows of x with ``w`` reads x as the i16 planes (I16_PLANE_PATHS),
    so that the kernel making x can write them."""
    return path(ctx, w, T) in I16_PLANE_PATHS


def product_of_planes(ctx: KernelContext, w: Weight, x, out, planes, *, stream=None, accumulate: bool = False):
    """out (+)= x @ W.T from x's i16 planes (made already) on the path of ``w`` at x's rows, one
    of I16_PLANE_PATHS: the i16 matvec or the fixed-point matvec, each accumulating as its
    ``accumulate`` does."""
    if path(ctx, w, x.shape[0]) == "i16":
        return mv.matvec(ctx, w, x, out, stream=stream, planes=planes, accumulate=accumulate)
    return fp.fx_matvec(ctx, w, x, out, stream=stream, planes=planes, accumulate=accumulate)


def gemm(ctx: KernelContext, w: Weight, x, out=None, *, stream=None, accumulate: bool = False):
    """out [T, n_rows] f32 = x [T, n_cols] f32 @ W.T (see the module doc). accumulate: out +=
    x @ W.T, the same f32 addition as a separate add: in the i16 matvec's epilogue, else through
    a scratch product and ``add``."""
    x = aligned_x(x, w.n_cols)
    T = x.shape[0]
    p = path(ctx, w, T)
    if accumulate:
        check_f32("out", out, (T, w.n_rows))
        if p == "i16":
            return mv.matvec(ctx, w, x, out, stream=stream, accumulate=True)
        if p == "rows":
            return _rows(ctx, w, x, out, stream, accumulate=True)
        if p == "fxmv":
            return fp.fx_matvec(ctx, w, x, out, stream=stream, accumulate=True)
        with stream_ctx(stream):
            tmp = ctx.scratch("gemm accumulate", T * w.n_rows * 4).view(cp.float32).reshape(T, w.n_rows)
            gemm(ctx, w, x, tmp, stream=stream)
            return nrk.add(ctx, out, tmp, out=out, stream=stream)
    if p == "dequant":
        return gemm_dequant(ctx, w, x, out, stream=stream)
    if p == "rows":
        return _rows(ctx, w, x, out, stream)
    if p == "fxmv":
        return fp.fx_matvec(ctx, w, x, out, stream=stream)
    if p in ("mmq", "mm", "fxmmq"):
        product = {"mmq": tc.mmq, "mm": tc.mm, "fxmmq": fp.fx_mmq}[p]
        if T <= MAX_MM_ROWS:
            return product(ctx, w, x, out, stream=stream)
        # the batch-invariant mode beyond one launch's rows: chunks, each row as in a narrower pass
        out = out_array(out, (T, w.n_rows), cp.float32)
        for i in range(0, T, MAX_MM_ROWS):
            j = min(i + MAX_MM_ROWS, T)
            product(ctx, w, x[i:j], out[i:j], stream=stream)
        return out
    if T <= MAX_MATVEC_B:
        return mv.matvec(ctx, w, x, out, stream=stream)
    out = out_array(out, (T, w.n_rows), cp.float32)
    for i in range(0, T, MAX_MATVEC_B):
        j = min(i + MAX_MATVEC_B, T)
        mv.matvec(ctx, w, x[i:j], out[i:j], stream=stream)
    return out


def _rows(ctx: KernelContext, w: Weight, x, out, stream, *, planes=None, accumulate: bool = False):
    """The batch-invariant mode past 8 rows: ``matvec.matvec_rows`` in launches of up to
    MAX_MM_ROWS rows (the arena's i16 planes hold that many; a row's bits do not depend on its
    launch). planes: x's, made already (up to MAX_MM_ROWS rows)."""
    T = x.shape[0]
    out = out_array(out, (T, w.n_rows), cp.float32)
    if planes is not None or T <= MAX_MM_ROWS:
        return mv.matvec_rows(ctx, w, x, out, stream=stream, planes=planes, accumulate=accumulate)
    for i in range(0, T, MAX_MM_ROWS):
        j = min(i + MAX_MM_ROWS, T)
        mv.matvec_rows(ctx, w, x[i:j], out[i:j], stream=stream, accumulate=accumulate)
    return out


def gemm_dequant(ctx: KernelContext, w: Weight, x, out=None, *, stream=None):
    """out [T, n_rows] f32 = x [T, n_cols] f32 @ W.T through an f16 copy of W: W dequantized to
    the context's f16 scratch, x rounded to f16, cuBLAS GEMM with f32 accumulation and f32
    output (relative error ~1e-3 from the two f16 roundings). Eager only (cupy cannot capture
    cuBLAS). W is copied and multiplied ``memory.dequant_chunk_rows`` rows at a time (all of
    it where it fits in DEQUANT_W16_BYTES), so that the scratch is not a whole copy of the
    largest matrix: each chunk's rows of out are whole dot products over n_cols, as before."""
    x = aligned_x(x, w.n_cols)
    T = x.shape[0]
    n_rows, n_cols = w.n_rows, w.n_cols
    out = out_array(out, (T, n_rows), cp.float32)
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas

    chunk_rows = dequant_chunk_rows(n_rows, n_cols)
    with stream_ctx(stream):
        w16_all = ctx.scratch("dequant w16", chunk_rows * n_cols * 2).view(cp.float16).reshape(chunk_rows, n_cols)
        x16 = ctx.scratch("dequant x16", T * n_cols * 2).view(cp.float16).reshape(T, n_cols)
        cp.copyto(x16, x, casting="same_kind")
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        one = np.array(1.0, dtype=np.float32)
        zero = np.array(0.0, dtype=np.float32)
        try:
            for r0 in range(0, n_rows, chunk_rows):
                m = min(chunk_rows, n_rows - r0)
                w16 = w16_all[:m]
                part = Weight(w.qtype, m, n_cols, w.row_bytes, w.data.reshape(-1)[r0 * w.row_bytes:(r0 + m) * w.row_bytes])
                dequantize_f16(ctx, part, out=w16)
                # column-major view: out^T [rows r0..r0+m of n_rows, T] = W16^T(op T of [n_cols, m]) @ x16^T [n_cols, T]
                cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, T, n_cols,
                              one.ctypes.data, w16.data.ptr, runtime.CUDA_R_16F, n_cols,
                              x16.data.ptr, runtime.CUDA_R_16F, n_cols,
                              zero.ctypes.data, out.data.ptr + r0 * 4, runtime.CUDA_R_32F, n_rows,
                              cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, mode)
    return out


def gemm_group(ctx: KernelContext, x, parts, *, stream=None, i16_planes=None) -> list:
    """The products of one x [T, K] with several matrices (parts: (weight, out) each, n_cols = K
    for all): each as ``gemm`` computes it, with x quantized once for all the products that take
    the same quantized x (mmq's planes, or the i16 matvec's) instead of once per matrix, and the
    i16 products of one type in one launch (mvq2g_kernel, up to three matrices); returns the
    outs. i16_planes: x's i16 planes, made already (``norm_rope_kv.rmsnorm_i16``)."""
    x = aligned_x(x, parts[0][0].n_cols)
    T = x.shape[0]
    if T > MAX_MM_ROWS and i16_planes is None and any(path(ctx, w, T) in ("mmq", "rows", "fxmmq") for w, _ in parts):
        # the batch-invariant mode beyond one launch's rows: the group chunk by chunk (the
        # planes are made for up to MAX_MM_ROWS rows)
        outs = [out_array(out, (T, w.n_rows), cp.float32) for w, out in parts]
        for i in range(0, T, MAX_MM_ROWS):
            j = min(i + MAX_MM_ROWS, T)
            gemm_group(ctx, x[i:j], [(w, o[i:j]) for (w, _), o in zip(parts, outs)], stream=stream)
        return outs
    shared: dict[str, Any] = {} if i16_planes is None else {"i16": i16_planes}
    outs: list[Any] = [None] * len(parts)
    i16_by_type: dict[int, list[int]] = {}
    for i, (w, out) in enumerate(parts):
        p = path(ctx, w, T)
        if p == "mmq":
            if "mmq" not in shared:
                shared["mmq"] = tc.mmq_quantize(ctx, x, stream=stream)
            outs[i] = tc.mmq(ctx, w, x, out, stream=stream, planes=shared["mmq"])
        elif p == "fxmmq":
            if "fxmmq" not in shared:
                shared["fxmmq"] = fp.fx_quantize(ctx, x, stream=stream)
            outs[i] = fp.fx_mmq(ctx, w, x, out, stream=stream, planes=shared["fxmmq"])
        elif p == "fxmv" and ctx.tuning().fx_matvec_kernel != "pieces":
            if "i16" not in shared:
                shared["i16"] = mv.i16_quantize(ctx, x, stream=stream)
            outs[i] = fp.fx_matvec(ctx, w, x, out, stream=stream, planes=shared["i16"])
        elif p in ("i16", "fxmv"):  # one launch per type: mvq2g_kernel, or fx_mvqg_kernel
            i16_by_type.setdefault((p, w.qtype), []).append(i)
        elif p == "rows":
            if "i16" not in shared:
                shared["i16"] = mv.i16_quantize(ctx, x, stream=stream)
            outs[i] = _rows(ctx, w, x, out, stream, planes=shared["i16"])
        else:
            outs[i] = gemm(ctx, w, x, out, stream=stream)
    for (p, _), members in i16_by_type.items():
        if "i16" not in shared:
            shared["i16"] = mv.i16_quantize(ctx, x, stream=stream)
        one, group = (fp.fx_matvec, fp.fx_matvec_group) if p == "fxmv" else (mv.matvec, mv.matvec_i16_group)
        for c in range(0, len(members), 3):
            chunk = members[c:c + 3]
            if len(chunk) == 1:
                w, out = parts[chunk[0]]
                outs[chunk[0]] = one(ctx, w, x, out, stream=stream, planes=shared["i16"])
            else:
                got = group(ctx, x, [parts[i] for i in chunk], shared["i16"], stream)
                for i, o in zip(chunk, got):
                    outs[i] = o
    return outs


def _fusable(ctx: KernelContext, T: int, width: int, parts, arrays) -> bool:
    """Whether a producer of x [T, width] can write x's i16 planes for ``parts``: some product
    reads them (I16_PLANE_PATHS), the groups of 32 align, and every array is C-contiguous and
    16-byte aligned (float4 accesses)."""
    if width % 32 or T > MAX_MATVEC_B or not any(takes_i16_planes(ctx, w, T) for w, _ in parts):
        return False
    return all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in arrays if a is not None)


def norm_gemm_group(ctx: KernelContext, x, w, eps: float, h, parts, *, residual=None, stream=None) -> list:
    """h = rmsnorm(x, w) (with residual: residual += x first and h its norm, as
    ``norm_rope_kv.rmsnorm``), then ``gemm_group(h, parts)``: where the group takes the i16
    matvec, the norm's kernel also writes h's i16 planes (rmsnorm_q2_kernel), one launch fewer
    than a norm and a quantization."""
    T, D = h.shape
    if _fusable(ctx, T, D, parts, (x, w, h, residual)):
        planes = nrk.rmsnorm_i16(ctx, x, w, eps, residual=residual, out=h, stream=stream)
        return gemm_group(ctx, h, parts, stream=stream, i16_planes=planes)
    nrk.rmsnorm(ctx, x, w, eps, residual=residual, out=h, stream=stream)
    return gemm_group(ctx, h, parts, stream=stream)


def swiglu_gemm_add(ctx: KernelContext, gate, up, act, w: Weight, out, *, stream=None):
    """act = silu(gate) * up [T, F], then out += act @ W.T (``gemm(accumulate=True)``): where that
    reads the i16 planes (the i16 or the fixed-point matvec), the swiglu kernel also writes
    act's planes (swiglu_q2_kernel), one launch fewer than a swiglu and a quantization, with
    the same bits."""
    check_f32("gate", gate)
    check_f32("up", up, gate.shape)
    act = out_array(act, gate.shape, cp.float32)
    T, F = gate.shape
    fused = (F % 32 == 0 and T <= MAX_MATVEC_B and takes_i16_planes(ctx, w, T)
             and all(a.data.ptr % 16 == 0 for a in (gate, up, act)))
    if not fused:
        nrk.swiglu(ctx, gate, up, out=act, stream=stream)
        return gemm(ctx, w, act, out, stream=stream, accumulate=True)
    check_f32("out", out, (T, w.n_rows))
    with stream_ctx(stream):
        planes = nrk.swiglu_i16(ctx, gate, up, act)
        return product_of_planes(ctx, w, act, out, planes, stream=stream, accumulate=True)
