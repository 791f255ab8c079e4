// The matvec skeleton and its two piece products (f32 weights times f32 x; integer weights times
// int8 planes of x), shared by the production matvec kernels (matvec.cu) and the variants kept
// for exploration (dev/cuda).

#include "quant_traits.cuh"

// ================================================================ matvec: one skeleton, two products
// out[b, row] = sum_c W[row, c] * x[b, c] for B <= 8 activation rows, weights read once for all B.
// matvec_rows is the skeleton of both matvec paths; the path is its piece product P:
//   P::EPB, P::BYTES, P::LPB, P::Raw, P::load   the weight layout (from QTraits / QDTraits)
//   P::Act                                      the activations (device pointers)
//   P::accumulate<B, NR>(raw, blk, j, act, n_cols, acc)
//                                               acc[r][b] += piece j of block blk of row r times
//                                               the matching activations of row b, for all r, b
// A CTA computes NR rows from row0 (NR in {1, 2, 4, 8}: one group per CTA, or several in turn
// with mvq2s_kernel); its warps split each row's pieces; every lane handles U pieces per trip
// with all weight loads issued before the first use. Each lane's partial sums are reduced over
// the warp (warp_sum), then over the CTA's warps in warp order, so a result does not depend on
// timing, nor on NR (which lane takes which piece depends only on the warps and U).
// The sums are f32, or the piece product's P::Acc where it names one (the batch-invariant mode's
// fixed-point product, fixed_point.cu: 64-bit integers, written out through mm_value).
// Programmatic launch (common.cuh): the first trip's weight loads are issued before the wait for
// the activations, the weights being constant while the pass runs. In the loop, behind a
// first-trip flag, ptxas keeps only some of them before the wait (1-8 of a lane's 8-16 at one
// row: the SASS). PEEL takes the first trip out of the loop with an unconditional wait, and all
// of them stay before it; the bits are the same (each lane's pieces and order). Only the
// fixed-point matvec peels, at one row of x (fixed_point.cu fx_peel: the fixed form's pass at
// batch 1 went from +5.4% to about +3% against the default, H100). Peeled, the i16 matvec took
// more registers in places and the default's pass measured slower (+4.4% at batch 1 against
// the unpeeled tree, another process of the same call), so it keeps the loop and its PTX
// (docs/PERFORMANCE.md, "The first trip's loads").
template <class T> struct MvVoid { typedef void type; };
template <class P, class = void> struct MvAcc { typedef float T; };
template <class P> struct MvAcc<P, typename MvVoid<typename P::Acc>::type> { typedef typename P::Acc T; };
template <class P, int B, int NR, int U, bool PEEL = false>
__device__ __forceinline__ void matvec_rows(const u8* __restrict__ w, const typename P::Act& act,
                                            float* __restrict__ out, int n_rows, int n_cols,
                                            long long row_bytes, int row0, bool accumulate = false) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int npieces = (n_cols / P::EPB) * P::LPB;
    typedef typename MvAcc<P>::T A;
    A acc[NR][B];
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[r][b] = 0;
    const u8* rp[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) rp[r] = w + (long long)min(row0 + r, n_rows - 1) * row_bytes;
    const int stride = nw * 32;
    typedef typename P::Raw Raw;
    // a trip: U pieces a lane, stride apart, of each of the NR rows; every weight load is issued
    // before the first product
    auto load_trip = [&](int p0, Raw (&raw)[U][NR]) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * stride;
            if (p < npieces) {
                const int blk = p / P::LPB, j = p % P::LPB;
#pragma unroll
                for (int r = 0; r < NR; r++) P::load(rp[r] + (long long)blk * P::BYTES, j, raw[u][r]);
            }
        }
    };
    auto multiply_trip = [&](int p0, const Raw (&raw)[U][NR]) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * stride;
            if (p < npieces) {
                const int blk = p / P::LPB, j = p % P::LPB;
                P::template accumulate<B, NR>(raw[u], blk, j, act, n_cols, acc);
            }
        }
    };
    // programmatic launch (common.cuh): the first trip's weight loads are issued before the wait
    // for the activations, the weights being constant while the pass runs
    pdl_trigger();
    if constexpr (PEEL) {  // the first trip peeled off the loop, its wait unconditional (see above)
        {
            Raw raw[U][NR];
            load_trip(warp * 32 + lane, raw);
            pdl_wait();  // a lane with no piece still waits: it writes out (through red)
            multiply_trip(warp * 32 + lane, raw);
        }
        for (int p0 = warp * 32 + lane + stride * U; p0 < npieces; p0 += stride * U) {
            Raw raw[U][NR];
            load_trip(p0, raw);
            multiply_trip(p0, raw);
        }
    } else {
        bool waited = false;
        for (int p0 = warp * 32 + lane; p0 < npieces; p0 += stride * U) {
            Raw raw[U][NR];
            load_trip(p0, raw);
            if (!waited) {
                pdl_wait();
                waited = true;
            }
            multiply_trip(p0, raw);
        }
        if (!waited) pdl_wait();  // a lane with no piece still writes out (through red)
    }
    __shared__ A red[8][NR * B];
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int b = 0; b < B; b++) {
            const A v = warp_sum(acc[r][b]);
            if (lane == 0) red[warp][r * B + b] = v;
        }
    __syncthreads();
    for (int o = threadIdx.x; o < NR * B; o += blockDim.x) {  // NR * B may exceed the CTA (8 x 8, 2 warps)
        const int r = o / B, b = o % B;
        A s = 0;
        for (int i = 0; i < nw; i++) s += red[i][o];
        const int row = row0 + r;
        if (row < n_rows) {
            float* o = out + (long long)b * n_rows + row;
            const float v = mm_value(s);
            *o = accumulate ? *o + v : v;
        }
    }
}

