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
// the form takes the matvec at 1-2 rows and mmq from 3, as the default does. What it costs
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
// take the same operands. Three matvecs: fx_mvq_kernel (production's: the i16 matvec's launch
// and pieces, 8 lanes a block, the block value chained across them by shuffles), fx_mvs_kernel
// (staged as mmq stages, a lane a row) and fx_mv_kernel (direct, a lane a block), the last two
// kept to measure against. Launched by fixed_point.py (fx_matvec_pieces, fx_matvec_group,
// fx_matvec_staged, fx_matvec_direct, fx_mmq, fx_quantize); compiled by NVRTC at run time,
// headers inlined.
//
// fx_mmq_kernel is mmq.cu's mmq_body with FX (its accumulation a template argument: the
// default's mmq_kernel PTX is unchanged by it, dev/ptx_compare.py), and the split-K partials are
// tensor_core.cuh's mm_add_splits on integers; fx_quantize_mmq_kernel is quantize_mmq_kernel with
// the i16 planes' group sum.

#include "mmq.cu"
#include "matvec.cuh"

// fx_of (a block value as 64-bit fixed point in units of 2^-32) and fx_value (a row's sum back
// as f32) are tensor_core.cuh's: mmq's fixed form sums with them too.

// The block value's steps: mmq_body's expressions (a product there is an operand of an fmaf,
// which no contraction merges; __fmul_rn says so here), so both kernels round alike.
// Q4_K/Q5_K, one sub-block: s, m its scale and min, dd x's (d2, group sum), t = 254 c1 + c2 of
// the plane sums rounded once.
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
    quantize_mmq<true>(x, xq, xd, n_cols, B, Bp);
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

