// The int8 tensor-core matmul (mmq): out[b, row] = sum_c W[row, c] * x[b, c] for up to 64 rows of x on the int8 tensor cores
// (mma.sync m16n8k32 / m16n8k16 .s8, exact int32 sums), for the K-quants, whose blocks come
// through mm_staged_walk's cp.async stages (tensor_core.cuh); each warp takes MT tiles of 16 rows.
// x enters as the i16 matvec's two int8 planes (quant2_group's arithmetic): per group of 32
// columns x ~= d * q1 + d2 * q2 with d2 = d / 254, so x ~= d2 * (254 q1 + q2) within
// max|x_group| / 64516 (~2e-5 relative), the same activations as the i16 matvec below mmq's rows.
// The weights enter as their integers (Q4_K/Q5_K q, Q6_K q - 32), one mma per plane per
// sub-block; sub-block scales and mins, and x's group scale d2 and group sum, apply in f32.
// So mmq is ~4x fewer tensor-core instructions than mm's exact f16 split (2 per 32 columns
// instead of 8 with the min terms), at the i16 matvec's precision.
//
// The int32 sums start from MMQ_BIAS, the f32 1.5 * 2^23 read as an integer: a sum s with
// |s| < 2^22 then reads as the float 1.5 * 2^23 + s, and one FADD gives s exactly (no I2F, a
// quarter-rate conversion that would bound the kernel). Per plane |s| <= 32 * 32 * 127 < 2^22.
//
// Fragments (lane = 4 gid + tig): m16n8k32 A regs (row gid, k 4tig..+3), (row gid+8, same k),
// (row gid, k 16+4tig..+3), (row gid+8, same); B (k 4tig..+3, col gid), (k 16+4tig..+3, col
// gid); C (row gid, col 2tig, 2tig+1), (row gid+8, ...). m16n8k16: A (row gid, k 4tig..+3),
// (row gid+8, same); B (k 4tig..+3, col gid). The k index is the element's position in the
// sub-block (Q4_K/Q5_K: 32, Q6_K: 16).
//
// x layout (quantize_mmq_kernel), Bp = 8 * NT rows (rows from B on are zero): xq [groups][Bp][4]
// uint4, entry (g, n, tig) = plane 1 at k 4tig..+3 and 16+4tig..+3 of group g, then plane 2
// likewise: the B fragments of both planes in one 16-byte load, 512 contiguous bytes a warp;
// xd [groups][Bp] float2 (d2, group sum of the dequantized x): a lane's C columns 2tig, 2tig+1
// are one float4.
//
// Launched by mm.py; compiled by NVRTC at run time, headers inlined (sources.py).

#include "tensor_core.cuh"

#define MMQ_BIAS 0x4B400000
#define MMQ_BIAS_F 12582912.0f
__device__ __forceinline__ float mmq_f(int c) { return __int_as_float(c) - MMQ_BIAS_F; }
// c = A B + MMQ_BIAS: the bias goes in as the C operand (one register for all four), not as
// accumulators set before the mma (four register moves per mma)
__device__ __forceinline__ void mma_s8_k32(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const int bias = MMQ_BIAS;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(bias));
}
__device__ __forceinline__ void mma_s8_k16(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    const int bias = MMQ_BIAS;
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(bias));
}
// 254 * (plane-1 sum) + (plane-2 sum) of one mma pair, as f32 (x = d2 * that per group)
__device__ __forceinline__ float mmq_t(int c1, int c2) { return fmaf(254.f, mmq_f(c1), mmq_f(c2)); }

