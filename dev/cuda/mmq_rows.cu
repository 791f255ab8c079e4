// mmq_rows_kernel: a lab variant of the int8 tensor-core matmul (production mmq.cu, included
// here) for one or two rows of x with mmq_kernel's bits, so that the batch-invariant mode's
// one-row passes would not pay mmq's 8-row tile (docs/PERFORMANCE.md, "The batch-invariant
// mode: its cost"). Measured on the H200 (dev/cuda/bench_mmq_rows.py): the same bits as
// mmq_kernel on every shape, but no faster than it (Q4_K 4096x4096 at one row: 0.0085-0.0101 ms
// against mmq's 0.0100 and the i16 matvec's 0.0053; Q6_K slower than mmq), so production keeps
// mmq. Launched by dev/cuda/lab.py (mmq_rows).

#include "mmq.cu"

// mmq_rows_kernel: out[b, row] for B <= NB <= 2 rows of x with mmq_kernel's bits, for the
// batch-invariant mode's one- and two-row passes, where mmq's tile of 8 x rows is 7/8 idle and
// its f32 epilogue runs for all 8 (~1.8x the i16 matvec's time at one row). Why the same bits:
// mmq's integer sums are exact, so only its f32 steps fix a result, and this kernel makes the
// same ones in the same order. mmq's value of a row is, per chain p = ks * WK + wk of block
// columns p, p + P, ... (P = WK * KS: the shape's mmq_launch), a chain of f32 steps over the
// chain's sub-blocks in order (Q4_K/Q5_K: acc = fmaf(s * d2, t, fmaf(-m, xsum, acc)); Q6_K per
// group of two 16-column halves: acc = fmaf(d2, fmaf(s0, t0, s1 * t1), acc)), t = 254 c1 + c2 of
// the exact plane sums rounded once (mmq_t's fmaf rounds that same integer); then the WK chains
// of a CTA are added in order from 0, then the KS partials likewise (mm_epilogue).
// Only the chains are sequential, and they are short (a sub-block's step is two FMAs), so a CTA
// of 256 threads takes R weight rows in two phases:
//   1. the integer sums, every thread: items (row, chunk of 64 columns; Q6_K: of 32) spread
//      over the CTA with the rows fastest (a warp's lanes: R rows of 32 / R chunks, so x's words
//      are shared loads), each item's t values as f32 into shared memory [NB][R][groups * TPG];
//   2. the chains, one thread per (row, chain), each reading its t values, its blocks' scales and
//      x's (d2, xsum), then the P chains added in mm_epilogue's nesting.
// So the weights are read by all 8 warps at once, as by a matvec, instead of by the P warps a
// row tile has in mmq. xq, xd: quantize_mmq_kernel's planes (Bp = 8 for B <= 8).
template <int N>
__device__ __forceinline__ void mmq_rows_words(const u8* p, u32 (&o)[N]) {  // 4N bytes at a 2-byte-aligned p
    const u32* a = (const u32*)((unsigned long long)p & ~3ull);
    const int mis = (int)((unsigned long long)p & 3ull);  // 0 or 2
    u32 v[N + 1];
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = __ldg(a + k);
    v[N] = mis ? __ldg(a + N) : 0u;
#pragma unroll
    for (int k = 0; k < N; k++) o[k] = mis ? __funnelshift_r(v[k], v[k + 1], 16) : v[k];
}
#ifndef MMQ_ROWS_UNROLL
#define MMQ_ROWS_UNROLL 4  // phase-1 items a thread loads before it computes them
#endif
template <int QT, int NB, int R>
__global__ void __launch_bounds__(256) mmq_rows_kernel(const u8* __restrict__ w, const uint4* xq, const float2* xd,
                                                       float* __restrict__ out, int n_rows, int n_cols,
                                                       long long row_bytes, int B, int WK, int KS) {
    pdl_enter();
    constexpr int Bp = 8;                         // quantize_mmq_kernel's padded rows for B <= 8
    constexpr bool K45 = QT == 12 || QT == 13;
    constexpr int TPG = K45 ? 1 : 2;              // t values per group of 32 columns (Q6_K: two halves)
    constexpr int GPI = K45 ? 2 : 1;              // groups per phase-1 item
    constexpr int IPB = 8 / GPI;                  // items per block
    constexpr int BYTES = QT == 12 ? 144 : QT == 13 ? 176 : 210, QS = QT == 12 ? 16 : 48;
    constexpr int U = MMQ_ROWS_UNROLL;
    // shared: hdr [R][nb] uint4 (K45: the block's header; Q6_K: its 16 scales), dq [R][nb] f32 (Q6_K),
    // xds [NB][groups] float2, t [NB][R][ts] f32 (ts = groups * TPG + 1: rows in different banks),
    // red [P][NB][R] f32
    extern __shared__ __align__(16) u8 smem[];
    const int ng = n_cols / 32, nb = n_cols / 256, ts = ng * TPG + 1, P = WK * KS;
    uint4* hdr = (uint4*)smem;
    float* dqs = (float*)(hdr + R * nb);
    float2* xds = (float2*)(dqs + (K45 ? 0 : R * nb));
    float* tsm = (float*)(xds + NB * ng);
    float* red = tsm + NB * R * ts;
    const int row0 = blockIdx.x * R;
    for (int i = threadIdx.x; i < NB * ng; i += blockDim.x) xds[i] = __ldca(xd + (long long)(i % ng) * Bp + i / ng);
    const int n_items = nb * IPB * R;
    for (int it0 = threadIdx.x; it0 < n_items; it0 += U * blockDim.x) {
        // every load of the thread's U items (rows fastest: it = q * R + r) first, then their sums
        u32 wq[U][8], qx[U][8];  // K45: qs words, Q5_K's qh words; Q6_K: ql, qh words
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int it = it0 + u * blockDim.x;
            if (it >= n_items) break;
            const int r = it % R, q = it / R, blk = q / IPB, j = q % IPB;
            const u8* bp = w + (long long)min(row0 + r, n_rows - 1) * row_bytes + (long long)blk * BYTES;
            if constexpr (K45) {
                const uint4 qa = ld128(bp + QS + 32 * j), qb = ld128(bp + QS + 32 * j + 16);
                wq[u][0] = qa.x; wq[u][1] = qa.y; wq[u][2] = qa.z; wq[u][3] = qa.w;
                wq[u][4] = qb.x; wq[u][5] = qb.y; wq[u][6] = qb.z; wq[u][7] = qb.w;
                if constexpr (QT == 13) {
                    const uint4 ha = ld128(bp + 16), hb = ld128(bp + 32);
                    qx[u][0] = ha.x; qx[u][1] = ha.y; qx[u][2] = ha.z; qx[u][3] = ha.w;
                    qx[u][4] = hb.x; qx[u][5] = hb.y; qx[u][6] = hb.z; qx[u][7] = hb.w;
                }
                if (j == 0) hdr[r * nb + blk] = ld128(bp);
            } else {
                const int h = j >> 2, kind = j & 3;
                mmq_rows_words(bp + 64 * h + 32 * (kind & 1), wq[u]);
                mmq_rows_words(bp + 128 + 32 * h, qx[u]);
                if (j == 0) {
                    u32 sc[4];
                    mmq_rows_words(bp + 192, sc);
                    hdr[r * nb + blk] = make_uint4(sc[0], sc[1], sc[2], sc[3]);
                    dqs[r * nb + blk] = h2f((u32)*(const u16*)(bp + 208));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int it = it0 + u * blockDim.x;
            if (it >= n_items) break;
            const int r = it % R, q = it / R, blk = q / IPB, j = q % IPB;
            if constexpr (K45) {  // chunk j: sub-blocks 2j, 2j + 1 (qs bytes 32j..32j+31, low / high nibbles)
#pragma unroll
                for (int sub = 0; sub < 2; sub++) {
                    const int g = blk * 8 + 2 * j + sub;
                    u32 wv[8];
#pragma unroll
                    for (int k = 0; k < 8; k++) {  // word k: elements 4k..4k+3
                        wv[k] = (sub ? wq[u][k] >> 4 : wq[u][k]) & 0x0F0F0F0Fu;
                        if constexpr (QT == 13) wv[k] |= ((qx[u][k] >> (2 * j + sub)) & 0x01010101u) << 4;
                    }
#pragma unroll
                    for (int b = 0; b < NB; b++) {
                        int c1 = 0, c2 = 0;
#pragma unroll
                        for (int tig = 0; tig < 4; tig++) {  // mmq's fragment words: (k 4tig..+3, k 16+4tig..+3)
                            const uint4 xv = __ldca(xq + ((long long)g * Bp + b) * 4 + tig);
                            c1 = __dp4a((int)wv[tig], (int)xv.x, c1); c1 = __dp4a((int)wv[4 + tig], (int)xv.y, c1);
                            c2 = __dp4a((int)wv[tig], (int)xv.z, c2); c2 = __dp4a((int)wv[4 + tig], (int)xv.w, c2);
                        }
                        tsm[(b * R + r) * ts + g] = __int2float_rn(254 * c1 + c2);
                    }
                }
            } else {  // Q6_K group g = blk * 8 + j: elements 128h + 32kind + (0..31), h = j / 4, kind = j % 4
                const int kind = j & 3, g = blk * 8 + j;
                u32 wv[8];
#pragma unroll
                for (int k = 0; k < 8; k++)
                    wv[k] = sub32_bytes(((kind >= 2 ? wq[u][k] >> 4 : wq[u][k]) & 0x0F0F0F0Fu)
                                        | (((qx[u][k] >> (2 * kind)) & 0x03030303u) << 4));
#pragma unroll
                for (int b = 0; b < NB; b++) {
                    int c10 = 0, c20 = 0, c11 = 0, c21 = 0;  // [plane][half]
#pragma unroll
                    for (int tig = 0; tig < 4; tig++) {  // half 0: words tig (k 4tig..+3), half 1: words 4 + tig
                        const uint4 xv = __ldca(xq + ((long long)g * Bp + b) * 4 + tig);
                        c10 = __dp4a((int)wv[tig], (int)xv.x, c10); c20 = __dp4a((int)wv[tig], (int)xv.z, c20);
                        c11 = __dp4a((int)wv[4 + tig], (int)xv.y, c11); c21 = __dp4a((int)wv[4 + tig], (int)xv.w, c21);
                    }
                    float* t = tsm + (b * R + r) * ts + 2 * g;
                    t[0] = __int2float_rn(254 * c10 + c20);
                    t[1] = __int2float_rn(254 * c11 + c21);
                }
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < P * R; e += blockDim.x) {  // phase 2: thread (row r, chain p)
        const int r = e % R, p = e / R;
        const float* t = tsm + r * ts;
        float acc[NB];
#pragma unroll
        for (int b = 0; b < NB; b++) acc[b] = 0.f;
        for (int blk = p; blk < nb; blk += P) {
            const uint4 hd = hdr[r * nb + blk];
            if constexpr (K45) {
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    float sc[2], mn[2];
                    mmq_k45_scales(hd, c, sc, mn);
#pragma unroll
                    for (int sub = 0; sub < 2; sub++) {
                        const int g = blk * 8 + 2 * c + sub;
#pragma unroll
                        for (int b = 0; b < NB; b++) {
                            const float2 dd = xds[b * ng + g];
                            acc[b] = fmaf(sc[sub] * dd.x, t[b * R * ts + g], fmaf(-mn[sub], dd.y, acc[b]));
                        }
                    }
                }
            } else {
                const float dq = dqs[r * nb + blk];
                const u32 scw[4] = {hd.x, hd.y, hd.z, hd.w};
#pragma unroll
                for (int gi = 0; gi < 8; gi++) {
                    const int g = blk * 8 + gi;  // scales sc[2gi], sc[2gi + 1] (8h + 2kind + half = 2gi + half)
                    const float s0 = dq * (float)(signed char)(scw[gi >> 1] >> (16 * (gi & 1)));
                    const float s1 = dq * (float)(signed char)(scw[gi >> 1] >> (16 * (gi & 1) + 8));
#pragma unroll
                    for (int b = 0; b < NB; b++) {
                        const float2 dd = xds[b * ng + g];
                        const float* tg = t + b * R * ts + 2 * g;
                        acc[b] = fmaf(dd.x, fmaf(s0, tg[0], s1 * tg[1]), acc[b]);
                    }
                }
            }
        }
#pragma unroll
        for (int b = 0; b < NB; b++) red[(p * NB + b) * R + r] = acc[b];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < R * B; e += blockDim.x) {  // mm_epilogue's order
        const int r = e % R, b = e / R, row = row0 + r;
        if (row >= n_rows) continue;
        float tot = 0.f;
        for (int ks = 0; ks < KS; ks++) {
            float s = 0.f;
            for (int k = 0; k < WK; k++) s += red[((ks * WK + k) * NB + b) * R + r];
            tot = KS == 1 ? s : tot + s;
        }
        out[(long long)b * n_rows + row] = tot;
    }
}
