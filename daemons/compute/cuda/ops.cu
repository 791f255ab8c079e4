// ntx CUDA kernels for the non-GEMM parts of a Llama forward pass and for sampling.
// Compiled by NVRTC at run time (cupy RawModule), common.cuh inlined (sources.py).
//
// KV cache layout (per layer): cache_k, cache_v: f16 [n_slots, n_kv, max_ctx, hd]; a sequence
// owns one slot; position p of kv-head g of slot s is row ((s * n_kv + g) * max_ctx + p).
// Every position, length and slot index is read from device memory, so a captured CUDA graph
// replays unchanged for the next step once those small arrays have been updated.

#include "common.cuh"

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

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

// ------------------------------------------------------------------------------- rope
// q: [T, Hq, hd], k: [T, Hk, hd] f32 in place (k may be null with Hk = 0: one launch for both);
// positions: [T] int32; llama.cpp NORMAL mode: rotate adjacent pairs (x[2i], x[2i+1]) for
// i < half = rope_dim/2 by theta = pos * inv_freq[i], inv_freq[i] = base^(-2i/rope_dim) /
// freq_factors[i] made once on the host in f64 (kernels.rope_inv_freq). The angle and its sine
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

// ------------------------------------------------------------------------------- rope + kv append
// A decoder layer's rope and kv_append in one launch: q rotated in place as rope_kernel does;
// k rotated in place too and, with v beside it, stored to cache[slots[t], :, cache_positions[t],
// :] (f16) as kv_append_kernel stores it (an out-of-range slot or position: not stored). One
// launch fewer per layer: at one token a launch is a good part of either kernel's time. Units
// per token: Hq * half q pairs, then Hk * hd / 2 (k pair, v pair) couples (the k pair rotated
// where its index is below half). grid (T, ceil(units / (ROPE_THREADS * ROPE_PER_THREAD))),
// block ROPE_THREADS, dynamic shared memory half * 8 bytes; q, k, v 8-byte aligned.
extern "C" __global__ void __launch_bounds__(ROPE_THREADS) rope_kv_kernel(
    float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v, u32* __restrict__ ck,
    u32* __restrict__ cv, const int* positions, const int* slots, const int* cache_positions,
    const double* __restrict__ inv_freq, int Hq, int Hk, int hd, int rope_dim, int max_ctx, int n_slots) {
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
    const bool store = slot >= 0 && slot < n_slots && cpos >= 0 && cpos < max_ctx;
    const int n_q = Hq * half, n_units = n_q + Hk * hp;
    const int j0 = blockIdx.y * (ROPE_THREADS * ROPE_PER_THREAD) + threadIdx.x;
    float2* pp[ROPE_PER_THREAD];  // the pair rotated in place (a q or k pair)
    float2 xv[ROPE_PER_THREAD], vv[ROPE_PER_THREAD];
    int ii[ROPE_PER_THREAD];     // pair index within the head
    long long dst[ROPE_PER_THREAD];  // the k/v pair's word in the cache; -1: a q pair, or not stored
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
            if (store) dst[r] = ((((long long)slot * Hk + g) * max_ctx + cpos) * hd + 2 * i) >> 1;
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
            ck[dst[r]] = (u32)f2h(y.x) | ((u32)f2h(y.y) << 16);
            cv[dst[r]] = (u32)f2h(vv[r].x) | ((u32)f2h(vv[r].y) << 16);
        }
    }
}

