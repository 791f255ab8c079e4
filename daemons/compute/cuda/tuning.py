"""Launch choices of the CUDA kernels, per device, with the measurements behind them.

kernels.py decides *what* to compute; this module holds every choice of *how* that only moves
speed: matvec launch configurations, which layout cut or activation path the "auto" matvec
takes, when gemm loops matvec instead of going through cuBLAS, how attention splits its keys,
rmsnorm's threads per row and the dequantizers' cut. A choice here moves a result only through
the order of its f32 additions (the last bits), except the dp4a path (activations rounded to
int8), which therefore stays opt-in (``dp4a_opt_in``).

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

__all__ = ["MatvecLaunch", "KernelTuning", "H200", "DEFAULT", "TUNINGS", "for_device", "dp4a_opt_in",
           "DP4A_ENV", "MAX_MATVEC_B"]

MAX_MATVEC_B = 8  # activation rows one matvec launch takes (the kernels' B template range)
DP4A_ENV = "NTX_MATVEC_DP4A"

# (rows per CTA in {1, 2, 4}, warps per CTA <= 8, pieces per lane per trip in {1, 2, 4})
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
    # "auto" (when dp4a is opted in) skips dp4a at B = 1 below this weight size: the extra
    # quantize-x launch outweighs the gain on small matrices
    dp4a_min_bytes: int
    # gemm loops matvec over MAX_MATVEC_B-row chunks up to this many rows on matrices up to this
    # size; beyond, dequantize-to-f16 + cuBLAS
    gemm_chunked_max_t: int
    gemm_chunked_max_bytes: int
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
#          hence dp4a_min_bytes = 8 MiB.
#     B=8 with (4, 4, 1): Q4_K 544 -> 1079, Q6_K 725 -> 1035, Q8_0 1057 -> 1931 (14336x4096).
#   Only Q4_K/Q6_K/Q8_0 were timed; the other types share the kernel and follow them.
# - B = 2..7 were not timed: the launches interpolate between the B=1 and B=8 bests.
# scripts/bench_gemm_paths.py, 70B shapes, T = 16, chunked matvec vs dequantize + cuBLAS:
#   1024x8192 Q4_K 0.11 ms vs 0.20; 8192x8192 Q4_K (38 MB) 0.14 vs 0.18; Q8_0 (71 MB) 0.15 vs 0.11;
#   28672x8192 Q4_K 0.53 vs 0.34: hence chunked up to T = 16 and 40 MiB.
# Dequantizers: 28672x8192 Q4_K to f16 + GEMM took 1.40 ms with cut v1 (8-byte stores scattered
#   over four blocks) against 0.32 ms for Q6_K and Q8_0; the v2 cut writes consecutive 4-element
#   runs from consecutive lanes, hence deq_cut v2 for Q4_K and Q5_K.
# Attention splits (2048 warps, at most 64 splits) and rmsnorm's threads per row were set at
# design time, not swept.
_MV_SMALL_B = (2, 4, 1)
_MV_LARGE_B = (4, 4, 1)
H200 = KernelTuning(
    name="H200",
    mv_launch={B: _MV_SMALL_B if B <= 4 else _MV_LARGE_B for B in range(1, MAX_MATVEC_B + 1)},
    mv_launch_override={(QT.F16, 1): (2, 8, 1)},
    mvq_launch={B: _MV_SMALL_B if B <= 4 else _MV_LARGE_B for B in range(1, MAX_MATVEC_B + 1)},
    mvq_launch_override={},
    v2_auto_types=frozenset({QT.Q4_K, QT.Q5_K, QT.Q8_0}),
    v2_auto_min_b=5,
    dp4a_min_bytes=8 << 20,
    gemm_chunked_max_t=16,
    gemm_chunked_max_bytes=40 << 20,
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


def dp4a_opt_in() -> bool:
    """Whether "auto" may take the int8-activation (dp4a) matvec: only with NTX_MATVEC_DP4A=1.

    Measured +35% decode on 8B Q4_K_M (186 -> 251 tok/s on the H200), but it moved a near-tie
    greedy token of a synthetic model away from the CPU reference; the f32 path is the one whose
    greedy tokens were checked equal to the reference on the GPU."""
    return os.environ.get(DP4A_ENV, "") == "1"

