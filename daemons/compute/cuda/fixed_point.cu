// fixed_point.cu: the batch-invariant mode's fixed form (KernelOptions.invariant_fixed): a row's
// sum that no order changes.
//
// Why. A row's bits depend on the order its f32 steps are added in, so the mode's two forms each
// fix one kernel's order at every row count: mmq's (+66% at one row, where the i16 matvec is
// faster) or the matvec's (+62% at 8 rows, several times mmq past 8; docs/PERFORMANCE.md, "The
// batch-invariant mode: its cost"). Here the order stops mattering. Every kernel computes, for
// each 256-column block of a weight row and each row of x, the same f32 value in the same steps
// (mmq's per-sub-block steps, chained from 0 over the block's sub-blocks in order: "the block
// value"); that value is converted to a 64-bit integer in units of 2^-32, and from there on the
// sums are integer sums, exact in any order: lanes, warps, split-K partials, atomics. So the
// matvec (1-8 rows) and mmq (1-64) give a row the same bits, and each keeps its own fast order:
// a pass could take the matvec at 1-2 rows and mmq from 3, as the default does. What it costs
// is one f32 -> s64 conversion and one 64-bit add per block value (a block is 8 sub-block steps
// of mmq's), and 64-bit accumulators.
//
// Range and precision: a block value under 2^31 in magnitude (the conversion saturates past it),
// a row's sum under 2^31; each block value is rounded to a multiple of 2^-32 (2.3e-10), so a row
// of nb blocks is within nb * 2^-33 of the f32 chain's sum of the same block values. A NaN block
// value converts to 0 and an infinite one saturates, where the f32 kernels carry them into the
// logits: not flagged yet (a per-entry flag would cost registers mmq's form has none left of).
//
// x is quantized as for the i16 matvec and mmq (quant2_group's two int8 planes): the matvec reads
// the i16 planes' layout, mmq its own (fx_quantize_mmq_kernel: one group sum for both, below),
// so a sub-block's integer sums are the same integers (dp4a here, mma there) and its f32 steps
// take the same operands. Launched by fixed_point.py (fx_matvec_direct, fx_matvec_staged,
// fx_mmq, fx_quantize); compiled by NVRTC at run time, headers inlined.
//
// fx_mmq_kernel, fx_epilogue and fx_quantize_mmq_kernel are copies of mmq_kernel, mm_epilogue
// and quantize_mmq_kernel with the accumulation (and the group sum) changed, so that the default's
// kernels stay exactly as measured until this form's speed is known; if it becomes the mode's
// form, the accumulation should become a template policy of those kernels (a change whose PTX
// for the default dev/ptx_compare.py can hold equal), not a second copy.

#include "mmq.cu"

#define FX_ONE 4294967296.f                 // 2^32: block values in units of 2^-32
#define FX_INV 2.3283064365386963e-10f      // 2^-32

// a block value as fixed point: exact integer additions from here on
__device__ __forceinline__ long long fx_of(float v) { return __float2ll_rn(__fmul_rn(v, FX_ONE)); }
// a row's fixed-point sum as f32 (one rounding, then an exact power-of-two scale)
__device__ __forceinline__ float fx_value(long long a) { return __fmul_rn(__ll2float_rn(a), FX_INV); }

// The block value's steps, mmq_kernel's expressions with the products unfused so that no
// compiler contraction can make two kernels differ. Q4_K/Q5_K, one sub-block: s, m its scale and
// min, dd x's (d2, group sum), t = 254 c1 + c2 of the plane sums rounded once.
__device__ __forceinline__ float fx_k45_step(float bv, float s, float m, float2 dd, float t) {
    return fmaf(__fmul_rn(s, dd.x), t, fmaf(-m, dd.y, bv));
}
// Q6_K, one group of 32 columns: two 16-column halves (scales s0, s1; t0, t1), x's d2
__device__ __forceinline__ float fx_q6_step(float bv, float s0, float s1, float d2, float t0, float t1) {
    return fmaf(d2, fmaf(s0, t0, __fmul_rn(s1, t1)), bv);
}
// t of a sub-block from its exact plane sums: mmq_t's value (fmaf rounds the same integer once)
__device__ __forceinline__ float fx_t(int c1, int c2) { return __int2float_rn(254 * c1 + c2); }