// ------------------------------------------------------------------------------- kv append
// k, v: [T, n_kv, hd] f32 -> cache[slots[t], :, positions[t], :] (f16). Out-of-range slot or
// position: the token is skipped.
extern "C" __global__ void kv_append_kernel(const float* k, const float* v,
                                            u16* __restrict__ ck, u16* __restrict__ cv,
                                            const int* slots, const int* positions,
                                            int T, int n_kv, int hd, int max_ctx, int n_slots) {
    pdl_enter();
    const long long total = (long long)T * n_kv * hd;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int e = (int)(idx % hd);
        const long long th = idx / hd;
        const int g = (int)(th % n_kv), t = (int)(th / n_kv);
        const int s = slots[t], p = positions[t];
        if (s < 0 || s >= n_slots || p < 0 || p >= max_ctx) continue;
        const long long dst = (((long long)s * n_kv + g) * max_ctx + p) * hd + e;
        ck[dst] = f2h(k[idx]);
        cv[dst] = f2h(v[idx]);
    }
}

// ------------------------------------------------------------------------------- kv move
// For every layer at once: cache[slot, :, dst[i], :] = cache[slot, :, src[i], :] for
// i = 0 .. n_moves-1 in that order (the accepted path of a verified token tree closing ranks).
// caches: [2 * n_layers] addresses (k0, v0, k1, v1, ...) of f16 [n_slots, n_kv, max_ctx, hd]
// caches of one shape. grid (n_kv, 2 * n_layers), block hd: each thread moves element e of one
// (layer, k|v, kv-head) through every move in order, so with dst[i] < src[i] and both
// increasing (dst[i] may be src[j] of an earlier j, never of a later one) it moves in place.
extern "C" __global__ void kv_move_kernel(u16* const* caches, const int* src,
                                          const int* dst, int n_moves, int slot, int n_kv,
                                          int max_ctx, int hd) {
    pdl_enter();
    u16* c = caches[blockIdx.y] + ((long long)slot * n_kv + blockIdx.x) * max_ctx * hd;
    for (int e = threadIdx.x; e < hd; e += blockDim.x)
        for (int i = 0; i < n_moves; i++) c[(long long)dst[i] * hd + e] = c[(long long)src[i] * hd + e];
}

// ------------------------------------------------------------------------------- attention
// q: [T, H, hd] f32, H = n_kv * G. Query t attends to cache positions [0, kv_lens[t]) of slot
// slots[t] (decode: kv_lens = pos + 1; causal prefill chunk: kv_lens[t] = positions[t] + 1).
// TREE (attn_tree_split_kernel): row t of a token tree whose row 0 is stored at cache position
// tree_base[t] (-1: not a tree row, the rule above) sees the keys before tree_base[t] and, of
// the tree's rows, row i (at tree_base[t] + i) where bit i of tree_mask[t, :] (mask_words u32
// words per row) is set: its ancestors and itself, not its siblings' branches. Masked keys
// weigh nothing; a tile whose keys are all masked is skipped (every row sees itself, so no row
// is left without keys).
// Split-K ("flash decoding"): warp s of the S = gridDim.x * warps_per_cta splits of (t, kv-head g)
// handles key tiles s, s+S, ... of 32 keys with an online softmax in f32 and writes its partial
// (m, l, acc) to part_ml [T, H, S, 2] / part_acc [T, H, S, HD]; attn_combine merges them.
// The cost follows the row's length L, not the S the launch was sized for (max_ctx): only the
// first attn_used_splits(L, S) = min(S, ceil(L / 32)) splits own a tile; the others return at
// once and write nothing, and attn_combine reads only the used ones (an unused split would have
// written m = -inf, which weighs nothing in the merge, so the result is the same to the bit).
// Within a tile each lane scores one key (q of the G heads in shared memory), then the lanes
// split the head dimension to accumulate p * v over the tile's keys. Latency, not bandwidth,
// bounds a short row, so each phase issues its loads before the arithmetic that uses them: a
// lane's whole key (up to 16 uint4) at once, then the tile's V rows in groups of up to 32 keys
// (kept as f16 bits, converted at use). Additions run in the same order as one load at a time.