// ================================================================ the matvec, in the i16 matvec's pieces
// fx_mvq_kernel: the i16 matvec (matvec.cu mvq2_kernel: matvec.cuh's matvec_rows, its launch
// table, its pieces and loads) with fixed-point sums. A block's 8 pieces lie in 8 consecutive
// lanes (piece j = lane % 8: matvec_rows strides by whole warps), each lane decoding its piece of
// NR weight rows once for all B rows of x, as mvq2 does. What differs is the sum: a lane's
// integer sums of a sub-block (254 c1 + c2 over its columns) are added across the lanes that
// share the sub-block with integer shuffles (exact), and the block value is then chained in
// fx_block's steps and order across the lanes that hold the sub-blocks, each lane taking its
// steps on the value the previous lanes passed on (a scan of shuffles), so one lane ends with
// fx_block's value and adds it as fixed point. The weights come in as mvq2 reads them: 16-byte
// loads, a warp on 4 consecutive blocks of a row.
template <int QT> struct MvFxP;
// Q4_K / Q5_K: piece j holds 16 columns of sub-blocks 2c and 2c + 1 (c = j / 2, QDK45): lanes j
// and j ^ 1 complete them; chunk c's lanes take steps 2c, 2c + 1 after chunk c - 1's.
template <int QT> struct MvFxK45 : QDK45<QT> {
    typedef QDK45<QT> T;
    typedef long long Acc;
    typedef typename MvDp4aP<QT, 2>::Act Act;
    static __device__ __forceinline__ int dot4(const u32 (&q)[4], const uint4& x) {
        return dp4(q[3], x.w, dp4(q[2], x.z, dp4(q[1], x.y, dp4(q[0], x.x, 0))));
    }
    template <int B, int NR>
    static __device__ __forceinline__ void accumulate(const typename T::Raw (&raw)[NR], int blk, int j, const Act& act,
                                                      int n_cols, long long (&acc)[NR][B]) {
        const int base = threadIdx.x & 24;  // this block's first lane in the warp
        const unsigned mask = 0xFFu << base;
        typename T::Dec dec[NR];
        float sc[NR][2], mn[NR][2];
#pragma unroll
        for (int r = 0; r < NR; r++) {
            T::decode(raw[r], j, dec[r]);  // its integer words; the scales are mmq's (fx_block's)
            mmq_k45_scales(raw[r].h, j >> 1, sc[r], mn[r]);
        }
#pragma unroll
        for (int b = 0; b < B; b++) {
            const long long xo = (long long)b * n_cols + (long long)blk * T::EPB;
            const long long go = (long long)b * act.ngroups + (long long)blk * (T::EPB / 32);
            typename T::XV x1, x2;
            T::loadx(j, act.xq + xo, act.ds + go, x1);
            T::loadx(j, act.xq2 + xo, act.ds2 + go, x2);
            const float2 dd0 = make_float2(x2.g0.x, fx_group_sum(x1.g0.y, x2.g0.y));
            const float2 dd1 = make_float2(x2.g1.x, fx_group_sum(x1.g1.y, x2.g1.y));
#pragma unroll
            for (int r = 0; r < NR; r++) {
                int t0 = 254 * dot4(dec[r].lo, x1.a) + dot4(dec[r].lo, x2.a);  // sub-block 2c, this lane's columns
                int t1 = 254 * dot4(dec[r].hi, x1.b) + dot4(dec[r].hi, x2.b);  // 2c + 1
                t0 += __shfl_xor_sync(mask, t0, 1);
                t1 += __shfl_xor_sync(mask, t1, 1);
                const float ft0 = __int2float_rn(t0), ft1 = __int2float_rn(t1);
                float v = 0.f;  // the block value after the chunks before this round's
#pragma unroll
                for (int c = 0; c < 4; c++) {  // round c: chunk c's lanes take their two steps
                    const float u = fx_k45_step(fx_k45_step(v, sc[r][0], mn[r][0], dd0, ft0), sc[r][1], mn[r][1], dd1, ft1);
                    v = c < 3 ? __shfl_sync(mask, u, base + 2 * c) : u;
                }
                if (j == 6) acc[r][b] += fx_of(v);  // chunk 3's value: the block's
            }
        }
    }
};
template <> struct MvFxP<12> : MvFxK45<12> {};
template <> struct MvFxP<13> : MvFxK45<13> {};
// Q6_K: piece j holds columns l0 .. l0 + 7 (l0 = 8 (j % 4)) of the 4 groups of half h = j / 4
// (QDTraits<14>): a group's 16-column halves are lanes {0, 1} and {2, 3} of the half's four, so
// two integer shuffles give every lane both; half 0's lanes take groups 0-3, half 1's 4-7.
template <> struct MvFxP<14> : QDTraits<14> {
    typedef QDTraits<14> T;
    typedef long long Acc;
    typedef MvDp4aP<14, 2>::Act Act;
    template <int B, int NR>
    static __device__ __forceinline__ void accumulate(const T::Raw (&raw)[NR], int blk, int j, const Act& act,
                                                      int n_cols, long long (&acc)[NR][B]) {
        const int base = threadIdx.x & 24;
        const unsigned mask = 0xFFu << base;
        const bool second = (j & 2) != 0;  // this lane's columns are the groups' second halves
        T::Dec dec[NR];
        float s0[NR][4], s1[NR][4];  // the groups' half scales, fx_block's products
#pragma unroll
        for (int r = 0; r < NR; r++) {
            T::decode(raw[r], j, dec[r]);
            const float dq = h2f(raw[r].d);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                s0[r][k] = dq * (float)(signed char)(raw[r].s[k >> 1] >> (16 * (k & 1)));
                s1[r][k] = dq * (float)(signed char)(raw[r].s[k >> 1] >> (16 * (k & 1) + 8));
            }
        }
#pragma unroll
        for (int b = 0; b < B; b++) {
            const long long xo = (long long)b * n_cols + (long long)blk * T::EPB;
            const long long go = (long long)b * act.ngroups + (long long)blk * (T::EPB / 32);
            T::XV x1, x2;
            T::loadx(j, act.xq + xo, act.ds + go, x1);
            T::loadx(j, act.xq2 + xo, act.ds2 + go, x2);  // x2.g: the groups' d2
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float ft0[4], ft1[4];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    int t = 254 * dp4(dec[r].q[k][1], x1.x[k].y, dp4(dec[r].q[k][0], x1.x[k].x, 0))
                            + dp4(dec[r].q[k][1], x2.x[k].y, dp4(dec[r].q[k][0], x2.x[k].x, 0));
                    t += __shfl_xor_sync(mask, t, 1);               // this lane's half of group k
                    const int o = __shfl_xor_sync(mask, t, 2);      // the other half
                    ft0[k] = __int2float_rn(second ? o : t);
                    ft1[k] = __int2float_rn(second ? t : o);
                }
                float v = 0.f;
#pragma unroll
                for (int h = 0; h < 2; h++) {  // round h: half h's lanes take groups 4h .. 4h + 3
#pragma unroll
                    for (int k = 0; k < 4; k++) v = fx_q6_step(v, s0[r][k], s1[r][k], x2.g[k], ft0[k], ft1[k]);
                    if (h == 0) v = __shfl_sync(mask, v, base);
                }
                if (j == 4) acc[r][b] += fx_of(v);
            }
        }
    }
};

