// Definitions every kernel source shares: short integer types, f16 <-> f32 conversions, the
// warp- and block-wide sums, rmsnorm's scale, programmatic dependent launch, and the i16
// activation planes (written by several producers, read by the i16 matvec).
//
// sources.kernel_source inlines this file (and every other header) in place of its #include
// line before NVRTC sees a source, so cupy's compile cache, keyed by the source text, is
// invalidated by a change here as by a change in the .cu file itself. Each header is inlined
// once per source.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

#define NEG_INF __int_as_float(0xff800000)

// f16 bits (the low 16 bits of h) -> f32
__device__ __forceinline__ float h2f(u32 h) {
    float f;
    u16 hs = (u16)(h & 0xFFFFu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
}
// f32 -> f16 bits, rounded to nearest even
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// sum of v over the 32 lanes of a warp (butterfly: every lane gets the sum, in the same order)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// the same butterfly on 64-bit integers (the fixed-point sums: exact, so any order gives one sum)
__device__ __forceinline__ long long warp_sum(long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Accumulators of 64-bit fixed point (the batch-invariant mode's fixed form, fixed_point.cu): a
// block's f32 value in units of 2^-32 as an integer, so that sums of them are exact in any
// order, and a row's sum back as f32 (one rounding, then an exact power-of-two scale).
#define FX_ONE 4294967296.f                 // 2^32
#define FX_INV 2.3283064365386963e-10f      // 2^-32
__device__ __forceinline__ long long fx_of(float v) { return __float2ll_rn(__fmul_rn(v, FX_ONE)); }
__device__ __forceinline__ float fx_value(long long a) { return __fmul_rn(__ll2float_rn(a), FX_INV); }
// a row's sum as the output's f32: an f32 accumulator as it is, a fixed-point one through fx_value
__device__ __forceinline__ float mm_value(float s) { return s; }
__device__ __forceinline__ float mm_value(long long s) { return fx_value(s); }

// block-wide sum; every thread gets the result. blockDim.x multiple of 32, <= 1024.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float t = lane < nw ? sh[lane] : 0.f;
    return warp_sum(t);
}
// 1 / rms of row x[base .. base + D) (residual != 0: of residual += x, written back), the row's
// CTA all calling it: rmsnorm_kernel's and rmsnorm_q2_kernel's one sum of squares, so both give
// the same bits. Its barriers make the CTA's residual writes visible to all its threads.
__device__ __forceinline__ float rms_scale(const float* x, float* residual, long long base, int D, float eps) {
    __shared__ float sh[32];
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = x[base + i];
        if (residual) { v += residual[base + i]; residual[base + i] = v; }
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, sh);
    return rsqrtf(ss / (float)D + eps);
}

// Programmatic dependent launch (sm_90 and later; runtime.py launches with the attribute where
// the device has it and the backend's KernelOptions ask for it, see runtime.Launcher). A kernel so launched may begin while the kernel before
// it in the stream is still running, so that its CTAs are resident and its constant inputs
// (weights) in flight when that kernel ends, instead of paying a launch and a ramp after it:
// in a decode pass of ~600 small kernels these gaps were a fifth of the pass. The contract, for
// every kernel of this folder:
//   pdl_trigger()  the next kernel may launch now (its CTAs take the slots this kernel's CTAs
//                  free, and wait); it takes effect once every CTA has triggered or exited, that
//                  is once this kernel's last CTA is resident, so it never delays this kernel.
//   pdl_wait()     before the first access to memory that earlier work in the stream writes or
//                  reads (activations, caches, partial sums, outputs); it returns once the
//                  previous kernel has completed and its writes are visible to this grid (that
//                  kernel waited likewise, so all earlier work has). A no-op when launched
//                  without the attribute. Before it a kernel reads only the weights, which no
//                  kernel of a pass writes.
// In-stream memory is read with coherent loads (plain, or __ldca), never __ldg / ld.global.nc,
// and its pointers are not `const __restrict__` (which lets the compiler use ld.global.nc on its
// own): ptxas moves non-coherent loads, "read-only for the kernel's lifetime", above the wait.
// It did in the first GPU run with PDL (the f32 matvec's loads of x were issued before the wait,
// and the SmolLM2 and synthetic decode logits were wrong); scripts/pdl_check.py checks the SASS.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// the usual start of a kernel: let the next one launch, then wait for the previous one
__device__ __forceinline__ void pdl_enter() {
    pdl_trigger();
    pdl_wait();
}

// ------------------------------------------------------------------------------- i16 planes
// four int8 values as one word, element 0 in the low byte
__device__ __forceinline__ u32 pack_bytes(const int (&q)[4]) {
    return (u32)(q[0] & 0xFF) | ((u32)(q[1] & 0xFF) << 8) | ((u32)(q[2] & 0xFF) << 16) | ((u32)(q[3] & 0xFF) << 24);
}

// The i16 activations of one group of 32 columns, held by 8 consecutive lanes (a float4 v each):
// quantize_x_kernel's int8 plane (q, d = max|x| / 127) and a second int8 plane of what it
// leaves, r = x - d * q (|r| <= d / 2), with d2 = d / 254: x = d * q + d2 * r to within
// d2 / 2 = max|x| / 64516 of its group ("i16": 15-bit activations). s, s2: the group's sums of
// q and r (every lane gets them). Shared by the i16 matvec's and mmq's quantizers, so that both
// products see the same activations.
__device__ __forceinline__ void quant2_group(const float4& v, int (&q)[4], int (&r)[4], float& d, float& d2,
                                             int& s, int& s2) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    d = amax / 127.f;
    d2 = d / 254.f;
    const float id = amax > 0.f ? 127.f / amax : 0.f, id2 = amax > 0.f ? 254.f / d : 0.f;
    const float xs[4] = {v.x, v.y, v.z, v.w};
    s = s2 = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        q[k] = __float2int_rn(xs[k] * id);
        r[k] = max(-127, min(127, __float2int_rn((xs[k] - d * (float)q[k]) * id2)));
        s += q[k];
        s2 += r[k];
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
}

// quant2_group of v (float4 t of x) stored as quantize_x2_kernel lays the planes out. Every lane
// of the warp calls it (the group's shuffles); ok: whether t is a real float4 of x (a group is
// all in or all out).
__device__ __forceinline__ void quant2_store(const float4& v, bool ok, long long t, u32* xq, float2* ds, u32* xq2,
                                             float2* ds2) {
    int q[4], r[4], s, s2;
    float d, d2;
    quant2_group(v, q, r, d, d2, s, s2);
    if (ok) {
        xq[t] = pack_bytes(q);
        xq2[t] = pack_bytes(r);
        if ((t & 7) == 0) {
            ds[t >> 3] = make_float2(d, d * (float)s);
            ds2[t >> 3] = make_float2(d2, d2 * (float)s2);
        }
    }
}
