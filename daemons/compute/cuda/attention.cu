// Grouped-query attention over the f16 KV cache: split-K partials (plain and token-tree masked)
// and their merge, which can also write the i16 planes of its output for W_o's product.
// Launched by attention.py; compiled by NVRTC at run time, common.cuh inlined (sources.py).
//
// KV cache: pages (kv_pages.cuh); a query row's sequence is `slots[t]`, its page table's row, and
// a key tile of 32 keys is one page. Every position, length, row and page is read from device
// memory, so a captured CUDA graph replays unchanged for the next step once those small arrays
// have been updated.

#include "common.cuh"
#include "kv_pages.cuh"

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ------------------------------------------------------------------------------- attention
// q: [T, H, hd] f32, H = n_kv * G. Query t attends to positions [0, kv_lens[t]) of the sequence of
// page-table row slots[t] in `layer`'s pages (decode: kv_lens = pos + 1; causal prefill chunk:
// kv_lens[t] = positions[t] + 1).
// TREE (attn_tree_split_kernel): row t of a token tree whose row 0 is stored at cache position
// tree_base[t] (-1: not a tree row, the rule above) sees the keys before tree_base[t] and, of
// the tree's rows, row i (at tree_base[t] + i) where bit i of tree_mask[t, :] (mask_words u32
// words per row) is set: its ancestors and itself, not its siblings' branches. Masked keys
// weigh nothing; a tile whose keys are all masked is skipped (every row sees itself, so no row
// is left without keys).
// ORDERED TREE (attn_ordered_tree_split_kernel, the batch-invariant mode): the same rows, but a
// tree row's keys in the order a plain row of its path would see them: kv_lens[t] is the row's
// logical length (its RoPE position + 1: the keys before tree_base[t], then its ancestors and
// itself), and logical key j >= tree_base[t] is the tree row of the (j - tree_base[t])-th set bit
// of its mask (the rows come after their parents, so by row index is by depth). Tiles, splits,
// lanes and every sum then run exactly as for that plain row: a verified row's result is the bits
// a decode of its path gets, whatever its tree's shape. Each lane finds its key's page (a
// logical tile's keys may lie on several pages) and the V rows' addresses go round by shuffle.
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

// Where logical key `key` of an ordered tree row lies (see ORDERED TREE above): its cache
// position, or -1 where the row's mask has fewer set bits than the key needs.
__device__ __forceinline__ int attn_ordered_position(int key, int base, const u32* row_mask, int mask_words) {
    if (base < 0 || key < base) return key;
    int rank = key - base;  // the rank-th set bit of the mask (0 first)
    for (int w = 0; w < mask_words; w++) {
        u32 bits = __ldca(row_mask + w);
        const int c = __popc(bits);
        if (rank < c) {
            for (int j = 0; j < rank; j++) bits &= bits - 1u;  // clear the lowest `rank` set bits
            return base + 32 * w + __ffs(bits) - 1;
        }
        rank -= c;
    }
    return -1;
}