// N words from a 2-byte-aligned address p, global or shared (Q6_K blocks are 210 bytes)
template <int N>
__device__ __forceinline__ void fx_words(const u8* p, u32 (&o)[N]) {
    const u32* a = (const u32*)((unsigned long long)p & ~3ull);
    if (((unsigned long long)p & 3ull) == 0) {
#pragma unroll
        for (int k = 0; k < N; k++) o[k] = a[k];
    } else {
        u32 prev = a[0];
#pragma unroll
        for (int k = 0; k < N; k++) {
            const u32 next = a[k + 1];
            o[k] = __funnelshift_r(prev, next, 16);
            prev = next;
        }
    }
}

// ================================================================ x: one group sum for both layouts
// The min term of a Q4_K/Q5_K sub-block takes x's group sum. mmq's planes carry fmaf(d, s, d2 s2)
// (quantize_mmq_kernel), the i16 planes (d, d s) and (d2, d2 s2) (quant2_store), from which
// that fmaf cannot be rebuilt. So the fixed-point sums define the group sum as the i16 planes'
// d s + d2 s2, each product rounded, then their sum: fx_quantize_mmq_kernel writes it into mmq's
// layout for fx_mmq_kernel, and the matvecs read the i16 planes that production's fused
// producers (rmsnorm_q2, swiglu_q2, attn_combine) already write for the i16 matvec.
__device__ __forceinline__ float fx_group_sum(float ds, float ds2) { return __fadd_rn(ds, ds2); }