// The row's key count as every attention kernel sees it: kv_lens[t] clamped to max_ctx, 0 for
// a slot outside [0, n_slots) (attend to nothing, output 0).
__device__ __forceinline__ int attn_row_len(const int* slots, const int* kv_lens, int t,
                                            int n_slots, int max_ctx, int* slot_out) {
    const int slot = slots[t];
    int L = kv_lens[t];
    if (L > max_ctx) L = max_ctx;
    if (slot < 0 || slot >= n_slots) { *slot_out = 0; return 0; }
    *slot_out = slot;
    return L;
}
// splits of S that own a tile of 32 keys of a row of L keys
__device__ __forceinline__ int attn_used_splits(int L, int S) { return L <= 0 ? 0 : min(S, (L + 31) >> 5); }

// V rows of one lane's EPL head-dim elements as raw f16 bits: VW 32-bit words a key (element e
// in the low or high half of word e / 2), loaded as one u32 / uint2 / uint4 where EPL is 2 / 4 /
// 8 (the lane's elements then aligned to their width), else one u16 at a time.
template <int EPL> struct AttnV {
    static constexpr int VW = (EPL + 1) / 2;
    static __device__ __forceinline__ void load(const u16* p, u32 (&r)[VW]) {
        if constexpr (EPL == 8) {
            const uint4 v = __ldca((const uint4*)p);
            r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
        } else if constexpr (EPL == 4) {
            const uint2 v = __ldca((const uint2*)p);
            r[0] = v.x; r[1] = v.y;
        } else if constexpr (EPL == 2) {
            r[0] = __ldca((const u32*)p);
        } else {
#pragma unroll
            for (int w = 0; w < VW; w++) r[w] = 0u;
#pragma unroll
            for (int e = 0; e < EPL; e++) r[e >> 1] |= (u32)__ldca(p + e) << (16 * (e & 1));
        }
    }
    static __device__ __forceinline__ float elem(const u32 (&r)[VW], int e) { return h2f(r[e >> 1] >> (16 * (e & 1))); }
};

