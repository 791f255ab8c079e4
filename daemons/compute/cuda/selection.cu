// Selection on the device: argmax, the repetition penalty, top-k. Launched by selection.py;
// compiled by NVRTC at run time, common.cuh inlined (sources.py).

#include "common.cuh"

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