// quantize_mmq_kernel (mmq.cu) with fx_group_sum in xd's second entry: x [B, n_cols] f32 ->
// xq, xd in mmq's layout (Bp = 8 NT rows, rows from B on zero).
extern "C" __global__ void __launch_bounds__(256) fx_quantize_mmq_kernel(const float* x, u32* __restrict__ xq,
                                                                         float2* __restrict__ xd, int n_cols, int B,
                                                                         int Bp) {
    pdl_enter();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int cols4 = n_cols >> 2, n4 = Bp * cols4;
    const int n = t / cols4, c4 = t % cols4;
    const bool ok = t < n4, real = ok && n < B;
    const float4 v = real ? __ldca((const float4*)x + (long long)n * cols4 + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    int q[4], r[4], s, s2;
    float d, d2;
    quant2_group(v, q, r, d, d2, s, s2);
    if (!ok) return;
    const int g = c4 >> 3, k = c4 & 7;
    u32* e = xq + ((long long)g * Bp + n) * 16 + 4 * (k & 3) + (k >> 2);
    e[0] = pack_bytes(q);
    e[2] = pack_bytes(r);
    if (k == 0) xd[(long long)g * Bp + n] = make_float2(d2, fx_group_sum(__fmul_rn(d, (float)s), __fmul_rn(d2, (float)s2)));
}

// ================================================================ a block's values, one lane
// The values of block blk of one weight row (its bytes at bp, global or shared memory) for B
// rows of x given as the i16 planes (xq, ds; xq2, ds2: quant2_store's layout, [B, n_cols] and
// [B, n_cols / 32]), computed whole by the calling lane in mmq's steps and order. A
// sub-block's integer sums (dp4a) are the ones mmq's mma gives; its f32 steps take the same
// operands (fx_group_sum); so bv[b] is fx_mmq_kernel's value of this block for row b.
#ifndef FX_MV_UNROLL
#define FX_MV_UNROLL 1  // chunks (Q4_K/Q5_K, of 4) or groups (Q6_K, of 8) of a block unrolled: each loads its own words
#endif
template <int QT, int B>
__device__ __forceinline__ void fx_block(const u8* bp, int blk, const u8* xq, const float2* ds, const u8* xq2,
                                         const float2* ds2, int n_cols, float (&bv)[B]) {
    constexpr int QS = QT == 12 ? 16 : 48;
    const int ng = n_cols / 32;
    // the sums of a sub-block (group g of x row b) against the weight words wv (word k: elements
    // 4k..4k+3), per plane: over words 0-3 (Q6_K's first half), over 4-7
    auto sums = [&](const u32 (&wv)[8], int b, long long g, int (&c)[2][2]) {
        const uint4* p1 = (const uint4*)(xq + (long long)b * n_cols + 32 * g);
        const uint4* p2 = (const uint4*)(xq2 + (long long)b * n_cols + 32 * g);
        const uint4 a0 = __ldca(p1), a1 = __ldca(p1 + 1), b0 = __ldca(p2), b1 = __ldca(p2 + 1);
        c[0][0] = __dp4a((int)wv[3], (int)a0.w, __dp4a((int)wv[2], (int)a0.z,
                  __dp4a((int)wv[1], (int)a0.y, __dp4a((int)wv[0], (int)a0.x, 0))));
        c[0][1] = __dp4a((int)wv[7], (int)a1.w, __dp4a((int)wv[6], (int)a1.z,
                  __dp4a((int)wv[5], (int)a1.y, __dp4a((int)wv[4], (int)a1.x, 0))));
        c[1][0] = __dp4a((int)wv[3], (int)b0.w, __dp4a((int)wv[2], (int)b0.z,
                  __dp4a((int)wv[1], (int)b0.y, __dp4a((int)wv[0], (int)b0.x, 0))));
        c[1][1] = __dp4a((int)wv[7], (int)b1.w, __dp4a((int)wv[6], (int)b1.z,
                  __dp4a((int)wv[5], (int)b1.y, __dp4a((int)wv[4], (int)b1.x, 0))));
    };
#pragma unroll
    for (int b = 0; b < B; b++) bv[b] = 0.f;
    if constexpr (QT == 12 || QT == 13) {
        const uint4 hd = *(const uint4*)bp;
        uint4 hv[2];  // Q5_K's qh
        if constexpr (QT == 13) { hv[0] = *(const uint4*)(bp + 16); hv[1] = *(const uint4*)(bp + 32); }
#pragma unroll FX_MV_UNROLL
        for (int c = 0; c < 4; c++) {  // chunk c: sub-blocks 2c, 2c + 1 (qs bytes 32c..32c+31, low / high nibbles)
            const uint4 q0 = *(const uint4*)(bp + QS + 32 * c), q1 = *(const uint4*)(bp + QS + 32 * c + 16);
            const u32 wq[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
            float sc[2], mn[2];
            mmq_k45_scales(hd, c, sc, mn);
#pragma unroll
            for (int sub = 0; sub < 2; sub++) {
                const long long g = (long long)blk * 8 + 2 * c + sub;
                u32 wv[8];
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    wv[k] = (sub ? wq[k] >> 4 : wq[k]) & 0x0F0F0F0Fu;
                    if constexpr (QT == 13) {
                        const u32 qh = k < 4 ? (&hv[0].x)[k] : (&hv[1].x)[k - 4];
                        wv[k] |= ((qh >> (2 * c + sub)) & 0x01010101u) << 4;
                    }
                }
#pragma unroll
                for (int b = 0; b < B; b++) {
                    int cs[2][2];
                    sums(wv, b, g, cs);
                    const float2 e1 = __ldca(ds + (long long)b * ng + g), e2 = __ldca(ds2 + (long long)b * ng + g);
                    bv[b] = fx_k45_step(bv[b], sc[sub], mn[sub], make_float2(e2.x, fx_group_sum(e1.y, e2.y)),
                                        fx_t(cs[0][0] + cs[0][1], cs[1][0] + cs[1][1]));
                }
            }
        }
    } else {  // Q6_K: ql [0, 128), qh [128, 192), scales [192, 208), d at 208; group gi = 4h + kind
        u32 scw[4];
        fx_words<4>(bp + 192, scw);
        const float dq = h2f((u32)*(const u16*)(bp + 208));
#pragma unroll FX_MV_UNROLL
        for (int gi = 0; gi < 8; gi++) {
            const int h = gi >> 2, kind = gi & 3;
            const long long g = (long long)blk * 8 + gi;
            u32 ql[8], qh[8];  // the group's low nibbles (ql bytes 64h + 32(kind & 1) ..) and high bits (qh 32h ..)
            fx_words<8>(bp + 64 * h + 32 * (kind & 1), ql);
            fx_words<8>(bp + 128 + 32 * h, qh);
            u32 wv[8];  // word k: elements 4k..4k+3 of the group (half 0: words 0-3, half 1: 4-7)
#pragma unroll
            for (int k = 0; k < 8; k++)
                wv[k] = sub32_bytes(((kind >= 2 ? ql[k] >> 4 : ql[k]) & 0x0F0F0F0Fu)
                                    | (((qh[k] >> (2 * kind)) & 0x03030303u) << 4));
            // scales sc[2gi], sc[2gi + 1] (mmq: 8h + 2kind + half)
            const float s0 = dq * (float)(signed char)(scw[gi >> 1] >> (16 * (gi & 1)));
            const float s1 = dq * (float)(signed char)(scw[gi >> 1] >> (16 * (gi & 1) + 8));
#pragma unroll
            for (int b = 0; b < B; b++) {
                int cs[2][2];  // [plane][half]
                sums(wv, b, g, cs);
                bv[b] = fx_q6_step(bv[b], s0, s1, __ldca(ds2 + (long long)b * ng + g).x, fx_t(cs[0][0], cs[1][0]),
                                   fx_t(cs[0][1], cs[1][1]));
            }
        }
    }
}

// ================================================================ the matvec, direct: a lane a block
// out[b, row] for B <= 8 rows of x (the i16 planes). TPR lanes take a weight row (256 / TPR rows
// a CTA of 256 threads), lane t its blocks t, t + TPR, ... read straight from global memory;
// each lane computes its blocks' values whole (fx_block: no f32 step crosses lanes), adds them as
// fixed point, and the row's lanes add theirs with shuffles. The lanes of a warp read different
// blocks, so their loads of the weights (16 bytes at the block stride) and of x (a block's
// columns each) touch up to 32 lines an instruction: fx_mvs_kernel stages instead.
#ifndef FX_MV_MIN_BLOCKS
#define FX_MV_MIN_BLOCKS 1  // CTAs of 256 threads an SM holds at least (2 caps registers at 128: spills here)
#endif
template <int QT, int B, int TPR>
__global__ void __launch_bounds__(256, FX_MV_MIN_BLOCKS)
    fx_mv_kernel(const u8* __restrict__ w, const u8* xq, const float2* ds, const u8* xq2, const float2* ds2,
                 float* __restrict__ out, int n_rows, int n_cols, long long row_bytes) {
    pdl_enter();
    constexpr int BYTES = QT == 12 ? 144 : QT == 13 ? 176 : 210;
    const int t = threadIdx.x % TPR, row = blockIdx.x * (256 / TPR) + threadIdx.x / TPR;
    const int nb = n_cols / 256;
    const u8* rp = w + (long long)min(row, n_rows - 1) * row_bytes;
    long long acc[B];
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = 0;
    for (int blk = t; blk < nb; blk += TPR) {
        float bv[B];
        fx_block<QT, B>(rp + (long long)blk * BYTES, blk, xq, ds, xq2, ds2, n_cols, bv);
#pragma unroll
        for (int b = 0; b < B; b++) acc[b] += fx_of(bv[b]);
    }
#pragma unroll
    for (int b = 0; b < B; b++)
#pragma unroll
        for (int o = TPR / 2; o > 0; o >>= 1) acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], o);
    if (t == 0 && row < n_rows) {
#pragma unroll
        for (int b = 0; b < B; b++) out[(long long)b * n_rows + row] = fx_value(acc[b]);
    }
}