template <int G, int HD, bool TREE>
__device__ __forceinline__ void attn_split_body(const float* q, const u16* ck,
                                                const u16* cv, const int* slots,
                                                const int* kv_lens, float* __restrict__ part_ml,
                                                float* __restrict__ part_acc, int n_slots, int n_kv, int max_ctx,
                                                float scale, float* qs_all, const int* tree_base,
                                                const u32* tree_mask, int mask_words) {
    constexpr int EPL = HD / 32;  // head-dim elements per lane in the V phase
    constexpr int KC = HD / 8 <= 16 ? HD / 8 : HD / 16;  // uint4 of a key in flight at once (1 or 2 rounds)
    typedef AttnV<EPL> V;
    constexpr int VG = V::VW * 32 <= 64 ? 32 : 16;  // keys whose V rows are loaded at once (<= 64 words)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpc = blockDim.x >> 5;
    const int S = gridDim.x * wpc, s = blockIdx.x * wpc + warp;
    const int g = blockIdx.y, t = blockIdx.z;
    const int H = n_kv * G;
    int slot;
    const int L = attn_row_len(slots, kv_lens, t, n_slots, max_ctx, &slot);
    if (s >= attn_used_splits(L, S)) return;  // no tile: attn_combine does not read this split
    float* qs = qs_all + warp * G * HD;
    for (int i = lane; i < G * HD; i += 32) qs[i] = q[((long long)t * H + g * G) * HD + i] * scale;
    __syncwarp();
    const long long kvbase = ((long long)slot * n_kv + g) * max_ctx * HD;
    int base = -1;  // TREE: cache position of the tree's row 0 (-1: a plain causal row)
    const u32* row_mask = nullptr;  // TREE: the row's visibility bits over the tree's rows
    if constexpr (TREE) {
        base = tree_base[t];
        row_mask = tree_mask + (long long)t * mask_words;
    }
    float m[G], l[G], acc[G][EPL];
#pragma unroll
    for (int h = 0; h < G; h++) {
        m[h] = NEG_INF; l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; e++) acc[h][e] = 0.f;
    }
    for (int tile = s; tile * 32 < L; tile += S) {
        const int key = tile * 32 + lane;
        bool valid = key < L;
        if constexpr (TREE) {
            const int i = key - base;  // the key's row in the tree
            if (valid && base >= 0 && i >= 0)
                valid = i < 32 * mask_words && ((__ldca(row_mask + (i >> 5)) >> (i & 31)) & 1u);
            if (__ballot_sync(0xffffffffu, valid) == 0u) continue;  // a tile of siblings' keys only
        }
        float sc[G];
#pragma unroll
        for (int h = 0; h < G; h++) sc[h] = 0.f;
        if (valid) {
            const uint4* kp = (const uint4*)(ck + kvbase + (long long)key * HD);
#pragma unroll
            for (int c0 = 0; c0 < HD / 8; c0 += KC) {
                uint4 kr[KC];  // the key's next KC * 8 elements, every load in flight at once
#pragma unroll
                for (int c = 0; c < KC; c++) kr[c] = __ldca(kp + c0 + c);
#pragma unroll
                for (int c = 0; c < KC; c++) {
                    const uint4 kv = kr[c];
                    float kf[8];
                    kf[0] = h2f(kv.x); kf[1] = h2f(kv.x >> 16); kf[2] = h2f(kv.y); kf[3] = h2f(kv.y >> 16);
                    kf[4] = h2f(kv.z); kf[5] = h2f(kv.z >> 16); kf[6] = h2f(kv.w); kf[7] = h2f(kv.w >> 16);
#pragma unroll
                    for (int h = 0; h < G; h++) {
                        const float4 qa = *(const float4*)(qs + h * HD + 8 * (c0 + c));
                        const float4 qb = *(const float4*)(qs + h * HD + 8 * (c0 + c) + 4);
                        float a = sc[h];
                        a = fmaf(qa.x, kf[0], a); a = fmaf(qa.y, kf[1], a); a = fmaf(qa.z, kf[2], a); a = fmaf(qa.w, kf[3], a);
                        a = fmaf(qb.x, kf[4], a); a = fmaf(qb.y, kf[5], a); a = fmaf(qb.z, kf[6], a); a = fmaf(qb.w, kf[7], a);
                        sc[h] = a;
                    }
                }
            }
        }
        const int nk = min(32, L - tile * 32);
        const u16* vp = cv + kvbase + (long long)tile * 32 * HD + lane * EPL;
        // the first group's V rows are loaded here, before the softmax's shuffles, so their
        // latency overlaps them; a key past nk is not loaded (zero) and has p = 0
        u32 vr[VG][V::VW];
#pragma unroll
        for (int u = 0; u < VG; u++) {
            if (u < nk) {
                V::load(vp + (long long)u * HD, vr[u]);
            } else {
#pragma unroll
                for (int w = 0; w < V::VW; w++) vr[u][w] = 0u;
            }
        }
        float p[G];
#pragma unroll
        for (int h = 0; h < G; h++) {
            const float tmax = warp_max(valid ? sc[h] : NEG_INF);
            const float mn = fmaxf(m[h], tmax);
            p[h] = valid ? __expf(sc[h] - mn) : 0.f;
            const float corr = __expf(m[h] - mn);  // m = -inf at the start -> 0
            l[h] = l[h] * corr + warp_sum(p[h]);
#pragma unroll
            for (int e = 0; e < EPL; e++) acc[h][e] *= corr;
            m[h] = mn;
        }
        // keys in groups of VG, each group's V rows loaded before the first is used (one
        // latency per group, not per key); a key past nk adds exactly nothing (p = 0, v = 0)
#pragma unroll
        for (int j0 = 0; j0 < 32; j0 += VG) {
            if (j0 >= nk) break;
            if (j0 > 0) {
#pragma unroll
                for (int u = 0; u < VG; u++) {
                    if (j0 + u < nk) {
                        V::load(vp + (long long)(j0 + u) * HD, vr[u]);
                    } else {
#pragma unroll
                        for (int w = 0; w < V::VW; w++) vr[u][w] = 0u;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < VG; u++) {
                float vf[EPL];
#pragma unroll
                for (int e = 0; e < EPL; e++) vf[e] = V::elem(vr[u], e);
#pragma unroll
                for (int h = 0; h < G; h++) {
                    const float pj = __shfl_sync(0xffffffffu, p[h], j0 + u);
#pragma unroll
                    for (int e = 0; e < EPL; e++) acc[h][e] = fmaf(pj, vf[e], acc[h][e]);
                }
            }
        }
    }
#pragma unroll
    for (int h = 0; h < G; h++) {
        const long long o = ((long long)t * H + g * G + h) * S + s;
        if (lane == 0) { part_ml[2 * o] = m[h]; part_ml[2 * o + 1] = l[h]; }
#pragma unroll
        for (int e = 0; e < EPL; e++) part_acc[o * HD + lane * EPL + e] = acc[h][e];
    }
}

template <int G, int HD>
__global__ void __launch_bounds__(128) attn_split_kernel(const float* q, const u16* ck,
                                                         const u16* cv, const int* slots,
                                                         const int* kv_lens, float* __restrict__ part_ml,
                                                         float* __restrict__ part_acc, int n_slots, int n_kv, int max_ctx,
                                                         float scale) {
    pdl_enter();
    extern __shared__ float qs_all[];
    attn_split_body<G, HD, false>(q, ck, cv, slots, kv_lens, part_ml, part_acc, n_slots, n_kv, max_ctx, scale, qs_all,
                                  nullptr, nullptr, 0);
}

template <int G, int HD>
__global__ void __launch_bounds__(128) attn_tree_split_kernel(const float* q, const u16* ck,
                                                              const u16* cv, const int* slots,
                                                              const int* kv_lens, float* __restrict__ part_ml,
                                                              float* __restrict__ part_acc, int n_slots, int n_kv,
                                                              int max_ctx, float scale, const int* tree_base,
                                                              const u32* tree_mask, int mask_words) {
    pdl_enter();
    extern __shared__ float qs_all[];
    attn_split_body<G, HD, true>(q, ck, cv, slots, kv_lens, part_ml, part_acc, n_slots, n_kv, max_ctx, scale, qs_all,
                                 tree_base, tree_mask, mask_words);
}

// out[t, h, :] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the row's used splits
// (attn_used_splits: the split kernel wrote only those; L from the same slots / kv_lens).
// grid (H, T), block min(HD, 256), S <= ATTN_MAX_SPLITS. The splits' (m, l) are read into shared
// memory by all threads at once and their weights e^(m_s - M) made there once, so the
// per-element sum issues its loads of acc without a dependent load per split (three serial
// loops over 64 splits took ~20 us per layer); every sum runs in split order, so the result is
// the same to the bit as merging all S splits (the unused ones had m = -inf and weighed nothing).
// xq != null: also out's i16 planes (xq, ds, xq2, ds2 as quantize_x2_kernel lays them out for
// out as [T, H * hd]), so that the attention output's product needs no quantizing launch; the
// same bits as quantize_x2_kernel of out (quant2_store over the same floats).
#define ATTN_MAX_SPLITS 256
#define ATTN_MAX_HD 256
extern "C" __global__ void attn_combine_kernel(const float* part_ml, const float* part_acc,
                                               float* __restrict__ out, int H, int S, int hd,
                                               const int* slots, const int* kv_lens,
                                               int n_slots, int max_ctx, u32* __restrict__ xq,
                                               float2* __restrict__ ds, u32* __restrict__ xq2,
                                               float2* __restrict__ ds2) {
    pdl_enter();
    __shared__ float w_s[ATTN_MAX_SPLITS];  // e^(m_s - M); -1 for a split that saw no key
    __shared__ float l_s[ATTN_MAX_SPLITS];
    __shared__ __align__(16) float o_s[ATTN_MAX_HD];  // the row's output, for the planes
    __shared__ float s_den;
    const int h = blockIdx.x, t = blockIdx.y;
    int slot;
    const int n_used = attn_used_splits(attn_row_len(slots, kv_lens, t, n_slots, max_ctx, &slot), S);
    const long long o = ((long long)t * H + h) * S;
    for (int s = threadIdx.x; s < n_used; s += blockDim.x) {
        const float2 ml = *(const float2*)(part_ml + 2 * (o + s));
        w_s[s] = ml.x;
        l_s[s] = ml.y;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float M = NEG_INF;
        for (int s = 0; s < n_used; s++) M = fmaxf(M, w_s[s]);
        float den = 0.f;
        for (int s = 0; s < n_used; s++) {
            const float ms = w_s[s];
            if (ms != NEG_INF) {
                const float wv = __expf(ms - M);
                den += wv * l_s[s];
                w_s[s] = wv;
            } else {
                w_s[s] = -1.f;
            }
        }
        s_den = den;
    }
    __syncthreads();
    const float den = s_den;
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float num = 0.f;
#pragma unroll 8
        for (int s = 0; s < n_used; s++) {
            const float wv = w_s[s];
            const float a = __ldca(part_acc + (o + s) * hd + e);
            if (wv >= 0.f) num += wv * a;
        }
        const float o = den > 0.f ? num / den : 0.f;
        out[((long long)t * H + h) * hd + e] = o;
        o_s[e] = o;
    }
    if (xq == nullptr) return;
    __syncthreads();
    const int i4 = threadIdx.x, n4 = hd / 4;  // float4 i4 of the row; hd % 32 == 0: groups align
    if ((i4 & ~31) < n4) {  // whole warps: quant2_group's shuffles span 8 lanes
        const bool ok = i4 < n4;
        const float4 v = ok ? *(const float4*)(o_s + 4 * i4) : make_float4(0.f, 0.f, 0.f, 0.f);
        quant2_store(v, ok, ((long long)t * H + h) * n4 + i4, xq, ds, xq2, ds2);
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

// ------------------------------------------------------------------------------- argmax
// logits [B, V] -> out [B] int32; ties go to the lowest id; NaN never wins.
extern "C" __global__ void argmax_kernel(const float* logits, int* __restrict__ out, int V) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = logits + (long long)blockIdx.x * V;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = row[i];
        if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) out[blockIdx.x] = bi < V ? bi : 0;
    }
}

