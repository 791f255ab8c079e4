"""A layer's operations around its products (norm_rope_kv.cu): rmsnorm, the residual add,
swiglu, rope, and the KV cache's stores and moves; the fused forms that also write the i16
planes of their output (``rmsnorm_i16``, ``swiglu_i16``) or store what they rotate
(``rope_kv_append``).

Every function takes cupy device arrays and an optional ``stream`` (the current stream when
None), launches asynchronously, writes the ``out`` it is given and allocates nothing, so a pass
of them can be captured in a CUDA graph; every position, length and slot index is read from
device memory, so one captured graph replays every decode step once those small arrays change.

KV cache layout (one pair per layer): ``cache_k``, ``cache_v``: f16 [n_slots, n_kv, max_ctx, hd];
a sequence owns one slot; position p of kv-head g of slot s is ``cache[s, g, p, :]``. Shapes: T
tokens, H query heads, n_kv kv heads (H = n_kv * group), hd head dim, D model dim, F feed-forward.
"""

from __future__ import annotations

import threading
from typing import Any

import cupy as cp
import numpy as np

from ntx.daemons.compute.cuda.kv_pages import KvPages
from ntx.daemons.compute.cuda.matvec import i16_planes
from ntx.daemons.compute.cuda.runtime import (KernelContext, check_f32, check_i32, function, out_array, ptr_or_null,
                                              stream_ctx, tuning)
from ntx.daemons.compute.cuda.tuning import MAX_MATVEC_B

__all__ = ["rmsnorm", "rmsnorm_i16", "add", "swiglu", "swiglu_i16", "rope_inv_freq", "rope_qk_inplace", "rope_inplace",
           "kv_append", "rope_kv_append", "kv_move", "qkv_bias_pairs"]

_SOURCE = "norm_rope_kv.cu"


def _kernel(name: str):
    return function(_SOURCE, name)


# ------------------------------------------------------------------------------ norm, add, swiglu
def rmsnorm(ctx: KernelContext, x, w, eps: float, *, residual=None, out=None, stream=None):
    """out = x / sqrt(mean(x^2) + eps) * w, per row. x: f32 [T, D] (or [D]); w: f32 [D].

    With residual (f32, x's shape): residual += x in place first and the norm is taken of the
    updated residual (a decoder layer's fused "h = h + delta; y = norm(h) * w")."""
    check_f32("x", x)
    check_f32("w", w)
    D = x.shape[-1]
    if w.size != D:
        raise ValueError(f"w has {w.size} entries, x rows have {D}")
    if residual is not None:
        check_f32("residual", residual, x.shape)
    out = out_array(out, x.shape, cp.float32)
    T = x.size // D
    if T == 0:
        return out
    block = tuning().rmsnorm_block(D)
    with stream_ctx(stream):
        ctx.launch(_kernel("rmsnorm_kernel"), (T,), (block,), (x, w, out, ptr_or_null(residual), np.int32(D),
                                                               np.float32(eps)))
    return out


def rmsnorm_i16(ctx: KernelContext, x, w, eps: float, *, residual=None, out=None, stream=None):
    """``rmsnorm`` that also quantizes its output for the i16 matvec in the same launch
    (rmsnorm_q2_kernel): returns the planes (as ``matvec.i16_quantize`` of out would, the same
    bits), in the context's scratch. x [T, D] with T <= MAX_MATVEC_B, D a multiple of 32, every
    array 16-byte aligned."""
    check_f32("x", x)
    check_f32("w", w)
    T, D = x.shape
    if w.size != D or D % 32 or T > MAX_MATVEC_B:
        raise ValueError(f"rmsnorm_i16 takes x [T <= {MAX_MATVEC_B}, D % 32 == 0] and w [D]; got {x.shape}, {w.shape}")
    if residual is not None:
        check_f32("residual", residual, x.shape)
    out = out_array(out, x.shape, cp.float32)
    block = tuning().rmsnorm_block(D)
    with stream_ctx(stream):
        planes = i16_planes(ctx, T, D)
        ctx.launch(_kernel("rmsnorm_q2_kernel"), (T,), (block,),
                   (x, w, out, ptr_or_null(residual), *planes, np.int32(D), np.float32(eps)))
    return planes


