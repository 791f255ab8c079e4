// What both tensor-core matmuls share (mm.cu: f16 mma on an exact split of x; mmq.cu: int8 mma
// on the i16 planes): the f16 mma step and its min terms, the epilogue that sums a CTA's warps
// and the split-K partials in a fixed order, and the staged block-column walk (cp.async).

#include "quant_traits.cuh"

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

// The fixed-point accumulators (fx_of, fx_value, mm_value) are common.cuh's: the matvec's skeleton
// (matvec.cuh) sums with them too.

// With KS = gridDim.y > 1 CTAs a row tile: each CTA has written its sums of rows row0 .. row0 +
// R - 1 to part [KS, B, n_rows]; the last of the tile's CTAs to get here (tile_count) adds the KS
// partials in order, writes out and resets the counter: the result does not depend on timing.
template <typename T>
__device__ __forceinline__ void mm_add_splits(const T* __restrict__ part, int* __restrict__ tile_count,
                                              float* __restrict__ out, int n_rows, int B, int row0, int R) {
    const int KS = gridDim.y;
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(tile_count + blockIdx.x, 1) == KS - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < R * B; e += blockDim.x) {
        const int r = e % R, n = e / R, row = row0 + r;
        if (row >= n_rows) continue;
        T s = 0;
        for (int k = 0; k < KS; k++) s += __ldcg(part + ((long long)k * B + n) * n_rows + row);
        out[(long long)n * n_rows + row] = mm_value(s);
    }
    if (threadIdx.x == 0) tile_count[blockIdx.x] = 0;
}

// The end of both tensor-core kernels: each warp's accumulators (rows gid, gid + 8 of its 16-row
// tile, x rows 8 nt + 2 tig, + 1) are summed over the CTA's WK warps in warp order through
// red [8 warps][16 rows][8 NT x rows]; with KS = gridDim.y > 1 each CTA writes its sums to part
// [KS, B, n_rows] and the last CTA of a row tile adds them (mm_add_splits). T: float, or long
// long for fixed-point sums (mmq's fixed form; red and part of that type).
template <int NT, int MT = 1, typename T = float>
__device__ __forceinline__ void mm_epilogue(const T (&acc)[MT][NT][4], T* red, float* __restrict__ out,
                                            T* __restrict__ part, int* __restrict__ tile_count,
                                            int n_rows, int B, int WR) {
    constexpr int R = 16 * MT;  // rows per warp: MT tiles of 16
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int gid = lane >> 2, tig = lane & 3, WK = nw / WR;
    T* wred = red + warp * R * 8 * NT;  // [R][8 NT]
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
        T s = 0;
        for (int k = 0; k < WK; k++) s += red[((k * WR + r / R) * R + r % R) * 8 * NT + n];
        const int row = row0 + r;
        if (row < n_rows) {
            if (KS == 1) out[(long long)n * n_rows + row] = mm_value(s);
            else part[((long long)blockIdx.y * B + n) * n_rows + row] = s;
        }
    }
    if (KS == 1) return;
    mm_add_splits(part, tile_count, out, n_rows, B, row0, R * WR);
}

// mm_epilogue for kernels whose warps hold one 16-row tile
template <int NT>
__device__ __forceinline__ void mm_epilogue(const float (&acc)[NT][4], float* red, float* __restrict__ out,
                                            float* __restrict__ part, int* __restrict__ tile_count,
                                            int n_rows, int B, int WR) {
    mm_epilogue<NT, 1>(reinterpret_cast<const float(&)[1][NT][4]>(acc), red, out, part, tile_count, n_rows, B, WR);
}

// 4-byte asynchronous copy global -> shared (cp.async, sm_80+): no register holds the data, so
// several block columns can be in flight per warp at no register cost
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* gsrc) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(gsrc) : "memory");
}
// 16-byte asynchronous copy global -> shared, cached in L2 only (cp.async.cg): mmqx's stages,
// whose x every CTA of the launch reads
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gsrc) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// stages per warp of the staged walk (block columns in flight); mm.MM_STAGES mirrors it to size
// the dynamic shared memory
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
