"""Grouped-query attention over the paged f16 KV cache (attention.cu, kv_pages.py), and its
fusion with the product of its output (W_o).

Token trees (speculative decoding verifies a tree of drafted tokens in one pass): attention
takes, per query row, the cache position of its tree's row 0 and a bit mask over the tree's rows
(``pack_tree_mask``); ``norm_rope_kv.kv_move`` then moves the accepted path's keys and values
down to the prefix in every layer at once.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from ntx.daemons.compute.backend import Weight
from ntx.daemons.compute.cuda import gemm as gm
from ntx.daemons.compute.cuda import instances
from ntx.daemons.compute.cuda.matvec import i16_planes
from ntx.daemons.compute.cuda.memory import tree_mask_words
from ntx.daemons.compute.cuda.kv_pages import KvPages
from ntx.daemons.compute.cuda.runtime import KernelContext, check_f32, check_i32, function, out_array, stream_ctx, tuning
from ntx.daemons.compute.cuda.tuning import ATTN_SPLIT_STEP, MAX_MATVEC_B

__all__ = ["attention", "attention_gemm", "attention_gemm_fuses", "attention_splits", "attention_workspace",
           "tree_mask_words", "pack_tree_mask"]

_ATTN_WARPS = ATTN_SPLIT_STEP  # warps per CTA of attn_split_kernel: n_splits is a multiple of it
_ATTN_MAX_SPLITS = 256  # attention.cu ATTN_MAX_SPLITS: attn_combine_kernel's shared arrays


def pack_tree_mask(visible, n_words: int):
    """A tree's visibility (bool [n, n], row j sees row i) as attention's tree_mask rows: uint32
    [n, n_words], bit i % 32 of word i // 32 of row j = visible[j, i]."""
    n = visible.shape[0]
    if n > 32 * n_words:
        raise ValueError(f"a tree of {n} rows needs {tree_mask_words(n)} mask words, not {n_words}")
    bits = np.zeros((n, 32 * n_words), dtype=bool)
    bits[:, :n] = visible
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def attention_splits(T: int, n_kv: int, max_ctx: int, ctx: KernelContext | None = None) -> int:
    """Default number of key splits (a multiple of 4) for attention over T queries: enough
    (query, kv-head, split) warps to fill the device (its tuning entry), at most one split per
    32-key tile; on ``ctx``'s table (the batch-invariant mode: the one-row splits at every T),
    else the device's."""
    return (ctx.tuning() if ctx is not None else tuning()).attn_splits(T, n_kv, max_ctx)


def attention_workspace(T: int, H: int, hd: int, n_splits: int):
    """(part_ml, part_acc) scratch for attention: f32 [T*H*n_splits*2] and [T*H*n_splits*hd]."""
    return cp.empty(T * H * n_splits * 2, dtype=cp.float32), cp.empty(T * H * n_splits * hd, dtype=cp.float32)


