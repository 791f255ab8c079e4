"""Launch choices of the CUDA kernels, per device, with the measurements behind them.

kernels.py decides *what* to compute; this module holds every choice of *how* that only moves
speed: matvec launch configurations, which layout cut the "auto" matvec takes, from how many rows
gemm takes the tensor-core matmul, how attention splits its keys, rmsnorm's threads per row and
the dequantizers' cut. A choice here moves a result only through the order of its f32 additions
(the last bits). The one choice that moves results more is the activation path
(``dp4a_enabled``): exact f32 activations (the default) or int8 ones (opt-in).

Entries are keyed by the device's name as CUDA reports it (``for_device``); a device without an
entry gets ``DEFAULT``. Only the H200 was measured, so ``DEFAULT`` is the H200's table; a new
device's entry is one more ``KernelTuning`` measured with scripts/bench_kernels.py and
scripts/bench_gemm_paths.py. Imports without cupy (scripts/compile_check.py reads the launch
configurations to know which templates to instantiate).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as QT

__all__ = ["MatvecLaunch", "KernelTuning", "H200", "DEFAULT", "TUNINGS", "for_device", "dp4a_enabled",
           "DP4A_ENV", "MAX_MATVEC_B", "MV_ROWS_PER_CTA", "MV_MAX_WARPS", "MV_UNROLLS", "MAX_MM_ROWS", "MM_UNROLL",
           "MAX_GRAPH_ROWS", "MMQ_TILES_PER_WARP"]

MAX_MATVEC_B = 8  # activation rows one matvec launch takes (the kernels' B template range)
MAX_MM_ROWS = 64  # activation rows one tensor-core matmul launch takes (8 per tile, NT <= 8)
MM_UNROLL = 2  # quad steps per lane per trip of the unstaged tensor-core matmul (mm_kernel's U)
MMQ_TILES_PER_WARP = (1, 2)  # 16-row tiles one warp of the int8 tensor-core matmul takes (mmq_kernel's MT)
# kernels.gemm of up to this many rows is one capturable launch sequence (matvec or the
# tensor-core matmul, workspaces made on the eager call and never reallocated; no cuBLAS):
# passes of up to this many rows are padded to a row bucket and replayed as CUDA graphs
MAX_GRAPH_ROWS = MAX_MM_ROWS
ATTN_SPLIT_STEP = 4  # attention's key splits are a multiple of its split kernel's warps per CTA
DP4A_ENV = "NTX_MATVEC_DP4A"

# (rows per CTA, warps per CTA, pieces per lane per trip) of a matvec launch, each from these:
# rows per CTA are a template argument (quant.cu matvec_rows NR: every CTA reads all of x once for
# its NR rows, so more rows per CTA cut the activations' L1/L2 traffic, at the cost of registers:
# NR * B accumulators), warps per CTA a launch one (its reduction keeps 8 warps' partials), pieces
# per trip a template one (U: loads in flight per lane)
MV_ROWS_PER_CTA = (1, 2, 4, 8)
MV_MAX_WARPS = 8
MV_UNROLLS = (1, 2, 4)
MatvecLaunch = tuple[int, int, int]


@dataclass(frozen=True)
class KernelTuning:
    """The launch choices kernels.py makes on one kind of device."""

    name: str
    # f32 matvec (quant.cu mv_kernel): launch per batch size B, and (type, B) overrides
    mv_launch: dict[int, MatvecLaunch]
    mv_launch_override: dict[tuple[QT, int], MatvecLaunch]
    # int8-activation matvec (mvq_kernel), likewise
    mvq_launch: dict[int, MatvecLaunch]
    mvq_launch_override: dict[tuple[QT, int], MatvecLaunch]
    # "auto" takes the lane-contiguous cut "v2" for these types from this batch size on
    v2_auto_types: frozenset[QT]
    v2_auto_min_b: int
    # exact activations (dp4a off): gemm takes the tensor-core matmul (quant.cu mm_kernel) from
    # this many rows (per type; others: mm_min_rows_default) up to MAX_MM_ROWS, else f32 matvec
    # in chunks of 8 rows; it aims for mm_target_ctas CTAs per launch, splitting each row's
    # pieces over more CTAs when the row tiles alone are fewer
    mm_min_rows: dict[QT, int]
    mm_min_rows_default: int
    mm_target_ctas: int
    # the K-quants (kernels.MMQ_TYPES): with mmq_auto, gemm takes the int8 tensor-core matmul
    # (quant.cu mmq_kernel, i16 activations) from mmq_min_rows[type] rows (else
    # mmq_min_rows_default) instead of mm, the i16 matvec below; its launch is mmq_launch
    mmq_auto: bool
    mmq_min_rows: dict[QT, int]
    mmq_min_rows_default: int
    # mmq from this many rows of x: two 16-row tiles per warp (each x fragment loaded once for
    # both), one below; mmq_launch aims for mmq_target_warps warps per matrix
    mmq_two_tiles_from_rows: int
    mmq_target_warps: int
    # exact activations below mm's rows: matvec "auto" takes the i16 product (two int8 planes,
    # ~2e-5 relative) where the type has a dp4a one, instead of f32
    i16_auto: bool
    # attention key splits (attention_splits): aim for this many (query, kv-head, split) warps,
    # at most attn_max_splits splits
    attn_target_warps: int
    attn_max_splits: int
    # rmsnorm threads per row: (smallest row length D, threads), largest D first
    rmsnorm_threads: tuple[tuple[int, int], ...]
    # layout cut of each type's dequantizer (types not listed: "v1")
    deq_cut: dict[QT, str] = field(default_factory=dict)

    def mv(self, qtype: QT, B: int) -> MatvecLaunch:
        """The f32 matvec launch for qtype at batch size B."""
        return self.mv_launch_override.get((qtype, B)) or self.mv_launch[B]

    def mvq(self, qtype: QT, B: int) -> MatvecLaunch:
        """The dp4a matvec launch for qtype at batch size B."""
        return self.mvq_launch_override.get((qtype, B)) or self.mvq_launch[B]

    def rmsnorm_block(self, D: int) -> int:
        """Threads per row of rmsnorm for rows of D elements."""
        return next(threads for min_d, threads in self.rmsnorm_threads if D >= min_d)

    def mm_launch(self, B: int, n_rows: int, n_steps: int) -> tuple[int, int, int]:
        """(WR, WK, KS) of the tensor-core matmul for B activation rows against n_rows weight rows
        of n_steps quad steps (4 pieces each): a CTA of WR * WK warps, WR of them side by side
        over 16-row tiles and WK over each row's pieces, KS CTAs per row tile (enough CTAs to fill
        the device, each warp at least 4 quad steps)."""
        wr, wk = 1, 4
        tiles = -(-n_rows // (16 * wr))
        ks = max(1, min(-(-self.mm_target_ctas // tiles), n_steps // (4 * wk), 16))
        return wr, wk, ks

    def mm_from_rows(self, qtype: QT) -> int:
        """Rows of x from which exact-activation gemm takes the tensor-core matmul for qtype."""
        return self.mm_min_rows.get(qtype, self.mm_min_rows_default)

    def mmq_launch(self, B: int, n_rows: int, n_steps: int) -> tuple[int, int, int, int]:
        """(WR, WK, KS, MT) of the int8 tensor-core matmul for n_steps sub-blocks of 32 columns
        per row: one warp per 16 MT rows side by side (WR = 1, MT = 2 from
        mmq_two_tiles_from_rows rows of x), WK warps (2..8, a power of two) and KS CTAs over the
        256-column block columns, so that about mmq_target_warps warps share the matrix (each
        with at least one block column)."""
        mt = 2 if B >= self.mmq_two_tiles_from_rows else 1
        tiles = -(-n_rows // (16 * mt))
        blocks = max(1, n_steps // 8)
        wk = 2
        while wk < 8 and tiles * wk < self.mmq_target_warps and 2 * wk <= blocks:
            wk *= 2
        ks = max(1, min(-(-self.mmq_target_warps // (tiles * wk)), blocks // wk, 16))
        return 1, wk, ks, mt

    def mmq_from_rows(self, qtype: QT) -> int:
        """Rows of x from which gemm takes the int8 tensor-core matmul for qtype (with mmq_auto)."""
        return self.mmq_min_rows.get(qtype, self.mmq_min_rows_default)

    def attn_splits(self, T: int, n_kv: int, max_ctx: int) -> int:
        """Key splits of attention over T query rows: enough (row, kv-head, split) warps to fill
        the device (attn_target_warps), at most attn_max_splits and one split per 32-key tile,
        a multiple of ATTN_SPLIT_STEP (the split kernel's warps per CTA)."""
        tiles = -(-max_ctx // 32)
        s = -(-self.attn_target_warps // max(1, T * n_kv))
        s = min(s, self.attn_max_splits, tiles)
        return max(ATTN_SPLIT_STEP, -(-s // ATTN_SPLIT_STEP) * ATTN_SPLIT_STEP)

    def all_mv_launches(self) -> set[MatvecLaunch]:
        return set(self.mv_launch.values()) | set(self.mv_launch_override.values())

    def all_mvq_launches(self) -> set[MatvecLaunch]:
        return set(self.mvq_launch.values()) | set(self.mvq_launch_override.values())


# ------------------------------------------------------------------------------ H200
# Copy bandwidth 4.2 TB/s (bytes read + written). scripts/bench_kernels.py replays CUDA graphs
# over >= 512 MiB of weight copies (L2-cold), 8B shapes (4096x4096, 14336x4096, 4096x14336,
# 1024x4096):
# - f32 matvec at B=1 reads F16 at 4.1 TB/s (98%), Q8_0 at 2.2-2.3 TB/s, Q6_K at 1.3-1.4,
#   Q4_K at 1.2-1.3: bound by the per-weight decode work, not DRAM.
# - cut v2 against v1: v1 faster at B=1 (fewer scale decodes per weight), v2 at B=8 for Q4_K
#   (+40-48%) and Q8_0 (+7-45%); Q6_K even. Q5_K shares Q4_K's cut and follows it.
# - F16 at B=1 with (2, 8, 1): 4.1 TB/s, vs 4.0 with (2, 4, 1).
# - dp4a against f32, GB/s (--quick, copy 4207 GB/s):
#     B=1: Q4_K 14336x4096 1293 -> 2330, 4096x14336 1232 -> 2199 (2447 with (4, 4, 1)),
#          4096x4096 1028 -> 1303; Q6_K 1396 -> 2195, 1281 -> 2071, 1129 -> 1397;
#          Q8_0 2279 -> 3271, 2175 -> 3013, 1807 -> 2090;
#          1024x4096 (2.4-4.5 MB): 2-7% slower (Q4_K 579 -> 536, Q6_K 671 -> 656, Q8_0 946 -> 888),
#          taken anyway: every batch size takes the same activation path (batch invariance).
#     B=8 with (4, 4, 1): Q4_K 544 -> 1079, Q6_K 725 -> 1035, Q8_0 1057 -> 1931 (14336x4096).
#   Only Q4_K/Q6_K/Q8_0 were timed; the other types share the kernel and follow them.
# - B = 2..7 were not timed: the launches interpolate between the B=1 and B=8 bests.
# scripts/bench_gemm_paths.py, 70B shapes, T = 16, chunked matvec vs dequantize + cuBLAS:
#   1024x8192 Q4_K 0.11 ms vs 0.20; 8192x8192 Q4_K (38 MB) 0.14 vs 0.18; Q8_0 (71 MB) 0.15 vs 0.11;
#   28672x8192 Q4_K 0.53 vs 0.34. cuBLAS cannot be called while cupy captures a graph, so every
#   T <= MAX_MM_ROWS goes through matvec or mm (capturable), cuBLAS only beyond.
# Tensor-core matmul (scripts/bench_gemm_paths.py --shapes 8b, graphs of 20 calls, ms at
# T = 1/4/8/16/32/64 rows), the K-quants staged through shared memory, 4 warps over the pieces:
#   Q4_K 14336x4096: f32 matvec 0.025/0.070/0.090/0.177/0.349/0.694, dp4a 0.014/0.023/0.031/0.060/
#     0.119/0.236, mm 0.042/0.044/0.051/0.092/0.111/0.196 (8 warps; 4 warps at T = 16/32: 0.097/0.109)
#   Q6_K 4096x14336: f32 0.038/0.053/0.064/0.137/0.275/0.548, dp4a 0.023/0.036/0.047/0.093/0.185/
#     0.369, mm 0.037/0.040/0.047/0.066/0.102/0.249
#   Q6_K 4096x4096: f32 0.012/0.017/0.021/0.041/0.080/0.165, mm 0.014/0.015/0.017/0.023/0.034/0.065
# i16 matvec (two int8 planes) at T = 1/2/3/4/8, ms: Q4_K 14336x4096 0.016/0.023/0.027/0.033/0.055
#   (f32 0.025/0.040/0.055/0.070/0.090, mm 0.043/0.044/0.045/0.045/0.047), 4096x4096 0.0078/0.010/
#   0.011/0.014/0.020 (f32 0.0097, mm 0.021-0.022), 4096x14336 0.016/0.023/0.028/0.037/0.063 (mm
#   0.060-0.066); Q6_K 4096x14336 0.030/0.042/0.045/0.063/0.079 (f32 0.038, mm 0.037/0.037/0.038/
#   0.040/0.047), 4096x4096 0.012/0.015/0.017/0.020/0.026 (mm 0.014/0.014/0.015/0.015/0.017). So
#   below mm: i16 (i16_auto), and mm from 6 rows on Q4_K/Q5_K, from 3 on Q6_K (mm_min_rows),
#   from 9 assumed for the others (not timed). On 1024-row matrices i16 is 0.5-1 us slower than
#   f32 at one row (0.0044 vs 0.0037 ms): taken anyway, one path for every size. Sweeping (WR, WK, KS) at T = 16 and 32: 16-row CTAs
# (WR 1) with 4 warps over the pieces, split-K only when the row tiles are under ~256 (1024-row
# matrices: KS 4), best or within 10% everywhere. Staging the weights through shared memory
# (coalesced 4-byte loads, one wavefront per 8 rows from the stage) beat direct fragment loads
# by 10-40% on Q6_K, less on Q4_K; at 32-64 rows the legacy mma.sync path itself (4 per
# fragment for the exact split with min terms) is the bound: ~28 cycles per mma per SM sub-partition.
# Int8 tensor-core matmul (mmq, scripts/bench_gemm_paths.py --paths mmq --sweep-mm, graphs of 20
# calls, 2026-12-01): it beats the i16 matvec from 3 rows (Q4_K 14336x4096 at T = 1/2/3/4/8:
# i16 0.016/0.023/0.027/0.033/0.054 ms, mmq 0.026-0.031 flat; 4096x14336 i16 0.028 at T = 3,
# mmq 0.026; Q6_K 4096x14336 i16 0.045 at T = 3, mmq 0.039): mmq_min_rows 3. Against mm at
# T = 16/32/64: Q4_K 14336x4096 0.097/0.109/0.207 -> 0.039/0.053/0.087, Q6_K 4096x14336
# 0.067/0.102/0.244 -> 0.049/0.067/0.099. Launch: the best (WK, KS) put about 1000-1800 warps on a
# matrix: 14336 rows WK 2 (0.0529 ms at T = 32 vs 0.0584 with WK 4), 4096 rows WK 4, 1024 rows
# WK 8 KS 2 (0.0111 vs 0.0179): mmq_target_warps. Two 16-row tiles per warp (MT 2, x fragments
# shared) gained at T <= 16 on 14336 rows only (0.0259 vs 0.0289 at T = 8) and lost elsewhere
# (Q6_K 4096x14336 at T = 64: 0.179 vs 0.099; 255 registers, spills): off (mmq_two_tiles_from_rows).
# The kernel is issue- and latency-bound, not DRAM-bound (with the loads removed, Q4_K
# 14336x4096 at T = 1 still takes 0.022 of 0.026 ms): ~30 instructions per mma pair for the
# two-plane activations' f32 epilogue. quant.cu's compile-time knobs were timed the same way:
# MMQ_UNROLL 4 (chunks unrolled) against 1 and 2: Q6_K 4096x14336 at T = 8 0.039 vs 0.053 ms;
# MMQ_MIN_BLOCKS 1 against 2 (128 registers): 2 is 20% faster on Q4_K 14336x4096 at T <= 16 but
# 2x slower on Q6_K 4096x14336 (spills); MM_STAGES 4 against 2 and 3: within 3%.
_MV_SMALL_B = (2, 4, 1)
_MV_LARGE_B = (4, 4, 1)
H200 = KernelTuning(
    name="H200",
    mv_launch={B: _MV_SMALL_B if B <= 4 else _MV_LARGE_B for B in range(1, MAX_MATVEC_B + 1)},
    mv_launch_override={(QT.F16, 1): (2, 8, 1)},
    mvq_launch={B: _MV_SMALL_B if B <= 4 else _MV_LARGE_B for B in range(1, MAX_MATVEC_B + 1)},
    # scripts/bench_gemm_paths.py --sweep-mv --ts 1 (graphs, copy 4184 GB/s, 2026-12-01), i16 at B=1,
    # ms for (2, 4, 1) -> the override: Q4_K 14336x4096 0.0165 -> 0.0145, 4096x14336 0.0160 -> 0.0137,
    # 4096x4096 0.0079 -> 0.0074, 1024x4096 0.0044 -> 0.0046 (weighted by a Llama-3-8B pass: -9%);
    # Q6_K 4096x14336 0.0303 -> 0.0251, 14336x4096 0.0260 -> 0.0246, 1024x4096 0.0053 -> 0.0060.
    # Q8_0 (--sweep-mv --types Q8_0 --ts 1 --mv-variants i16,v1,v2, copy 4186 GB/s, 2026-12-01, sixth
    # session): 14336x4096 0.0194 -> 0.0179, 4096x4096 0.0084 -> 0.0072, 4096x14336 0.0218 -> 0.0189,
    # 1024x4096 0.0038 -> 0.0029 (weighted by a Llama-3-8B layer: 0.0850 -> 0.0749 ms, -12%; the
    # best single shape's pick, (4, 4, 1) on 14336x4096, loses on the others). The f32 matvec's
    # best cut is 1.4-1.5x slower on the three large shapes (v1 0.0269 / 0.0089 / 0.0267 ms).
    # dp4a shares the table (not timed with these).
    mvq_launch_override={(QT.Q4_K, 1): (8, 4, 1), (QT.Q6_K, 1): (4, 2, 2), (QT.Q8_0, 1): (4, 8, 1)},
    v2_auto_types=frozenset({QT.Q4_K, QT.Q5_K, QT.Q8_0}),
    v2_auto_min_b=5,
    mm_min_rows={QT.Q4_K: 6, QT.Q5_K: 6, QT.Q6_K: 3},
    mm_min_rows_default=9,
    mm_target_ctas=256,
    mmq_auto=True,
    mmq_min_rows={},
    mmq_min_rows_default=3,
    mmq_two_tiles_from_rows=MAX_MM_ROWS + 1,  # never: see the measurements above
    mmq_target_warps=1024,
    i16_auto=True,
    attn_target_warps=2048,
    attn_max_splits=64,
    rmsnorm_threads=((8192, 1024), (2048, 512), (0, 256)),
    deq_cut={QT.Q4_K: "v2", QT.Q5_K: "v2"},
)
DEFAULT = H200  # the only device measured
TUNINGS: dict[str, KernelTuning] = {"H200": H200}


def for_device(device_name: str) -> KernelTuning:
    """The entry whose key occurs in the device's name (e.g. "NVIDIA H200"), else DEFAULT."""
    for key, tuning in TUNINGS.items():
        if key in device_name:
            return tuning
    return DEFAULT


def dp4a_enabled() -> bool:
    """Whether "auto" takes the int8-activation (dp4a) matvec where the type has one: only with
    NTX_MATVEC_DP4A=1. Otherwise the exact family: f32 matvec and the tensor-core matmul.

    Opt-in because it does not hold the CPU reference's tolerances on the real SmolLM2: with int8
    activations in every product (every batch size, so that a sequence's tokens do not depend on
    what it is batched with), SmolLM2's prefill logits are 4.1e-2 relative from the CPU
    reference's, against the 2e-2 the GPU tests allow and the exact path holds; on the synthetic
    Q4_K, Q6_K and Q8_0 models they land at 2.0-2.1e-2, and a greedy token of the rope-freqs
    model moves (tests/gpu/test_backend.py, H200, 2026-12-01). It decodes 8B Q4_K_M 1.37x
    faster (256 vs 187 tok/s)."""
    return os.environ.get(DP4A_ENV, "") == "1"

