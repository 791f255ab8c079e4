// ntx CUDA kernels for GGUF-quantized weights: matrix-vector products (decode) and
// dequantization (prefill GEMM operand, embedding lookup).
//
// Weights are the tensor's exact GGUF bytes: a row-major matrix [n_rows, n_cols] (GGUF ne =
// [n_cols, n_rows]); each row is n_cols / EPB blocks of BYTES bytes, rows back to back, so
// row_bytes = n_cols / EPB * BYTES. Nothing is repacked.
//
// Work decomposition (the same for every type): a block is cut into LPB "pieces"; consecutive
// lanes of a warp take consecutive pieces, so a warp's loads cover contiguous bytes. A piece
// decodes into NG groups of 8 weights, each group two runs of 4 consecutive columns (o0..o0+3,
// o1..o1+3) so the activations are read as float4. Loads use the widest width that the
// layout's alignment allows (16 B for Q4_K/Q5_K/F16/BF16/F32, 4 B for Q4_1/Q5_1, 2 B for the
// 2-byte-aligned Q4_0/Q5_0/Q8_0/Q6_K blocks).
//
// Small integers become floats without the (quarter-rate) I2F conversion: byte_perm builds the
// float 2^23 + q and one FADD removes 2^23 (exact for q < 2^23).
//
// A layout cut (template parameter CUT) is one way of dividing a type's block among a warp's
// lanes: CUT_V1 (every type has it) and CUT_V2 (the lane-contiguous cut, for Q4_K, Q5_K, Q6_K and
// Q8_0; see below). shared/quant_types.py lists the cuts of each type (QuantType.cuts).
//
// Compiled by NVRTC at run time (cupy RawModule), common.cuh inlined (sources.py).

#include "common.cuh"

#define MAGIC 8388608.0f  // 2^23
constexpr int CUT_V1 = 1, CUT_V2 = 2;  // layout cuts (QuantType.cuts "v1", "v2")

__device__ __forceinline__ u32 ld16(const u8* p) { return (u32)__ldg((const u16*)p); }
__device__ __forceinline__ u32 ld32a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)__ldg(q) | ((u32)__ldg(q + 1) << 16);
}
__device__ __forceinline__ u32 ld32(const u8* p) { return __ldg((const u32*)p); }
__device__ __forceinline__ uint4 ld128(const u8* p) { return __ldg((const uint4*)p); }
// byte k of v (unsigned) as float, minus `off` (exact for small integers)
__device__ __forceinline__ float bytef(u32 v, int k, float off) {
    return __int_as_float((int)__byte_perm(v, 0x4B000000u, 0x7440u + (u32)k)) - (MAGIC + off);
}
__device__ __forceinline__ u32 byte_of(u32 v, int k) { return (v >> (8 * k)) & 0xFFu; }

template <int QT, int CUT> struct QTraits;

// ---------------------------------------------------------------- F32 (virtual block of 8)
template <> struct QTraits<0, CUT_V1> {
    static constexpr int EPB = 8, BYTES = 32, LPB = 1, NG = 1;
    struct Raw { float4 a, b; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.a = __ldg((const float4*)blk);
        r.b = __ldg((const float4*)(blk + 16));
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        w[0] = r.a.x; w[1] = r.a.y; w[2] = r.a.z; w[3] = r.a.w;
        w[4] = r.b.x; w[5] = r.b.y; w[6] = r.b.z; w[7] = r.b.w;
        o0 = 0; o1 = 4;
    }
};
// ---------------------------------------------------------------- F16 (virtual block of 8)
template <> struct QTraits<1, CUT_V1> {
    static constexpr int EPB = 8, BYTES = 16, LPB = 1, NG = 1;
    struct Raw { uint4 v; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) { r.v = ld128(blk); }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        w[0] = h2f(r.v.x); w[1] = h2f(r.v.x >> 16); w[2] = h2f(r.v.y); w[3] = h2f(r.v.y >> 16);
        w[4] = h2f(r.v.z); w[5] = h2f(r.v.z >> 16); w[6] = h2f(r.v.w); w[7] = h2f(r.v.w >> 16);
        o0 = 0; o1 = 4;
    }
};
// ---------------------------------------------------------------- BF16 (virtual block of 8)
template <> struct QTraits<30, CUT_V1> {
    static constexpr int EPB = 8, BYTES = 16, LPB = 1, NG = 1;
    struct Raw { uint4 v; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) { r.v = ld128(blk); }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        w[0] = __uint_as_float(r.v.x << 16); w[1] = __uint_as_float(r.v.x & 0xFFFF0000u);
        w[2] = __uint_as_float(r.v.y << 16); w[3] = __uint_as_float(r.v.y & 0xFFFF0000u);
        w[4] = __uint_as_float(r.v.z << 16); w[5] = __uint_as_float(r.v.z & 0xFFFF0000u);
        w[6] = __uint_as_float(r.v.w << 16); w[7] = __uint_as_float(r.v.w & 0xFFFF0000u);
        o0 = 0; o1 = 4;
    }
};
// ---------------------------------------------------------------- Q4_0: d f16, qs[16]
template <> struct QTraits<2, CUT_V1> {
    static constexpr int EPB = 32, BYTES = 18, LPB = 4, NG = 1;
    struct Raw { u32 d, q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.d = ld16(blk); r.q = ld32a2(blk + 2 + 4 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const float d = h2f(r.d);
        const u32 lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = d * bytef(lo, k, 8.f); w[4 + k] = d * bytef(hi, k, 8.f); }
        o0 = 4 * j; o1 = 16 + 4 * j;
    }
};
// ---------------------------------------------------------------- Q4_1: d, m f16, qs[16]
template <> struct QTraits<3, CUT_V1> {
    static constexpr int EPB = 32, BYTES = 20, LPB = 4, NG = 1;
    struct Raw { u32 dm, q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.dm = ld32(blk); r.q = ld32(blk + 4 + 4 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const float d = h2f(r.dm), m = h2f(r.dm >> 16);
        const u32 lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = fmaf(d, bytef(lo, k, 0.f), m); w[4 + k] = fmaf(d, bytef(hi, k, 0.f), m); }
        o0 = 4 * j; o1 = 16 + 4 * j;
    }
};
// spread bits 0..3 of t to bit 4 of bytes 0..3
__device__ __forceinline__ u32 q5_hbits(u32 t) {
    return ((t << 4) & 0x10u) | ((t << 11) & 0x1000u) | ((t << 18) & 0x100000u) | ((t << 25) & 0x10000000u);
}
// ---------------------------------------------------------------- Q5_0: d f16, qh u32, qs[16]
template <> struct QTraits<6, CUT_V1> {
    static constexpr int EPB = 32, BYTES = 22, LPB = 4, NG = 1;
    struct Raw { u32 d, qh, q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.d = ld16(blk); r.qh = ld32a2(blk + 2); r.q = ld32a2(blk + 6 + 4 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const float d = h2f(r.d);
        const u32 lo = (r.q & 0x0F0F0F0Fu) | q5_hbits(r.qh >> (4 * j));
        const u32 hi = ((r.q >> 4) & 0x0F0F0F0Fu) | q5_hbits(r.qh >> (16 + 4 * j));
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = d * bytef(lo, k, 16.f); w[4 + k] = d * bytef(hi, k, 16.f); }
        o0 = 4 * j; o1 = 16 + 4 * j;
    }
};
// ---------------------------------------------------------------- Q5_1: d, m f16, qh u32, qs[16]
template <> struct QTraits<7, CUT_V1> {
    static constexpr int EPB = 32, BYTES = 24, LPB = 4, NG = 1;
    struct Raw { u32 dm, qh, q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.dm = ld32(blk); r.qh = ld32(blk + 4); r.q = ld32(blk + 8 + 4 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const float d = h2f(r.dm), m = h2f(r.dm >> 16);
        const u32 lo = (r.q & 0x0F0F0F0Fu) | q5_hbits(r.qh >> (4 * j));
        const u32 hi = ((r.q >> 4) & 0x0F0F0F0Fu) | q5_hbits(r.qh >> (16 + 4 * j));
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = fmaf(d, bytef(lo, k, 0.f), m); w[4 + k] = fmaf(d, bytef(hi, k, 0.f), m); }
        o0 = 4 * j; o1 = 16 + 4 * j;
    }
};
// ---------------------------------------------------------------- Q8_0: d f16, qs[32] int8
template <> struct QTraits<8, CUT_V1> {
    static constexpr int EPB = 32, BYTES = 34, LPB = 4, NG = 1;
    struct Raw { u32 d, q0, q1; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.d = ld16(blk); r.q0 = ld32a2(blk + 2 + 8 * j); r.q1 = ld32a2(blk + 6 + 8 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const float d = h2f(r.d);
        const u32 a = r.q0 ^ 0x80808080u, b = r.q1 ^ 0x80808080u;  // int8 -> uint8 + 128
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = d * bytef(a, k, 128.f); w[4 + k] = d * bytef(b, k, 128.f); }
        o0 = 8 * j; o1 = 8 * j + 4;
    }
};
// K-quant 6-bit scale/min of sub-block `is` (0..7) from the 12 packed bytes s0|s1|s2 (words)
__device__ __forceinline__ void k4_scale_min(int is, u32 s0, u32 s1, u32 s2, float& sc, float& m) {
    const int t = is & 3;
    if (is < 4) {
        sc = (float)(byte_of(s0, t) & 63u);
        m = (float)(byte_of(s1, t) & 63u);
    } else {
        sc = (float)((byte_of(s2, t) & 0xFu) | ((byte_of(s0, t) >> 6) << 4));
        m = (float)((byte_of(s2, t) >> 4) | ((byte_of(s1, t) >> 6) << 4));
    }
}
// ---------------------------------------------------------------- Q4_K: d, dmin f16, scales[12], qs[128]
template <> struct QTraits<12, CUT_V1> {
    static constexpr int EPB = 256, BYTES = 144, LPB = 8, NG = 4;
    struct Raw { uint4 h, q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.h = ld128(blk); r.q = ld128(blk + 16 + 16 * j);
    }
    // piece j: qs bytes [16j, 16j+16) = chunk c = j/2, positions l0..l0+15 (l0 = 16*(j&1));
    // low nibbles -> sub-block 2c, high nibbles -> sub-block 2c+1.
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const int c = j >> 1, l0 = (j & 1) * 16, hiq = g >> 1, half = g & 1;
        const int is = 2 * c + hiq;
        float sc, m;
        k4_scale_min(is, r.h.y, r.h.z, r.h.w, sc, m);
        const float d = h2f(r.h.x) * sc, dm = h2f(r.h.x >> 16) * m;
        const u32 wa = half ? r.q.z : r.q.x, wb = half ? r.q.w : r.q.y;
        const u32 a = (wa >> (4 * hiq)) & 0x0F0F0F0Fu, b = (wb >> (4 * hiq)) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = fmaf(d, bytef(a, k, 0.f), -dm); w[4 + k] = fmaf(d, bytef(b, k, 0.f), -dm); }
        o0 = 64 * c + 32 * hiq + l0 + 8 * half; o1 = o0 + 4;
    }
};
// ---------------------------------------------------------------- Q5_K: d, dmin, scales[12], qh[32], qs[128]
template <> struct QTraits<13, CUT_V1> {
    static constexpr int EPB = 256, BYTES = 176, LPB = 8, NG = 4;
    struct Raw { uint4 h, qh, q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.h = ld128(blk); r.qh = ld128(blk + 16 + (j & 1) * 16); r.q = ld128(blk + 48 + 16 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const int c = j >> 1, l0 = (j & 1) * 16, hiq = g >> 1, half = g & 1;
        const int is = 2 * c + hiq;
        float sc, m;
        k4_scale_min(is, r.h.y, r.h.z, r.h.w, sc, m);
        const float d = h2f(r.h.x) * sc, dm = h2f(r.h.x >> 16) * m;
        const u32 wa = half ? r.q.z : r.q.x, wb = half ? r.q.w : r.q.y;
        const u32 ha = half ? r.qh.z : r.qh.x, hb = half ? r.qh.w : r.qh.y;
        const u32 a = ((wa >> (4 * hiq)) & 0x0F0F0F0Fu) | (((ha >> is) & 0x01010101u) << 4);
        const u32 b = ((wb >> (4 * hiq)) & 0x0F0F0F0Fu) | (((hb >> is) & 0x01010101u) << 4);
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = fmaf(d, bytef(a, k, 0.f), -dm); w[4 + k] = fmaf(d, bytef(b, k, 0.f), -dm); }
        o0 = 64 * c + 32 * hiq + l0 + 8 * half; o1 = o0 + 4;
    }
};
// ---------------------------------------------------------------- Q6_K: ql[128], qh[64], scales[16] int8, d f16
// element e: h = e/128, r = e%128, k = r/32, l = r%32;
//   low 4 bits = (ql[64h + l + 32*(k&1)] >> 4*(k>>1)) & 15, high 2 bits = (qh[32h + l] >> 2k) & 3,
//   value = d * scales[e/16] * (q - 32).
// piece j (16 per block): h = j/8, l = 4*(j%8); the 16 elements l..l+3 of each k = 0..3.
template <> struct QTraits<14, CUT_V1> {
    static constexpr int EPB = 256, BYTES = 210, LPB = 16, NG = 2;
    struct Raw { u32 qa, qb, qh, sc, d; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        const int h = j >> 3, l = 4 * (j & 7);
        r.qa = ld32a2(blk + 64 * h + l);
        r.qb = ld32a2(blk + 64 * h + 32 + l);
        r.qh = ld32a2(blk + 128 + 32 * h + l);
        const u8* s = blk + 192 + 8 * h + (l >> 4);
        r.sc = (u32)__ldg(s) | ((u32)__ldg(s + 2) << 8) | ((u32)__ldg(s + 4) << 16) | ((u32)__ldg(s + 6) << 24);
        r.d = ld16(blk + 208);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const int h = j >> 3, l = 4 * (j & 7);
        const float d = h2f(r.d);
        const int k0 = 2 * g, k1 = 2 * g + 1;  // g=0: k 0,1 (low nibbles); g=1: k 2,3 (high nibbles)
        const float s0 = d * (float)(signed char)byte_of(r.sc, k0), s1 = d * (float)(signed char)byte_of(r.sc, k1);
        const u32 a = ((r.qa >> (4 * g)) & 0x0F0F0F0Fu) | (((r.qh >> (2 * k0)) & 0x03030303u) << 4);
        const u32 b = ((r.qb >> (4 * g)) & 0x0F0F0F0Fu) | (((r.qh >> (2 * k1)) & 0x03030303u) << 4);
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = s0 * bytef(a, k, 32.f); w[4 + k] = s1 * bytef(b, k, 32.f); }
        o0 = 128 * h + 32 * k0 + l; o1 = 128 * h + 32 * k1 + l;
    }
};