// x [B, n_cols] f32 -> xq, xd above; one thread per float4 of the Bp padded rows (n4 = Bp * n_cols
// / 4), 8 threads per group, the arithmetic of quantize_x2_kernel (quant2_group). FX (the
// batch-invariant mode's fixed form, fixed_point.cu fx_quantize_mmq_kernel): the group sum as the
// i16 planes carry it, d s + d2 s2 with each product rounded (fx_group_sum), so that mmq's min
// term takes the fixed-point matvec's operand.
template <bool FX>
__device__ __forceinline__ void quantize_mmq(const float* x, u32* __restrict__ xq, float2* __restrict__ xd, int n_cols,
                                             int B, int Bp) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int cols4 = n_cols >> 2, n4 = Bp * cols4;
    const int n = t / cols4, c4 = t % cols4;
    const bool ok = t < n4, real = ok && n < B;  // n4 is a multiple of 8: a group is all in or all out
    const float4 v = real ? __ldca((const float4*)x + (long long)n * cols4 + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    int q[4], r[4], s, s2;
    float d, d2;
    quant2_group(v, q, r, d, d2, s, s2);
    if (!ok) return;
    const int g = c4 >> 3, k = c4 & 7;  // elements 4k..4k+3 of group g
    u32* e = xq + ((long long)g * Bp + n) * 16 + 4 * (k & 3) + (k >> 2);  // entry (g, n, tig = k & 3)
    e[0] = pack_bytes(q);
    e[2] = pack_bytes(r);
    if constexpr (FX) {
        if (k == 0) xd[(long long)g * Bp + n] = make_float2(d2, __fadd_rn(__fmul_rn(d, (float)s), __fmul_rn(d2, (float)s2)));
    } else {
        if (k == 0) xd[(long long)g * Bp + n] = make_float2(d2, fmaf(d, (float)s, d2 * (float)s2));
    }
}
extern "C" __global__ void __launch_bounds__(256) quantize_mmq_kernel(const float* x, u32* __restrict__ xq,
                                                                      float2* __restrict__ xd, int n_cols, int B,
                                                                      int Bp) {
    pdl_enter();
    quantize_mmq<false>(x, xq, xd, n_cols, B, Bp);
}

// The A fragments of the K-quants, read from a staged block p for the lane's row.
// Q4_K / Q5_K chunk c (sub-blocks 2c, 2c+1): qs bytes [32c, 32c+32) hold element l of sub-block
// 2c (low nibble) and 2c+1 (high); Q5_K's fifth bit of element l of sub-block is is bit is of
// qh[l]. lo, hi: the (k 4tig..+3, k 16+4tig..+3) words of sub-blocks 2c and 2c+1.
template <int QT>
__device__ __forceinline__ void mmq_k45_chunk(const u8* p, int c, int tig, u32 (&lo)[2], u32 (&hi)[2]) {
    constexpr int QS = QT == 12 ? 16 : 48;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 wq = *(const u32*)(p + QS + 32 * c + 16 * i + 4 * tig);
        lo[i] = wq & 0x0F0F0F0Fu;
        hi[i] = (wq >> 4) & 0x0F0F0F0Fu;
        if (QT == 13) {
            const u32 qh = *(const u32*)(p + 16 + 16 * i + 4 * tig);
            lo[i] |= ((qh >> (2 * c)) & 0x01010101u) << 4;
            hi[i] |= ((qh >> (2 * c + 1)) & 0x01010101u) << 4;
        }
    }
}
// sub-block scales s and mins m (weight = s * q - m) of chunk c's two sub-blocks from the header h
__device__ __forceinline__ void mmq_k45_scales(const uint4& h, int c, float (&s)[2], float (&m)[2]) {
    u32 scw, mw;
    k4_scales_packed(h.y, h.z, h.w, c >= 2, scw, mw);
    const int idx = (2 * c) & 3;
    const float d = h2f(h.x), dmin = h2f(h.x >> 16);
    s[0] = d * bytef(scw, idx, 0.f); s[1] = d * bytef(scw, idx + 1, 0.f);
    m[0] = dmin * bytef(mw, idx, 0.f); m[1] = dmin * bytef(mw, idx + 1, 0.f);
}
// Q6_K sub-block (h, kind, half) = elements 128h + 32 kind + 16 half + (0..15), scale
// sc[8h + 2 kind + half]: the lane's word (k 4tig..+3) as int8 q - 32
__device__ __forceinline__ u32 mmq_q6_word(const u8* p, int h, int kind, int half, int tig) {
    const int l = 16 * half + 4 * tig;
    const u32 ql = lds32a2(p + 64 * h + 32 * (kind & 1) + l);
    const u32 qh = lds32a2(p + 128 + 32 * h + l);
    const u32 nib = (kind >= 2 ? (ql >> 4) : ql) & 0x0F0F0F0Fu;
    return sub32_bytes(nib | (((qh >> (2 * kind)) & 0x03030303u) << 4));
}

