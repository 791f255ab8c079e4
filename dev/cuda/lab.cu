// Kernel variants kept for exploration, outside the package: none of them is launched by the
// engine. They reuse the production headers (matvec.cuh, tensor_core.cuh, quant_traits.cuh in
// daemons/compute/cuda), so a variant measures the same decoders as production runs.
//   quantize_x_kernel, mvq_kernel  the dp4a matvec: x quantized to ONE int8 plane (~0.3-0.5%
//                                  error; faster than i16 but off the CPU reference's tolerance)
//   mvq2s_kernel                   the i16 matvec with x staged in shared memory once per CTA
//   mms_kernel                     the f16 tensor-core matmul of the K-quants through the
//                                  shared-memory stage (production takes mmq for them)
// Launched by dev/cuda/lab.py.

#include "matvec.cuh"
#include "tensor_core.cuh"

// quantize_x_kernel: 8 threads per group of 32 (a float4 each); n4 = B * n_cols / 4.
extern "C" __global__ void __launch_bounds__(256) quantize_x_kernel(const float* x,
                                                                    u32* __restrict__ xq,
                                                                    float2* __restrict__ ds, int n4) {
    pdl_enter();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const bool ok = t < n4;  // n4 is a multiple of 8: a group is all in or all out
    float4 v = ok ? __ldca((const float4*)x + t) : make_float4(0.f, 0.f, 0.f, 0.f);
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.f;
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    const int q0 = __float2int_rn(v.x * id), q1 = __float2int_rn(v.y * id);
    const int q2 = __float2int_rn(v.z * id), q3 = __float2int_rn(v.w * id);
    int s = q0 + q1 + q2 + q3;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (ok) {
        xq[t] = (u32)(q0 & 0xFF) | ((u32)(q1 & 0xFF) << 8) | ((u32)(q2 & 0xFF) << 16) | ((u32)(q3 & 0xFF) << 24);
        if ((t & 7) == 0) ds[t >> 3] = make_float2(d, d * (float)s);
    }
}

// out[b, row] = sum_c W[row, c] * dequant(xq)[b, c]; xq, ds: quantize_x_kernel's output for x.
template <int QT, int B, int NR, int U>
__global__ void __launch_bounds__(256) mvq_kernel(const u8* __restrict__ w, const u8* xq,
                                                  const float2* ds, float* __restrict__ out,
                                                  int n_rows, int n_cols, long long row_bytes) {
    typedef MvDp4aP<QT, 1> P;
    matvec_rows<P, B, NR, U>(w, typename P::Act{xq, ds, nullptr, nullptr, n_cols / 32}, out, n_rows, n_cols, row_bytes, blockIdx.x * NR);
}

// The activation reader of the staged variant: the CTA's shared-memory stage (generic pointers).
struct LdS {
    static __device__ __forceinline__ uint4 u128(const u8* p) { return *(const uint4*)p; }
    static __device__ __forceinline__ uint2 u64(const u8* p) { return *(const uint2*)p; }
    static __device__ __forceinline__ float2 f2(const float2* p) { return *p; }
    static __device__ __forceinline__ float f(const float* p) { return *p; }
};

// mvq2_kernel with the activations staged in shared memory once per CTA (B * n_cols * 2.5 bytes:
// both int8 planes, then both (d, d * sum) arrays) and each CTA looping over row groups NR rows
// apart (grid: as many CTAs as fit on the device at once, or fewer): x crosses from L2 once per
// CTA instead of once per NR rows, and every piece reads it from the stage. Within a row group
// the additions are mvq2_kernel's, in its order: the same bits.
template <int QT, int B, int NR, int U>
__global__ void __launch_bounds__(256) mvq2s_kernel(const u8* __restrict__ w, const u8* xq,
                                                    const float2* ds, const u8* xq2,
                                                    const float2* ds2, float* __restrict__ out,
                                                    int n_rows, int n_cols, long long row_bytes) {
    pdl_enter();
    extern __shared__ uint4 stage[];
    const int ng = n_cols / 32;
    const int n16 = B * n_cols / 16;  // uint4 of one plane (n_cols is a multiple of 32)
    uint4* sq = stage;
    uint4* sq2 = stage + n16;
    float2* sds = (float2*)(stage + 2 * n16);
    float2* sds2 = sds + B * ng;
    for (int i = threadIdx.x; i < n16; i += blockDim.x) {
        sq[i] = __ldca((const uint4*)xq + i);
        sq2[i] = __ldca((const uint4*)xq2 + i);
    }
    for (int i = threadIdx.x; i < B * ng; i += blockDim.x) {
        sds[i] = __ldca(ds + i);
        sds2[i] = __ldca(ds2 + i);
    }
    __syncthreads();
    typedef MvDp4aP<QT, 2, LdS> P;
    const typename P::Act act{(const u8*)sq, sds, (const u8*)sq2, sds2, ng};
    for (int row0 = blockIdx.x * NR; row0 < n_rows; row0 += gridDim.x * NR) {
        matvec_rows<P, B, NR, U>(w, act, out, n_rows, n_cols, row_bytes, row0);
        __syncthreads();  // the next group writes the reduction's shared partials again
    }
}