// ---------------------------------------------------------------- lane-contiguous cut (CUT_V2)
// The cuts below cut a block so that the 8 lanes of a group read 32
// consecutive activations: a warp's float4 loads of x then touch 4 whole 128-byte lines
// (the mapping above scatters them over up to 32 lines, and the L1 wavefronts of those
// loads, not DRAM, bound the kernel).
//
// K-quant scales and mins of all 8 sub-blocks as packed bytes (llama.cpp's trick): words for
// sub-blocks 0..3 (lo) and 4..7 (hi).
__device__ __forceinline__ void k4_scales_packed(u32 s0, u32 s1, u32 s2, bool hi, u32& scw, u32& mw) {
    const u32 sc_lo = s0 & 0x3F3F3F3Fu, m_lo = s1 & 0x3F3F3F3Fu;
    const u32 sc_hi = (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);
    const u32 m_hi = ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
    scw = hi ? sc_hi : sc_lo;
    mw = hi ? m_hi : m_lo;
}
// Q4_K, 32 pieces of 4 qs bytes: piece j -> chunk c = j/8, positions p..p+3 (p = 4*(j%8));
// low nibbles -> sub-block 2c, high nibbles -> sub-block 2c+1.
template <> struct QTraits<12, CUT_V2> {
    static constexpr int EPB = 256, BYTES = 144, LPB = 32, NG = 1;
    struct Raw { uint4 h; u32 q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.h = ld128(blk); r.q = ld32(blk + 16 + 4 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const int c = j >> 3, p = 4 * (j & 7), idx = (2 * c) & 3;
        u32 scw, mw;
        k4_scales_packed(r.h.y, r.h.z, r.h.w, c >= 2, scw, mw);
        const float d = h2f(r.h.x), dmin = h2f(r.h.x >> 16);
        const float ds0 = d * bytef(scw, idx, 0.f), ds1 = d * bytef(scw, idx + 1, 0.f);
        const float dm0 = dmin * bytef(mw, idx, 0.f), dm1 = dmin * bytef(mw, idx + 1, 0.f);
        const u32 lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = fmaf(ds0, bytef(lo, k, 0.f), -dm0); w[4 + k] = fmaf(ds1, bytef(hi, k, 0.f), -dm1); }
        o0 = 64 * c + p; o1 = o0 + 32;
    }
};
// Q5_K, as Q4_K v2 plus the high bits: qh byte p+t holds bit `is` for sub-block is.
template <> struct QTraits<13, CUT_V2> {
    static constexpr int EPB = 256, BYTES = 176, LPB = 32, NG = 1;
    struct Raw { uint4 h; u32 qh, q; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.h = ld128(blk); r.qh = ld32(blk + 16 + 4 * (j & 7)); r.q = ld32(blk + 48 + 4 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const int c = j >> 3, p = 4 * (j & 7), idx = (2 * c) & 3;
        u32 scw, mw;
        k4_scales_packed(r.h.y, r.h.z, r.h.w, c >= 2, scw, mw);
        const float d = h2f(r.h.x), dmin = h2f(r.h.x >> 16);
        const float ds0 = d * bytef(scw, idx, 0.f), ds1 = d * bytef(scw, idx + 1, 0.f);
        const float dm0 = dmin * bytef(mw, idx, 0.f), dm1 = dmin * bytef(mw, idx + 1, 0.f);
        const u32 lo = (r.q & 0x0F0F0F0Fu) | (((r.qh >> (2 * c)) & 0x01010101u) << 4);
        const u32 hi = ((r.q >> 4) & 0x0F0F0F0Fu) | (((r.qh >> (2 * c + 1)) & 0x01010101u) << 4);
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = fmaf(ds0, bytef(lo, k, 0.f), -dm0); w[4 + k] = fmaf(ds1, bytef(hi, k, 0.f), -dm1); }
        o0 = 64 * c + p; o1 = o0 + 32;
    }
};
// Q6_K, 32 pieces: piece j -> half h = j/16, kk = (j/8)%2, l = 4*(j%8); the 4 bytes
// ql[64h + 32kk + l ..] give k = kk (low nibbles) and k = kk+2 (high nibbles).
template <> struct QTraits<14, CUT_V2> {
    static constexpr int EPB = 256, BYTES = 210, LPB = 32, NG = 1;
    struct Raw { u32 ql, qh, sc, d; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        const int h = j >> 4, kk = (j >> 3) & 1, l = 4 * (j & 7);
        r.ql = ld32a2(blk + 64 * h + 32 * kk + l);
        r.qh = ld32a2(blk + 128 + 32 * h + l);
        const u8* s = blk + 192 + 8 * h + 2 * kk + (l >> 4);
        r.sc = (u32)__ldg(s) | ((u32)__ldg(s + 4) << 8);
        r.d = ld16(blk + 208);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const int h = j >> 4, kk = (j >> 3) & 1, l = 4 * (j & 7);
        const float d = h2f(r.d);
        const float s0 = d * (float)(signed char)(r.sc & 0xFFu), s1 = d * (float)(signed char)((r.sc >> 8) & 0xFFu);
        const u32 a = (r.ql & 0x0F0F0F0Fu) | (((r.qh >> (2 * kk)) & 0x03030303u) << 4);
        const u32 b = ((r.ql >> 4) & 0x0F0F0F0Fu) | (((r.qh >> (2 * kk + 4)) & 0x03030303u) << 4);
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = s0 * bytef(a, k, 32.f); w[4 + k] = s1 * bytef(b, k, 32.f); }
        o0 = 128 * h + 32 * kk + l; o1 = o0 + 64;
    }
};
// Q8_0 in pairs of blocks (rows of an even number of blocks): piece j (8 per pair) takes
// qs bytes 4j..4j+3 of both blocks.
template <> struct QTraits<8, CUT_V2> {
    static constexpr int EPB = 64, BYTES = 68, LPB = 8, NG = 1;
    struct Raw { u32 d0, q0, d1, q1; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.d0 = ld16(blk); r.q0 = ld32a2(blk + 2 + 4 * j);
        r.d1 = ld16(blk + 34); r.q1 = ld32a2(blk + 36 + 4 * j);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, int g, float* w, int& o0, int& o1) {
        const float d0 = h2f(r.d0), d1 = h2f(r.d1);
        const u32 a = r.q0 ^ 0x80808080u, b = r.q1 ^ 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; k++) { w[k] = d0 * bytef(a, k, 128.f); w[4 + k] = d1 * bytef(b, k, 128.f); }
        o0 = 4 * j; o1 = 32 + 4 * j;
    }
};

