"""The CPU backend's operations besides the matrix products, numba-compiled.

Why. A decode step of a small model is some 300 operations of a few microseconds of arithmetic
each; as numpy expressions each costs several array allocations and Python calls, which on
SmolLM2 cost more than the products themselves. Here each operation is one compiled call that
writes into the pass's buffers: the residual add and norm, with the int8 rounding of its output
for the products that follow (``cpu_kernels.QuantizedActivations``); RoPE; attention over the
KV pages where they lie (no gathering copy); SwiGLU. The numpy formulas in ``cpu_backend`` stay
as the reference the tests hold these to.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES

from ntx.daemons.compute import cpu_kernels
from ntx.daemons.compute.cpu_kernels import numba

if numba is not None:
    from numba import njit, prange

    # Fast-math without "no NaN/inf": attention masks with -inf, and a NaN must reach the logits.
    _FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
    _JIT = dict(nogil=True, fastmath=_FAST, cache=True, boundscheck=False, error_model="numpy")

    @njit(**_JIT)
    def add_norm_quantize(x, delta, has_delta, w, eps, h, xq, xd, xs):  # pragma: no cover - compiled
        # x: [T, D] (x += delta first when has_delta); h = x / sqrt(mean(x^2) + eps) * w: [T, D];
        # then h rounded to int8 per 32 values -> xq [T, D], xd/xs [T, D/32]
        T, D = x.shape
        for t in range(T):
            ss = np.float32(0.0)
            for i in range(D):
                if has_delta:
                    x[t, i] += delta[t, i]
                ss += x[t, i] * x[t, i]
            r = np.float32(1.0) / np.sqrt(ss / np.float32(D) + np.float32(eps))
            for i in range(D):
                h[t, i] = x[t, i] * r * w[i]
        cpu_kernels.round_rows(h, xq, xd, xs)

    @njit(**_JIT)
    def swiglu_quantize(gate, up, act, xq, xd, xs):  # pragma: no cover - compiled
        # act = silu(gate) * up: [T, F], then rounded to int8 as above
        T, F = gate.shape
        for t in range(T):
            for i in range(F):
                g = gate[t, i]
                act[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]
        cpu_kernels.round_rows(act, xq, xd, xs)

    @njit(**_JIT)
    def rope(x, positions, inv_freq, n_heads, head_dim):  # pragma: no cover - compiled
        # x: [T, n_heads*head_dim] in place; rotate adjacent pairs of the first 2*len(inv_freq)
        # dims of each head by position * inv_freq (angles in float64, as the reference)
        T = x.shape[0]
        half = inv_freq.shape[0]
        for t in range(T):
            for i in range(half):
                theta = np.float64(positions[t]) * inv_freq[i]
                c = np.float32(np.cos(theta))
                s = np.float32(np.sin(theta))
                for h in range(n_heads):
                    j = h * head_dim + 2 * i
                    x0 = x[t, j]
                    x1 = x[t, j + 1]
                    x[t, j] = x0 * c - x1 * s
                    x[t, j + 1] = x0 * s + x1 * c

    def attention(q, out, keys, values, layer, pages, chunk_pages, start_pos, vis, has_vis, n_head, n_head_kv,
                  head_dim, scale):  # pragma: no cover - compiled
        # One chunk of n rows of one sequence. q, out: [n, H*hd]. keys/values: the KV pool,
        # [chunks, L, chunk_pages, Hkv, PAGE, hd]; pages: the sequence's page table. Row i is at
        # cache position start_pos + i and sees [0, start_pos) and, of the chunk's rows, those
        # j <= i (causal) or with vis[i, j] (a tree).
        n = q.shape[0]
        page_tokens = keys.shape[4]
        group = n_head // n_head_kv
        end_pos = start_pos + n
        n_pages = (end_pos + page_tokens - 1) // page_tokens
        for ih in prange(n * n_head):
            i = ih // n_head
            h = ih - i * n_head
            kh = h // group
            qh = q[i, h * head_dim:(h + 1) * head_dim]
            scores = np.empty(n_pages * page_tokens, np.float32)
            best = -np.inf
            for pg in range(n_pages):
                page = pages[pg]
                c = page // chunk_pages
                k = keys[c, layer, page - c * chunk_pages, kh]  # [PAGE, hd]
                for off in range(page_tokens):
                    p = pg * page_tokens + off
                    seen = p < end_pos
                    if seen and p >= start_pos:
                        seen = vis[i, p - start_pos] if has_vis else p - start_pos <= i
                    if not seen:
                        scores[p] = -np.inf
                        continue
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += qh[d] * k[off, d]
                    s *= scale
                    scores[p] = s
                    if s > best:
                        best = s
            acc = np.zeros(head_dim, np.float32)
            total = np.float32(0.0)
            for pg in range(n_pages):
                page = pages[pg]
                c = page // chunk_pages
                v = values[c, layer, page - c * chunk_pages, kh]  # [PAGE, hd]
                for off in range(page_tokens):
                    sc = scores[pg * page_tokens + off]
                    if sc == -np.inf:
                        continue
                    e = np.float32(np.exp(sc - best))
                    total += e
                    for d in range(head_dim):
                        acc[d] += e * v[off, d]
            for d in range(head_dim):
                out[i, h * head_dim + d] = acc[d] / total

    # One build only: the serial and the parallel build of a fast-math loop may round differently,
    # and a row's attention must not depend on its chunk's size (a prompt's last row decoded alone
    # gets the bits it gets in the prompt's pass).
    attention = njit(parallel=True, **_JIT)(attention)

    @njit(**_JIT)
    def kv_store(keys, values, layer, pages, chunk_pages, start_pos, k, v, n_head_kv, head_dim):  # pragma: no cover
        # One chunk's n rows of keys and values k, v [n, Hkv*hd] at cache positions
        # start_pos + i of its sequence (page table ``pages``), in layer ``layer`` of the pool.
        page_tokens = keys.shape[4]
        for i in range(k.shape[0]):
            p = start_pos + i
            page = pages[p // page_tokens]
            c = page // chunk_pages
            off = p - (p // page_tokens) * page_tokens
            for h in range(n_head_kv):
                for d in range(head_dim):
                    keys[c, layer, page - c * chunk_pages, h, off, d] = k[i, h * head_dim + d]
                    values[c, layer, page - c * chunk_pages, h, off, d] = v[i, h * head_dim + d]


def compile_all(head_dim: int = 64) -> None:
    """Compile (or load from numba's cache) every kernel the CPU backend calls, with the argument
    types its passes use, so that no request pays for it (``CpuBackend.warm_up``). The first time
    on a machine this takes a minute or two (LLVM builds every kernel for the host's CPU); then
    numba's on-disk cache (``__pycache__`` beside the modules, or ``$NUMBA_CACHE_DIR``) serves
    them in about a second."""
    ck = cpu_kernels
    rng = np.random.default_rng(0)
    T, K, N = 2, 256, 8
    # a c4 and a c8 matrix with one-level scales, and each with two (the K-quants' int8 scales):
    # each kernel, serial and parallel
    for qt in (ck.QT.Q4_1, ck.QT.Q8_0, ck.QT.Q4_K, ck.QT.Q6_K):
        block_weights, block_bytes = GGML_QUANT_SIZES[qt]
        raw = np.zeros(N * K // block_weights * block_bytes, np.uint8)
        w = ck.pack(raw, qt, N, K)
        x = rng.standard_normal((T, K)).astype(np.float32)
        for threshold in (0, 1 << 62):
            saved, ck.PARALLEL_FROM_MACS = ck.PARALLEL_FROM_MACS, threshold
            try:
                ck.matmul(w, x, np.empty((T, N), np.float32))
                ck.dequantize_rows(w, np.arange(N, dtype=np.int64))
            finally:
                ck.PARALLEL_FROM_MACS = saved
    h = np.ones((T, K), np.float32)
    qx = ck.QuantizedActivations(h, quantize=False)
    for delta in (True, False):
        add_norm_quantize(h, h, delta, np.ones(K, np.float32), 1e-5, h, qx.xq, qx.xd, qx.xs)
    swiglu_quantize(h, h, h, qx.xq, qx.xd, qx.xs)
    inv_freq = np.ones(head_dim // 2, np.float64)
    rope(np.ones((T, 2 * head_dim), np.float32), np.zeros(T, np.int32), inv_freq, 2, head_dim)
    keys, values = (np.zeros((1, 1, 2, 1, 32, head_dim), np.float32) for _ in range(2))
    pages = np.zeros(1, np.int64)
    kv = np.ones((T, head_dim), np.float32)
    kv_store(keys, values, 0, pages, 2, 0, kv, kv, 1, head_dim)
    q = np.ones((T, 2 * head_dim), np.float32)
    for vis in (np.zeros((1, 1), np.bool_), np.ones((T, T), np.bool_)):
        attention(q, np.empty_like(q), keys, values, 0, pages, 2, 0, vis, vis.shape[0] > 1, 2, 1, head_dim,
                  np.float32(0.125))