// One CTA: WR warps side by side over 16-row tiles, WK = warps / WR over the block columns;
// gridDim.y = KS more splits of the block columns (mm_launch, as mm); mm_epilogue sums.
// xq, xd: quantize_mmq_kernel of x with Bp = 8 NT; out: [B, n_rows] f32.
//
// FX (the batch-invariant mode's fixed form, fixed_point.cu fx_mmq_kernel): the same steps, but
// each 256-column block's are chained from 0 (bv: "the block value", the one the fixed-point
// matvec computes) and the block values added as 64-bit fixed point (fx_of), exact in any order;
// part is then long long, and mm_epilogue sums integers. Without FX every step chains into acc.
// Where mmq_fx_shared_sums says so, FX's sums wait in shared memory while the blocks go by, not
// in registers: Q6_K's 64-bit sums at 6-8 tiles of x take 48-64 registers of mmq's 255, and
// ptxas, short of them, stopped loading x ahead of the mmas (H100, 64 rows: 58% of fx_mmq's
// stall samples were long-scoreboard waits, mostly at the mmas, against 18% for mmq); in shared
// memory its time at 64 rows went from 1.23-2.07x mmq's to 1.19-1.22x, and the 8B Q4_K_M pass's
// cost at 64 rows from +31.8% to +19.3% (H100, 2026-12-06). Q4_K and Q5_K, and Q6_K up to 4 tiles,
// measured faster with the sums in registers; at 5 tiles the two were mixed, and the registers
// won on the shapes that weigh most there (docs/PERFORMANCE.md, "Where the stalls are").
#ifndef MMQ_UNROLL
#define MMQ_UNROLL 4  // chunks (Q4_K/Q5_K: all 4) or groups (Q6_K: 4 of 8) unrolled per trip
#endif
#ifndef MMQ_MIN_BLOCKS
#define MMQ_MIN_BLOCKS 1  // __launch_bounds__ minimum CTAs of 256 threads per SM (2 caps registers at 128)
#endif
template <bool FX> struct MmqSum { typedef float T; };         // a row's sums: f32 chains
// whether fx_mmq_kernel<QT, NT, MT> keeps its 64-bit sums in shared memory (above); mirrored by
// fixed_point.py fx_mmq_shared_sums, which sizes the memory. (No check of the size in the kernel:
// one at its start, a branch of thread 0, moved ptxas's allocation enough to cost 20% at 64 rows.)
__host__ __device__ constexpr bool mmq_fx_shared_sums(int QT, int NT) { return QT == 14 && NT > 5; }
template <> struct MmqSum<true> { typedef long long T; };      // FX: 64-bit fixed point
template <int QT, int NT, int MT, bool FX>
__device__ __forceinline__ void mmq_body(const u8* __restrict__ w, const uint4* xq, const float2* xd,
                                         float* __restrict__ out, typename MmqSum<FX>::T* __restrict__ part,
                                         int* __restrict__ tile_count, int n_rows, int n_cols, long long row_bytes,
                                         int B, int WR) {
    typedef typename MmqSum<FX>::T T;
    typedef MmStage<QT> S;
    constexpr int Bp = 8 * NT;
    extern __shared__ __align__(16) u8 smem[];  // max(warps * MM_STAGES * 16 * SROW, mm_epilogue's warps * 16 MT * 8 NT * sizeof(T))
                                                // then FX's shared sums (fixed_point.py fx_mmq_smem_bytes)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int WK = nw / WR, wr = warp % WR, wk = warp / WR;
    const int gid = lane >> 2, tig = lane & 3;
    const int nparts = gridDim.y * WK, kpart = blockIdx.y * WK + wk;
    const uint4* xql = xq + gid * 4 + tig;                     // + (g Bp + 8 nt) * 4: entry (g, 8 nt + gid, tig)
    const float4* xdl = (const float4*)xd + tig;                // + g Bp / 2 + 4 nt: (d2, sum) of rows 8 nt + 2 tig, + 1
    T acc[MT][NT][4];  // [m-tile][n-tile][C entry]: each x fragment serves the warp's MT tiles of 16 rows
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0;
    // FX's shared sums: a thread's sum i (MT * NT * 4 of them) at sums[i * blockDim.x], past the
    // stages and the epilogue's area; read into acc after the walk, for mm_epilogue
    constexpr bool SHARED_SUMS = FX && mmq_fx_shared_sums(QT, NT);
    T* sums = nullptr;
    if constexpr (SHARED_SUMS) {
        const int off = max(nw * MM_STAGES * 16 * S::SROW, nw * 16 * MT * 8 * NT * (int)sizeof(T));
        sums = (T*)(smem + off) + threadIdx.x;
#pragma unroll
        for (int i = 0; i < MT * NT * 4; i++) sums[i * blockDim.x] = 0;
    }
    mm_staged_walk<QT, MT>(w, n_rows, row_bytes, blockIdx.x * 16 * MT * WR + 16 * MT * wr, kpart, nparts, n_cols / 256,
                           smem + warp * MM_STAGES * 16 * S::SROW, [&](int blk, const u8* const (&rows)[2 * MT]) {
        float bv[MT][NT][4];  // FX: the block's values, chained from 0 (unused without FX)
        if constexpr (FX) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) bv[mt][nt][0] = bv[mt][nt][1] = bv[mt][nt][2] = bv[mt][nt][3] = 0.f;
        }
        // the f32 chain a step adds to: acc itself, or with FX the block value
        auto chain = [&](int mt, int nt) -> float* {
            if constexpr (FX) return bv[mt][nt];
            else return acc[mt][nt];
        };
        if constexpr (QT == 12 || QT == 13) {
            uint4 hd[2 * MT];  // headers of the lane's rows gid + 8 i
#pragma unroll
            for (int i = 0; i < 2 * MT; i++) hd[i] = *(const uint4*)rows[i];
#pragma unroll MMQ_UNROLL
            for (int c = 0; c < 4; c++) {
                u32 lo[2 * MT][2], hi[2 * MT][2];
                float sc[2 * MT][2], mn[2 * MT][2];
#pragma unroll
                for (int i = 0; i < 2 * MT; i++) {
                    mmq_k45_chunk<QT>(rows[i], c, tig, lo[i], hi[i]);
                    mmq_k45_scales(hd[i], c, sc[i], mn[i]);
                }
#pragma unroll
                for (int sub = 0; sub < 2; sub++) {
                    const long long g = (long long)blk * 8 + 2 * c + sub;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const uint4 xv = __ldca(xql + (g * Bp + 8 * nt) * 4);
                        const float4 dd = __ldca(xdl + g * (Bp / 2) + 4 * nt);  // (d2, sum) of columns 2tig, 2tig+1
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            const int ia = 2 * mt, ib = 2 * mt + 1;  // rows 16 mt + gid, + 8
                            const u32(&qa)[2] = sub ? hi[ia] : lo[ia];
                            const u32(&qb)[2] = sub ? hi[ib] : lo[ib];
                            int c1[4], c2[4];
                            mma_s8_k32(c1, qa[0], qb[0], qa[1], qb[1], xv.x, xv.y);
                            mma_s8_k32(c2, qa[0], qb[0], qa[1], qb[1], xv.z, xv.w);
                            float* ac = chain(mt, nt);
                            const float sa = sc[ia][sub], ma = mn[ia][sub], sb = sc[ib][sub], mb = mn[ib][sub];
                            ac[0] = fmaf(sa * dd.x, mmq_t(c1[0], c2[0]), fmaf(-ma, dd.y, ac[0]));
                            ac[1] = fmaf(sa * dd.z, mmq_t(c1[1], c2[1]), fmaf(-ma, dd.w, ac[1]));
                            ac[2] = fmaf(sb * dd.x, mmq_t(c1[2], c2[2]), fmaf(-mb, dd.y, ac[2]));
                            ac[3] = fmaf(sb * dd.z, mmq_t(c1[3], c2[3]), fmaf(-mb, dd.w, ac[3]));
                        }
                    }
                }
            }
        } else {  // Q6_K: weight = d * sc * (q - 32), sub-blocks of 16, two per group of 32
            float dq[2 * MT];
#pragma unroll
            for (int i = 0; i < 2 * MT; i++) dq[i] = h2f((u32)*(const u16*)(rows[i] + 208));
#pragma unroll MMQ_UNROLL
            for (int gi = 0; gi < 8; gi++) {  // group gi of the block: h = gi / 4, kind = gi % 4
                const int h = gi >> 2, kind = gi & 3;
                u32 a[2 * MT][2];    // [row gid + 8 i][half]
                float s[2 * MT][2];  // likewise
#pragma unroll
                for (int i = 0; i < 2 * MT; i++)
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        a[i][half] = mmq_q6_word(rows[i], h, kind, half, tig);
                        s[i][half] = dq[i] * (float)(signed char)rows[i][192 + 8 * h + 2 * kind + half];
                    }
                const long long g = (long long)blk * 8 + gi;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 xv = __ldca(xql + (g * Bp + 8 * nt) * 4);
                    const float4 dd = __ldca(xdl + g * (Bp / 2) + 4 * nt);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const int ia = 2 * mt, ib = 2 * mt + 1;
                        int c10[4], c20[4], c11[4], c21[4];
                        mma_s8_k16(c10, a[ia][0], a[ib][0], xv.x);
                        mma_s8_k16(c20, a[ia][0], a[ib][0], xv.z);
                        mma_s8_k16(c11, a[ia][1], a[ib][1], xv.y);
                        mma_s8_k16(c21, a[ia][1], a[ib][1], xv.w);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int i = e < 2 ? ia : ib;  // C entries 0, 1: row gid; 2, 3: row gid + 8
                            const float u = fmaf(s[i][0], mmq_t(c10[e], c20[e]), s[i][1] * mmq_t(c11[e], c21[e]));
                            float* ac = chain(mt, nt);
                            ac[e] = fmaf((e & 1) ? dd.z : dd.x, u, ac[e]);
                        }
                    }
                }
            }
        }
        if constexpr (FX) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        if constexpr (SHARED_SUMS) sums[((mt * NT + nt) * 4 + e) * blockDim.x] += fx_of(bv[mt][nt][e]);
                        else acc[mt][nt][e] += fx_of(bv[mt][nt][e]);
                    }
        }
    });
    if constexpr (SHARED_SUMS) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][nt][e] = sums[((mt * NT + nt) * 4 + e) * blockDim.x];
    }
    __syncthreads();  // every warp is done with its stage: the reduction reuses the memory
    mm_epilogue<NT, MT, T>(acc, (T*)smem, out, part, tile_count, n_rows, B, WR);
}

