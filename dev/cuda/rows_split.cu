// mvq2_rows_split_kernel: a lab variant of production's matvec_rows (mvq2_rows_kernel,
// matvec_rows.cu, included here) with the same bits and K split over the CTA's warps.
//
// Why: on the H100, matvec_rows ran at 7-20x the i16 matvec at one row and 6-10x mmq at 64
// (docs/PERFORMANCE.md, "The other way round"). There one warp walks its 16 weight rows' whole
// K, every lane slot of the matvec's order in turn, so a 14336-row matrix is 896 one-warp CTAs
// on 132 SMs: most likely too little in flight. The order allows a split: in mvq2_rows_kernel's
// walk of warp slot ws (lanes in bit-reversed order, k = 0..31, a pair of lanes per step), the
// steps k = 8 grp .. 8 grp + 7 form an 8-lane subtree G_grp that depends on nothing outside it,
// and the slot's value is (G0 + G1) + (G2 + G3), added to the running total slot by slot from
// 0.f. So here the 4 nw subtrees (ws, grp) are spread over the CTA's warps, each writes its
// G to shared memory, and warp 0 adds them in that nesting: the same f32 steps on the same
// operands (the pieces' values come from the same mvq2_rows_piece), hence the same bits.
//
// One tile of 8 rows of x a CTA (NT = 1: its registers fit 256 threads), 16 weight rows, WARPS
// warps taking subtree g = warp, warp + WARPS, ... Grid: (ceil(n_rows / 16), ceil(B / 8)).
// xq, ds, xq2, ds2: quantize_x2_kernel's planes of x [B, n_cols]. Launched by dev/cuda/lab.py
// (matvec_rows_split); tested against production's matvec by test_lab_kernels.py.

#include "matvec_rows.cu"

#define ROWS_SPLIT_WARPS 8
#define ROWS_SPLIT_MAX_NW 8

template <int QT>
__global__ void __launch_bounds__(32 * ROWS_SPLIT_WARPS) mvq2_rows_split_kernel(
    const u8* __restrict__ w, const u8* xq, const float2* ds, const u8* xq2, const float2* ds2, float* out,
    int n_rows, int n_cols, long long row_bytes, int B, int nw, int acc) {
    typedef QDTraits<QT> T;
    __shared__ float part[4 * ROWS_SPLIT_MAX_NW][4][32];  // [subtree 4 ws + grp][C entry][lane]
    pdl_enter();  // x's planes and out are the stream's (common.cuh)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int xbase = blockIdx.y * 8;
    const int row0 = blockIdx.x * 16;
    const u8* w0 = w + (long long)min(row0 + gid, n_rows - 1) * row_bytes;
    const u8* w1 = w + (long long)min(row0 + gid + 8, n_rows - 1) * row_bytes;
    int xr[1], cr[1][2];  // the lane's x row for B fragments; its C columns' x rows
    xr[0] = min(xbase + gid, B - 1);
    cr[0][0] = min(xbase + 2 * tig, B - 1);
    cr[0][1] = min(xbase + 2 * tig + 1, B - 1);
    const int ng = n_cols / 32, npieces = (n_cols / T::EPB) * T::LPB, S = 32 * nw;
    for (int g = warp; g < 4 * nw; g += ROWS_SPLIT_WARPS) {
        const int ws = g >> 2, k0 = 8 * (g & 3);
        float t1[4], t2[4];
        for (int k = k0; k < k0 + 8; k += 2) {
            const int l = __brev(k) >> 27;  // lanes l and l + 16: the butterfly's first pair
            float a[1][4], b[1][4];
#pragma unroll
            for (int e = 0; e < 4; e++) a[0][e] = b[0][e] = 0.f;
            for (int p = ws * 32 + l; p < npieces; p += S)
                mvq2_rows_piece<QT, 1>(w0, w1, p, xq, ds, xq2, ds2, n_cols, ng, xr, cr, tig, a);
            for (int p = ws * 32 + l + 16; p < npieces; p += S)
                mvq2_rows_piece<QT, 1>(w0, w1, p, xq, ds, xq2, ds2, n_cols, ng, xr, cr, tig, b);
            // mvq2_rows_kernel's tree within the subtree: a pair, then 4 lanes (k bit 1), 8 (bit 2)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = a[0][e] + b[0][e];
                if (!(k & 2)) { t1[e] = x; continue; }
                x = t1[e] + x;
                if (!(k & 4)) { t2[e] = x; continue; }
                part[g][e][lane] = t2[e] + x;
            }
        }
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float total = 0.f;
        for (int ws = 0; ws < nw; ws++) {
            const int g = 4 * ws;
            total = total + ((part[g][e][lane] + part[g + 1][e][lane]) + (part[g + 2][e][lane] + part[g + 3][e][lane]));
        }
        const int row = row0 + gid + (e >= 2 ? 8 : 0), b = xbase + 2 * tig + (e & 1);
        if (row < n_rows && b < B) {
            float* o = out + (long long)b * n_rows + row;
            *o = acc ? *o + total : total;
        }
    }
}
