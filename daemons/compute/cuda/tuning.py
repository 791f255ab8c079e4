"""Launch choices of the CUDA kernels, per device: values only.

The family modules decide *what* to compute; this table holds every choice of *how* that only
moves speed: the matvec launch configurations, from how many rows gemm takes the tensor-core
matmuls, how those split their work, how attention splits its keys, rmsnorm's threads per row
and the dequantizers' layout cut. A choice here moves a result only through the order of its
f32 additions (the last bits). The measurements behind each value are in docs/PERFORMANCE.md,
"Kernel tuning: the measurements behind the tables"; dev/cuda has the sweeps that take them.

Entries are keyed by the device's name as CUDA reports it (``for_device``); a device without an
entry gets ``DEFAULT``. Only the H200 was measured, so ``DEFAULT`` is the H200's table; a new
device's entry is one more ``KernelTuning`` measured with dev/cuda's sweeps. Imports without
cupy (the planner, scripts/compile_check.py and instances.py read it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from gguf import GGMLQuantizationType as QT

from ntx.shared.quant_types import QUANT_TYPES

__all__ = ["MatvecLaunch", "MmqChoice", "KernelTuning", "H200", "DEFAULT", "TUNINGS", "for_device", "batch_invariant",
           "MAX_MATVEC_B",
           "MV_ROWS_PER_CTA", "MV_MAX_WARPS", "MV_UNROLLS", "MAX_MM_ROWS", "MM_UNROLL", "MAX_GRAPH_ROWS",
           "ATTN_SPLIT_STEP", "DEQUANT_W16_BYTES", "ROWS_TILES", "ROWS_MAX_WARPS", "FX_LANES_PER_ROW", "FX_MVS_MAX_WARPS"]

MAX_MATVEC_B = 8  # activation rows one matvec launch takes (the kernels' B template range)
MAX_MM_ROWS = 64  # activation rows one tensor-core matmul launch takes (8 per tile, NT <= 8)
MM_UNROLL = 2  # quad steps per lane per trip of the tensor-core matmul (mm_kernel's U)
# gemm of up to this many rows is one capturable launch sequence (matvec or the tensor-core
# matmuls, scratch in fixed places; no cuBLAS): passes of up to this many rows are padded to a
# row bucket and replayed as CUDA graphs
MAX_GRAPH_ROWS = MAX_MM_ROWS
# the cuBLAS path's f16 copy of a matrix (gemm_dequant) is made and multiplied this many bytes of
# rows at a time: a whole copy of the 70B's gate, up or down matrix took 448 MiB of VRAM, most of a
# resident layer, for the eager passes alone (memory.dequant_chunk_rows)
DEQUANT_W16_BYTES = 128 << 20
ATTN_SPLIT_STEP = 4  # attention's key splits are a multiple of its split kernel's warps per CTA
ROWS_TILES = (1, 2)  # matvec_rows' tiles of 8 rows of x a warp (mvq2_rows_kernel's NT)
ROWS_MAX_WARPS = 4  # matvec_rows' warps a CTA, over the rows of x (its __launch_bounds__(128))
FX_LANES_PER_ROW = (8, 16, 32)  # fixed_point.cu fx_mv_kernel's TPR: lanes (blocks at once) a weight row
FX_MATVEC_KERNELS = ("pieces", "staged", "direct")  # fixed_point.fx_matvec's kernels (KernelTuning.fx_matvec_kernel)
FX_MVS_MAX_WARPS = 8  # fixed_point.cu fx_mvs_kernel's warps a CTA (its __launch_bounds__(256))
# mmqx_kernel's launch (mmq.cu: x staged once per CTA): warps a CTA side by side (16 rows each) and
# stages (block columns in flight: 3 of 55-65 KB at 64 rows of x, one CTA an SM); the fastest
# of 2-8 warps and 2-3 stages on the 8B's gate/up shape at 8-64 rows (H100, 2026-12-06,
# dev/cuda/bench_mmqx.py; docs/PERFORMANCE.md, "x staged once per CTA")
MMQX_WARPS = 8
MMQX_STAGES = 3

# (rows per CTA, warps per CTA, pieces per lane per trip) of a matvec launch, each from these:
# rows per CTA are a template argument (matvec.cuh matvec_rows NR: every CTA reads all of x once
# for its NR rows, so more rows per CTA cut the activations' L1/L2 traffic, at the cost of
# registers: NR * B accumulators), warps per CTA a launch one (its reduction keeps 8 warps'
# partials), pieces per trip a template one (U: loads in flight per lane)
MV_ROWS_PER_CTA = (1, 2, 4, 8)
MV_MAX_WARPS = 8
MV_UNROLLS = (1, 2, 4)
MatvecLaunch = tuple[int, int, int]


class MmqChoice(NamedTuple):
    """The int8 tensor-core matmul's kernel and launch for one matrix at B rows of x
    (``KernelTuning.mmq_choice``): mmqx_kernel (``staged_x``: x staged once per CTA of WR warps,
    NS stages, WK 1) or mmq_kernel (WR, WK warps a CTA, NS 0); KS CTAs over the block columns.
    One choice for mm.mm_plan, fixed_point.fx_mmq and memory.gemm_scratch_bytes, so the scratch
    sized is the scratch the launch takes."""

    staged_x: bool
    wr: int
    wk: int
    ns: int
    ks: int


@dataclass(frozen=True)
class KernelTuning:
    """The launch choices the family modules make on one kind of device."""

    name: str
    # f32 matvec (mv_kernel, the float types): launch per batch size B, and (type, B) overrides
    mv_launch: dict[int, MatvecLaunch]
    mv_launch_override: dict[tuple[QT, int], MatvecLaunch]
    # i16 matvec (mvq2_kernel, mvq2g_kernel: the block-quantized types), likewise
    i16_launch: dict[int, MatvecLaunch]
    i16_launch_override: dict[tuple[QT, int], MatvecLaunch]
    # gemm takes the tensor-core matmul (mm_kernel) from this many rows up to MAX_MM_ROWS for the
    # types mm decodes other than the K-quants, the matvec below; it aims for mm_target_ctas
    # CTAs per launch, splitting each row's pieces over more CTAs when the row tiles are fewer
    mm_min_rows: int
    mm_target_ctas: int
    # the K-quants (mm.MMQ_TYPES): gemm takes the int8 tensor-core matmul (mmq_kernel, i16
    # activations) from mmq_min_rows rows, the i16 matvec below; mmq_launch aims for
    # mmq_target_warps warps per matrix
    mmq_min_rows: int
    mmq_target_warps: int
    # attention key splits (attn_splits): aim for this many (query, kv-head, split) warps, at
    # most attn_max_splits splits
    attn_target_warps: int
    attn_max_splits: int
    # rmsnorm threads per row: (smallest row length D, threads), largest D first
    rmsnorm_threads: tuple[tuple[int, int], ...]
    # layout cut of each type's dequantizer (types not listed: "v1")
    deq_cut: dict[QT, str] = field(default_factory=dict)
    # the batch-invariant mode's product past the matvec's rows (matvec.matvec_rows,
    # matvec_rows.cu): tiles of 8 rows of x a warp (its NT, one of ROWS_TILES)
    rows_nt: int = 2
    # the batch-invariant form of a table (``batch_invariant``): memory.gemm_path takes one path
    # per weight format at every row count and attn_splits one split count at every row count;
    # invariant_rows (KernelOptions.invariant_rows): the i16 matvec (one warps-per-CTA per type at
    # every B) then matvec_rows for the block-quantized types instead
    batch_invariant: bool = False
    invariant_rows: bool = False
    # invariant_fixed (KernelOptions.invariant_fixed): the K-quants' sums as 64-bit fixed point
    # (fixed_point.py), the fixed-point matvec up to fx_matvec_rows rows and fixed-point mmq from
    # there (any boundary gives the same bits: it moves speed only); the matvec's kernel
    # (fx_matvec_kernel, one of FX_MATVEC_KERNELS): "pieces", the i16 matvec's launch and pieces
    # (fx_mvq_kernel), "staged" as mmq stages (its launch aiming for fx_target_ctas CTAs) or
    # "direct", a lane a block
    invariant_fixed: bool = False
    fx_matvec_rows: int = 2
    fx_matvec_kernel: str = "pieces"
    # fx_mvq_kernel's launch per (type, B) where it is not the i16 matvec's (its chained steps
    # favour fewer warps a CTA); batch_invariant(fixed=True) fills in the rest from the i16 table
    fx_mvq_launch: dict[tuple[QT, int], MatvecLaunch] = field(default_factory=dict)
    # and its launch for a small matrix (a launch's rows, all its matrices together, at most
    # fx_mvq_small_rows: a layer's k or v alone), which the launch above would leave the GPU too
    # few warps; absent: fx_mvq_launch's
    fx_mvq_small_launch: dict[tuple[QT, int], MatvecLaunch] = field(default_factory=dict)
    fx_mvq_small_rows: int = 2048
    fx_target_ctas: int = 264
    # mmqx_kernel (mmq.cu: x staged once per CTA of MMQX_WARPS warps) instead of mmq_kernel where a
    # Q4_K/Q5_K matrix gives at least mmqx_min_ctas CTAs of 16 MMQX_WARPS rows without splitting
    # K (about the device's SMs: fewer, and the split it then needs costs more than x's loads;
    # ``mmqx_launch``); 0: never
    mmqx_min_ctas: int = 0

    def mv(self, qtype: QT, B: int) -> MatvecLaunch:
        """The f32 matvec launch for qtype at batch size B."""
        return self.mv_launch_override.get((qtype, B)) or self.mv_launch[B]

    def i16(self, qtype: QT, B: int) -> MatvecLaunch:
        """The i16 matvec launch for qtype at batch size B."""
        return self.i16_launch_override.get((qtype, B)) or self.i16_launch[B]

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

    def mmq_launch(self, B: int, n_rows: int, n_steps: int) -> tuple[int, int, int]:
        """(WR, WK, KS) of the int8 tensor-core matmul for n_steps sub-blocks of 32 columns per
        row: one warp per 16-row tile side by side (WR = 1), WK warps (2..8, a power of two) and
        KS CTAs over the 256-column block columns, so that about mmq_target_warps warps share the
        matrix (each with at least one block column)."""
        tiles = -(-n_rows // 16)
        blocks = max(1, n_steps // 8)
        wk = 2
        while wk < 8 and tiles * wk < self.mmq_target_warps and 2 * wk <= blocks:
            wk *= 2
        ks = max(1, min(-(-self.mmq_target_warps // (tiles * wk)), blocks // wk, 16))
        return 1, wk, ks

    def mmqx_launch(self, qtype: QT, B: int, n_rows: int, nb: int) -> tuple[int, int, int] | None:
        """(WR, NS, KS) of mmqx_kernel for a K-quant matrix of n_rows rows of nb 256-column blocks
        at B rows of x, or None where mmq_kernel does better (dev/cuda/bench_mmqx.py, H100):

          * Q4_K and Q5_K where the matrix gives mmqx_min_ctas CTAs without split-K, at every B
            (0.77-0.92x mmq at 8-64 rows on the 8B's 14336 x 4096, 0.66-0.74x on the 70B's
            28672 x 8192), and where K split in two gives them with 32 block columns a CTA or
            more (the 70B's down, 8192 x 28672: 0.81-0.90x mmq at 8-64 rows, Q5_K 0.75-0.88x):
            B does not enter, so a row's order stays one at every row count (the batch-invariant
            mode's mmq/mm form; the split's partials are added in split order). Splits of more
            than two, or of fewer columns a CTA, lost to mmq outside the fixed form (the 8B's
            down at 16-32 rows, the 70B's q and o at 64).
          * the fixed form only (its sums are exact in any order, so any launch keeps a row's
            bits): Q6_K of mmqx_min_ctas CTAs from 9 rows (fx_mmq's 64-bit sums: 0.86x fx_mmq at
            64 rows, 0.96x at 16), and Q4_K/Q5_K rows of 32 blocks or more past 32 rows, K split
            so that the CTAs come to mmqx_min_ctas with 8 block columns a CTA or more (the 8B's
            down 0.73x fx_mmq at 64 rows, the 70B's q and o 0.70x; the 70B's k and v, 8 CTAs
            that would need 13 splits, stay with fx_mmq)."""
        if not self.mmqx_min_ctas:
            return None
        ctas = -(-n_rows // (16 * MMQX_WARPS))
        k45 = qtype in (QT.Q4_K, QT.Q5_K)
        if ctas >= self.mmqx_min_ctas and (k45 or (self.invariant_fixed and B > 8)):
            return MMQX_WARPS, MMQX_STAGES, 1
        ks = -(-self.mmqx_min_ctas // ctas)  # the split that brings the CTAs to mmqx_min_ctas
        if k45 and ks == 2 and nb >= 64:
            return MMQX_WARPS, MMQX_STAGES, 2
        if self.invariant_fixed and k45 and B > 32 and nb >= 32 and nb // ks >= 8:
            return MMQX_WARPS, MMQX_STAGES, ks
        return None

    def mmq_choice(self, qtype: QT, B: int, n_rows: int, nb: int) -> MmqChoice:
        """mmqx_kernel's launch where ``mmqx_launch`` gives one, else mmq_kernel's
        (``mmq_launch``), for a K-quant matrix of n_rows rows of nb 256-column blocks at B rows."""
        staged_x = self.mmqx_launch(qtype, B, n_rows, nb)
        if staged_x is not None:
            wr, ns, ks = staged_x
            return MmqChoice(True, wr, 1, ns, ks)
        wr, wk, ks = self.mmq_launch(B, n_rows, nb * 8)
        return MmqChoice(False, wr, wk, 0, ks)

    def fx_mvs_launch(self, n_rows: int, nb: int, warps: int | None = None) -> tuple[int, int]:
        """(warps a CTA, KS) of the staged fixed-point matvec (fx_mvs_kernel) for n_rows rows of
        nb 256-column blocks: about fx_target_ctas CTAs (split-K where the 32-row tiles are
        fewer), each warp at least two block columns where there are enough, warps fewer before
        CTAs are (a small matrix spread over the SMs rather than stacked on a few); ``warps``
        given: only KS. Moves speed only: the sums are exact in any split."""
        tiles = -(-n_rows // 32)
        ks_target = -(-self.fx_target_ctas // tiles)
        if warps is None:
            warps = max(1, min(FX_MVS_MAX_WARPS, nb // (2 * ks_target)))
        return warps, max(1, min(ks_target, nb // (2 * warps)))

    def attn_splits(self, T: int, n_kv: int, max_ctx: int) -> int:
        """Key splits of attention over T query rows: enough (row, kv-head, split) warps to fill
        the device (attn_target_warps), at most attn_max_splits and one split per 32-key tile,
        a multiple of ATTN_SPLIT_STEP (the split kernel's warps per CTA). Batch-invariant: the
        splits of one row whatever T is (a row's keys are merged in an order fixed by S)."""
        if self.batch_invariant:
            T = 1
        return self.attn_grid_splits(T, n_kv, max_ctx)

    def attn_grid_splits(self, T: int, n_kv: int, max_ctx: int) -> int:
        """attn_splits outside the batch-invariant mode: the mode's launches walk its one-row
        splits over a grid of this many warps a (row, kv head) (attention.cu attn_walk)."""
        tiles = -(-max_ctx // 32)
        s = -(-self.attn_target_warps // max(1, T * n_kv))
        s = min(s, self.attn_max_splits, tiles)
        return max(ATTN_SPLIT_STEP, -(-s // ATTN_SPLIT_STEP) * ATTN_SPLIT_STEP)

    def fx_mvq(self, qtype: QT, B: int, n_rows: int | None = None) -> MatvecLaunch:
        """The fixed-point matvec's launch (fixed_point.fx_matvec_pieces) for qtype at B rows of
        x against n_rows weight rows (one launch's, its matrices together; None: a large
        matrix): fx_mvq_small_launch's for at most fx_mvq_small_rows, else fx_mvq_launch's,
        else the i16 matvec's on this table."""
        if n_rows is not None and n_rows <= self.fx_mvq_small_rows and (qtype, B) in self.fx_mvq_small_launch:
            return self.fx_mvq_small_launch[(qtype, B)]
        return self.fx_mvq_launch.get((qtype, B)) or self.i16(qtype, B)

    def fx_mvq_launches(self, qtype: QT, B: int) -> set[MatvecLaunch]:
        """Every launch fx_mvq may give qtype at B rows (what to compile)."""
        return {self.fx_mvq(qtype, B)} | ({self.fx_mvq_small_launch[(qtype, B)]}
                                          if (qtype, B) in self.fx_mvq_small_launch else set())

    def all_mv_launches(self) -> set[MatvecLaunch]:
        return set(self.mv_launch.values()) | set(self.mv_launch_override.values())

    def all_i16_launches(self) -> set[MatvecLaunch]:
        return set(self.i16_launch.values()) | set(self.i16_launch_override.values())


_MV_SMALL_B = (2, 4, 1)
_MV_LARGE_B = (4, 4, 1)
H200 = KernelTuning(
    name="H200",
    mv_launch={B: _MV_SMALL_B if B <= 4 else _MV_LARGE_B for B in range(1, MAX_MATVEC_B + 1)},
    mv_launch_override={(QT.F16, 1): (2, 8, 1)},
    i16_launch={B: _MV_SMALL_B if B <= 4 else _MV_LARGE_B for B in range(1, MAX_MATVEC_B + 1)},
    i16_launch_override={(QT.Q4_K, 1): (8, 4, 1), (QT.Q6_K, 1): (4, 2, 2), (QT.Q8_0, 1): (4, 8, 1)},
    mm_min_rows=9,
    mm_target_ctas=256,
    mmq_min_rows=3,
    mmq_target_warps=1024,
    attn_target_warps=2048,
    attn_max_splits=64,
    rmsnorm_threads=((8192, 1024), (2048, 512), (0, 256)),
    deq_cut={QT.Q4_K: "v2", QT.Q5_K: "v2"},
    # the sweep of fx_mvq's launches at 1-2 rows, an 8B layer's products weighted (H200,
    # 2026-12-06; docs/PERFORMANCE.md, "A third road"): 4 rows, 2 warps, 1 piece a trip was the
    # fastest or within 1% for Q4_K and Q6_K at both (8% and 7% under the i16 table's launches
    # at one row, 22% at two); Q5_K, not swept, takes Q4_K's (the same pieces and steps)
    fx_mvq_launch={(qt, B): (4, 2, 1) for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K) for B in (1, 2)},
    # ... except a matrix of at most 2048 rows (k or v, 1024 x 4096), which took 19-22% less time
    # at 2 rows a CTA and 4 warps (1024 warps against 256) at 1 and 2 rows, Q4_K and Q6_K alike,
    # as fast as the i16 matvec there (H100, 2026-12-06, the same sweep with --mv-variants fx)
    fx_mvq_small_launch={(qt, B): (2, 4, 1) for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K) for B in (1, 2)},
    # 104 CTAs of 128 rows (13,185 rows and more: the 8B's and the 70B's gate and up; in the fixed
    # form also the head, Q6_K in a Q4_K_M), about the 132 SMs of an H100 or H200 less a wave's
    # tail (H100, 2026-12-06)
    mmqx_min_ctas=104,
)
DEFAULT = H200  # the only device measured
TUNINGS: dict[str, KernelTuning] = {"H200": H200}


def batch_invariant(t: KernelTuning, rows: bool = False, fixed: bool = False) -> KernelTuning:
    """``t``'s batch-invariant form (``KernelOptions.batch_invariant``): a row's result does not
    depend on how many rows share its pass.

    What a row's reduction order depends on, per family: the matvec's warps per CTA (its lanes
    take pieces warp * 32 + lane, stepping by all the CTA's lanes; the launch's rows per CTA and
    unroll do not move the order, nor does B). The tensor-core matmuls' launches (mm_launch,
    mmq_launch) depend on the matrix's shape only, their tiles of 8 x rows never meet, and
    split-K partials are added in a fixed order: per row they are invariant as they are.
    Attention: the one-row key splits at every T (attn_splits).

    The form in use (``rows`` False): the matmuls from one row (mm_min_rows = mmq_min_rows = 1)
    so that gemm never mixes them with the matvec, whose f32 sums round differently
    (memory.gemm_path); the matvec (F32, BF16) one launch for every B, the table's B = 8 one,
    without the B = 1 overrides.

    ``rows`` (``KernelOptions.invariant_rows``; its GPU tests pass): each block-quantized type
    keeps its own i16 launches at every B with one warps-per-CTA, its B = 8 launch's (the
    ``MAX_MATVEC_B`` one: the widest chunk a matvec takes); rows per CTA and pieces per trip stay
    as tuned, so every launch is one the default compiles. Past 8 rows they take ``matvec_rows``
    (matvec_rows.cu), which makes the matvec's f32 steps in its order at that same warps per CTA.
    F16 keeps mm from one row.

    ``fixed`` (``KernelOptions.invariant_fixed``): as the form in use, except the K-quants, whose
    sums are 64-bit fixed point (fixed_point.py), exact in any order: they take the fixed-point
    matvec up to fx_matvec_rows rows and fixed-point mmq from there, each in its own order; the
    matvec (fx_mvq) at its own launches (fx_mvq_launch) or the i16 matvec's tuned ones, B = 1
    overrides too (any launch gives the same bits), while the table's i16 launches stay the
    mode's."""
    if rows and fixed:
        raise ValueError("the batch-invariant mode has one form at a time: rows or fixed, not both")
    mv_one = t.mv_launch[MAX_MATVEC_B]
    i16_launch, i16_override = {B: t.i16_launch[MAX_MATVEC_B] for B in t.i16_launch}, {}
    if rows:
        i16_launch = dict(t.i16_launch)
        for q in QUANT_TYPES.values():
            if not q.dp4a:
                continue
            qt = QT(q.qtype)
            nw = t.i16(qt, MAX_MATVEC_B)[1]
            for B in t.i16_launch:
                nr, _, u = t.i16(qt, B)
                if (nr, nw, u) != t.i16_launch[B]:
                    i16_override[(qt, B)] = (nr, nw, u)
    # the K-quants' fixed-point matvec keeps its own launches and the i16 matvec's tuned ones
    # (no launch changes its bits), not the mode's one per B
    fx_launch = {(QT(q.qtype), B): t.fx_mvq(QT(q.qtype), B) for q in QUANT_TYPES.values() if q.mm_staged
                 for B in t.i16_launch} if fixed else {}
    fx_small = dict(t.fx_mvq_small_launch) if fixed else {}
    form = " rows" if rows else " fixed" if fixed else ""
    return replace(t, name=f"{t.name} batch-invariant{form}", batch_invariant=True, invariant_rows=rows,
                   invariant_fixed=fixed, mv_launch={B: mv_one for B in t.mv_launch}, mv_launch_override={},
                   i16_launch=i16_launch, i16_launch_override=i16_override, fx_mvq_launch=fx_launch,
                   fx_mvq_small_launch=fx_small,
                   mm_min_rows=1, mmq_min_rows=1)


def for_device(device_name: str) -> KernelTuning:
    """The entry whose key occurs in the device's name (e.g. "NVIDIA H200"), else DEFAULT."""
    for key, tuning in TUNINGS.items():
        if key in device_name:
            return tuning
    return DEFAULT