// Dequantize rows: out[i, :] = W[ids ? ids[i] : i, :] as f16 (OUT_F32 = 0) or f32 (OUT_F32 = 1).
// out: [n_out_rows, n_cols]. A row id outside [0, n_src_rows) gives a row of NaN.
template <int QT, int CUT, int OUT_F32>
__global__ void __launch_bounds__(256) deq_kernel(const u8* __restrict__ w, const int* ids,
                                                  void* __restrict__ out, int n_out_rows, int n_cols,
                                                  long long row_bytes, int n_src_rows) {
    pdl_enter();
    typedef QTraits<QT, CUT> T;
    const int npieces = (n_cols / T::EPB) * T::LPB;
    const long long total = (long long)n_out_rows * npieces;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(idx / npieces), p = (int)(idx % npieces);
        const int src = ids ? ids[row] : row;
        const int blk = p / T::LPB, j = p % T::LPB;
        const long long obase = (long long)row * n_cols + (long long)blk * T::EPB;
        const bool ok = src >= 0 && src < n_src_rows;
        typename T::Raw raw;
        if (ok) T::load(w + (long long)src * row_bytes + (long long)blk * T::BYTES, j, raw);
#pragma unroll
        for (int g = 0; g < T::NG; g++) {
            float wv[8];
            int o0 = 0, o1 = 0;
            T::decode(raw, j, g, wv, o0, o1);
            if (!ok) {
#pragma unroll
                for (int k = 0; k < 8; k++) wv[k] = __int_as_float(0x7fc00000);
            }
            if (OUT_F32) {
                float* o = (float*)out + obase;
                *(float4*)(o + o0) = make_float4(wv[0], wv[1], wv[2], wv[3]);
                *(float4*)(o + o1) = make_float4(wv[4], wv[5], wv[6], wv[7]);
            } else {
                u16* o = (u16*)out + obase;
                uint2 a, b;
                a.x = (u32)f2h(wv[0]) | ((u32)f2h(wv[1]) << 16); a.y = (u32)f2h(wv[2]) | ((u32)f2h(wv[3]) << 16);
                b.x = (u32)f2h(wv[4]) | ((u32)f2h(wv[5]) << 16); b.y = (u32)f2h(wv[6]) | ((u32)f2h(wv[7]) << 16);
                *(uint2*)(o + o0) = a;
                *(uint2*)(o + o1) = b;
            }
        }
    }
}

// ================================================================ int8 activations + dp4a ("dp4a")
// llama.cpp's "mmvq" scheme: the activation rows x [B, n_cols] are quantized once per matvec to
// int8 in groups of 32 (quantize_x_kernel: xq[b, c] = round(x[b, c] / d), d = max|x| / 127 over
// the group; ds[b, g] = (d, d * sum of the group's 32 int8 values)), then each weight block is
// multiplied with integer dot products (__dp4a: 4 int8 MACs per instruction) and its scales are
// applied once per sub-block: sum_i w_i x_i ~= sum_g d_w,g * d_x,g * sum_i q_i xq_i (+ min terms
// through the group sums). Every sub-block of every supported type covers whole groups of 32 (or
// 16 for Q6_K's scales), so the groups never straddle a weight scale.
//
// Loads: 16-byte vectors where the block layout is 16-byte aligned (Q4_K, Q5_K), aligned words
// for 4-byte-aligned layouts (Q4_1, Q5_1), and for the 2-byte-aligned layouts (Q4_0, Q5_0, Q8_0,
// Q6_K) aligned words stitched with a funnel shift (+ one halfword for the tail): every word read
// holds at least one byte of the block, so no read leaves the tensor's (4-byte-aligned) allocation.

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

// pack_bytes, quant2_group, quant2_store: common.cuh (attn_combine_kernel writes the planes too)

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

__device__ __forceinline__ int dp4(u32 a, u32 b, int c) { return __dp4a((int)a, (int)b, c); }
// N words of bytes p .. p + 4N - 1 for a 2-byte-aligned p: aligned words stitched by a funnel
// shift; the last two bytes come from a halfword load, made only when p is not 4-byte aligned.
template <int N>
__device__ __forceinline__ void ld_words_a2(const u8* p, u32 (&r)[N]) {
    const unsigned long long a = (unsigned long long)p;
    const u32 sh = (u32)(a & 2ull) * 8u;
    const u32* q = (const u32*)(a & ~3ull);
    u32 w[N + 1];
#pragma unroll
    for (int i = 0; i < N; i++) w[i] = __ldg(q + i);
    w[N] = 0u;
    if (sh) w[N] = (u32)__ldg((const u16*)(q + N));
#pragma unroll
    for (int i = 0; i < N; i++) r[i] = __funnelshift_r(w[i], w[i + 1], sh);
}
// per-byte q - 32 for bytes q in [0, 64), as int8 (no borrow between bytes)
__device__ __forceinline__ u32 sub32_bytes(u32 q) { return ((q | 0x80808080u) - 0x20202020u) ^ 0x80808080u; }

// Where a dp4a product reads its activations from: LdG global memory through the read-only path
// (every kernel but one), LdS the CTA's shared-memory stage (mvq2s_kernel; generic pointers).
struct LdG {
    static __device__ __forceinline__ uint4 u128(const u8* p) { return __ldca((const uint4*)p); }
    static __device__ __forceinline__ uint2 u64(const u8* p) { return __ldca((const uint2*)p); }
    static __device__ __forceinline__ float2 f2(const float2* p) { return __ldca(p); }
    static __device__ __forceinline__ float f(const float* p) { return __ldca(p); }
};
struct LdS {
    static __device__ __forceinline__ uint4 u128(const u8* p) { return *(const uint4*)p; }
    static __device__ __forceinline__ uint2 u64(const u8* p) { return *(const uint2*)p; }
    static __device__ __forceinline__ float2 f2(const float2* p) { return *p; }
    static __device__ __forceinline__ float f(const float* p) { return *p; }
};

