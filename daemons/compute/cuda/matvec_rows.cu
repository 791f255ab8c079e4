// mvq2_rows_kernel: the i16 matvec's bits (mvq2_kernel, matvec.cuh) for any number of rows of x,
// on the int8 tensor cores: the batch-invariant mode's product past the matvec's 8 rows.
//
// Why: the mode gives a row the same bits whatever else shares its pass. It keeps the i16 matvec
// at 1-8 rows (a row's sums there depend on its warps per CTA, nw, and on nothing else: not on B,
// the rows per CTA or the unroll), at one nw per type (tuning.batch_invariant), and gives the
// wider passes the matvec's order through this kernel. Before, the mode ran mmq at every row
// count, and at one row mmq costs 1.8x the i16 matvec (+82% a decode pass of the 8B;
// docs/PERFORMANCE.md, "The batch-invariant mode: its cost").
//
// The matvec's value of (x row b, weight row r), per piece p of the row (a piece: Q4_K/Q5_K's
// 16 positions of two sub-blocks, Q6_K's 8 of four groups, 8 a 256-column block; Q8_0's 16, two a
// block of 32; Q4_0/Q4_1/Q5_0/Q5_1's whole block of 32):
//   v_p   = dot(plane 1) + dot(plane 2), dot = QDTraits::dot (f32 steps on exact integer sums);
//   lane  = the chain of lane slot L = w * 32 + l over its pieces p = L, L + S, L + 2S, ...
//           (S = 32 nw), in increasing p, from 0.f: acc += v_p;
//   warp  = warp_sum over its 32 lanes: a butterfly (xor 16, 8, 4, 2, 1), which lane 0 reads as
//           a pairwise tree over the lanes in bit-reversed order (lanes l and l ^ 16 first);
//   value = 0.f + warp 0 + warp 1 + ... in order (then + out when accumulating).
// Float addition is commutative, so the pair (a, b) gives the same bits either way round; the
// integer sums are exact whoever computes them. So a kernel that forms each v_p with the same f32
// steps and adds them in that tree gives the matvec's bits, however it computes the integers.
//
// Here one warp takes 16 weight rows x 8 NT rows of x, and walks the lane slots in the tree's
// order: for each warp slot w, the 32 lanes in bit-reversed order, each lane's chain whole, the
// tree's partial sums held in t1..t4 (a lane pair, 4 lanes, 8, 16) and the warps' running sum in
// total. The integer sums of a piece come from m16n8k16 int8 mma (Q4_K/Q5_K: two 16-position
// segments, two planes; Q6_K: four 8-position segments, half of each mma zero; Q8_0: one of 16;
// the 32-blocks: one m16n8k32), its f32 steps are QDTraits::dot's. A CTA holds WA warps over the rows of x (its
// weight rows are read once from DRAM; the other warps find them in L1/L2).
// xq, ds, xq2, ds2: quantize_x2_kernel's planes of x [B, n_cols] (matvec.cu). Every type the i16
// matvec takes: the K-quants, Q8_0, Q4_0/Q4_1/Q5_0/Q5_1.
// Launched by matvec.py (matvec_rows); dev/cuda/lab.py's mvq2_rows launches both tiles for the sweeps.

#include "matvec.cuh"