template <int QT, int NT, int MT>
__global__ void __launch_bounds__(256, MMQ_MIN_BLOCKS) mmq_kernel(const u8* __restrict__ w, const uint4* xq,
                                                  const float2* xd, float* __restrict__ out,
                                                  float* __restrict__ part, int* __restrict__ tile_count, int n_rows,
                                                  int n_cols, long long row_bytes, int B, int WR) {
    pdl_enter();
    mmq_body<QT, NT, MT, false>(w, xq, xd, out, part, tile_count, n_rows, n_cols, row_bytes, B, WR);
}

// ================================================================ mmqx: x staged once per CTA
// mmqx_kernel: mmq for matrices of many rows, x staged in shared memory once per CTA for the
// warps that share a block column.
//
// Why. mmq_kernel gives each 16-row weight tile its own CTA of WK warps, each warp on its own
// block columns, and every warp reads x's fragments from L1/L2: at 64 rows of x that is 36 KB of
// x per 256-column block against 2.3 KB of weights, and the kernel waits on those loads (long
// scoreboard: 24% of mmq's stall samples at 64 rows, 35% of the fixed form's, whose 64-bit sums
// leave ptxas no registers to load x ahead; docs/PERFORMANCE.md, "Where the stalls are"). Here a
// CTA of WR warps takes WR tiles side by side (16 WR rows) and walks one block-column sequence
// (blockIdx.y, + KS ...): each column's weights for the 16 WR rows and x's 8 groups for all 8 NT
// rows come in together by 16-byte cp.async (4-byte for Q6_K's 2-byte-aligned blocks) into one
// of NS stages, one __syncthreads a column, and the warps read x's fragments from shared memory:
// x crosses L2 -> SM once per CTA instead of once per warp. It pays where the matrix gives about
// an SM's worth of CTAs of 128 rows without split-K (the 8B's gate and up: 0.77-0.92x mmq at 8-64
// rows on an H100), and loses where it must split K to fill the GPU (4096-row matrices: 1.2-2x):
// tuning.py mmqx_launch says where it runs (docs/PERFORMANCE.md, "x staged once per CTA").
//
// The steps of a block are mmq_body's, the same expressions in the same order (kept apart from
// mmq_body's: sharing one function moved ptxas's allocation of mmq_kernel, dev/ptx_compare.py),
// so with FX (fixed_point.cu fx_mmqx_kernel) a block's value is fx_mmq_kernel's and a row's
// fixed-point sum has its bits exactly; without FX each warp chains its rows over its CTA's
// columns in order, as mmq_kernel does at WK = 1, whatever NT: the row's order depends on the
// matrix's shape (the launch) only.
//
// Stage layout (one of NS): the weights [16 WR rows][SROW], then x's block: xq's 8 groups
// [8][Bp][4] uint4 (quantize_mmq_kernel's layout, contiguous per block), then xd's [8][Bp] float2.