template <int QT> struct QDTraits;

// ---------------------------------------------------------------- Q4_K / Q5_K (dp4a)
// piece j (8 per block): chunk c = j/2, qs bytes [16j, 16j+16) = positions p..p+15 (p = 16*(j&1))
// of sub-blocks 2c (low nibbles) and 2c+1 (high nibbles). The min terms use the whole group
// sums and are added by the even piece of each chunk only.
template <int QT> struct QDK45 {
    static constexpr int EPB = 256, BYTES = (QT == 12 ? 144 : 176), LPB = 8;
    struct Raw { uint4 h, q, qh; };
    struct Dec { u32 lo[4], hi[4]; float ds0, ds1, dm0, dm1; };
    struct XV { uint4 a, b; float2 g0, g1; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        r.h = ld128(blk);
        if (QT == 12) {
            r.q = ld128(blk + 16 + 16 * j);
        } else {
            r.qh = ld128(blk + 16 + 16 * (j & 1));
            r.q = ld128(blk + 48 + 16 * j);
        }
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, Dec& e) {
        const int c = j >> 1, idx = (2 * c) & 3;
        u32 scw, mw;
        k4_scales_packed(r.h.y, r.h.z, r.h.w, c >= 2, scw, mw);
        const float d = h2f(r.h.x), dmin = (j & 1) ? 0.f : h2f(r.h.x >> 16);
        e.ds0 = d * bytef(scw, idx, 0.f); e.ds1 = d * bytef(scw, idx + 1, 0.f);
        e.dm0 = dmin * bytef(mw, idx, 0.f); e.dm1 = dmin * bytef(mw, idx + 1, 0.f);
        const u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        const u32 h[4] = {r.qh.x, r.qh.y, r.qh.z, r.qh.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            e.lo[i] = q[i] & 0x0F0F0F0Fu;
            e.hi[i] = (q[i] >> 4) & 0x0F0F0F0Fu;
            if (QT == 13) {
                e.lo[i] |= ((h[i] >> (2 * c)) & 0x01010101u) << 4;
                e.hi[i] |= ((h[i] >> (2 * c + 1)) & 0x01010101u) << 4;
            }
        }
    }
    // xq, ds: this block's activations of one batch row
    template <class LD = LdG>
    static __device__ __forceinline__ void loadx(int j, const u8* xq, const float2* ds, XV& v) {
        const int c = j >> 1, p = 16 * (j & 1);
        v.a = LD::u128(xq + 64 * c + p);
        v.b = LD::u128(xq + 64 * c + 32 + p);
        v.g0 = LD::f2(ds + 2 * c);
        v.g1 = LD::f2(ds + 2 * c + 1);
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XV& v) {
        int s0 = dp4(e.lo[0], v.a.x, 0), s1 = dp4(e.hi[0], v.b.x, 0);
        s0 = dp4(e.lo[1], v.a.y, s0); s1 = dp4(e.hi[1], v.b.y, s1);
        s0 = dp4(e.lo[2], v.a.z, s0); s1 = dp4(e.hi[2], v.b.z, s1);
        s0 = dp4(e.lo[3], v.a.w, s0); s1 = dp4(e.hi[3], v.b.w, s1);
        float r = e.ds0 * v.g0.x * (float)s0;
        r = fmaf(e.ds1 * v.g1.x, (float)s1, r);
        r = fmaf(-e.dm0, v.g0.y, r);
        return fmaf(-e.dm1, v.g1.y, r);
    }
};
template <> struct QDTraits<12> : QDK45<12> {};
template <> struct QDTraits<13> : QDK45<13> {};

// ---------------------------------------------------------------- Q6_K (dp4a)
// piece j (8 per block): half h = j/4, positions l0..l0+7 (l0 = 8*(j&3)) of the four 32-groups
// k = 0..3 of the half: ql[64h + l0 ..] (k = 0 low, k = 2 high nibbles), ql[64h + 32 + l0 ..]
// (k = 1, 3), qh[32h + l0 ..] (2 bits per k); scale of (h, k, l0) = scales[8h + 2k + l0/16].
template <> struct QDTraits<14> {
    static constexpr int EPB = 256, BYTES = 210, LPB = 8;
    struct Raw { u32 a[2], b[2], h[2], s[2], d; };
    struct Dec { u32 q[4][2]; float sc[4]; };
    struct XV { uint2 x[4]; float g[4]; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        const int h = j >> 2, l0 = 8 * (j & 3);
        ld_words_a2<2>(blk + 64 * h + l0, r.a);
        ld_words_a2<2>(blk + 64 * h + 32 + l0, r.b);
        ld_words_a2<2>(blk + 128 + 32 * h + l0, r.h);
        ld_words_a2<2>(blk + 192 + 8 * h, r.s);
        r.d = ld16(blk + 208);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, Dec& e) {
        const int hs = (j & 3) >> 1;  // l0 / 16
        const float d = h2f(r.d);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 sw = r.s[k >> 1];
            e.sc[k] = d * (float)(signed char)byte_of(sw, 2 * (k & 1) + hs);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const u32 l = (k & 1) ? r.b[i] : r.a[i];
                const u32 lo = (k >> 1) ? ((l >> 4) & 0x0F0F0F0Fu) : (l & 0x0F0F0F0Fu);
                e.q[k][i] = sub32_bytes(lo | (((r.h[i] >> (2 * k)) & 0x03030303u) << 4));
            }
        }
    }
    template <class LD = LdG>
    static __device__ __forceinline__ void loadx(int j, const u8* xq, const float2* ds, XV& v) {
        const int h = j >> 2, l0 = 8 * (j & 3);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v.x[k] = LD::u64(xq + 128 * h + 32 * k + l0);
            v.g[k] = LD::f((const float*)(ds + 4 * h + k));
        }
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XV& v) {
        float r = 0.f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int s = dp4(e.q[k][1], v.x[k].y, dp4(e.q[k][0], v.x[k].x, 0));
            r = fmaf(e.sc[k] * v.g[k], (float)s, r);
        }
        return r;
    }
};

// ---------------------------------------------------------------- Q8_0 (dp4a)
// piece j (2 per block): qs bytes [16j, 16j+16) -> activations 16j..16j+15 of the block's group.
template <> struct QDTraits<8> {
    static constexpr int EPB = 32, BYTES = 34, LPB = 2;
    struct Raw { u32 q[4], d; };
    struct Dec { u32 q[4]; float d; };
    struct XV { uint4 a; float dx; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        ld_words_a2<4>(blk + 2 + 16 * j, r.q);
        r.d = ld16(blk);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, Dec& e) {
#pragma unroll
        for (int i = 0; i < 4; i++) e.q[i] = r.q[i];
        e.d = h2f(r.d);
    }
    template <class LD = LdG>
    static __device__ __forceinline__ void loadx(int j, const u8* xq, const float2* ds, XV& v) {
        v.a = LD::u128(xq + 16 * j);
        v.dx = LD::f((const float*)ds);
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XV& v) {
        const int s = dp4(e.q[3], v.a.w, dp4(e.q[2], v.a.z, dp4(e.q[1], v.a.y, dp4(e.q[0], v.a.x, 0))));
        return e.d * v.dx * (float)s;
    }
};