// The staged f16 matmul's fragment loads from the stage (MmStage's layout).
template <int QT> struct MmLoadS;
template <> struct MmLoadS<12> {
    static __device__ __forceinline__ void load(const u8* blk, int j, QTraits<12, CUT_V2>::Raw& r) {
        r.h = *(const uint4*)blk; r.q = *(const u32*)(blk + 16 + 4 * j);
    }
};
template <> struct MmLoadS<13> {
    static __device__ __forceinline__ void load(const u8* blk, int j, QTraits<13, CUT_V2>::Raw& r) {
        r.h = *(const uint4*)blk; r.qh = *(const u32*)(blk + 16 + 4 * (j & 7)); r.q = *(const u32*)(blk + 48 + 4 * j);
    }
};
template <> struct MmLoadS<14> {
    static __device__ __forceinline__ void load(const u8* blk, int j, QTraits<14, CUT_V2>::Raw& r) {
        const int h = j >> 4, kk = (j >> 3) & 1, l = 4 * (j & 7);
        r.ql = lds32a2(blk + 64 * h + 32 * kk + l);
        r.qh = lds32a2(blk + 128 + 32 * h + l);
        const u8* sp = blk + 192 + 8 * h + 2 * kk + (l >> 4);
        r.sc = (u32)sp[0] | ((u32)sp[4] << 8);
        r.d = (u32)*(const u16*)(blk + 208);
    }
};

template <int QT, int NT>
__global__ void __launch_bounds__(256) mms_kernel(const u8* __restrict__ w, const uint4* xs,
                                                  float* __restrict__ out, float* __restrict__ part,
                                                  int* __restrict__ tile_count, int n_rows, int n_cols,
                                                  long long row_bytes, int B, int WR) {
    pdl_enter();
    typedef QTraits<QT, CUT_V2> T;
    typedef MmTraits<QT, CUT_V2> M;
    typedef MmStage<QT> S;
    extern __shared__ __align__(16) u8 smem[];  // max(warps * MM_STAGES * 16 * SROW, mm_epilogue's warps * 16 * 8 NT * 4)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int WK = nw / WR, wr = warp % WR, wk = warp / WR;
    const int gid = lane >> 2, tig = lane & 3;
    const int nparts = gridDim.y * WK, kpart = blockIdx.y * WK + wk;
    const uint4* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = xs + min(8 * nt + gid, B - 1);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    mm_staged_walk<QT, 1>(w, n_rows, row_bytes, blockIdx.x * 16 * WR + 16 * wr, kpart, nparts, n_cols / T::EPB,
                          smem + warp * MM_STAGES * 16 * S::SROW, [&](int blk, const u8* const (&rows)[2]) {
        const u8* sa = rows[0];
        const u8* sb = rows[1];
#pragma unroll 2
        for (int st = 0; st < T::LPB / 4; st++) {
            const int j = 4 * st + tig;
            typename T::Raw ra, rb;
            MmLoadS<QT>::load(sa, j, ra);
            MmLoadS<QT>::load(sb, j, rb);
            u32 aa[4], ab[4];
            float fa[2], ma[2], fb[2], mb[2];
            int o[2];
            M::decode(ra, j, aa, fa, ma, o);
            M::decode(rb, j, ab, fb, mb, o);
#pragma unroll
            for (int run = 0; run < 2; run++) {
                const int c4 = (blk * T::EPB + o[run]) >> 2;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 xv = __ldca(xr[nt] + (long long)c4 * B);
                    float c[4] = {0.f, 0.f, 0.f, 0.f};
                    mma16816(c, aa[2 * run], ab[2 * run], aa[2 * run + 1], ab[2 * run + 1], xv.x, xv.y);
                    mma16816(c, aa[2 * run], ab[2 * run], aa[2 * run + 1], ab[2 * run + 1], xv.z, xv.w);
                    acc[nt][0] = fmaf(fa[run], c[0], acc[nt][0]);
                    acc[nt][1] = fmaf(fa[run], c[1], acc[nt][1]);
                    acc[nt][2] = fmaf(fb[run], c[2], acc[nt][2]);
                    acc[nt][3] = fmaf(fb[run], c[3], acc[nt][3]);
                    if (M::HAS_MIN) mm_min_terms(acc[nt], xv, ma[run], mb[run]);
                }
            }
        }
    });
    __syncthreads();  // every warp is done with its stage: the reduction reuses the memory
    mm_epilogue<NT>(acc, (float*)smem, out, part, tile_count, n_rows, B, WR);
}