// With KS = gridDim.y > 1 CTAs a row tile: each CTA has written its 64-bit sums of rows row0 ..
// row0 + R - 1 to part [KS, B, n_rows]; the last of the tile's CTAs to get here (tile_count)
// adds the KS of them and writes out, and resets the counter for the next launch.
__device__ __forceinline__ void fx_add_splits(const long long* __restrict__ part, int* __restrict__ tile_count,
                                              float* __restrict__ out, int n_rows, int B, int row0, int R) {
    const int KS = gridDim.y;
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(tile_count + blockIdx.x, 1) == KS - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < R * B; e += blockDim.x) {
        const int r = e % R, n = e / R, row = row0 + r;
        if (row >= n_rows) continue;
        long long s = 0;
        for (int k = 0; k < KS; k++) s += __ldcg(part + ((long long)k * B + n) * n_rows + row);
        out[(long long)n * n_rows + row] = fx_value(s);
    }
    if (threadIdx.x == 0) tile_count[blockIdx.x] = 0;
}

// ================================================================ the matvec, staged: a lane a row
// out[b, row] for B <= 8 rows of x (the i16 planes). A CTA takes 32 weight rows, its WK warps
// and the grid's KS = gridDim.y splits the block columns kpart = blockIdx.y * WK + warp, + WK KS,
// ...; each warp stages its 32 rows' block columns through mm_staged_walk (mmq.cu's: coalesced
// cp.async, MT = 2 tiles of 16 rows, columns in flight ahead of the one computed), and lane
// (gid, tig) computes the block of row gid + 8 tig from the stage (fx_block). So the weights
// come in as mmq reads them, every lane of a warp reads the same columns of x (one address a
// load), and no f32 step crosses lanes. The CTA's warps add their 64-bit sums through shared
// memory; with KS > 1 each CTA writes them to part [KS, B, n_rows] and the last CTA of the row
// tile (tile_count) adds the KS of them. Dynamic shared memory: WK warps x MM_STAGES x 16 x
// SROW (the stages), at least WK x 32 x B x 8 (the sums).
template <int QT, int B>
__global__ void __launch_bounds__(256) fx_mvs_kernel(const u8* __restrict__ w, const u8* xq, const float2* ds,
                                                     const u8* xq2, const float2* ds2, float* __restrict__ out,
                                                     long long* __restrict__ part, int* __restrict__ tile_count,
                                                     int n_rows, int n_cols, long long row_bytes) {
    pdl_enter();
    typedef MmStage<QT> S;
    extern __shared__ __align__(16) u8 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, WK = blockDim.x >> 5, KS = gridDim.y;
    const int gid = lane >> 2, tig = lane & 3;
    long long acc[B];
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = 0;
    mm_staged_walk<QT, 2>(w, n_rows, row_bytes, blockIdx.x * 32, blockIdx.y * WK + warp, KS * WK, n_cols / 256,
                          smem + warp * MM_STAGES * 16 * S::SROW, [&](int blk, const u8* const (&rows)[4]) {
        const u8* mine = tig == 0 ? rows[0] : tig == 1 ? rows[1] : tig == 2 ? rows[2] : rows[3];  // row gid + 8 tig
        float bv[B];
        fx_block<QT, B>(mine, blk, xq, ds, xq2, ds2, n_cols, bv);
#pragma unroll
        for (int b = 0; b < B; b++) acc[b] += fx_of(bv[b]);
    });
    __syncthreads();  // every warp is done with its stages: the sums reuse the memory
    long long* red = (long long*)smem;  // [WK][32 rows][B]
#pragma unroll
    for (int b = 0; b < B; b++) red[(warp * 32 + gid + 8 * tig) * B + b] = acc[b];
    __syncthreads();
    for (int e = threadIdx.x; e < 32 * B; e += blockDim.x) {
        const int r = e % 32, b = e / 32, row = blockIdx.x * 32 + r;
        long long s = 0;
        for (int k = 0; k < WK; k++) s += red[(k * 32 + r) * B + b];
        if (row < n_rows) {
            if (KS == 1) out[(long long)b * n_rows + row] = fx_value(s);
            else part[((long long)blockIdx.y * B + b) * n_rows + row] = s;
        }
    }
    if (KS > 1) fx_add_splits(part, tile_count, out, n_rows, B, blockIdx.x * 32, 32);
}