__device__ __forceinline__ void mma_s8_k16_zero(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

__device__ __forceinline__ void mma_s8_k32_zero(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ u32 pick4(const u32 (&v)[4], int i) {  // v[i] without local memory
    return i == 0 ? v[0] : i == 1 ? v[1] : i == 2 ? v[2] : v[3];
}

// chain[nt][e] += v_p for piece p of the warp's 16 weight rows (r0 = gid, r1 = gid + 8 of the
// tile) and its x rows: C entry e of tile nt is (weight row e < 2 ? r0 : r1, x row 8 nt + 2 tig
// + (e & 1)), as QDTraits<QT>::dot forms it: dot of plane 1 plus dot of plane 2. The scales come
// from QDTraits' own decode, so they are the matvec's to the bit.
template <int QT, int NT>
__device__ __forceinline__ void mvq2_rows_piece(const u8* w0, const u8* w1, int p, const u8* xq, const float2* ds,
                                                const u8* xq2, const float2* ds2, int n_cols, int ng,
                                                const int (&xr)[NT], const int (&cr)[NT][2], int tig,
                                                float (&chain)[NT][4]) {
    typedef QDTraits<QT> T;
    const int blk = p / T::LPB, j = p % T::LPB;
    typename T::Raw raw0, raw1;
    T::load(w0 + (long long)blk * T::BYTES, j, raw0);
    T::load(w1 + (long long)blk * T::BYTES, j, raw1);
    typename T::Dec e0, e1;  // rows r0, r1
    T::decode(raw0, j, e0);
    T::decode(raw1, j, e1);
    if constexpr (QT == 12 || QT == 13) {
        // two segments of 16 positions (pos..pos + 15 of sub-blocks 2c and 2c + 1), one
        // m16n8k16 each per plane; A fragments (row gid / gid + 8, positions 4 tig..+3)
        const int c = j >> 1, pos = 16 * (j & 1);
        const u32 a00 = pick4(e0.lo, tig), a01 = pick4(e1.lo, tig);
        const u32 a10 = pick4(e0.hi, tig), a11 = pick4(e1.hi, tig);
        const int col0 = blk * 256 + 64 * c + pos + 4 * tig;  // segment 0's columns of this lane
        const int g0 = blk * 8 + 2 * c;                       // sub-block 2c's group of 32 columns
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const long long xo = (long long)xr[nt] * n_cols + col0;
            const u32 b10 = *(const u32*)(xq + xo), b11 = *(const u32*)(xq + xo + 32);
            const u32 b20 = *(const u32*)(xq2 + xo), b21 = *(const u32*)(xq2 + xo + 32);
            int s10[4], s11[4], s20[4], s21[4];  // [plane][segment]
            mma_s8_k16_zero(s10, a00, a01, b10);
            mma_s8_k16_zero(s11, a10, a11, b11);
            mma_s8_k16_zero(s20, a00, a01, b20);
            mma_s8_k16_zero(s21, a10, a11, b21);
#pragma unroll
            for (int h = 0; h < 2; h++) {  // C columns 2 tig + h
                const long long go = (long long)cr[nt][h] * ng + g0;
                const float2 x1g0 = ds[go], x1g1 = ds[go + 1], x2g0 = ds2[go], x2g1 = ds2[go + 1];
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {  // C rows gid (entries 0, 1), gid + 8 (2, 3)
                    const typename T::Dec& e = rr ? e1 : e0;
                    const int ci = 2 * rr + h;
                    float d1 = e.ds0 * x1g0.x * (float)s10[ci];
                    d1 = fmaf(e.ds1 * x1g1.x, (float)s11[ci], d1);
                    d1 = fmaf(-e.dm0, x1g0.y, d1);
                    d1 = fmaf(-e.dm1, x1g1.y, d1);
                    float d2 = e.ds0 * x2g0.x * (float)s20[ci];
                    d2 = fmaf(e.ds1 * x2g1.x, (float)s21[ci], d2);
                    d2 = fmaf(-e.dm0, x2g0.y, d2);
                    d2 = fmaf(-e.dm1, x2g1.y, d2);
                    chain[nt][ci] += d1 + d2;
                }
            }
        }
    } else if constexpr (QT == 8) {  // Q8_0: one segment of 16 positions (16j..16j + 15 of the block)
        const u32 a0 = pick4(e0.q, tig), a1 = pick4(e1.q, tig);
        const int col0 = blk * 32 + 16 * j + 4 * tig;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const long long xo = (long long)xr[nt] * n_cols + col0;
            int s1[4], s2[4];
            mma_s8_k16_zero(s1, a0, a1, *(const u32*)(xq + xo));
            mma_s8_k16_zero(s2, a0, a1, *(const u32*)(xq2 + xo));
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const long long go = (long long)cr[nt][h] * ng + blk;
                const float g1 = ds[go].x, g2 = ds2[go].x;
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const typename T::Dec& e = rr ? e1 : e0;
                    const int ci = 2 * rr + h;
                    const float d1 = e.d * g1 * (float)s1[ci], d2 = e.d * g2 * (float)s2[ci];
                    chain[nt][ci] += d1 + d2;  // as the matvec's: the same expression, so the same
                                               // contraction of its products into an FMA
                }
            }
        }
    } else if constexpr (QT == 2 || QT == 3 || QT == 6 || QT == 7) {  // Q4_0/Q4_1/Q5_0/Q5_1: a block of 32
        // positions, one m16n8k32 per plane (positions 0-15 the low nibbles, 16-31 the high)
        const u32 a0 = pick4(e0.lo, tig), a1 = pick4(e1.lo, tig), a2 = pick4(e0.hi, tig), a3 = pick4(e1.hi, tig);
        const int col0 = blk * 32 + 4 * tig;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const long long xo = (long long)xr[nt] * n_cols + col0;
            int s1[4], s2[4];
            mma_s8_k32_zero(s1, a0, a1, a2, a3, *(const u32*)(xq + xo), *(const u32*)(xq + xo + 16));
            mma_s8_k32_zero(s2, a0, a1, a2, a3, *(const u32*)(xq2 + xo), *(const u32*)(xq2 + xo + 16));
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const long long go = (long long)cr[nt][h] * ng + blk;
                const float2 g1 = ds[go], g2 = ds2[go];
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const typename T::Dec& e = rr ? e1 : e0;
                    const int ci = 2 * rr + h;
                    float d1, d2;
                    if constexpr (T::HAS_M) {
                        d1 = fmaf(e.d * g1.x, (float)s1[ci], e.m * g1.y);
                        d2 = fmaf(e.d * g2.x, (float)s2[ci], e.m * g2.y);
                    } else {
                        d1 = e.d * fmaf(g1.x, (float)s1[ci], -T::OFF * g1.y);
                        d2 = e.d * fmaf(g2.x, (float)s2[ci], -T::OFF * g2.y);
                    }
                    chain[nt][ci] += d1 + d2;
                }
            }
        }
    } else {  // Q6_K: four segments of 8 positions (l0..l0 + 7 of groups 4h + k), one m16n8k16 each
              // per plane with positions 8-15 zero (lanes tig 2, 3)
        const int h = j >> 2, l0 = 8 * (j & 3);
        u32 a0[4], a1[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            a0[k] = tig == 0 ? e0.q[k][0] : tig == 1 ? e0.q[k][1] : 0u;
            a1[k] = tig == 0 ? e1.q[k][0] : tig == 1 ? e1.q[k][1] : 0u;
        }
        const int col0 = blk * 256 + 128 * h + l0 + 4 * min(tig, 1);  // segment 0's columns (tig < 2)
        const int g0 = blk * 8 + 4 * h;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const long long xo = (long long)xr[nt] * n_cols + col0;
            int s1[4][4], s2[4][4];  // [segment][C entry], planes 1 and 2
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32 b1 = tig < 2 ? *(const u32*)(xq + xo + 32 * k) : 0u;
                const u32 b2 = tig < 2 ? *(const u32*)(xq2 + xo + 32 * k) : 0u;
                mma_s8_k16_zero(s1[k], a0[k], a1[k], b1);
                mma_s8_k16_zero(s2[k], a0[k], a1[k], b2);
            }
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {  // C columns 2 tig + hh
                const long long go = (long long)cr[nt][hh] * ng + g0;
                float g1[4], g2[4];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    g1[k] = ds[go + k].x;
                    g2[k] = ds2[go + k].x;
                }
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const typename T::Dec& e = rr ? e1 : e0;
                    const int ci = 2 * rr + hh;
                    float d1 = 0.f, d2 = 0.f;
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        d1 = fmaf(e.sc[k] * g1[k], (float)s1[k][ci], d1);
                        d2 = fmaf(e.sc[k] * g2[k], (float)s2[k][ci], d2);
                    }
                    chain[nt][ci] += d1 + d2;
                }
            }
        }
    }
}

