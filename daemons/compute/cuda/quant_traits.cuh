// The quantized-weight trait families every matrix kernel decodes GGUF blocks through:
//   QTraits<QT, CUT>   a block's loads and its decode into f32 weights, per layout cut (the f32
//                      matvec, the dequantizer; the tensor-core matmuls take their loads)
//   QDTraits<QT>       a block's decode into integers and its dot product with int8
//                      activations (the i16 matvec)
//   MmTraits<QT, CUT>  a piece's decode into exact f16 integers, scales and mins (mm)
//   MmStage<QT>        a block's place in the staged kernels' shared-memory stage (mmq)
// One header, so that every kernel of a type reads its blocks the same way; a file that
// includes it instantiates only what it launches.
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

// ================================================================ integer dot products (QDTraits)
// llama.cpp's "mmvq" scheme: the activation rows x [B, n_cols] are quantized to int8 in groups
// of 32 (d = max|x| / 127 over the group; per group (d, d * sum of the group's 32 int8 values)),
// then each weight block is multiplied with integer dot products (__dp4a: 4 int8 MACs per
// instruction) and its scales are applied once per sub-block: sum_i w_i x_i ~= sum_g d_w,g *
// d_x,g * sum_i q_i xq_i (+ min terms through the group sums). Every sub-block of every supported
// type covers whole groups of 32 (or 16 for Q6_K's scales), so the groups never straddle a
// weight scale. The i16 matvec (matvec.cu) takes two such planes of x.
//
// Loads: 16-byte vectors where the block layout is 16-byte aligned (Q4_K, Q5_K), aligned words
// for 4-byte-aligned layouts (Q4_1, Q5_1), and for the 2-byte-aligned layouts (Q4_0, Q5_0, Q8_0,
// Q6_K) aligned words stitched with a funnel shift (+ one halfword for the tail): every word read
// holds at least one byte of the block, so no read leaves the tensor's (4-byte-aligned) allocation.

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

// Where an integer product reads its activations from: LdG, global memory with coherent loads
// (in-stream memory; common.cuh, programmatic launch). A QDTraits loadx takes the reader as a
// template argument, so that an activation stage in shared memory can be read alike.
struct LdG {
    static __device__ __forceinline__ uint4 u128(const u8* p) { return __ldca((const uint4*)p); }
    static __device__ __forceinline__ uint2 u64(const u8* p) { return __ldca((const uint2*)p); }
    static __device__ __forceinline__ float2 f2(const float2* p) { return __ldca(p); }
    static __device__ __forceinline__ float f(const float* p) { return __ldca(p); }
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

// ================================================================ exact f16 integers (MmTraits)
// The tensor-core matmul's decode (mm.cu has the scheme): a piece's weights as small integers,
// exact in f16, with f32 scales and mins per sub-block.
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

// ================================================================ staged blocks (MmStage)
// The staged kernels (mmq.cu) copy a warp's 16-row block columns into shared memory with
// coalesced 4-byte loads; a block keeps its address modulo 4 in the stage (Q6_K blocks are
// 2-byte aligned), so a staged block reads as the global one does.
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
