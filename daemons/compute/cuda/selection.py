"""Selection on the device (selection.cu): argmax, the repetition penalty, and top-k, the
head's reduction of each logit row to what the engine asks for (``backend.Pick``)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ntx.daemons.compute.cuda.runtime import (KernelContext, check_f32, check_i32, function, out_array, ptr_or_null,
                                              sm_count, stream_ctx)

__all__ = ["argmax", "apply_repetition_penalty", "topk"]


def _kernel(name: str):
    return function("selection.cu", name)


def _logits2d(logits):
    check_f32("logits", logits)
    return logits.reshape(1, -1) if logits.ndim == 1 else logits


def argmax(ctx: KernelContext, logits, out=None, *, stream=None):
    """int32 [B]: index of the largest logit per row of f32 [B, V]; ties go to the lowest id."""
    lg = _logits2d(logits)
    B, V = lg.shape
    out = out_array(out, (B,), cp.int32)
    if B:
        with stream_ctx(stream):
            ctx.launch(_kernel("argmax_kernel"), (B,), (1024,), (lg, out, np.int32(V)))
    return out


def apply_repetition_penalty(ctx: KernelContext, logits, history, penalty, *, stream=None):
    """In place on f32 [B, V]: for each distinct id in history[b] (int32 [B, n], entries < 0 are
    padding) logit / p if logit > 0 else logit * p (llama.cpp's rule), p = penalty (a float, or
    f32 [B] on the device)."""
    lg = _logits2d(logits)
    B, V = lg.shape
    if history.ndim == 1:
        history = history.reshape(1, -1)
    check_i32("history", history)
    if history.shape[0] != B:
        raise ValueError(f"history has {history.shape[0]} rows, logits {B}")
    pen_arr = None
    if isinstance(penalty, cp.ndarray):
        check_f32("penalty", penalty, (B,))
        pen_arr, penalty = penalty, 1.0
    if B and history.shape[1]:
        with stream_ctx(stream):
            ctx.launch(_kernel("rep_penalty_kernel"), (B,), (256,), (
                lg, history, np.int32(V), np.int32(history.shape[1]), np.float32(penalty), ptr_or_null(pen_arr)))
    return logits


def _topk_chunks(V: int, k: int, B: int = 1) -> int:
    """Chunks topk splits each of B rows of V into (1: none): the largest divisor of V up to
    64 that leaves chunks of at least max(k, 2048) entries, and keeps B x chunks CTAs within
    about two per SM (one wave). One CTA scans a row several times, so a long row's chunks run
    side by side, then one CTA picks the top k of their candidates."""
    cap = max(1, min(64, 2 * sm_count() // max(1, B)))
    for c in range(cap, 1, -1):
        if V % c == 0 and V // c >= max(k, 2048):
            return c
    return 1


def topk(ctx: KernelContext, logits, k: int, values=None, ids=None, *, stream=None):
    """(values f32 [B, k], ids int32 [B, k]) of the k largest logits per row, best first, ties
    broken by the lower id; k <= 256 and k <= V. Long rows go in two stages (``_topk_chunks``):
    the top k of each chunk, then the top k of those candidates, whose order (chunk by chunk,
    each best first and lower id first) keeps the tie rule. The candidates are small device
    arrays made per call (the head runs outside graphs)."""
    lg = _logits2d(logits)
    B, V = lg.shape
    if not 1 <= k <= min(256, V):
        raise ValueError(f"k={k} must be in [1, min(256, V={V})]")
    values = out_array(values, (B, k), cp.float32)
    ids = out_array(ids, (B, k), cp.int32)
    if not B:
        return values, ids
    kern = _kernel("topk_kernel")
    C = _topk_chunks(V, k, B)
    with stream_ctx(stream):
        if C == 1:
            ctx.launch(kern, (B,), (1024,), (lg, values, ids, np.int32(V), np.int32(k)))
            return values, ids
        n = V // C
        cand_v = cp.empty((B * C, k), dtype=cp.float32)
        cand_i = cp.empty((B * C, k), dtype=cp.int32)
        ctx.launch(kern, (B * C,), (1024,), (lg, cand_v, cand_i, np.int32(n), np.int32(k)))  # rows of [B * C, n]
        cand_i += (cp.arange(B * C, dtype=cp.int32) % C * n)[:, None]  # chunk ids -> row ids
        pos = cp.empty((B, k), dtype=cp.int32)
        ctx.launch(kern, (B,), (1024,), (cand_v, values, pos, np.int32(C * k), np.int32(k)))
        ids[...] = cp.take_along_axis(cand_i.reshape(B, C * k), pos, axis=1)
    return values, ids