// ================================================================ mmq with fixed-point sums
// mm_epilogue's walk with 64-bit sums: the CTA's WK warps through shared memory, the KS
// partials through part [KS, B, n_rows] (the last CTA of a row tile adds them); any order gives
// the same integers, the order is kept only to mirror mm_epilogue.
template <int NT, int MT>
__device__ __forceinline__ void fx_epilogue(const long long (&acc)[MT][NT][4], long long* red, float* __restrict__ out,
                                            long long* __restrict__ part, int* __restrict__ tile_count, int n_rows,
                                            int B, int WR) {
    constexpr int R = 16 * MT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int gid = lane >> 2, tig = lane & 3, WK = nw / WR;
    long long* wred = red + warp * R * 8 * NT;  // [R][8 NT]
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int ra = 16 * mt + gid;
            wred[ra * 8 * NT + 8 * nt + 2 * tig] = acc[mt][nt][0];
            wred[ra * 8 * NT + 8 * nt + 2 * tig + 1] = acc[mt][nt][1];
            wred[(ra + 8) * 8 * NT + 8 * nt + 2 * tig] = acc[mt][nt][2];
            wred[(ra + 8) * 8 * NT + 8 * nt + 2 * tig + 1] = acc[mt][nt][3];
        }
    __syncthreads();
    const int KS = gridDim.y, n_entries = R * WR * B;
    const int row0 = blockIdx.x * R * WR;
    for (int e = threadIdx.x; e < n_entries; e += blockDim.x) {
        const int r = e % (R * WR), n = e / (R * WR);
        long long s = 0;
        for (int k = 0; k < WK; k++) s += red[((k * WR + r / R) * R + r % R) * 8 * NT + n];
        const int row = row0 + r;
        if (row < n_rows) {
            if (KS == 1) out[(long long)n * n_rows + row] = fx_value(s);
            else part[((long long)blockIdx.y * B + n) * n_rows + row] = s;
        }
    }
    if (KS > 1) fx_add_splits(part, tile_count, out, n_rows, B, row0, R * WR);
}

