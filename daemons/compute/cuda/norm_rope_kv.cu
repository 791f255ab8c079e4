// A layer's operations around its matrix products: rmsnorm (and the fused norm that also writes
// the i16 planes of its output), the residual add, swiglu (and its fused i16 form), rope, the KV
// cache stores (kv_append, the fused rope_kv) and moves (kv_move). Launched by norm_rope_kv.py;
// compiled by NVRTC at run time, common.cuh inlined (sources.py).
//
// KV cache: pages (kv_pages.cuh); a row's sequence is `slots[t]`, its page table's row.
// Every position, length and slot index is read from device memory, so a captured CUDA graph
// replays unchanged for the next step once those small arrays have been updated.

#include "common.cuh"
#include "kv_pages.cuh"

// ------------------------------------------------------------------------------- rmsnorm
// x: [T, D], w: [D], out: [T, D]. If residual != 0: residual += x (in place), and the norm is
// taken of the updated residual (the fused "h = h + delta; y = norm(h) * w" of a decoder layer).
extern "C" __global__ void rmsnorm_kernel(const float* x, const float* __restrict__ w,
                                          float* __restrict__ out, float* __restrict__ residual,
                                          int D, float eps) {
    pdl_enter();
    const long long base = (long long)blockIdx.x * D;
    const float r = rms_scale(x, residual, base, D, eps);
    const float* src = residual ? residual : x;
    for (int i = threadIdx.x; i < D; i += blockDim.x) out[base + i] = src[base + i] * r * w[i];
}

// rmsnorm_kernel and then quantize_x2_kernel of its output, in one launch: out = the
// norm of x (or of residual += x), written as f32 and as the i16 matvec's two planes, laid out
// as quantize_x2_kernel lays them. The sum of squares is rmsnorm_kernel's (same threads, same
// order) and each output element the same product, so out and the planes are the bits the two
// kernels made. grid T rows, block a multiple of 32 (<= 1024); D a multiple of 32; x, out,
// residual and w 16-byte aligned.
extern "C" __global__ void rmsnorm_q2_kernel(const float* x, const float* __restrict__ w, float* out,
                                             float* residual, u32* xq, float2* ds, u32* xq2, float2* ds2,
                                             int D, float eps) {
    pdl_enter();
    const long long base = (long long)blockIdx.x * D;
    const float r = rms_scale(x, residual, base, D, eps);
    const float* src = residual ? residual : x;
    const int D4 = D >> 2;
    for (int i0 = 0; i0 < D4; i0 += blockDim.x) {  // every thread every trip: quant2_group's shuffles
        const int i4 = i0 + threadIdx.x;
        const bool ok = i4 < D4;  // D4 is a multiple of 8: a group is all in or all out
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (ok) {
            const float4 a = *(const float4*)(src + base + 4 * i4);
            const float4 g = *(const float4*)(w + 4 * i4);
            v = make_float4(a.x * r * g.x, a.y * r * g.y, a.z * r * g.z, a.w * r * g.w);
            *(float4*)(out + base + 4 * i4) = v;
        }
        quant2_store(v, ok, (long long)blockIdx.x * D4 + i4, xq, ds, xq2, ds2);  // D4 % 8 == 0: groups align
    }
}

// ------------------------------------------------------------------------------- add
// out = x + y elementwise (out may be x or y): the residual add, with programmatic launch
// (cupy's own elementwise kernel has none, and broke the pass's chain of early launches).
extern "C" __global__ void add_kernel(const float* x, const float* y, float* out, long long n) {
    pdl_enter();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = x[i] + y[i];
}

// ------------------------------------------------------------------------------- swiglu
extern "C" __global__ void swiglu_kernel(const float* gate, const float* up,
                                         float* __restrict__ out, long long n) {
    pdl_enter();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.f + __expf(-g)) * up[i];
    }
}

// swiglu_kernel and then quantize_x2_kernel of its output, in one launch: out =
// silu(gate) * up as f32 and as the i16 planes (quantize_x2_kernel's layout), each element the
// same expression, so the bits of the two kernels. n4 = T * F / 4 (F a multiple of 32), one
// float4 a thread; gate, up, out 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) swiglu_q2_kernel(const float* gate, const float* up, float* out,
                                                                   u32* xq, float2* ds, u32* xq2, float2* ds2,
                                                                   int n4) {
    pdl_enter();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const bool ok = t < n4;  // n4 is a multiple of 8: a group is all in or all out
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (ok) {
        const float4 g = *((const float4*)gate + t), u = *((const float4*)up + t);
        v = make_float4(g.x / (1.f + __expf(-g.x)) * u.x, g.y / (1.f + __expf(-g.y)) * u.y,
                        g.z / (1.f + __expf(-g.z)) * u.z, g.w / (1.f + __expf(-g.w)) * u.w);
        *((float4*)out + t) = v;
    }
    quant2_store(v, ok, t, xq, ds, xq2, ds2);
}

