"""Dequantization of GGUF rows (dequant.cu): a matrix's f16 copy for the cuBLAS path of gemm
beyond the tensor-core matmuls' rows, and the embedding lookup. Each type decodes through the
layout cut of the device's table (tuning.KernelTuning.deq_cut), one thread per piece."""

from __future__ import annotations

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import instances
from ntx.daemons.compute.cuda.runtime import KernelContext, check_i32, function, out_array, ptr_or_null, stream_ctx, tuning
from ntx.shared.quant_types import quant_type

__all__ = ["dequantize_f16", "get_rows"]

# elements per piece (EPB / LPB of quant_traits.cuh QTraits<QT, CUT>) where it is not 8
_ELEMS_PER_PIECE = {(QT.Q4_K, "v1"): 32, (QT.Q5_K, "v1"): 32, (QT.Q6_K, "v1"): 16}


def _deq_launch(ctx: KernelContext, w: Weight, ids, out, n_out_rows: int, out_f32: bool, stream):
    q = quant_type(w.qtype)
    cut = tuning().deq_cut.get(q.qtype, "v1")
    total = n_out_rows * w.n_cols // _ELEMS_PER_PIECE.get((q.qtype, cut), 8)
    if total == 0:
        return out
    blocks = min((total + 255) // 256, 1 << 20)
    names = instances.deq_names(int(q.qtype), cut)
    with stream_ctx(stream):
        ctx.launch(function("dequant.cu", names[int(out_f32)], names), (blocks,), (256,), (
            w.data, ptr_or_null(ids), out, np.int32(n_out_rows), np.int32(w.n_cols), np.int64(w.row_bytes),
            np.int32(w.n_rows)))
    return out


def dequantize_f16(ctx: KernelContext, w: Weight, out=None, *, stream=None):
    """W [n_rows, n_cols] as f16 (dequantized in f32, rounded once to f16)."""
    out = out_array(out, (w.n_rows, w.n_cols), cp.float16)
    return _deq_launch(ctx, w, None, out, w.n_rows, False, stream)


def get_rows(ctx: KernelContext, table: Weight, ids, out=None, *, stream=None):
    """Embedding lookup: out[t, :] = table[ids[t], :] in f32. ids: int32 [T] on the device; out:
    f32 [T, n_cols]. An id outside [0, n_rows) gives a row of NaN."""
    check_i32("ids", ids)
    T = ids.size
    out = out_array(out, (T, table.n_cols), cp.float32)
    return _deq_launch(ctx, table, ids, out, T, True, stream)