def attention(ctx: KernelContext, q, kv: KvPages, layer: int, slots, kv_lens, out=None, *, n_splits=None,
              workspace=None, scale=None, tree_base=None, tree_mask=None, planes=None, stream=None):
    """Grouped-query attention over ``layer``'s f16 KV pages, softmax in f32.

    q: f32 [T, H, hd] (RoPE applied), H = n_kv * group; query t (head h) attends to positions
    [0, kv_lens[t]) of the sequence of page-table row slots[t] through kv-head h // group,
    scaled by 1/sqrt(hd). slots, kv_lens: int32 [T] on the device.
      decode:  T sequences, kv_lens[t] = pos[t] + 1 (after kv_append of this step's k, v);
      prefill: one sequence's chunk of T positions, slots all equal, kv_lens[t] = positions[t] + 1
               (causal within the chunk, the chunk's own keys appended first).
      tree:    with tree_base (int32 [T]) and tree_mask (uint32 [T, W], pack_tree_mask), a row t
               with tree_base[t] >= 0 is a row of a token tree whose row 0 sits at cache position
               tree_base[t]: of the keys in [0, kv_lens[t]) it sees those before tree_base[t] and
               the tree row i (at tree_base[t] + i) where bit i of tree_mask[t] is set (its
               ancestors and itself). Rows with tree_base[t] = -1 keep the rule above. Without
               them the kernel has no mask code at all (a separate instantiation).
               Batch-invariant mode (``ctx.batch_invariant``): a tree row's kv_lens[t] is its
               logical length, its RoPE position + 1 (the keys before tree_base[t], then its
               ancestors and itself), and its keys are taken in its path's order, so that its
               result is the bits a plain row of that path gets (attention.cu, ORDERED TREE).
    out: f32 [T, H, hd]. n_splits: key splits (multiple of 4; default attention_splits); pass the
    same n_splits and a workspace (attention_workspace) to make the call allocation-free. A
    workspace of fewer than T rows (at least one) runs the rows in launches of as many rows as
    it holds: each row's result is the same bits (rows never meet; the batch-invariant mode's
    wide passes, ``memory.attention_rows``).
    planes: ``matvec.i16_planes(ctx, T, H * hd)``, written with out's i16 activations
    (``matvec.i16_quantize`` of out as [T, H * hd], the same bits) by the combine kernel: see
    ``attention_gemm``.
    """
    n_slots, n_kv, max_ctx, hd = kv.n_rows, kv.n_kv, kv.max_positions, kv.hd
    if not 0 <= layer < kv.n_layers:
        raise ValueError(f"layer {layer} outside [0, {kv.n_layers})")
    check_f32("q", q)
    if q.ndim != 3 or q.shape[2] != hd or q.shape[1] % n_kv:
        raise ValueError(f"q must be [T, n_kv*group, {hd}], got {q.shape}")
    T, H, _ = q.shape
    G = H // n_kv
    if hd % 32 or hd > 256 or G * hd > 2048:
        raise ValueError(f"unsupported head dim {hd} / group {G} (hd multiple of 32 <= 256, group*hd <= 2048)")
    check_i32("slots", slots, T)
    check_i32("kv_lens", kv_lens, T)
    tree = tree_base is not None
    if tree != (tree_mask is not None):
        raise ValueError("tree_base and tree_mask go together")
    if tree:
        check_i32("tree_base", tree_base, T)
        if (not isinstance(tree_mask, cp.ndarray) or tree_mask.dtype != cp.uint32 or tree_mask.ndim != 2
                or tree_mask.shape[0] != T or not tree_mask.flags.c_contiguous):
            raise TypeError(f"tree_mask must be a C-contiguous cupy uint32 [{T}, W] array")
    out = out_array(out, (T, H, hd), cp.float32)
    if T == 0:
        return out
    S = n_splits or attention_splits(T, n_kv, max_ctx, ctx)
    if S % _ATTN_WARPS or S > _ATTN_MAX_SPLITS:
        raise ValueError(f"n_splits={S} must be a multiple of {_ATTN_WARPS} up to {_ATTN_MAX_SPLITS}")
    if workspace is None:
        workspace = attention_workspace(T, H, hd, S)
    part_ml, part_acc = workspace
    rows_per_launch = min(T, part_ml.size // (H * S * 2), part_acc.size // (H * S * hd))
    if rows_per_launch < 1 or (rows_per_launch < T and planes is not None):
        raise ValueError("workspace too small for this T, H, hd, n_splits")
    if rows_per_launch < T:  # rows in launches of what the workspace holds (q, out, fields: row slices)
        for i in range(0, T, rows_per_launch):
            j = min(i + rows_per_launch, T)
            attention(ctx, q[i:j], kv, layer, slots[i:j], kv_lens[i:j], out[i:j], n_splits=S, workspace=workspace,
                      scale=scale, tree_base=None if tree_base is None else tree_base[i:j],
                      tree_mask=None if tree_mask is None else tree_mask[i:j], stream=stream)
        return out
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    smem = _ATTN_WARPS * G * hd * 4
    args = (q, kv.k_chunks, kv.v_chunks, kv.page_table, slots, kv_lens, part_ml, part_acc, np.int32(n_slots),
            np.int32(n_kv), np.int32(kv.max_pages), np.int32(kv.chunk_pages), np.int32(layer), np.float32(sc))
    if tree:
        args += (tree_base, tree_mask, np.int32(tree_mask.shape[1]))
    names = instances.attn_names(G, hd)
    # tree rows: masked in place, or in the batch-invariant mode in their paths' order (kv_lens logical)
    kind = (2 if ctx.batch_invariant else 1) if tree else 0
    kern, grid_splits = function("attention.cu", names[kind], names), S
    if ctx.batch_invariant:  # the one-row splits, walked by the warps the default launches for T rows
        grid_splits = min(S, ctx.tuning().attn_grid_splits(T, n_kv, max_ctx))
        if grid_splits < S:
            walk = instances.attn_walk_names(G, hd)
            kern, args = function("attention.cu", walk[kind // 2], walk), args + (np.int32(S),)
    with stream_ctx(stream):
        ctx.launch(kern, (grid_splits // _ATTN_WARPS, n_kv, T), (32 * _ATTN_WARPS,), args, shared_mem=smem)
        # the combine reads only the splits the row's length uses (kv_lens, slots as above)
        ctx.launch(function("attention.cu", "attn_combine_kernel"), (H, T), (min(hd, 256),), (
            part_ml, part_acc, out, np.int32(H), np.int32(S), np.int32(hd), slots, kv_lens, np.int32(n_slots),
            np.int32(max_ctx), *(planes if planes is not None else (np.uint64(0),) * 4)))
    return out


def attention_gemm_fuses(ctx: KernelContext, T: int, w: Weight) -> bool:
    """Whether ``attention_gemm`` of T rows by ``w`` is one fused operation (the product reads the
    i16 planes: the i16 or the fixed-point matvec) rather than an attention and then a gemm."""
    return w.n_cols % 32 == 0 and T <= MAX_MATVEC_B and gm.takes_i16_planes(ctx, w, T)


def attention_gemm(ctx: KernelContext, q, kv: KvPages, layer: int, slots, kv_lens, attn, w: Weight, out, *,
                   n_splits=None, workspace=None, tree_base=None, tree_mask=None, stream=None):
    """attn = attention(q, ...) [T, H, hd], then out = attn @ W.T [T, n_rows] (n_cols = H * hd):
    where that product reads the i16 planes, attention's combine kernel also writes attn's planes,
    one launch fewer than an attention and a quantization, with the same bits."""
    T, H, hd = q.shape
    if w.n_cols != H * hd:
        raise ValueError(f"attention_gemm: W has {w.n_cols} columns for an attention output of {H}x{hd}")
    attn = out_array(attn, (T, H, hd), cp.float32)
    fused = attention_gemm_fuses(ctx, T, w) and attn.data.ptr % 16 == 0
    with stream_ctx(stream):
        planes = i16_planes(ctx, T, w.n_cols) if fused else None
        attention(ctx, q, kv, layer, slots, kv_lens, attn, n_splits=n_splits, workspace=workspace,
                  tree_base=tree_base, tree_mask=tree_mask, planes=planes)
        x = attn.reshape(T, w.n_cols)
        if not fused:
            return gm.gemm(ctx, w, x, out)
        return gm.product_of_planes(ctx, w, x, out, planes)