// ------------------------------------------------------------------------------- rope
// q: [T, Hq, hd], k: [T, Hk, hd] f32 in place (k may be null with Hk = 0: one launch for both);
// positions: [T] int32; llama.cpp NORMAL mode: rotate adjacent pairs (x[2i], x[2i+1]) for
// i < half = rope_dim/2 by theta = pos * inv_freq[i], inv_freq[i] = base^(-2i/rope_dim) /
// freq_factors[i] made once on the host in f64 (norm_rope_kv.rope_inv_freq). The angle and its sine
// and cosine are formed in f64 so large positions keep full f32 accuracy: once per (token, pair)
// in shared memory, not once per head (an f64 pow and sincos per element, in two launches, took
// ~8.6 us a layer at one token on the H200). grid (T, ceil((Hq + Hk) * half / (ROPE_THREADS *
// ROPE_PER_THREAD))), block ROPE_THREADS, dynamic shared memory half * 8 bytes; pairs are read
// as float2 (q, k 8-byte aligned).
#define ROPE_THREADS 256
#define ROPE_PER_THREAD 4
extern "C" __global__ void __launch_bounds__(ROPE_THREADS) rope_kernel(float* __restrict__ q, float* __restrict__ k,
                                                                       const int* positions,
                                                                       const double* __restrict__ inv_freq, int Hq,
                                                                       int Hk, int hd, int rope_dim) {
    pdl_enter();
    extern __shared__ float2 cs[];  // (cos, sin) of pair i at this token
    const int half = rope_dim / 2, t = blockIdx.x;
    const double pos = (double)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double sn, c;
        sincos(pos * inv_freq[i], &sn, &c);
        cs[i] = make_float2((float)c, (float)sn);
    }
    __syncthreads();
    const int n_pairs = (Hq + Hk) * half;
    const int j0 = blockIdx.y * (ROPE_THREADS * ROPE_PER_THREAD) + threadIdx.x;
    float2* pp[ROPE_PER_THREAD];
    float2 xv[ROPE_PER_THREAD];
    int ii[ROPE_PER_THREAD];
#pragma unroll
    for (int r = 0; r < ROPE_PER_THREAD; r++) {  // every load issued before the first store
        const int j = j0 + r * ROPE_THREADS;
        pp[r] = nullptr;
        if (j < n_pairs) {
            const int h = j / half, i = j - h * half;
            float* row = h < Hq ? q + ((long long)t * Hq + h) * hd : k + ((long long)t * Hk + (h - Hq)) * hd;
            pp[r] = (float2*)(row + 2 * i);
            ii[r] = i;
            xv[r] = *pp[r];
        }
    }
#pragma unroll
    for (int r = 0; r < ROPE_PER_THREAD; r++) {
        if (pp[r] != nullptr) {
            const float2 cf = cs[ii[r]];
            const float x0 = xv[r].x, x1 = xv[r].y;
            *pp[r] = make_float2(x0 * cf.x - x1 * cf.y, x0 * cf.y + x1 * cf.x);
        }
    }
}

