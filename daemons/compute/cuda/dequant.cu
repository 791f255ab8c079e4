// Dequantization of GGUF rows: the f16 copy of a matrix for the cuBLAS path (gemm beyond the
// tensor-core matmuls' rows) and the embedding lookup (get_rows). Launched by dequant.py;
// compiled by NVRTC at run time, headers inlined (sources.py).

#include "quant_traits.cuh"

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