// Whether the fixed-point matvec peels its first trip (matvec.cuh matvec_rows' PEEL: every first
// weight load before the programmatic-launch wait): at one row of x only. There, in the loop,
// ptxas kept 1-2 of a lane's 8 first Q4_K loads before the wait, and peeled the kernels take no
// more registers; the fixed form's pass at batch 1 went from +5.4% to about +3% against the
// default (H100: +2.8% to +3.3% in four processes of 10 rounds). At two rows peeled kernels
// take more registers (Q4_K 140 for 128, Q6_K 168 for 128: fewer warps an SM), and the pass at
// batch 2 went from -1.6% to +2.0% (Q4_K peeled) or +5.8% (both). docs/PERFORMANCE.md, "The
// first trip's loads".
__device__ constexpr bool fx_peel(int B) { return B == 1; }

// out[b, row] for B <= 8 rows of x (the i16 planes), NR weight rows a CTA, U pieces a lane a
// trip: mvq2_kernel's launch (tuning.i16) and order of loads, fixed-point sums. acc != 0: out
// += the row's value (the residual add fused, as mvq2_kernel's: the same f32 addition).
template <int QT, int B, int NR, int U>
__global__ void __launch_bounds__(256) fx_mvq_kernel(const u8* __restrict__ w, const u8* xq, const float2* ds,
                                                     const u8* xq2, const float2* ds2, float* out, int n_rows,
                                                     int n_cols, long long row_bytes, int acc) {
    typedef MvFxP<QT> P;
    matvec_rows<P, B, NR, U, fx_peel(B)>(w, typename P::Act{xq, ds, xq2, ds2, n_cols / 32}, out, n_rows, n_cols,
                                         row_bytes, blockIdx.x * NR, acc != 0);
}

// fx_mvq_kernel over up to three matrices of one type that multiply the same x (a layer's q and
// k, or gate and up), in one launch: mvq2g_kernel's split of the CTAs (matvec.cuh matvec_part).
template <int QT, int B, int NR, int U>
__global__ void __launch_bounds__(256) fx_mvqg_kernel(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                                      const u8* __restrict__ w2, float* out0, float* out1,
                                                      float* out2, int rows0, int rows1, int rows2, int end0,
                                                      int end1, long long rb0, long long rb1, long long rb2,
                                                      const u8* xq, const float2* ds, const u8* xq2,
                                                      const float2* ds2, int n_cols) {
    typedef MvFxP<QT> P;
    const MvPart m = matvec_part<NR>(w0, w1, w2, out0, out1, out2, rows0, rows1, rows2, end0, end1, rb0, rb1, rb2);
    matvec_rows<P, B, NR, U, fx_peel(B)>(m.w, typename P::Act{xq, ds, xq2, ds2, n_cols / 32}, m.out, m.n_rows,
                                         n_cols, m.row_bytes, m.row0);
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
    if (KS > 1) mm_add_splits(part, tile_count, out, n_rows, B, blockIdx.x * 32, 32);
}

// ================================================================ mmq with fixed-point sums
// mmq_kernel (mmq.cu) in its fixed form: each block's value chained from 0 in f32, then added to
// 64-bit accumulators, and mm_epilogue on integers: the same block values as the matvecs'
// fx_block, so the same row sums. Launched as mmq_kernel (mm_launch's grid and block);
// shared memory: the stages or the epilogue's warps x 16 MT rows x 8 NT 64-bit sums, whichever
// is larger.
template <int QT, int NT, int MT>
__global__ void __launch_bounds__(256, MMQ_MIN_BLOCKS) fx_mmq_kernel(const u8* __restrict__ w, const uint4* xq,
                                                                     const float2* xd, float* __restrict__ out,
                                                                     long long* __restrict__ part,
                                                                     int* __restrict__ tile_count, int n_rows,
                                                                     int n_cols, long long row_bytes, int B, int WR) {
    pdl_enter();
    mmq_body<QT, NT, MT, true>(w, xq, xd, out, part, tile_count, n_rows, n_cols, row_bytes, B, WR);
}

// mmqx_kernel (mmq.cu) with fixed-point sums: fx_mmq_kernel's block values, so its bits, with x
// staged once per CTA; launched as fx_mmq_kernel (fixed_point.py fx_mmq, where tuning.py
// mmqx_launch says), its split-K partials 64-bit.
template <int QT, int NT, int WR, int NS>
__global__ void __launch_bounds__(32 * WR, 1) fx_mmqx_kernel(const u8* __restrict__ w, const uint4* xq,
                                                            const float2* xd, float* __restrict__ out,
                                                            long long* __restrict__ part, int* __restrict__ tile_count,
                                                            int n_rows, int n_cols, long long row_bytes, int B,
                                                            int /* WR: the template's */) {
    pdl_enter();
    mmqx_body<QT, NT, WR, NS, true>(w, xq, xd, out, part, tile_count, n_rows, n_cols, row_bytes, B);
}