// ---------------------------------------------------------------- Q4_0 / Q4_1 / Q5_0 / Q5_1 (dp4a)
// one piece per block: qs[l] low nibble -> element l, high nibble -> element 16 + l (l < 16);
// Q5: bit l / 16 + l of qh is bit 4. Offsets (Q4_0, Q5_0: value (q - off) * d) go through the
// group sum: d * (dx * sum q xq - off * dx * sum xq); mins (Q4_1, Q5_1): + m * dx * sum xq.
template <int QT> struct QD32 {
    static constexpr bool HAS_M = (QT == 3 || QT == 7), Q5 = (QT == 6 || QT == 7);
    static constexpr int EPB = 32, LPB = 1;
    static constexpr int BYTES = QT == 2 ? 18 : QT == 3 ? 20 : QT == 6 ? 22 : 24;
    static constexpr int QS = QT == 2 ? 2 : QT == 3 ? 4 : QT == 6 ? 6 : 8;  // offset of qs
    static constexpr float OFF = QT == 2 ? 8.f : 16.f;
    struct Raw { u32 q[4], dm, qh; };
    struct Dec { u32 lo[4], hi[4]; float d, m; };
    struct XV { uint4 a, b; float2 g; };
    static __device__ __forceinline__ void load(const u8* blk, int j, Raw& r) {
        if (HAS_M) {  // 4-byte-aligned blocks
            r.dm = ld32(blk);
#pragma unroll
            for (int i = 0; i < 4; i++) r.q[i] = ld32(blk + QS + 4 * i);
            r.qh = Q5 ? ld32(blk + 4) : 0u;
        } else {
            r.dm = ld16(blk);
            ld_words_a2<4>(blk + QS, r.q);
            r.qh = Q5 ? ld32a2(blk + 2) : 0u;
        }
    }
    static __device__ __forceinline__ void decode(const Raw& r, int j, Dec& e) {
        e.d = h2f(r.dm);
        e.m = HAS_M ? h2f(r.dm >> 16) : 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            e.lo[i] = r.q[i] & 0x0F0F0F0Fu;
            e.hi[i] = (r.q[i] >> 4) & 0x0F0F0F0Fu;
            if (Q5) {
                e.lo[i] |= q5_hbits(r.qh >> (4 * i));
                e.hi[i] |= q5_hbits(r.qh >> (16 + 4 * i));
            }
        }
    }
    template <class LD = LdG>
    static __device__ __forceinline__ void loadx(int j, const u8* xq, const float2* ds, XV& v) {
        v.a = LD::u128(xq);
        v.b = LD::u128(xq + 16);
        v.g = LD::f2(ds);
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XV& v) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) s = dp4(e.lo[i], (&v.a.x)[i], s);
#pragma unroll
        for (int i = 0; i < 4; i++) s = dp4(e.hi[i], (&v.b.x)[i], s);
        if (HAS_M) return fmaf(e.d * v.g.x, (float)s, e.m * v.g.y);
        return e.d * fmaf(v.g.x, (float)s, -OFF * v.g.y);
    }
};
template <> struct QDTraits<2> : QD32<2> {};
template <> struct QDTraits<3> : QD32<3> {};
template <> struct QDTraits<6> : QD32<6> {};
template <> struct QDTraits<7> : QD32<7> {};

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
template <class P, int B, int NR, int U>
__device__ __forceinline__ void matvec_rows(const u8* __restrict__ w, const typename P::Act& act,
                                            float* __restrict__ out, int n_rows, int n_cols,
                                            long long row_bytes, int row0, bool accumulate = false) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int npieces = (n_cols / P::EPB) * P::LPB;
    float acc[NR][B];
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[r][b] = 0.f;
    const u8* rp[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) rp[r] = w + (long long)min(row0 + r, n_rows - 1) * row_bytes;
    const int stride = nw * 32;
    // programmatic launch (common.cuh): the first trip's weight loads are issued before the wait
    // for the activations, the weights being constant while the pass runs
    pdl_trigger();
    bool waited = false;
    for (int p0 = warp * 32 + lane; p0 < npieces; p0 += stride * U) {
        typename P::Raw raw[U][NR];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * stride;
            if (p < npieces) {
                const int blk = p / P::LPB, j = p % P::LPB;
#pragma unroll
                for (int r = 0; r < NR; r++) P::load(rp[r] + (long long)blk * P::BYTES, j, raw[u][r]);
            }
        }
        if (!waited) {
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * stride;
            if (p < npieces) {
                const int blk = p / P::LPB, j = p % P::LPB;
                P::template accumulate<B, NR>(raw[u], blk, j, act, n_cols, acc);
            }
        }
    }
    if (!waited) pdl_wait();  // a lane with no piece still writes out (through red)
    __shared__ float red[8][NR * B];
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int b = 0; b < B; b++) {
            const float v = warp_sum(acc[r][b]);
            if (lane == 0) red[warp][r * B + b] = v;
        }
    __syncthreads();
    for (int o = threadIdx.x; o < NR * B; o += blockDim.x) {  // NR * B may exceed the CTA (8 x 8, 2 warps)
        const int r = o / B, b = o % B;
        float s = 0.f;
        for (int i = 0; i < nw; i++) s += red[i][o];
        const int row = row0 + r;
        if (row < n_rows) {
            float* o = out + (long long)b * n_rows + row;
            *o = accumulate ? *o + s : s;
        }
    }
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

// x: [B, n_cols] f32, out: [B, n_rows] f32; weights of type QT read through layout cut CUT.
template <int QT, int CUT, int B, int NR, int U>
__global__ void __launch_bounds__(256) mv_kernel(const u8* __restrict__ w, const float* x,
                                                 float* __restrict__ out, int n_rows, int n_cols,
                                                 long long row_bytes) {
    typedef MvF32<QT, CUT> P;
    matvec_rows<P, B, NR, U>(w, typename P::Act{x}, out, n_rows, n_cols, row_bytes, blockIdx.x * NR);
}

// out[b, row] = sum_c W[row, c] * dequant(xq)[b, c]; xq, ds: quantize_x_kernel's output for x.
template <int QT, int B, int NR, int U>
__global__ void __launch_bounds__(256) mvq_kernel(const u8* __restrict__ w, const u8* xq,
                                                  const float2* ds, float* __restrict__ out,
                                                  int n_rows, int n_cols, long long row_bytes) {
    typedef MvDp4aP<QT, 1> P;
    matvec_rows<P, B, NR, U>(w, typename P::Act{xq, ds, nullptr, nullptr, n_cols / 32}, out, n_rows, n_cols, row_bytes, blockIdx.x * NR);
}

// ================================================================ tensor-core matmul ("mm")
// out[b, row] = sum_c W[row, c] * x[b, c] for up to 64 activation rows, on the tensor cores
// (mma.sync m16n8k16, f16 inputs, f32 accumulation), weights read once for all rows.
//
// Exact split, so that the result is the f32 matvec's up to f32 rounding (no batch size changes
// a token through rounding): each weight is s * q - m with q a small integer (exact in f16) and
// s, m per sub-block in f32; x is split into x_hi = f16(x) and x_lo = f16(x - x_hi) (mm_split_x,
// x ~= x_hi + x_lo to ~2^-22). One mma step multiplies 16 rows by 16 columns: the product of q
// with x_hi and x_lo starts from zero, is scaled by the row's s in f32, and the sub-block's min
// term uses the same mma with q = 1 (the column sum of x). A step's 16 columns are the runs of
// 4 consecutive columns of the 4 pieces (one per lane of a quad) of one sub-block: the dot
// product does not care in which order the k index visits columns, as long as the weight
// (A) and activation (B) fragments agree, and both are loaded at the lane's own columns.
//
// Fragment layout of mma.m16n8k16 (lane = 4 * gid + tig): A row gid holds k {2tig, 2tig+1}
// (a0) and {2tig+8, 2tig+9} (a2), row gid+8 likewise (a1, a3); B column n = gid holds the same
// k (b0, b1); C: (row gid, n 2tig, 2tig+1) = c0, c1, (row gid+8, ...) = c2, c3. A lane's run of
// columns o..o+3 is k 2tig, 2tig+1, 2tig+8, 2tig+9.
//
// MmTraits<QT, CUT>: decode of one piece (QTraits<QT, CUT>'s layout and loads, NG = 1: two runs
// of 4 columns) into the integers as f16 pairs a[0..1] (run 0), a[2..3] (run 1), their scales
// s[run] and min terms m[run] (weight = s * q - m), and the runs' column offsets in the block.

// bytes k0, k1 of v (values < 1024) minus `bias` as f16 pair: 0x64xx is the f16 1024 + xx
__device__ __forceinline__ u32 h2_bytes(u32 v, u32 sel, u32 bias) {
    const u32 p = __byte_perm(v, 0x64u, sel);
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(p), "r"(bias));
    return r;
}
constexpr u32 SEL01 = 0x4140u, SEL23 = 0x4342u;  // byte_perm selectors: bytes 0,1 / 2,3 as f16 1024+b
// f16 pair bias (1024 + off, 1024 + off)
__host__ __device__ constexpr u32 h2_bias(int off) { return (0x6400u + (u32)off) * 0x10001u; }