// mmq_kernel (mmq.cu) with each block's value chained from 0 in f32 (bv), then added to 64-bit
// accumulators: the same block values as the matvecs' fx_block, so the same row sums. Launched as
// mmq_kernel (mm_launch's grid and block); shared memory: the stages or fx_epilogue's warps x
// 16 MT rows x 8 NT 64-bit sums, whichever is larger.
template <int QT, int NT, int MT>
__global__ void __launch_bounds__(256, MMQ_MIN_BLOCKS) fx_mmq_kernel(const u8* __restrict__ w, const uint4* xq,
                                                                     const float2* xd, float* __restrict__ out,
                                                                     long long* __restrict__ part,
                                                                     int* __restrict__ tile_count, int n_rows,
                                                                     int n_cols, long long row_bytes, int B, int WR) {
    pdl_enter();
    typedef MmStage<QT> S;
    constexpr int Bp = 8 * NT;
    extern __shared__ __align__(16) u8 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int WK = nw / WR, wr = warp % WR, wk = warp / WR;
    const int gid = lane >> 2, tig = lane & 3;
    const int nparts = gridDim.y * WK, kpart = blockIdx.y * WK + wk;
    const uint4* xql = xq + gid * 4 + tig;
    const float4* xdl = (const float4*)xd + tig;
    long long acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0;
    mm_staged_walk<QT, MT>(w, n_rows, row_bytes, blockIdx.x * 16 * MT * WR + 16 * MT * wr, kpart, nparts, n_cols / 256,
                           smem + warp * MM_STAGES * 16 * S::SROW, [&](int blk, const u8* const (&rows)[2 * MT]) {
        float bv[MT][NT][4];  // the block's values, chained from 0
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) bv[mt][nt][0] = bv[mt][nt][1] = bv[mt][nt][2] = bv[mt][nt][3] = 0.f;
        if constexpr (QT == 12 || QT == 13) {
            uint4 hd[2 * MT];
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
                        const float4 dd = __ldca(xdl + g * (Bp / 2) + 4 * nt);  // (d2, sum) of x rows 2tig, 2tig+1
                        const float2 d0 = make_float2(dd.x, dd.y), d1 = make_float2(dd.z, dd.w);
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            const int ia = 2 * mt, ib = 2 * mt + 1;
                            const u32(&qa)[2] = sub ? hi[ia] : lo[ia];
                            const u32(&qb)[2] = sub ? hi[ib] : lo[ib];
                            int c1[4], c2[4];
                            mma_s8_k32(c1, qa[0], qb[0], qa[1], qb[1], xv.x, xv.y);
                            mma_s8_k32(c2, qa[0], qb[0], qa[1], qb[1], xv.z, xv.w);
                            float* v = bv[mt][nt];
                            v[0] = fx_k45_step(v[0], sc[ia][sub], mn[ia][sub], d0, mmq_t(c1[0], c2[0]));
                            v[1] = fx_k45_step(v[1], sc[ia][sub], mn[ia][sub], d1, mmq_t(c1[1], c2[1]));
                            v[2] = fx_k45_step(v[2], sc[ib][sub], mn[ib][sub], d0, mmq_t(c1[2], c2[2]));
                            v[3] = fx_k45_step(v[3], sc[ib][sub], mn[ib][sub], d1, mmq_t(c1[3], c2[3]));
                        }
                    }
                }
            }
        } else {  // Q6_K
            float dq[2 * MT];
#pragma unroll
            for (int i = 0; i < 2 * MT; i++) dq[i] = h2f((u32)*(const u16*)(rows[i] + 208));
#pragma unroll MMQ_UNROLL
            for (int gi = 0; gi < 8; gi++) {
                const int h = gi >> 2, kind = gi & 3;
                u32 a[2 * MT][2];
                float s[2 * MT][2];
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
                            const int i = e < 2 ? ia : ib;
                            bv[mt][nt][e] = fx_q6_step(bv[mt][nt][e], s[i][0], s[i][1], (e & 1) ? dd.z : dd.x,
                                                       mmq_t(c10[e], c20[e]), mmq_t(c11[e], c21[e]));
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][nt][e] += fx_of(bv[mt][nt][e]);
    });
    __syncthreads();
    fx_epilogue<NT, MT>(acc, (long long*)smem, out, part, tile_count, n_rows, B, WR);
}