// out[b, row] (+= when acc != 0) for B rows of x, with mvq2_kernel's bits at a launch of NW
// warps per CTA (nw). Grid: (ceil(n_rows / 16), ceil(B / (8 NT WA))), WA = blockDim.x / 32.
template <int QT, int NT>
__global__ void __launch_bounds__(128) mvq2_rows_kernel(const u8* __restrict__ w, const u8* xq, const float2* ds,
                                                        const u8* xq2, const float2* ds2, float* out, int n_rows,
                                                        int n_cols, long long row_bytes, int B, int nw, int acc) {
    typedef QDTraits<QT> T;
    pdl_enter();  // x's planes and out are the stream's (common.cuh); a warp past B leaves after it
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, WA = blockDim.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int xbase = (blockIdx.y * WA + warp) * 8 * NT;
    if (xbase >= B) return;  // no barrier below: a warp past the rows of x leaves
    const int row0 = blockIdx.x * 16;
    const u8* w0 = w + (long long)min(row0 + gid, n_rows - 1) * row_bytes;
    const u8* w1 = w + (long long)min(row0 + gid + 8, n_rows - 1) * row_bytes;
    int xr[NT], cr[NT][2];  // the lane's x row for B fragments; its C columns' x rows
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        xr[nt] = min(xbase + 8 * nt + gid, B - 1);
        cr[nt][0] = min(xbase + 8 * nt + 2 * tig, B - 1);
        cr[nt][1] = min(xbase + 8 * nt + 2 * tig + 1, B - 1);
    }
    const int ng = n_cols / 32, npieces = (n_cols / T::EPB) * T::LPB, S = 32 * nw;
    float total[NT][4], t1[NT][4], t2[NT][4], t3[NT][4], t4[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) total[nt][e] = 0.f;
    for (int ws = 0; ws < nw; ws++) {
        for (int k = 0; k < 32; k += 2) {
            const int l = __brev(k) >> 27;  // lanes l and l + 16: the butterfly's first pair
            float a[NT][4], b[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) a[nt][e] = b[nt][e] = 0.f;
            for (int p = ws * 32 + l; p < npieces; p += S)
                mvq2_rows_piece<QT, NT>(w0, w1, p, xq, ds, xq2, ds2, n_cols, ng, xr, cr, tig, a);
            for (int p = ws * 32 + l + 16; p < npieces; p += S)
                mvq2_rows_piece<QT, NT>(w0, w1, p, xq, ds, xq2, ds2, n_cols, ng, xr, cr, tig, b);
            // the tree: a pair, then 4 lanes (k bit 1), 8 (bit 2), 16 (bit 3), 32 (bit 4)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float x = a[nt][e] + b[nt][e];
                    if (!(k & 2)) { t1[nt][e] = x; continue; }
                    x = t1[nt][e] + x;
                    if (!(k & 4)) { t2[nt][e] = x; continue; }
                    x = t2[nt][e] + x;
                    if (!(k & 8)) { t3[nt][e] = x; continue; }
                    x = t3[nt][e] + x;
                    if (!(k & 16)) { t4[nt][e] = x; continue; }
                    total[nt][e] = total[nt][e] + (t4[nt][e] + x);
                }
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = row0 + gid + (e >= 2 ? 8 : 0), b = xbase + 8 * nt + 2 * tig + (e & 1);
            if (row < n_rows && b < B) {
                float* o = out + (long long)b * n_rows + row;
                *o = acc ? *o + total[nt][e] : total[nt][e];
            }
        }
}