// TREE: 0 plain rows, 1 tree rows masked in place, 2 ordered tree rows (see above). Split s of
// S (the split kernels: s = blockIdx.x * warps_per_cta + warp, S = gridDim.x * warps_per_cta;
// the walking kernels below: every split of the warp's walk). Returns false for a split that
// owns no tile (nor does any later one: attn_used_splits).
template <int G, int HD, int TREE>
__device__ __forceinline__ bool attn_split_body(const float* q, const unsigned long long* kchunks,
                                                const unsigned long long* vchunks, const int* page_table,
                                                const int* slots, const int* kv_lens, float* __restrict__ part_ml,
                                                float* __restrict__ part_acc, int n_slots, int n_kv, int max_pages,
                                                int cp, int layer, float scale, float* qs_all, const int* tree_base,
                                                const u32* tree_mask, int mask_words, const int S, const int s) {
    constexpr int EPL = HD / 32;  // head-dim elements per lane in the V phase
    constexpr int KC = HD / 8 <= 16 ? HD / 8 : HD / 16;  // uint4 of a key in flight at once (1 or 2 rounds)
    typedef AttnV<EPL> V;
    constexpr int VG = V::VW * 32 <= 64 ? 32 : 16;  // keys whose V rows are loaded at once (<= 64 words)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = blockIdx.y, t = blockIdx.z;
    const int H = n_kv * G;
    int slot;
    const int L = attn_row_len(slots, kv_lens, t, n_slots, max_pages * KV_PAGE, &slot);
    if (s >= attn_used_splits(L, S)) return false;  // no tile: attn_combine does not read this split
    float* qs = qs_all + warp * G * HD;
    for (int i = lane; i < G * HD; i += 32) qs[i] = q[((long long)t * H + g * G) * HD + i] * scale;
    __syncwarp();
    int base = -1;  // TREE: cache position of the tree's row 0 (-1: a plain causal row)
    const u32* row_mask = nullptr;  // TREE: the row's visibility bits over the tree's rows
    if constexpr (TREE != 0) {
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
        const u16* ck;  // the lane's key row is ck + lane * HD
        const u16* cv;  // key u's V rows: cv + u * HD (TREE 2: the lane's own key's, shuffled from lane u)
        if constexpr (TREE == 2) {
            const int pos = valid ? attn_ordered_position(key, base, row_mask, mask_words) : -1;
            const int page = pos >= 0 ? kv_page_of(page_table, slot, max_pages, pos) : -1;
            valid = valid && page >= 0;
            if (__ballot_sync(0xffffffffu, valid) == 0u) continue;  // (no key with a page: never asked for)
            const int in_page = pos & (KV_PAGE - 1);
            const int pg = page >= 0 ? page : 0;  // an address to form; an invalid lane loads nothing from it
            ck = kv_page_rows(kchunks, pg, layer, g, cp, n_kv, HD) + (long long)(in_page - lane) * HD;
            cv = kv_page_rows(vchunks, pg, layer, g, cp, n_kv, HD) + (long long)in_page * HD;
        } else {
            const int page = kv_page_of(page_table, slot, max_pages, tile * 32);  // the tile's 32 keys: one page
            if (page < 0) continue;  // (a tile of positions without a page: the engine never asks for one)
            ck = kv_page_rows(kchunks, page, layer, g, cp, n_kv, HD);  // [KV_PAGE, HD]
            cv = kv_page_rows(vchunks, page, layer, g, cp, n_kv, HD);
        }
        if constexpr (TREE == 1) {
            const int i = key - base;  // the key's row in the tree
            if (valid && base >= 0 && i >= 0)
                valid = i < 32 * mask_words && ((__ldca(row_mask + (i >> 5)) >> (i & 31)) & 1u);
            if (__ballot_sync(0xffffffffu, valid) == 0u) continue;  // a tile of siblings' keys only
        }
        float sc[G];
#pragma unroll
        for (int h = 0; h < G; h++) sc[h] = 0.f;
        if (valid) {
            const uint4* kp = (const uint4*)(ck + (long long)lane * HD);
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
        const u16* vp = cv + lane * EPL;
        // TREE 2: the keys with a V row to load (the other kernels load every key below nk)
        const unsigned valid_bits = TREE == 2 ? __ballot_sync(0xffffffffu, valid) : 0xffffffffu;
        // key u's V row: at vp + u * HD, or (TREE 2) at lane u's own address
        auto v_row = [&](int u) -> const u16* {
            if constexpr (TREE == 2)
                return (const u16*)__shfl_sync(0xffffffffu, (unsigned long long)cv, u) + lane * EPL;
            else
                return vp + (long long)u * HD;
        };
        auto v_loads = [&](int u) -> bool { return TREE == 2 ? ((valid_bits >> u) & 1u) != 0u : true; };
        // the first group's V rows are loaded here, before the softmax's shuffles, so their
        // latency overlaps them; a key past nk is not loaded (zero) and has p = 0
        u32 vr[VG][V::VW];
#pragma unroll
        for (int u = 0; u < VG; u++) {
            const u16* vu = v_row(u);
            if (u < nk && v_loads(u)) {
                V::load(vu, vr[u]);
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
                    const u16* vu = v_row(j0 + u);
                    if (j0 + u < nk && v_loads(j0 + u)) {
                        V::load(vu, vr[u]);
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
    return true;
}

template <int G, int HD>
__global__ void __launch_bounds__(128) attn_split_kernel(const float* q, const unsigned long long* kchunks,
                                                         const unsigned long long* vchunks, const int* page_table,
                                                         const int* slots, const int* kv_lens,
                                                         float* __restrict__ part_ml, float* __restrict__ part_acc,
                                                         int n_slots, int n_kv, int max_pages, int cp, int layer,
                                                         float scale) {
    pdl_enter();
    extern __shared__ float qs_all[];
    attn_split_body<G, HD, 0>(q, kchunks, vchunks, page_table, slots, kv_lens, part_ml, part_acc, n_slots, n_kv,
                                  max_pages, cp, layer, scale, qs_all, nullptr, nullptr, 0,
                                  gridDim.x * (blockDim.x >> 5), blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
}

template <int G, int HD>
__global__ void __launch_bounds__(128) attn_tree_split_kernel(const float* q, const unsigned long long* kchunks,
                                                              const unsigned long long* vchunks,
                                                              const int* page_table, const int* slots,
                                                              const int* kv_lens, float* __restrict__ part_ml,
                                                              float* __restrict__ part_acc, int n_slots, int n_kv,
                                                              int max_pages, int cp, int layer, float scale,
                                                              const int* tree_base, const u32* tree_mask,
                                                              int mask_words) {
    pdl_enter();
    extern __shared__ float qs_all[];
    attn_split_body<G, HD, 1>(q, kchunks, vchunks, page_table, slots, kv_lens, part_ml, part_acc, n_slots, n_kv,
                              max_pages, cp, layer, scale, qs_all, tree_base, tree_mask, mask_words,
                              gridDim.x * (blockDim.x >> 5), blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
}

// the batch-invariant mode's tree rows (ORDERED TREE above): kv_lens logical, the same arguments
template <int G, int HD>
__global__ void __launch_bounds__(128) attn_ordered_tree_split_kernel(
    const float* q, const unsigned long long* kchunks, const unsigned long long* vchunks, const int* page_table,
    const int* slots, const int* kv_lens, float* __restrict__ part_ml, float* __restrict__ part_acc, int n_slots,
    int n_kv, int max_pages, int cp, int layer, float scale, const int* tree_base, const u32* tree_mask,
    int mask_words) {
    pdl_enter();
    extern __shared__ float qs_all[];
    attn_split_body<G, HD, 2>(q, kchunks, vchunks, page_table, slots, kv_lens, part_ml, part_acc, n_slots, n_kv,
                              max_pages, cp, layer, scale, qs_all, tree_base, tree_mask, mask_words,
                              gridDim.x * (blockDim.x >> 5), blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
}

// The batch-invariant mode's launches (attention.py): the one-row split count S at every T (a
// row's keys merge in an order fixed by S), but over a grid of the CTAs the default launches for
// T rows (gridDim.x * warps_per_cta <= S), each warp walking splits s, s + gridDim.x *
// warps_per_cta, ... below S. Every split is computed as the split kernels compute it, into its
// own slot, so a row gets their bits; what changes is that a wide pass no longer launches S / 4
// CTAs a (row, kv head), all but the few of a short row returning at once (at 64 rows of the
// 8B, 16 CTAs where the default launches 1). TREE 0 (plain rows) or 2 (ordered tree rows).
template <int G, int HD, int TREE>
__device__ __forceinline__ void attn_walk(const float* q, const unsigned long long* kchunks,
                                          const unsigned long long* vchunks, const int* page_table, const int* slots,
                                          const int* kv_lens, float* __restrict__ part_ml, float* __restrict__ part_acc,
                                          int n_slots, int n_kv, int max_pages, int cp, int layer, float scale,
                                          float* qs_all, const int* tree_base, const u32* tree_mask, int mask_words,
                                          int S) {
    const int wpc = blockDim.x >> 5, stride = gridDim.x * wpc;
    for (int s = blockIdx.x * wpc + (threadIdx.x >> 5); s < S; s += stride) {
        __syncwarp();  // the warp's lanes are done with the last split's q in shared memory
        if (!attn_split_body<G, HD, TREE>(q, kchunks, vchunks, page_table, slots, kv_lens, part_ml, part_acc,
                                          n_slots, n_kv, max_pages, cp, layer, scale, qs_all, tree_base, tree_mask,
                                          mask_words, S, s))
            break;
    }
}

template <int G, int HD>
__global__ void __launch_bounds__(128) attn_walk_split_kernel(const float* q, const unsigned long long* kchunks,
                                                              const unsigned long long* vchunks,
                                                              const int* page_table, const int* slots,
                                                              const int* kv_lens, float* __restrict__ part_ml,
                                                              float* __restrict__ part_acc, int n_slots, int n_kv,
                                                              int max_pages, int cp, int layer, float scale, int S) {
    pdl_enter();
    extern __shared__ float qs_all[];
    attn_walk<G, HD, 0>(q, kchunks, vchunks, page_table, slots, kv_lens, part_ml, part_acc, n_slots, n_kv,
                        max_pages, cp, layer, scale, qs_all, nullptr, nullptr, 0, S);
}

template <int G, int HD>
__global__ void __launch_bounds__(128) attn_walk_ordered_tree_split_kernel(
    const float* q, const unsigned long long* kchunks, const unsigned long long* vchunks, const int* page_table,
    const int* slots, const int* kv_lens, float* __restrict__ part_ml, float* __restrict__ part_acc, int n_slots,
    int n_kv, int max_pages, int cp, int layer, float scale, const int* tree_base, const u32* tree_mask,
    int mask_words, int S) {
    pdl_enter();
    extern __shared__ float qs_all[];
    attn_walk<G, HD, 2>(q, kchunks, vchunks, page_table, slots, kv_lens, part_ml, part_acc, n_slots, n_kv,
                        max_pages, cp, layer, scale, qs_all, tree_base, tree_mask, mask_words, S);
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