def _elementwise2(ctx: KernelContext, kernel: str, names: tuple[str, str], a, b, out, stream):
    """out = kernel(a, b), elementwise over f32 arrays of one shape (the grid-stride form)."""
    check_f32(names[0], a)
    check_f32(names[1], b, a.shape)
    out = out_array(out, a.shape, cp.float32)
    n = a.size
    if n:
        with stream_ctx(stream):
            ctx.launch(_kernel(kernel), (min((n + 255) // 256, 1 << 16),), (256,), (a, b, out, np.int64(n)))
    return out


def add(ctx: KernelContext, x, y, out=None, *, stream=None):
    """out = x + y, elementwise (f32, one shape; out may be x or y)."""
    return _elementwise2(ctx, "add_kernel", ("x", "y"), x, y, out, stream)


def swiglu(ctx: KernelContext, gate, up, out=None, *, stream=None):
    """silu(gate) * up, elementwise; gate, up: f32 [T, F]."""
    return _elementwise2(ctx, "swiglu_kernel", ("gate", "up"), gate, up, out, stream)


def swiglu_i16(ctx: KernelContext, gate, up, act):
    """act = silu(gate) * up, and act's i16 planes in the same launch (swiglu_q2_kernel: the bits
    of swiglu and then ``matvec.i16_quantize``), on the current stream; returns the planes, in
    the context's scratch. gate, up, act: f32 [T, F], T <= MAX_MATVEC_B, F a multiple of 32,
    16-byte aligned (checked by the caller, ``gemm.swiglu_gemm_add``)."""
    T, F = gate.shape
    n4 = T * F // 4
    planes = i16_planes(ctx, T, F)
    ctx.launch(_kernel("swiglu_q2_kernel"), ((n4 + 255) // 256,), (256,), (gate, up, act, *planes, np.int32(n4)))
    return planes


# ------------------------------------------------------------------------------ rope
_ROPE_THREADS, _ROPE_PER_THREAD = 256, 4  # norm_rope_kv.cu ROPE_THREADS, ROPE_PER_THREAD


class _RopeFreqs:
    """Per-(device, rope_dim, base, freq_factors) device copies of the pairs' angular speeds
    (``rope_inv_freq``), made on the first eager call and kept: a captured CUDA graph keeps
    pointing at them, and the capture itself must allocate nothing. A cached entry holds the
    freq_factors array it was made from, so its address names that array for the cache's life
    (its values are read once: change them in place and the cache does not see it)."""

    def __init__(self):
        self.arrays: dict[tuple, tuple[Any, Any]] = {}
        self.lock = threading.Lock()

    def get(self, rope_dim: int, base: float, freq_factors):
        ff_key = None if freq_factors is None else (freq_factors.data.ptr, freq_factors.size)
        key = (cp.cuda.runtime.getDevice(), int(rope_dim), float(base), ff_key)
        hit = self.arrays.get(key)
        if hit is not None:
            return hit[0]
        if cp.cuda.get_current_stream().is_capturing():
            raise RuntimeError("rope's frequency table for this (rope_dim, base, freq_factors) does not exist yet, and the "
                               "stream is capturing a CUDA graph: run the same call once eagerly before capture")
        with self.lock:
            hit = self.arrays.get(key)
            if hit is None:
                ff = None if freq_factors is None else cp.asnumpy(freq_factors)
                inv = cp.asarray(rope_inv_freq(rope_dim, base, ff))
                cp.cuda.get_current_stream().synchronize()  # the copy is done before any stream reads it
                hit = self.arrays[key] = (inv, freq_factors)
        return hit[0]


_rope_freqs = _RopeFreqs()


def rope_inv_freq(rope_dim: int, base: float, freq_factors=None) -> np.ndarray:
    """The angular speed of each rotated pair, f64 [rope_dim/2] on the host:
    base^(-2i/rope_dim) / freq_factors[i] (numpy freq_factors f32 [rope_dim/2] or None), as the
    CPU reference (cpu_backend.rope_inv_freq) makes it."""
    inv = float(base) ** (-np.arange(rope_dim // 2, dtype=np.float64) * 2.0 / rope_dim)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float32).astype(np.float64)
    return inv


def _rope_check(name: str, x, positions, rope_dim: int):
    check_f32(name, x)
    if x.ndim != 3:
        raise ValueError(f"{name} must be [T, H, hd]")
    if x.data.ptr % 8:
        raise ValueError(f"{name} must start on an 8-byte boundary (pairs are read as float2)")
    T, _, hd = x.shape
    check_i32("positions", positions, T)
    if rope_dim % 2 or not 0 < rope_dim <= hd:
        raise ValueError(f"rope_dim={rope_dim} must be even and in (0, hd={hd}]")


def rope_qk_inplace(ctx: KernelContext, q, k, positions, rope_dim: int, base: float, freq_factors=None, *,
                    stream=None):
    """Rotary embedding of q and k in place in one launch, llama.cpp NORMAL mode (the GGUF llama
    layout): rotate adjacent pairs (x[2i], x[2i+1]), i < rope_dim/2, by
    theta = pos * base^(-2i/rope_dim) / freq_factors[i], angle and sine/cosine in f64.
    q: f32 [T, Hq, hd]; k: f32 [T, Hk, hd] (same T and hd) or None; positions: int32 [T] on the
    device; freq_factors: f32 [rope_dim/2] on the device or None. Dimensions from rope_dim on are
    left untouched. The pairs' speeds are made once per (rope_dim, base, freq_factors) on the
    host in f64 (``rope_inv_freq``) and kept on the device: the first call of each must be eager
    (not under graph capture)."""
    _rope_check("q", q, positions, rope_dim)
    T, Hq, hd = q.shape
    Hk = 0
    if k is not None:
        _rope_check("k", k, positions, rope_dim)
        if k.shape[0] != T or k.shape[2] != hd:
            raise ValueError(f"k {k.shape} and q {q.shape} differ in T or hd")
        Hk = k.shape[1]
    if freq_factors is not None:
        check_f32("freq_factors", freq_factors, (rope_dim // 2,))
    half = rope_dim // 2
    n_pairs = (Hq + Hk) * half
    if T == 0 or n_pairs == 0:
        return q, k
    with stream_ctx(stream):
        inv = _rope_freqs.get(rope_dim, base, freq_factors)
        per_cta = _ROPE_THREADS * _ROPE_PER_THREAD
        ctx.launch(_kernel("rope_kernel"), (T, -(-n_pairs // per_cta)), (_ROPE_THREADS,), (
            q, ptr_or_null(k), positions, inv, np.int32(Hq), np.int32(Hk), np.int32(hd), np.int32(rope_dim)),
            shared_mem=half * 8)
    return q, k


def rope_inplace(ctx: KernelContext, x, positions, rope_dim: int, base: float, freq_factors=None, *, stream=None):
    """Rotary embedding of one tensor in place (``rope_qk_inplace`` with k = None).
    x: f32 [T, H, hd]; positions: int32 [T] on the device; freq_factors: f32 [rope_dim/2] or None."""
    rope_qk_inplace(ctx, x, None, positions, rope_dim, base, freq_factors, stream=stream)
    return x


# ------------------------------------------------------------------------------ KV pages
def _check_rows(kv: KvPages, layer: int, k, v, T: int) -> None:
    if not 0 <= layer < kv.n_layers:
        raise ValueError(f"layer {layer} outside [0, {kv.n_layers})")
    check_f32("k", k, (T, kv.n_kv, kv.hd))
    check_f32("v", v, (T, kv.n_kv, kv.hd))


def kv_append(ctx: KernelContext, k, v, kv: KvPages, layer: int, slots, positions, *, stream=None):
    """The keys k[t] and values v[t] (f16) at position positions[t] of the sequence of page-table
    row slots[t], in ``layer``'s pages. k, v: f32 [T, n_kv, hd]; slots, positions: int32 [T] on
    the device (decode: one entry per sequence; prefill: one row repeated, consecutive
    positions). Tokens with an out-of-range row or position, or a position without a page, are
    skipped."""
    T = k.shape[0]
    _check_rows(kv, layer, k, v, T)
    check_i32("slots", slots, T)
    check_i32("positions", positions, T)
    total = T * kv.n_kv * kv.hd
    if total == 0:
        return
    with stream_ctx(stream):
        ctx.launch(_kernel("kv_append_kernel"), (min((total + 255) // 256, 1 << 16),), (256,), (
            k, v, kv.k_chunks, kv.v_chunks, kv.page_table, slots, positions, np.int32(T), np.int32(kv.n_kv),
            np.int32(kv.hd), np.int32(kv.max_pages), np.int32(kv.n_rows), np.int32(kv.chunk_pages), np.int32(layer)))


_QKV_THREADS = 128


def qkv_bias_pairs(ctx: KernelContext, q, k, v, bq=None, bk=None, bv=None, rope_dim: int = 0, *, stream=None):
    """A Qwen2 layer's products made ready for rope and the cache, in place, in one launch:
    q, k, v += bq, bk, bv (each None: no bias), then with ``rope_dim`` > 0 each q and k head's
    first rope_dim dims reordered so that dims i and i + rope_dim/2 become the adjacent pair
    (2i, 2i+1): NEOX RoPE (each head's halves rotated against each other) is then the NORMAL
    rotation ``rope_kernel`` and ``rope_kv_kernel`` do, and q and k reordered alike give the
    same attention scores (``Backend.qkv_bias_pairs``). q: f32 [T, Hq, hd]; k, v: f32 [T, Hk, hd];
    bq: f32 [Hq * hd]; bk, bv: f32 [Hk * hd]; all on the device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_f32(name, x)
        if x.ndim != 3:
            raise ValueError(f"{name} must be [T, heads, hd], got {x.shape}")
    T, Hq, hd = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != hd:
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} must share T and hd (k and v one shape)")
    Hk = k.shape[1]
    for name, b, n in (("bq", bq, Hq * hd), ("bk", bk, Hk * hd), ("bv", bv, Hk * hd)):
        if b is not None:
            check_f32(name, b, (n,))
    if not (rope_dim == 0 or (rope_dim % 2 == 0 and 0 < rope_dim <= hd)):
        raise ValueError(f"rope_dim {rope_dim} must be 0 or even and in (0, {hd}]")
    if T == 0 or (rope_dim == 0 and bq is None and bk is None and bv is None):
        return
    with stream_ctx(stream):
        ctx.launch(_kernel("qkv_bias_pairs_kernel"), (T, Hq + 2 * Hk), (_QKV_THREADS,), (
            q, k, v, ptr_or_null(bq), ptr_or_null(bk), ptr_or_null(bv), np.int32(Hq), np.int32(Hk), np.int32(hd),
            np.int32(rope_dim)), shared_mem=hd * 4)


def rope_kv_append(ctx: KernelContext, q, k, v, kv: KvPages, layer: int, positions, slots, cache_positions,
                   rope_dim: int, base: float, freq_factors=None, *, stream=None):
    """``rope_qk_inplace(q, k, positions, ...)`` then ``kv_append(k, v, kv, layer, slots,
    cache_positions)`` in one launch, with the same results bit for bit: a decoder layer's
    rotation and cache store. q: f32 [T, Hq, hd]; k, v: f32 [T, n_kv, hd]; positions (RoPE),
    slots, cache_positions: int32 [T] on the device."""
    _rope_check("q", q, positions, rope_dim)
    T, Hq, _ = q.shape
    _rope_check("k", k, positions, rope_dim)
    _check_rows(kv, layer, k, v, T)
    if q.shape[2] != kv.hd:
        raise ValueError(f"q {q.shape} and the cache's head dim {kv.hd} differ")
    if v.data.ptr % 8:
        raise ValueError("v must start on an 8-byte boundary (pairs are read as float2)")
    check_i32("slots", slots, T)
    check_i32("cache_positions", cache_positions, T)
    if freq_factors is not None:
        check_f32("freq_factors", freq_factors, (rope_dim // 2,))
    n_units = Hq * (rope_dim // 2) + kv.n_kv * (kv.hd // 2)
    if T == 0:
        return
    with stream_ctx(stream):
        inv = _rope_freqs.get(rope_dim, base, freq_factors)
        per_cta = _ROPE_THREADS * _ROPE_PER_THREAD
        ctx.launch(_kernel("rope_kv_kernel"), (T, -(-n_units // per_cta)), (_ROPE_THREADS,), (
            q, k, v, kv.k_chunks, kv.v_chunks, kv.page_table, positions, slots, cache_positions, inv, np.int32(Hq),
            np.int32(kv.n_kv), np.int32(kv.hd), np.int32(rope_dim), np.int32(kv.max_pages), np.int32(kv.n_rows),
            np.int32(kv.chunk_pages), np.int32(layer)), shared_mem=(rope_dim // 2) * 8)


def kv_move(ctx: KernelContext, kv: KvPages, row: int, src_positions, dst_positions, *, stream=None):
    """For every layer, in the sequence of page-table row ``row``: the keys and values at dst[i]
    become those at src[i], for i in increasing order, in one launch. src_positions,
    dst_positions: host ints with dst[i] < src[i], both strictly increasing (so dst[i] may be an
    earlier src[j], never a later one, and moving in order is in place)."""
    src = np.asarray(src_positions, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_positions, dtype=np.int64).reshape(-1)
    if src.size != dst.size:
        raise ValueError(f"kv_move: {src.size} source positions, {dst.size} destinations")
    if not 0 <= row < kv.n_rows:
        raise ValueError(f"kv_move: row {row} outside [0, {kv.n_rows})")
    if src.size == 0:
        return
    if (np.any(np.diff(src) <= 0) or np.any(np.diff(dst) <= 0) or np.any(dst >= src) or dst[0] < 0
            or src[-1] >= kv.max_positions):
        raise ValueError("kv_move: positions must be strictly increasing, each destination below its "
                         f"source, all in [0, {kv.max_positions})")
    with stream_ctx(stream):
        moves = cp.asarray(np.stack([src, dst]).astype(np.int32))  # [2, n]: sources, destinations
        ctx.launch(_kernel("kv_move_kernel"), (kv.n_kv, 2 * kv.n_layers), (min(kv.hd, 256),), (
            kv.k_chunks, kv.v_chunks, kv.page_table, moves[0], moves[1], np.int32(src.size), np.int32(row),
            np.int32(kv.max_pages), np.int32(kv.chunk_pages), np.int32(kv.n_kv), np.int32(kv.hd)))