template <int QT, int CUT> struct MmTraits;
template <> struct MmTraits<12, CUT_V2> {  // Q4_K: w = d*sc*q - dmin*m, q in [0, 16)
    static constexpr bool HAS_MIN = true;
    typedef QTraits<12, CUT_V2>::Raw Raw;
    static __device__ __forceinline__ void decode(const Raw& r, int j, u32 (&a)[4], float (&s)[2], float (&m)[2], int (&o)[2]) {
        const int c = j >> 3, idx = (2 * c) & 3;
        u32 scw, mw;
        k4_scales_packed(r.h.y, r.h.z, r.h.w, c >= 2, scw, mw);
        const float d = h2f(r.h.x), dmin = h2f(r.h.x >> 16);
        s[0] = d * bytef(scw, idx, 0.f); s[1] = d * bytef(scw, idx + 1, 0.f);
        m[0] = dmin * bytef(mw, idx, 0.f); m[1] = dmin * bytef(mw, idx + 1, 0.f);
        const u32 lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
        a[0] = h2_bytes(lo, SEL01, h2_bias(0)); a[1] = h2_bytes(lo, SEL23, h2_bias(0));
        a[2] = h2_bytes(hi, SEL01, h2_bias(0)); a[3] = h2_bytes(hi, SEL23, h2_bias(0));
        o[0] = 64 * c + 4 * (j & 7); o[1] = o[0] + 32;
    }
};
template <> struct MmTraits<13, CUT_V2> {  // Q5_K: Q4_K plus a fifth bit, q in [0, 32)
    static constexpr bool HAS_MIN = true;
    typedef QTraits<13, CUT_V2>::Raw Raw;
    static __device__ __forceinline__ void decode(const Raw& r, int j, u32 (&a)[4], float (&s)[2], float (&m)[2], int (&o)[2]) {
        const int c = j >> 3, idx = (2 * c) & 3;
        u32 scw, mw;
        k4_scales_packed(r.h.y, r.h.z, r.h.w, c >= 2, scw, mw);
        const float d = h2f(r.h.x), dmin = h2f(r.h.x >> 16);
        s[0] = d * bytef(scw, idx, 0.f); s[1] = d * bytef(scw, idx + 1, 0.f);
        m[0] = dmin * bytef(mw, idx, 0.f); m[1] = dmin * bytef(mw, idx + 1, 0.f);
        const u32 lo = (r.q & 0x0F0F0F0Fu) | (((r.qh >> (2 * c)) & 0x01010101u) << 4);
        const u32 hi = ((r.q >> 4) & 0x0F0F0F0Fu) | (((r.qh >> (2 * c + 1)) & 0x01010101u) << 4);
        a[0] = h2_bytes(lo, SEL01, h2_bias(0)); a[1] = h2_bytes(lo, SEL23, h2_bias(0));
        a[2] = h2_bytes(hi, SEL01, h2_bias(0)); a[3] = h2_bytes(hi, SEL23, h2_bias(0));
        o[0] = 64 * c + 4 * (j & 7); o[1] = o[0] + 32;
    }
};
template <> struct MmTraits<14, CUT_V2> {  // Q6_K: w = d*sc*(q - 32), q in [0, 64)
    static constexpr bool HAS_MIN = false;
    typedef QTraits<14, CUT_V2>::Raw Raw;
    static __device__ __forceinline__ void decode(const Raw& r, int j, u32 (&a)[4], float (&s)[2], float (&m)[2], int (&o)[2]) {
        const int h = j >> 4, kk = (j >> 3) & 1, l = 4 * (j & 7);
        const float d = h2f(r.d);
        s[0] = d * (float)(signed char)(r.sc & 0xFFu); s[1] = d * (float)(signed char)((r.sc >> 8) & 0xFFu);
        m[0] = m[1] = 0.f;
        const u32 lo = (r.ql & 0x0F0F0F0Fu) | (((r.qh >> (2 * kk)) & 0x03030303u) << 4);
        const u32 hi = ((r.ql >> 4) & 0x0F0F0F0Fu) | (((r.qh >> (2 * kk + 4)) & 0x03030303u) << 4);
        a[0] = h2_bytes(lo, SEL01, h2_bias(32)); a[1] = h2_bytes(lo, SEL23, h2_bias(32));
        a[2] = h2_bytes(hi, SEL01, h2_bias(32)); a[3] = h2_bytes(hi, SEL23, h2_bias(32));
        o[0] = 128 * h + 32 * kk + l; o[1] = o[0] + 64;
    }
};
template <int CUT> struct MmQ8_0 {  // Q8_0: w = d*q, q int8 (as q + 128 in [0, 256))
    static constexpr bool HAS_MIN = false;
    typedef typename QTraits<8, CUT>::Raw Raw;
    static __device__ __forceinline__ void decode(const Raw& r, int j, u32 (&a)[4], float (&s)[2], float (&m)[2], int (&o)[2]) {
        u32 qa, qb;
        if constexpr (CUT == CUT_V2) {  // a pair of blocks: run 0 from the first, run 1 from the second
            qa = r.q0; qb = r.q1; s[0] = h2f(r.d0); s[1] = h2f(r.d1); o[0] = 4 * j; o[1] = 32 + 4 * j;
        } else {  // v1: piece j = columns 8j..8j+7 of one block
            qa = r.q0; qb = r.q1; s[0] = s[1] = h2f(r.d); o[0] = 8 * j; o[1] = 8 * j + 4;
        }
        m[0] = m[1] = 0.f;
        qa ^= 0x80808080u; qb ^= 0x80808080u;
        a[0] = h2_bytes(qa, SEL01, h2_bias(128)); a[1] = h2_bytes(qa, SEL23, h2_bias(128));
        a[2] = h2_bytes(qb, SEL01, h2_bias(128)); a[3] = h2_bytes(qb, SEL23, h2_bias(128));
    }
};
template <> struct MmTraits<8, CUT_V2> : MmQ8_0<CUT_V2> {};
template <> struct MmTraits<8, CUT_V1> : MmQ8_0<CUT_V1> {};
// Q4_0 / Q4_1 / Q5_0 / Q5_1 (v1, 4 pieces per block: a quad is one block, one scale):
// piece j = columns 4j..4j+3 (low nibbles) and 16+4j.. (high); Q4_0/Q5_0: w = d*(q - 8 / 16),
// Q4_1/Q5_1: w = d*q + m
template <int QT> struct MmQ32 {
    static constexpr bool HAS_M = (QT == 3 || QT == 7), Q5 = (QT == 6 || QT == 7);
    static constexpr bool HAS_MIN = HAS_M;
    static constexpr int OFF = HAS_M ? 0 : (Q5 ? 16 : 8);
    typedef typename QTraits<QT, CUT_V1>::Raw Raw;
    static __device__ __forceinline__ void decode(const Raw& r, int j, u32 (&a)[4], float (&s)[2], float (&m)[2], int (&o)[2]) {
        u32 dm;
        u32 lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
        if constexpr (HAS_M) dm = r.dm; else dm = r.d;
        if constexpr (Q5) {
            lo |= q5_hbits(r.qh >> (4 * j));
            hi |= q5_hbits(r.qh >> (16 + 4 * j));
        }
        s[0] = s[1] = h2f(dm);
        m[0] = m[1] = HAS_M ? -h2f(dm >> 16) : 0.f;
        a[0] = h2_bytes(lo, SEL01, h2_bias(OFF)); a[1] = h2_bytes(lo, SEL23, h2_bias(OFF));
        a[2] = h2_bytes(hi, SEL01, h2_bias(OFF)); a[3] = h2_bytes(hi, SEL23, h2_bias(OFF));
        o[0] = 4 * j; o[1] = 16 + 4 * j;
    }
};
template <> struct MmTraits<2, CUT_V1> : MmQ32<2> {};
template <> struct MmTraits<3, CUT_V1> : MmQ32<3> {};
template <> struct MmTraits<6, CUT_V1> : MmQ32<6> {};
template <> struct MmTraits<7, CUT_V1> : MmQ32<7> {};
template <> struct MmTraits<1, CUT_V1> {  // F16: the weights are f16 already (exact), scale 1
    static constexpr bool HAS_MIN = false;
    typedef QTraits<1, CUT_V1>::Raw Raw;
    static __device__ __forceinline__ void decode(const Raw& r, int j, u32 (&a)[4], float (&s)[2], float (&m)[2], int (&o)[2]) {
        a[0] = r.v.x; a[1] = r.v.y; a[2] = r.v.z; a[3] = r.v.w;
        s[0] = s[1] = 1.f; m[0] = m[1] = 0.f;
        o[0] = 0; o[1] = 4;
    }
};

// x [B, n_cols] f32 -> xs [n_cols / 4, B] of uint4 (x_hi of 4 columns as two f16 pairs, then
// x_lo likewise), column groups outermost: the 8 x rows of one mma tile at one column group are
// 128 contiguous bytes, so a warp's fragment load touches 4 cache lines, not 8; n4 = B * n_cols / 4.
__device__ __forceinline__ u32 f2h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
extern "C" __global__ void __launch_bounds__(256) mm_split_x_kernel(const float4* x, uint4* __restrict__ xs,
                                                                    int n4, int cols4, int B) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const int n = i / cols4, c4 = i % cols4;
    const float4 v = __ldca(x + i);
    const u32 h0 = f2h2(v.x, v.y), h1 = f2h2(v.z, v.w);
    const float r0 = v.x - h2f(h0), r1 = v.y - h2f(h0 >> 16), r2 = v.z - h2f(h1), r3 = v.w - h2f(h1 >> 16);
    xs[(long long)c4 * B + n] = make_uint4(h0, h1, f2h2(r0, r1), f2h2(r2, r3));
}

__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The min terms of a step (weight = s * q - m): the same mma with q = 1 gives the column sums
// of x over the step's 16 columns (every row alike); the C entries (row gid / gid + 8) lose m
// times them. Two more mma per step measured faster than loading precomputed sums (1.6x at 64
// rows of Q4_K): those loads, 2 per tile, were latency the kernel could not hide.
__device__ __forceinline__ void mm_min_terms(float (&a)[4], const uint4& xv, float ma, float mb) {
    const u32 ONE = 0x3C003C00u;  // f16 pair (1, 1)
    float e[4] = {0.f, 0.f, 0.f, 0.f};
    mma16816(e, ONE, ONE, ONE, ONE, xv.x, xv.y);
    mma16816(e, ONE, ONE, ONE, ONE, xv.z, xv.w);
    a[0] = fmaf(-ma, e[0], a[0]);
    a[1] = fmaf(-ma, e[1], a[1]);
    a[2] = fmaf(-mb, e[2], a[2]);
    a[3] = fmaf(-mb, e[3], a[3]);
}

