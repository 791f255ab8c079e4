// Definitions shared by ops.cu and quant.cu: short integer types, f16 <-> f32 conversions and
// the warp-wide sum.
//
// kernels.py (sources.kernel_source) inlines this file in place of its #include line before
// NVRTC sees a source, so cupy's compile cache, keyed by the source text, is invalidated by a
// change here as by a change in the .cu file itself. Each header is inlined once per source.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

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
