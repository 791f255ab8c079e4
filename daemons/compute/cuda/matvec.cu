// Matrix-vector products for up to 8 rows of x (decode, small batches): out[b, row] = sum_c
// W[row, c] * x[b, c], weights read once for all rows. The f32 product (mv_kernel) for the
// float types; the i16 product (mvq2_kernel, mvq2g_kernel) for every block-quantized type, x as
// two int8 planes (quantize_x2_kernel, or the fused producers: rmsnorm_q2_kernel,
// swiglu_q2_kernel, attn_combine_kernel). Launched by matvec.py. Compiled by NVRTC at run time,
// headers inlined (sources.py).

#include "matvec.cuh"

// x: [B, n_cols] f32, out: [B, n_rows] f32; weights of type QT read through layout cut CUT.
template <int QT, int CUT, int B, int NR, int U>
__global__ void __launch_bounds__(256) mv_kernel(const u8* __restrict__ w, const float* x,
                                                 float* __restrict__ out, int n_rows, int n_cols,
                                                 long long row_bytes) {
    typedef MvF32<QT, CUT> P;
    matvec_rows<P, B, NR, U>(w, typename P::Act{x}, out, n_rows, n_cols, row_bytes, blockIdx.x * NR);
}

// quantize_x2_kernel: quant2_group's two planes, each laid out as quantize_x_kernel's (q int8
// [B, n_cols], (d, d * sum) per group); n4 = B * n_cols / 4.
extern "C" __global__ void __launch_bounds__(256) quantize_x2_kernel(const float* x,
                                                                     u32* __restrict__ xq, float2* __restrict__ ds,
                                                                     u32* __restrict__ xq2, float2* __restrict__ ds2,
                                                                     int n4) {
    pdl_enter();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const bool ok = t < n4;
    const float4 v = ok ? __ldca((const float4*)x + t) : make_float4(0.f, 0.f, 0.f, 0.f);
    quant2_store(v, ok, t, xq, ds, xq2, ds2);
}

// out[b, row] = sum_c W[row, c] * (d * q1 + d2 * q2)[b, c]; the planes from quantize_x2_kernel
// (or rmsnorm_q2_kernel). acc != 0: out[b, row] += the sum instead (the residual add of a layer's
// last product, fused: the same f32 addition the separate add made).
template <int QT, int B, int NR, int U>
__global__ void __launch_bounds__(256) mvq2_kernel(const u8* __restrict__ w, const u8* xq,
                                                   const float2* ds, const u8* xq2,
                                                   const float2* ds2, float* out,
                                                   int n_rows, int n_cols, long long row_bytes, int acc) {
    typedef MvDp4aP<QT, 2> P;
    matvec_rows<P, B, NR, U>(w, typename P::Act{xq, ds, xq2, ds2, n_cols / 32}, out, n_rows, n_cols, row_bytes,
                             blockIdx.x * NR, acc != 0);
}

// mvq2_kernel over up to three matrices of one type that multiply the same x (a layer's q and k,
// or gate and up: gemm_group), in one launch: CTAs [0, end0) take matrix 0's row groups,
// [end0, end1) matrix 1's, the rest matrix 2's. One launch instead of three, and the small
// matrices' few CTAs (k, v: 1024 rows, 128 CTAs) share the GPU with the large one's. Each
// matrix's rows get mvq2_kernel's sums, in its order: the same bits.
template <int QT, int B, int NR, int U>
__global__ void __launch_bounds__(256) mvq2g_kernel(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                                    const u8* __restrict__ w2, float* out0, float* out1,
                                                    float* out2, int rows0, int rows1, int rows2, int end0,
                                                    int end1, long long rb0, long long rb1, long long rb2,
                                                    const u8* xq, const float2* ds, const u8* xq2,
                                                    const float2* ds2, int n_cols) {
    typedef MvDp4aP<QT, 2> P;
    const MvPart m = matvec_part<NR>(w0, w1, w2, out0, out1, out2, rows0, rows1, rows2, end0, end1, rb0, rb1, rb2);
    matvec_rows<P, B, NR, U>(m.w, typename P::Act{xq, ds, xq2, ds2, n_cols / 32}, m.out, m.n_rows, n_cols, m.row_bytes,
                             m.row0);
}