template <int QT, int NT, int WR>
struct MmqxStage {
    typedef MmStage<QT> S;
    static constexpr int Bp = 8 * NT;
    static constexpr int W_BYTES = 16 * WR * S::SROW;
    static constexpr int XQ_BYTES = 8 * Bp * 64;
    static constexpr int XD_BYTES = 8 * Bp * 8;
    static constexpr int BYTES = W_BYTES + XQ_BYTES + XD_BYTES;
};

// out [B, n_rows] (or, with KS = gridDim.y > 1, part [KS, B, n_rows] and the last CTA's sum):
// grid (ceil(n_rows / 16 WR), KS), block 32 WR, dynamic shared memory
// max(NS * MmqxStage::BYTES, WR * 16 * 8 NT * sizeof(sum)).
template <int QT, int NT, int WR, int NS, bool FX>
__device__ __forceinline__ void mmqx_body(const u8* __restrict__ w, const uint4* xq, const float2* xd,
                                          float* __restrict__ out, typename MmqSum<FX>::T* __restrict__ part,
                                          int* __restrict__ tile_count, int n_rows, int n_cols, long long row_bytes,
                                          int B) {
    typedef typename MmqSum<FX>::T T;
    typedef QTraits<QT, CUT_V2> QTr;
    typedef MmStage<QT> S;
    typedef MmqxStage<QT, NT, WR> X;
    constexpr int Bp = X::Bp, R = 16 * WR, NTH = 32 * WR;
    static_assert(NS >= 2, "two stages at least");
    extern __shared__ __align__(16) u8 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    const int gid = lane >> 2, tig = lane & 3;
    const int KS = gridDim.y, kpart = blockIdx.y, nb = n_cols / 256;
    const int row0 = blockIdx.x * R;
    auto row_ptr = [&](int r) { return w + (long long)min(row0 + r, n_rows - 1) * row_bytes; };

    auto issue = [&](int blk, int slot) {
        if (blk < nb) {
            u8* st = smem + slot * X::BYTES;
            if constexpr (QTr::BYTES % 16 == 0) {  // Q4_K, Q5_K: 16-byte-aligned blocks, SROW = BYTES
                constexpr int CH = QTr::BYTES / 16;
                for (int i = tid; i < R * CH; i += NTH) {
                    const int r = i / CH, k = i % CH;
                    cp_async16(st + r * S::SROW + 16 * k, row_ptr(r) + (long long)blk * QTr::BYTES + 16 * k);
                }
            } else {  // Q6_K: 4-byte copies from the word below the block's start (MmStage)
                for (int i = tid; i < R * S::NWORDS; i += NTH) {
                    const int r = i / S::NWORDS, k = i % S::NWORDS;
                    const unsigned long long g = (unsigned long long)(row_ptr(r) + (long long)blk * QTr::BYTES);
                    cp_async4(st + r * S::SROW + 4 * k, (const u32*)(g & ~3ull) + k);
                }
            }
            const uint4* xs = xq + (long long)blk * 8 * Bp * 4;  // the block's 8 groups, contiguous
            u8* xqd = st + X::W_BYTES;
#pragma unroll 4
            for (int i = tid; i < 8 * Bp * 4; i += NTH) cp_async16(xqd + 16 * i, xs + i);
            const uint4* ds = (const uint4*)(xd + (long long)blk * 8 * Bp);
            u8* xdd = xqd + X::XQ_BYTES;
            for (int i = tid; i < 8 * Bp / 2; i += NTH) cp_async16(xdd + 16 * i, ds + i);
        }
        cp_async_commit();  // a group per column, empty past the end
    };

    T acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;

#pragma unroll
    for (int s = 0; s < NS - 1; s++) issue(kpart + s * KS, s);
    int slot = 0;
    for (int blk = kpart; blk < nb; blk += KS) {
        cp_async_wait<NS - 2>();  // this column's group (the oldest but NS - 2) has landed, this thread's part
        __syncthreads();          // every thread's part; and every warp is past the previous column
        issue(blk + (NS - 1) * KS, slot == 0 ? NS - 1 : slot - 1);
        const u8* st = smem + slot * X::BYTES;
        const uint4* xsl = (const uint4*)(st + X::W_BYTES) + gid * 4 + tig;            // + (gl Bp + 8 nt) * 4
        const float4* xdl = (const float4*)(st + X::W_BYTES + X::XQ_BYTES) + tig;       // + gl Bp / 2 + 4 nt
        const u8* rows[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int r = 16 * warp + gid + 8 * i;
            const int mis = QTr::BYTES % 4 == 0 ? 0
                            : (int)((unsigned long long)(row_ptr(r) + (long long)blk * QTr::BYTES) & 3ull);
            rows[i] = st + r * S::SROW + mis;
        }
        float bv[NT][4];
        if constexpr (FX) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) bv[nt][0] = bv[nt][1] = bv[nt][2] = bv[nt][3] = 0.f;
        }
        auto chain = [&](int nt) -> float* {
            if constexpr (FX) return bv[nt];
            else return acc[nt];
        };
        if constexpr (QT == 12 || QT == 13) {
            uint4 hd[2];
#pragma unroll
            for (int i = 0; i < 2; i++) hd[i] = *(const uint4*)rows[i];
#pragma unroll MMQ_UNROLL
            for (int c = 0; c < 4; c++) {
                u32 lo[2][2], hi[2][2];
                float sc[2][2], mn[2][2];
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    mmq_k45_chunk<QT>(rows[i], c, tig, lo[i], hi[i]);
                    mmq_k45_scales(hd[i], c, sc[i], mn[i]);
                }
#pragma unroll
                for (int sub = 0; sub < 2; sub++) {
                    const int gl = 2 * c + sub;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const uint4 xv = xsl[(gl * Bp + 8 * nt) * 4];
                        const float4 dd = xdl[gl * (Bp / 2) + 4 * nt];
                        const u32(&qa)[2] = sub ? hi[0] : lo[0];
                        const u32(&qb)[2] = sub ? hi[1] : lo[1];
                        int c1[4], c2[4];
                        mma_s8_k32(c1, qa[0], qb[0], qa[1], qb[1], xv.x, xv.y);
                        mma_s8_k32(c2, qa[0], qb[0], qa[1], qb[1], xv.z, xv.w);
                        float* ac = chain(nt);
                        const float sa = sc[0][sub], ma = mn[0][sub], sb = sc[1][sub], mb = mn[1][sub];
                        ac[0] = fmaf(sa * dd.x, mmq_t(c1[0], c2[0]), fmaf(-ma, dd.y, ac[0]));
                        ac[1] = fmaf(sa * dd.z, mmq_t(c1[1], c2[1]), fmaf(-ma, dd.w, ac[1]));
                        ac[2] = fmaf(sb * dd.x, mmq_t(c1[2], c2[2]), fmaf(-mb, dd.y, ac[2]));
                        ac[3] = fmaf(sb * dd.z, mmq_t(c1[3], c2[3]), fmaf(-mb, dd.w, ac[3]));
                    }
                }
            }
        } else {  // Q6_K, as mmq_body
            float dq[2];
#pragma unroll
            for (int i = 0; i < 2; i++) dq[i] = h2f((u32)*(const u16*)(rows[i] + 208));
#pragma unroll MMQ_UNROLL
            for (int gi = 0; gi < 8; gi++) {
                const int h = gi >> 2, kind = gi & 3;
                u32 a[2][2];
                float s[2][2];
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        a[i][half] = mmq_q6_word(rows[i], h, kind, half, tig);
                        s[i][half] = dq[i] * (float)(signed char)rows[i][192 + 8 * h + 2 * kind + half];
                    }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 xv = xsl[(gi * Bp + 8 * nt) * 4];
                    const float4 dd = xdl[gi * (Bp / 2) + 4 * nt];
                    int c10[4], c20[4], c11[4], c21[4];
                    mma_s8_k16(c10, a[0][0], a[1][0], xv.x);
                    mma_s8_k16(c20, a[0][0], a[1][0], xv.z);
                    mma_s8_k16(c11, a[0][1], a[1][1], xv.y);
                    mma_s8_k16(c21, a[0][1], a[1][1], xv.w);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int i = e < 2 ? 0 : 1;
                        const float u = fmaf(s[i][0], mmq_t(c10[e], c20[e]), s[i][1] * mmq_t(c11[e], c21[e]));
                        float* ac = chain(nt);
                        ac[e] = fmaf((e & 1) ? dd.z : dd.x, u, ac[e]);
                    }
                }
            }
        }
        if constexpr (FX) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[nt][e] += fx_of(bv[nt][e]);
        }
        slot = slot == NS - 1 ? 0 : slot + 1;
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: the epilogue reuses the memory
    mm_epilogue<NT, 1, T>(reinterpret_cast<const T(&)[1][NT][4]>(acc), (T*)smem, out, part, tile_count, n_rows, B,
                          WR);
}

// mmqx_body as a kernel, its arguments mmq_kernel's (mm.py launches both alike)
template <int QT, int NT, int WR, int NS>
__global__ void __launch_bounds__(32 * WR, 1) mmqx_kernel(const u8* __restrict__ w, const uint4* xq, const float2* xd,
                                                         float* __restrict__ out, float* __restrict__ part,
                                                         int* __restrict__ tile_count, int n_rows, int n_cols,
                                                         long long row_bytes, int B, int /* WR: the template's */) {
    pdl_enter();
    mmqx_body<QT, NT, WR, NS, false>(w, xq, xd, out, part, tile_count, n_rows, n_cols, row_bytes, B);
}