// ------------------------------------------------------------------------------- qwen2's q, k, v
// q: [T, Hq, hd], k, v: [T, Hk, hd] f32 in place: each += its bias ([Hq * hd], [Hk * hd]; null:
// none), then, with rope_dim > 0, each q and k head's first rope_dim dims reordered so that dims
// i and i + rope_dim/2 (the pair NEOX RoPE rotates) become the adjacent pair (2i, 2i+1) that
// rope_kernel rotates (norm_rope_kv.qkv_bias_pairs says why). grid (T, Hq + 2 * Hk): one CTA a
// head of a row, all its loads before any store; dynamic shared memory hd * 4 bytes.
#define QKV_THREADS 128
extern "C" __global__ void __launch_bounds__(QKV_THREADS) qkv_bias_pairs_kernel(
    float* __restrict__ q, float* __restrict__ k, float* __restrict__ v, const float* __restrict__ bq,
    const float* __restrict__ bk, const float* __restrict__ bv, int Hq, int Hk, int hd, int rope_dim) {
    pdl_enter();
    extern __shared__ float head[];  // the head's values, bias added
    const int t = blockIdx.x, h = blockIdx.y;
    float* row;
    const float* b;
    bool reorder = rope_dim > 0;
    if (h < Hq) {
        row = q + ((long long)t * Hq + h) * hd;
        b = bq != nullptr ? bq + (long long)h * hd : nullptr;
    } else if (h < Hq + Hk) {
        row = k + ((long long)t * Hk + (h - Hq)) * hd;
        b = bk != nullptr ? bk + (long long)(h - Hq) * hd : nullptr;
    } else {
        row = v + ((long long)t * Hk + (h - Hq - Hk)) * hd;
        b = bv != nullptr ? bv + (long long)(h - Hq - Hk) * hd : nullptr;
        reorder = false;
    }
    if (!reorder) {
        if (b != nullptr)
            for (int e = threadIdx.x; e < hd; e += blockDim.x) row[e] += b[e];
        return;
    }
    for (int e = threadIdx.x; e < hd; e += blockDim.x) head[e] = row[e] + (b != nullptr ? b[e] : 0.0f);
    __syncthreads();
    const int half = rope_dim / 2;
    for (int e = threadIdx.x; e < hd; e += blockDim.x)
        row[e] = head[e < rope_dim ? (e & 1 ? half + (e >> 1) : e >> 1) : e];
}

// ------------------------------------------------------------------------------- rope + kv append
// A decoder layer's rope and kv_append in one launch: q rotated in place as rope_kernel does;
// k rotated in place too and, with v beside it, stored (f16) at position cache_positions[t] of
// the sequence of row slots[t] in `layer`'s pages as kv_append_kernel stores it (an out-of-range
// row or position, or a position without a page: not stored). One
// launch fewer per layer: at one token a launch is a good part of either kernel's time. Units
// per token: Hq * half q pairs, then Hk * hd / 2 (k pair, v pair) couples (the k pair rotated
// where its index is below half). grid (T, ceil(units / (ROPE_THREADS * ROPE_PER_THREAD))),
// block ROPE_THREADS, dynamic shared memory half * 8 bytes; q, k, v 8-byte aligned.
extern "C" __global__ void __launch_bounds__(ROPE_THREADS) rope_kv_kernel(
    float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v, const unsigned long long* kchunks,
    const unsigned long long* vchunks, const int* page_table, const int* positions, const int* slots,
    const int* cache_positions, const double* __restrict__ inv_freq, int Hq, int Hk, int hd, int rope_dim,
    int max_pages, int n_slots, int cp, int layer) {
    pdl_enter();
    extern __shared__ float2 cs[];  // (cos, sin) of pair i at this token
    const int half = rope_dim / 2, hp = hd / 2, t = blockIdx.x;
    const double pos = (double)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double sn, c;
        sincos(pos * inv_freq[i], &sn, &c);
        cs[i] = make_float2((float)c, (float)sn);
    }
    __syncthreads();
    const int slot = slots[t], cpos = cache_positions[t];
    const int page = slot >= 0 && slot < n_slots && cpos >= 0 && cpos < max_pages * KV_PAGE
                         ? kv_page_of(page_table, slot, max_pages, cpos) : -1;
    const bool store = page >= 0;
    // the token's k and v rows of each kv-head: u32 words (f16 pairs), head g at + g * KV_PAGE * hd / 2
    u32* krow = store ? (u32*)(kv_page_rows(kchunks, page, layer, 0, cp, Hk, hd) + (cpos % KV_PAGE) * hd) : nullptr;
    u32* vrow = store ? (u32*)(kv_page_rows(vchunks, page, layer, 0, cp, Hk, hd) + (cpos % KV_PAGE) * hd) : nullptr;
    const int n_q = Hq * half, n_units = n_q + Hk * hp;
    const int j0 = blockIdx.y * (ROPE_THREADS * ROPE_PER_THREAD) + threadIdx.x;
    float2* pp[ROPE_PER_THREAD];  // the pair rotated in place (a q or k pair)
    float2 xv[ROPE_PER_THREAD], vv[ROPE_PER_THREAD];
    int ii[ROPE_PER_THREAD];     // pair index within the head
    long long dst[ROPE_PER_THREAD];  // the k/v pair's word in the token's rows; -1: a q pair, or not stored
