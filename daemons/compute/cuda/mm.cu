// The tensor-core matmul (mm): out[b, row] = sum_c W[row, c] * x[b, c] for up to 64 activation rows, on the tensor cores
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
// MmTraits (quant_traits.cuh) decode a piece into the f16 integers, their scales and mins.
// Launched by mm.py; compiled by NVRTC at run time, headers inlined (sources.py).

#include "tensor_core.cuh"

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