// The end of both tensor-core kernels: each warp's accumulators (rows gid, gid + 8 of its 16-row
// tile, x rows 8 nt + 2 tig, + 1) are summed over the CTA's WK warps in warp order through
// red [8 warps][16 rows][8 NT x rows]; with KS = gridDim.y > 1 each CTA writes its sums to part
// [KS, B, n_rows] and the last CTA of a row tile to finish (tile_count) adds the KS partials in
// order and resets the counter: the result does not depend on timing.
template <int NT, int MT = 1>
__device__ __forceinline__ void mm_epilogue(const float (&acc)[MT][NT][4], float* red, float* __restrict__ out,
                                            float* __restrict__ part, int* __restrict__ tile_count,
                                            int n_rows, int B, int WR) {
    constexpr int R = 16 * MT;  // rows per warp: MT tiles of 16
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int gid = lane >> 2, tig = lane & 3, WK = nw / WR;
    float* wred = red + warp * R * 8 * NT;  // [R][8 NT]
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
        const int r = e % (R * WR), n = e / (R * WR);  // consecutive threads: consecutive rows
        float s = 0.f;
        for (int k = 0; k < WK; k++) s += red[((k * WR + r / R) * R + r % R) * 8 * NT + n];
        const int row = row0 + r;
        if (row < n_rows) {
            if (KS == 1) out[(long long)n * n_rows + row] = s;
            else part[((long long)blockIdx.y * B + n) * n_rows + row] = s;
        }
    }
    if (KS == 1) return;
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(tile_count + blockIdx.x, 1) == KS - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < n_entries; e += blockDim.x) {
        const int r = e % (R * WR), n = e / (R * WR), row = row0 + r;
        if (row >= n_rows) continue;
        float s = 0.f;
        for (int k = 0; k < KS; k++) s += __ldcg(part + ((long long)k * B + n) * n_rows + row);
        out[(long long)n * n_rows + row] = s;
    }
    if (threadIdx.x == 0) tile_count[blockIdx.x] = 0;
}

// mm_epilogue for kernels whose warps hold one 16-row tile
template <int NT>
__device__ __forceinline__ void mm_epilogue(const float (&acc)[NT][4], float* red, float* __restrict__ out,
                                            float* __restrict__ part, int* __restrict__ tile_count,
                                            int n_rows, int B, int WR) {
    mm_epilogue<NT, 1>(reinterpret_cast<const float(&)[1][NT][4]>(acc), red, out, part, tile_count, n_rows, B, WR);
}

// One CTA: WR warps side by side over rows (16 rows each), WK = warps / WR over the pieces of
// those rows; gridDim.y = KS more splits of the pieces. Quad step q = pieces 4q..4q+3 of a row;
// a warp takes the steps kpart, kpart + nparts, ... (nparts = KS * WK); mm_epilogue sums.
// Every fragment load of weights touches 8 rows (8 cache lines for 128 bytes), which bounds it
// (L1 wavefronts); mms_kernel stages whole blocks through shared memory for the K-quants.
// xs: mm_split_x_kernel of x [B, n_cols] ([n_cols / 4, B] uint4); out: [B, n_rows] f32; NT = ceil(B / 8) tiles of 8 rows of x.
template <int QT, int CUT, int NT, int U>
__global__ void __launch_bounds__(256) mm_kernel(const u8* __restrict__ w, const uint4* xs,
                                                 float* __restrict__ out, float* __restrict__ part,
                                                 int* __restrict__ tile_count, int n_rows, int n_cols,
                                                 long long row_bytes, int B, int WR) {
    pdl_enter();
    typedef QTraits<QT, CUT> T;
    typedef MmTraits<QT, CUT> M;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int WK = nw / WR, wr = warp % WR, wk = warp / WR;
    const int gid = lane >> 2, tig = lane & 3;
    const int row_a = blockIdx.x * 16 * WR + 16 * wr + gid;  // this lane's rows: row_a, row_a + 8
    const u8* rpa = w + (long long)min(row_a, n_rows - 1) * row_bytes;
    const u8* rpb = w + (long long)min(row_a + 8, n_rows - 1) * row_bytes;
    const int nq = (n_cols / T::EPB) * T::LPB / 4;
    const int nparts = gridDim.y * WK, kpart = blockIdx.y * WK + wk;
    const uint4* xr[NT];  // this lane's activation row of each tile (n = 8 nt + gid, clamped), column group 0
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = xs + min(8 * nt + gid, B - 1);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int q0 = kpart; q0 < nq; q0 += nparts * U) {
        typename T::Raw ra[U], rb[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = q0 + u * nparts;
            if (q < nq) {
                const int p = 4 * q + tig, blk = p / T::LPB, j = p % T::LPB;
                T::load(rpa + (long long)blk * T::BYTES, j, ra[u]);
                T::load(rpb + (long long)blk * T::BYTES, j, rb[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = q0 + u * nparts;
            if (q < nq) {
                const int p = 4 * q + tig, blk = p / T::LPB, j = p % T::LPB;
                u32 aa[4], ab[4];
                float sa[2], ma[2], sb[2], mb[2];
                int o[2];
                M::decode(ra[u], j, aa, sa, ma, o);
                M::decode(rb[u], j, ab, sb, mb, o);
#pragma unroll
                for (int run = 0; run < 2; run++) {
                    const int c4 = (blk * T::EPB + o[run]) >> 2;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const uint4 xv = __ldca(xr[nt] + (long long)c4 * B);  // x_hi (x, y), x_lo (z, w)
                        float c[4] = {0.f, 0.f, 0.f, 0.f};
                        mma16816(c, aa[2 * run], ab[2 * run], aa[2 * run + 1], ab[2 * run + 1], xv.x, xv.y);
                        mma16816(c, aa[2 * run], ab[2 * run], aa[2 * run + 1], ab[2 * run + 1], xv.z, xv.w);
                        acc[nt][0] = fmaf(sa[run], c[0], acc[nt][0]);
                        acc[nt][1] = fmaf(sa[run], c[1], acc[nt][1]);
                        acc[nt][2] = fmaf(sb[run], c[2], acc[nt][2]);
                        acc[nt][3] = fmaf(sb[run], c[3], acc[nt][3]);
                        if (M::HAS_MIN) mm_min_terms(acc[nt], xv, ma[run], mb[run]);
                    }
                }
            }
        }
    }
    __shared__ float red[8 * 16 * 8 * NT];
    mm_epilogue<NT>(acc, red, out, part, tile_count, n_rows, B, WR);
}

// ---------------------------------------------------------------- staged tensor-core matmul (mms)
// mm_kernel for the 256-column K-quants (Q4_K, Q5_K, Q6_K, cut v2), with the weights staged
// through shared memory: per block column, a warp copies its 16 rows' blocks (16 * BYTES bytes)
// with coalesced 4-byte loads (32 lanes read 128 contiguous bytes of one row) into its stage,
// prefetching the next block column into registers while it computes this one from the stage;
// the fragments then come from shared memory (MmTraits::load_s), whose reads cost one wavefront
// per 8 rows instead of eight. A block keeps its address modulo 4 in the stage (Q6_K blocks are
// 2-byte aligned), so load_s reads the same layout as the global loads do.
template <int QT> struct MmStage {
    typedef QTraits<QT, CUT_V2> T;
    static constexpr int MAXMIS = (T::BYTES % 4 == 0) ? 0 : 2;       // block start modulo 4
    static constexpr int NWORDS = (T::BYTES + MAXMIS + 3) / 4;       // words that cover a block
    static constexpr int SROW = ((NWORDS * 4 + 15) / 16) * 16;      // stage bytes per row
    static constexpr int WPL = (16 * NWORDS + 31) / 32;              // staged words per lane
};
__device__ __forceinline__ u32 lds32a2(const u8* p) {  // a 2-byte-aligned word from shared memory
    return (u32)*(const u16*)p | ((u32)*(const u16*)(p + 2) << 16);
}
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

// 4-byte asynchronous copy global -> shared (cp.async, sm_80+): no register holds the data, so
// several block columns can be in flight per warp at no register cost
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* gsrc) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// stages per warp of the staged walk (block columns in flight); kernels.MM_STAGES mirrors it to
// size the dynamic shared memory
#ifndef MM_STAGES
#define MM_STAGES 4
#endif