// This CTA's matrix of up to three that multiply the same x in one launch (mvq2g_kernel,
// fixed_point.cu's fx_mvqg_kernel): CTAs [0, end0) take matrix 0's row groups of NR rows,
// [end0, end1) matrix 1's, the rest matrix 2's; the kernel then runs matvec_rows on it.
struct MvPart {
    const u8* w;
    float* out;
    int n_rows;
    long long row_bytes;
    int row0;
};
template <int NR>
__device__ __forceinline__ MvPart matvec_part(const u8* w0, const u8* w1, const u8* w2, float* out0, float* out1,
                                              float* out2, int rows0, int rows1, int rows2, int end0, int end1,
                                              long long rb0, long long rb1, long long rb2) {
    const int b = blockIdx.x;
    return MvPart{b < end0 ? w0 : b < end1 ? w1 : w2, b < end0 ? out0 : b < end1 ? out1 : out2,
                  b < end0 ? rows0 : b < end1 ? rows1 : rows2, b < end0 ? rb0 : b < end1 ? rb1 : rb2,
                  (b < end0 ? b : b < end1 ? b - end0 : b - end1) * NR};
}

// f32 product: the piece's NG groups of 8 weights are dequantized in registers (once for all B
// rows), each group times two float4 runs of x (once for all NR rows), f32 FMAs in column order.
template <int QT, int CUT> struct MvF32 : QTraits<QT, CUT> {
    typedef QTraits<QT, CUT> T;
    struct Act { const float* x; };  // x: [B, n_cols] f32
    template <int B, int NR>
    static __device__ __forceinline__ void accumulate(const typename T::Raw (&raw)[NR], int blk, int j,
                                                      const Act& act, int n_cols, float (&acc)[NR][B]) {
        const float* xb = act.x + (long long)blk * T::EPB;
#pragma unroll
        for (int g = 0; g < T::NG; g++) {
            float wv[NR][8];
            int o0 = 0, o1 = 0;
#pragma unroll
            for (int r = 0; r < NR; r++) T::decode(raw[r], j, g, wv[r], o0, o1);
#pragma unroll
            for (int b = 0; b < B; b++) {
                const float4 xa = __ldca((const float4*)(xb + (long long)b * n_cols + o0));
                const float4 xc = __ldca((const float4*)(xb + (long long)b * n_cols + o1));
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    float s = acc[r][b];
                    s = fmaf(wv[r][0], xa.x, s); s = fmaf(wv[r][1], xa.y, s);
                    s = fmaf(wv[r][2], xa.z, s); s = fmaf(wv[r][3], xa.w, s);
                    s = fmaf(wv[r][4], xc.x, s); s = fmaf(wv[r][5], xc.y, s);
                    s = fmaf(wv[r][6], xc.z, s); s = fmaf(wv[r][7], xc.w, s);
                    acc[r][b] = s;
                }
            }
        }
    }
};

// int8 products, NP planes of activations: NP = 1, dp4a (xq, ds from quantize_x_kernel); NP = 2,
// i16 (quantize_x2_kernel's two planes, x ~= d * q1 + d2 * q2). The piece's weights are decoded
// to integers once for all B rows, each row's activation piece (per plane) is loaded once for
// all NR rows, and dot() applies the scales per sub-block; the planes' products are added.
template <int QT, int NP, class LD = LdG> struct MvDp4aP : QDTraits<QT> {
    typedef QDTraits<QT> T;
    struct Act {
        const u8* xq;        // plane 1: int8 [B, n_cols], (d, d * sum) [B, ngroups]
        const float2* ds;
        const u8* xq2;       // plane 2 (NP = 2), likewise
        const float2* ds2;
        int ngroups;         // n_cols / 32
    };
    template <int B, int NR>
    static __device__ __forceinline__ void accumulate(const typename T::Raw (&raw)[NR], int blk, int j,
                                                      const Act& act, int n_cols, float (&acc)[NR][B]) {
        typename T::Dec dec[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) T::decode(raw[r], j, dec[r]);
#pragma unroll
        for (int b = 0; b < B; b++) {
            const long long xo = (long long)b * n_cols + (long long)blk * T::EPB;
            const long long go = (long long)b * act.ngroups + (long long)blk * (T::EPB / 32);
            typename T::XV x1;
            T::template loadx<LD>(j, act.xq + xo, act.ds + go, x1);
            if constexpr (NP == 1) {
#pragma unroll
                for (int r = 0; r < NR; r++) acc[r][b] += T::dot(dec[r], x1);
            } else {
                typename T::XV x2;
                T::template loadx<LD>(j, act.xq2 + xo, act.ds2 + go, x2);
#pragma unroll
                for (int r = 0; r < NR; r++) acc[r][b] += T::dot(dec[r], x1) + T::dot(dec[r], x2);
            }
        }
    }
};