// ------------------------------------------------------------------------------- repetition penalty
// logits [B, V] in place; history [B, n_hist] int32 (entries < 0 or >= V are padding). Each
// distinct id of row b is penalized once (llama.cpp rule): logit > 0 -> logit / p, else logit * p,
// with p = penalties ? penalties[b] : penalty.
extern "C" __global__ void rep_penalty_kernel(float* __restrict__ logits, const int* history,
                                              int V, int n_hist, float penalty, const float* penalties) {
    pdl_enter();
    const int b = blockIdx.x;
    const int* hist = history + (long long)b * n_hist;
    const float p = penalties ? penalties[b] : penalty;
    for (int i = threadIdx.x; i < n_hist; i += blockDim.x) {
        const int id = hist[i];
        if (id < 0 || id >= V) continue;
        bool first = true;
        for (int j = 0; j < i; j++) if (hist[j] == id) { first = false; break; }
        if (!first) continue;
        float* lp = logits + (long long)b * V + id;
        const float l = *lp;
        *lp = l > 0.f ? l / p : l * p;
    }
}

// ------------------------------------------------------------------------------- top-k
// logits [B, V] -> values [B, k] f32, ids [B, k] int32, sorted best first (ties: lower id first).
// One CTA per row: 4 radix-select passes (8 bits each) over order-preserving keys find the k-th
// largest key; keys above it are collected, then equal keys in index order; a bitonic sort of
// the <= 256 candidates orders them. NaN ranks below every number.
__device__ __forceinline__ u32 fkey(float v) {
    if (v != v) return 0u;
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
extern "C" __global__ void __launch_bounds__(1024) topk_kernel(const float* logits, float* __restrict__ values,
                                                               int* __restrict__ ids, int V, int k) {
    pdl_enter();
    __shared__ int hist[256];
    __shared__ u64 cand[256];
    __shared__ u32 s_prefix, s_mask;
    __shared__ int s_kk, s_cnt, s_taken;
    __shared__ int s_wcnt[32];
    const float* row = logits + (long long)blockIdx.x * V;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    if (tid == 0) { s_prefix = 0u; s_mask = 0u; s_kk = k; s_cnt = 0; s_taken = 0; }
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const u32 prefix = s_prefix, mask = s_mask;
        for (int base = 0; base < V; base += blockDim.x) {  // warp-aggregated shared atomics
            const int i = base + tid;
            const u32 key = i < V ? fkey(row[i]) : 0u;
            const bool in = i < V && (key & mask) == prefix;
            const u32 digit = in ? ((key >> shift) & 255u) : 256u;
            const u32 peers = __match_any_sync(0xffffffffu, digit);
            if (in && (__ffs(peers) - 1) == lane) atomicAdd(&hist[digit], __popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            int kk = s_kk, cum = 0, sel = 0;
            for (int d = 255; d >= 0; d--) {
                if (cum + hist[d] >= kk) { sel = d; break; }
                cum += hist[d];
            }
            s_kk = kk - cum;
            s_prefix = prefix | ((u32)sel << shift);
            s_mask = mask | (255u << shift);
        }
        __syncthreads();
    }
    const u32 thr = s_prefix;
    const int need_eq = s_kk;      // how many keys equal to thr belong to the top k
    const int n_gt = k - need_eq;  // keys strictly greater than thr (all in the top k)
    for (int i = tid; i < V; i += blockDim.x) {
        const u32 key = fkey(row[i]);
        if (key > thr) {
            const int pos = atomicAdd(&s_cnt, 1);
            cand[pos] = ((u64)key << 32) | (u64)(0xFFFFFFFFu - (u32)i);
        }
    }
    __syncthreads();
    // equal keys, lowest ids first: scan the row in index order, one blockDim-chunk at a time
    for (int base = 0; base < V; base += blockDim.x) {
        if (s_taken >= need_eq) break;  // uniform: read after a barrier
        const int i = base + tid;
        const bool eq = i < V && fkey(row[i]) == thr;
        const u32 bal = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) s_wcnt[warp] = __popc(bal);
        __syncthreads();
        int before = 0, total = 0;
        for (int w2 = 0; w2 < nw; w2++) { if (w2 < warp) before += s_wcnt[w2]; total += s_wcnt[w2]; }
        const int rank = s_taken + before + __popc(bal & ((1u << lane) - 1u));
        if (eq && rank < need_eq) cand[n_gt + rank] = ((u64)thr << 32) | (u64)(0xFFFFFFFFu - (u32)i);
        __syncthreads();
        if (tid == 0) s_taken += total;
        __syncthreads();
    }
    for (int i = k + tid; i < 256; i += blockDim.x) cand[i] = 0ull;
    __syncthreads();
    // bitonic sort, descending
    for (int size = 2; size <= 256; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            if (tid < 128) {
                const int i = 2 * stride * (tid / stride) + (tid % stride), jx = i + stride;
                const bool desc = ((i & size) == 0);
                const u64 a = cand[i], b = cand[jx];
                if (desc ? (a < b) : (a > b)) { cand[i] = b; cand[jx] = a; }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += blockDim.x) {
        const int id = (int)(0xFFFFFFFFu - (u32)(cand[i] & 0xFFFFFFFFull));
        ids[(long long)blockIdx.x * k + i] = id;
        values[(long long)blockIdx.x * k + i] = row[id];
    }
}