// The block-column walk both staged kernels share: the warp's 16 MT rows (from row_t) go through
// block columns kpart, kpart + nparts, ... < nb. Each column's blocks are copied (coalesced
// 4-byte cp.async: 32 lanes, 128 contiguous bytes of a row) into one of MM_STAGES / MT stages
// ([16 MT rows][SROW] each, at `stage`: the bytes in flight are the same for every MT), a few
// columns ahead of the one computed, and body(blk, rows) computes from the stage: rows[i] is
// the staged block of the lane's row gid + 8 i (i < 2 MT), at its global address modulo 4 (so
// 2-byte-aligned layouts read alike).
template <int QT, int MT, class Body>
__device__ __forceinline__ void mm_staged_walk(const u8* __restrict__ w, int n_rows, long long row_bytes, int row_t,
                                               int kpart, int nparts, int nb, u8* stage, Body&& body) {
    typedef QTraits<QT, CUT_V2> T;
    typedef MmStage<QT> S;
    constexpr int R = 16 * MT, NS = MM_STAGES / MT, STAGE_BYTES = R * S::SROW, WPL = (R * S::NWORDS + 31) / 32;
    static_assert(NS >= 2, "the walk needs two stages");
    const int lane = threadIdx.x & 31, gid = lane >> 2;
    auto row_ptr = [&](int r) { return w + (long long)min(row_t + r, n_rows - 1) * row_bytes; };
    // staged word i of this lane: w = lane + 32 i, row w / NWORDS, word w % NWORDS
    auto issue = [&](int blk, int slot) {
        if (blk < nb) {
#pragma unroll
            for (int i = 0; i < WPL; i++) {
                const int wi = lane + 32 * i;
                if (wi < R * S::NWORDS) {
                    const int r = wi / S::NWORDS, k = wi % S::NWORDS;
                    const unsigned long long g = (unsigned long long)(row_ptr(r) + (long long)blk * T::BYTES);
                    cp_async4(stage + slot * STAGE_BYTES + r * S::SROW + 4 * k, (const u32*)(g & ~3ull) + k);
                }
            }
        }
        cp_async_commit();  // a group per column, empty past the end: the wait below counts groups
    };
#pragma unroll
    for (int s = 0; s < NS - 1; s++) issue(kpart + s * nparts, s);
    int slot = 0;
    for (int blk = kpart; blk < nb; blk += nparts) {
        // the stage the previous column used (every lane is past it: __syncwarp below) takes the
        // column NS - 1 ahead; then this column's group is the oldest of NS pending
        issue(blk + (NS - 1) * nparts, slot == 0 ? NS - 1 : slot - 1);
        cp_async_wait<NS - 1>();
        __syncwarp();  // every lane's copies of this column have landed
        const u8* st = stage + slot * STAGE_BYTES;
        const u8* rows[2 * MT];
#pragma unroll
        for (int i = 0; i < 2 * MT; i++) {
            const int mis = (int)((unsigned long long)(row_ptr(gid + 8 * i) + (long long)blk * T::BYTES) & 3ull);
            rows[i] = st + (gid + 8 * i) * S::SROW + mis;
        }
        body(blk, rows);
        __syncwarp();
        slot = slot == NS - 1 ? 0 : slot + 1;
    }
    cp_async_wait<0>();
}

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

// ---------------------------------------------------------------- int8 tensor-core matmul (mmq)
// out[b, row] = sum_c W[row, c] * x[b, c] for up to 64 rows of x on the int8 tensor cores
// (mma.sync m16n8k32 / m16n8k16 .s8, exact int32 sums), for the K-quants, whose blocks come
// through mm_staged_walk's cp.async stages as in mms; each warp takes MT tiles of 16 rows.
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
// / 4), 8 threads per group, the arithmetic of quantize_x2_kernel (quant2_group).
extern "C" __global__ void __launch_bounds__(256) quantize_mmq_kernel(const float* x, u32* __restrict__ xq,
                                                                      float2* __restrict__ xd, int n_cols, int B,
                                                                      int Bp) {
    pdl_enter();
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
    if (k == 0) xd[(long long)g * Bp + n] = make_float2(d2, fmaf(d, (float)s, d2 * (float)s2));
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
#ifndef MMQ_UNROLL
#define MMQ_UNROLL 4  // chunks (Q4_K/Q5_K: all 4) or groups (Q6_K: 4 of 8) unrolled per trip
#endif
#ifndef MMQ_MIN_BLOCKS
#define MMQ_MIN_BLOCKS 1  // __launch_bounds__ minimum CTAs of 256 threads per SM (2 caps registers at 128)
#endif
template <int QT, int NT, int MT>
__global__ void __launch_bounds__(256, MMQ_MIN_BLOCKS) mmq_kernel(const u8* __restrict__ w, const uint4* xq,
                                                  const float2* xd, float* __restrict__ out,
                                                  float* __restrict__ part, int* __restrict__ tile_count, int n_rows,
                                                  int n_cols, long long row_bytes, int B, int WR) {
    pdl_enter();
    typedef MmStage<QT> S;
    constexpr int Bp = 8 * NT;
    extern __shared__ __align__(16) u8 smem[];  // max(warps * MM_STAGES * 16 * SROW, mm_epilogue's warps * 16 MT * 8 NT * 4)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int WK = nw / WR, wr = warp % WR, wk = warp / WR;
    const int gid = lane >> 2, tig = lane & 3;
    const int nparts = gridDim.y * WK, kpart = blockIdx.y * WK + wk;
    const uint4* xql = xq + gid * 4 + tig;                     // + (g Bp + 8 nt) * 4: entry (g, 8 nt + gid, tig)
    const float4* xdl = (const float4*)xd + tig;                // + g Bp / 2 + 4 nt: (d2, sum) of rows 8 nt + 2 tig, + 1
    float acc[MT][NT][4];  // [m-tile][n-tile][C entry]: each x fragment serves the warp's MT tiles of 16 rows
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
    mm_staged_walk<QT, MT>(w, n_rows, row_bytes, blockIdx.x * 16 * MT * WR + 16 * MT * wr, kpart, nparts, n_cols / 256,
                           smem + warp * MM_STAGES * 16 * S::SROW, [&](int blk, const u8* const (&rows)[2 * MT]) {
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
                            float* ac = acc[mt][nt];
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
                            acc[mt][nt][e] = fmaf((e & 1) ? dd.z : dd.x, u, acc[mt][nt][e]);
                        }
                    }
                }
            }
        }
    });
    __syncthreads();  // every warp is done with its stage: the reduction reuses the memory
    mm_epilogue<NT, MT>(acc, (float*)smem, out, part, tile_count, n_rows, B, WR);
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
    const int b = blockIdx.x;
    const u8* w = b < end0 ? w0 : b < end1 ? w1 : w2;
    float* out = b < end0 ? out0 : b < end1 ? out1 : out2;
    const int n_rows = b < end0 ? rows0 : b < end1 ? rows1 : rows2;
    const long long rb = b < end0 ? rb0 : b < end1 ? rb1 : rb2;
    const int row0 = (b < end0 ? b : b < end1 ? b - end0 : b - end1) * NR;
    matvec_rows<P, B, NR, U>(w, typename P::Act{xq, ds, xq2, ds2, n_cols / 32}, out, n_rows, n_cols, rb, row0);
}

// swiglu_kernel (ops.cu) and then quantize_x2_kernel of its output, in one launch: out =
// silu(gate) * up as f32 and as the i16 planes (quantize_x2_kernel's layout), each element the
// same expression, so the bits of the two kernels. n4 = T * F / 4 (F a multiple of 32), one
// float4 a thread; gate, up, out 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) swiglu_q2_kernel(const float* gate, const float* up, float* out,
                                                                   u32* xq, float2* ds, u32* xq2, float2* ds2,
                                                                   int n4) {
    pdl_enter();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const bool ok = t < n4;  // n4 is a multiple of 8: a group is all in or all out
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (ok) {
        const float4 g = *((const float4*)gate + t), u = *((const float4*)up + t);
        v = make_float4(g.x / (1.f + __expf(-g.x)) * u.x, g.y / (1.f + __expf(-g.y)) * u.y,
                        g.z / (1.f + __expf(-g.z)) * u.z, g.w / (1.f + __expf(-g.w)) * u.w);
        *((float4*)out + t) = v;
    }
    quant2_store(v, ok, t, xq, ds, xq2, ds2);
}

// rmsnorm_kernel (ops.cu) and then quantize_x2_kernel of its output, in one launch: out = the
// norm of x (or of residual += x), written as f32 and as the i16 matvec's two planes, laid out
// as quantize_x2_kernel lays them. The sum of squares is rmsnorm_kernel's (same threads, same
// order) and each output element the same product, so out and the planes are the bits the two
// kernels made. grid T rows, block a multiple of 32 (<= 1024); D a multiple of 32; x, out,
// residual and w 16-byte aligned.
extern "C" __global__ void rmsnorm_q2_kernel(const float* x, const float* __restrict__ w, float* out,
                                             float* residual, u32* xq, float2* ds, u32* xq2, float2* ds2,
                                             int D, float eps) {
    pdl_enter();
    const long long base = (long long)blockIdx.x * D;
    const float r = rms_scale(x, residual, base, D, eps);
    const float* src = residual ? residual : x;
    const int D4 = D >> 2;
    for (int i0 = 0; i0 < D4; i0 += blockDim.x) {  // every thread every trip: quant2_group's shuffles
        const int i4 = i0 + threadIdx.x;
        const bool ok = i4 < D4;  // D4 is a multiple of 8: a group is all in or all out
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (ok) {
            const float4 a = *(const float4*)(src + base + 4 * i4);
            const float4 g = *(const float4*)(w + 4 * i4);
            v = make_float4(a.x * r * g.x, a.y * r * g.y, a.z * r * g.z, a.w * r * g.w);
            *(float4*)(out + base + 4 * i4) = v;
        }
        quant2_store(v, ok, (long long)blockIdx.x * D4 + i4, xq, ds, xq2, ds2);  // D4 % 8 == 0: groups align
    }
}

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