#pragma unroll
    for (int r = 0; r < ROPE_PER_THREAD; r++) {  // every load issued before the first store
        const int j = j0 + r * ROPE_THREADS;
        pp[r] = nullptr;
        dst[r] = -1;
        if (j < n_q) {
            const int h = j / half, i = j - h * half;
            pp[r] = (float2*)(q + ((long long)t * Hq + h) * hd + 2 * i);
            ii[r] = i;
            xv[r] = *pp[r];
        } else if (j < n_units) {
            const int u = j - n_q, g = u / hp, i = u - g * hp;
            const long long src = ((long long)t * Hk + g) * hd + 2 * i;
            pp[r] = (float2*)(k + src);
            ii[r] = i;
            xv[r] = *pp[r];
            vv[r] = *(const float2*)(v + src);
            if (store) dst[r] = ((long long)g * KV_PAGE * hd + 2 * i) >> 1;
        }
    }
#pragma unroll
    for (int r = 0; r < ROPE_PER_THREAD; r++) {
        if (pp[r] == nullptr) continue;
        float2 y = xv[r];
        if (ii[r] < half) {
            const float2 cf = cs[ii[r]];
            y = make_float2(xv[r].x * cf.x - xv[r].y * cf.y, xv[r].x * cf.y + xv[r].y * cf.x);
            *pp[r] = y;
        }
        if (dst[r] >= 0) {  // element 2i in the low half: the cache's little-endian f16 pair
            krow[dst[r]] = (u32)f2h(y.x) | ((u32)f2h(y.y) << 16);
            vrow[dst[r]] = (u32)f2h(vv[r].x) | ((u32)f2h(vv[r].y) << 16);
        }
    }
}

// ------------------------------------------------------------------------------- kv append
// k, v: [T, n_kv, hd] f32 -> position positions[t] of the sequence of row slots[t] in `layer`'s
// pages (f16). An out-of-range row or position, or a position without a page: the token is skipped.
extern "C" __global__ void kv_append_kernel(const float* k, const float* v,
                                            const unsigned long long* kchunks, const unsigned long long* vchunks,
                                            const int* page_table, const int* slots, const int* positions,
                                            int T, int n_kv, int hd, int max_pages, int n_slots, int cp, int layer) {
    pdl_enter();
    const long long total = (long long)T * n_kv * hd;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int e = (int)(idx % hd);
        const long long th = idx / hd;
        const int g = (int)(th % n_kv), t = (int)(th / n_kv);
        const int s = slots[t], p = positions[t];
        if (s < 0 || s >= n_slots || p < 0 || p >= max_pages * KV_PAGE) continue;
        const int page = kv_page_of(page_table, s, max_pages, p);
        if (page < 0) continue;
        const long long row = (long long)(p % KV_PAGE) * hd + e;
        kv_page_rows(kchunks, page, layer, g, cp, n_kv, hd)[row] = f2h(k[idx]);
        kv_page_rows(vchunks, page, layer, g, cp, n_kv, hd)[row] = f2h(v[idx]);
    }
}

// ------------------------------------------------------------------------------- kv move
// For every layer at once, in the sequence of page-table row `row`: the keys and values at position
// dst[i] become those at src[i], for i = 0 .. n_moves-1 in that order (the accepted path of a
// verified token tree closing ranks). grid (n_kv, 2 * n_layers): block y is layer y / 2, keys
// (even) or values (odd); block hd: each thread moves element e of one (layer, k|v, kv-head)
// through every move in order, so with dst[i] < src[i] and both increasing (dst[i] may be src[j]
// of an earlier j, never of a later one) it moves in place.
extern "C" __global__ void kv_move_kernel(const unsigned long long* kchunks, const unsigned long long* vchunks,
                                          const int* page_table, const int* src, const int* dst, int n_moves,
                                          int row, int max_pages, int cp, int n_kv, int hd) {
    pdl_enter();
    const int layer = blockIdx.y >> 1, g = blockIdx.x;
    const unsigned long long* chunks = (blockIdx.y & 1) ? vchunks : kchunks;
    for (int e = threadIdx.x; e < hd; e += blockDim.x)
        for (int i = 0; i < n_moves; i++) {
            const int s = src[i], d = dst[i];
            const u16 x = kv_page_rows(chunks, kv_page_of(page_table, row, max_pages, s), layer, g, cp, n_kv, hd)
                [(s % KV_PAGE) * hd + e];
            kv_page_rows(chunks, kv_page_of(page_table, row, max_pages, d), layer, g, cp, n_kv, hd)
                [(d % KV_PAGE) * hd + e] = x;
        }
}
