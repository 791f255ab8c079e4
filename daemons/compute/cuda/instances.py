"""The template instantiations of the kernels production launches, by source file: what the
runtime compiles into each module (``runtime.module``) and what scripts/compile_check.py,
scripts/pdl_check.py and dev/ptx_compare.py compile. One place, so the checks compile exactly
what runs. Imports without cupy.

A module holds a launcher's family of instantiations (e.g. one matvec launch configuration at
every batch size 1..8), compiled together on the first call that needs one of them.
"""

from __future__ import annotations

from ntx.daemons.compute.cuda import tuning
from ntx.shared.quant_types import QUANT_TYPES, QuantType

__all__ = ["CUT_ID", "MATVEC_ROWS", "MM_TILES", "ATTENTION_SHAPES", "mv_names", "i16_names", "deq_names",
           "mm_names", "mmq_names", "mmqx_names", "fx_mmqx_names", "rows_names", "fx_mvq_names", "fx_mv_names", "fx_mvs_names", "fx_mmq_names", "attn_names", "attn_walk_names", "extern_kernels", "matvec_kind", "type_modules",
           "production"]

CUT_ID = {"v1": 1, "v2": 2}  # template argument of each layout cut (quant_traits.cuh CUT_V1, CUT_V2)
MATVEC_ROWS = range(1, tuning.MAX_MATVEC_B + 1)  # the matvec kernels' B
MM_TILES = range(1, tuning.MAX_MM_ROWS // 8 + 1)  # the tensor-core matmuls' NT (8 rows of x a tile)
# (group, head dim) of the attention kernels compile_check builds (any other is compiled on use)
ATTENTION_SHAPES = tuple((g, hd) for g in (1, 2, 3, 4, 8) for hd in (64, 128, 256) if g * hd <= 2048)


def mv_names(qt: int, nr: int, u: int, cut: str = "v1") -> tuple[str, ...]:
    """The f32 matvec (the float types, cut v1) at every B, one launch configuration."""
    return tuple(f"mv_kernel<{int(qt)},{CUT_ID[cut]},{b},{nr},{u}>" for b in MATVEC_ROWS)


def i16_names(qt: int, nr: int, u: int) -> tuple[str, ...]:
    """The i16 matvec at every B, then its three-matrix form (mvq2g_kernel) likewise."""
    return tuple(f"{k}<{int(qt)},{b},{nr},{u}>" for k in ("mvq2_kernel", "mvq2g_kernel") for b in MATVEC_ROWS)


def rows_names(qt: int) -> tuple[str, ...]:
    """matvec_rows (the batch-invariant mode's i16 product past 8 rows) at each tile count."""
    return tuple(f"mvq2_rows_kernel<{int(qt)},{nt}>" for nt in tuning.ROWS_TILES)


def deq_names(qt: int, cut: str) -> tuple[str, ...]:
    """The dequantizer to f16 (the cuBLAS path) and to f32 (get_rows)."""
    return tuple(f"deq_kernel<{int(qt)},{CUT_ID[cut]},{o}>" for o in (0, 1))


def mm_names(qt: int, cut: str) -> tuple[str, ...]:
    return tuple(f"mm_kernel<{int(qt)},{CUT_ID[cut]},{nt},{tuning.MM_UNROLL}>" for nt in MM_TILES)


def mmq_names(qt: int) -> tuple[str, ...]:
    """The int8 tensor-core matmul, one 16-row tile per warp (its MT = 1)."""
    return tuple(f"mmq_kernel<{int(qt)},{nt},1>" for nt in MM_TILES)


def mmqx_names(qt: int) -> tuple[str, ...]:
    """mmq with x staged once per CTA (mmqx_kernel) at tuning.py's launch, every NT."""
    return tuple(f"mmqx_kernel<{int(qt)},{nt},{tuning.MMQX_WARPS},{tuning.MMQX_STAGES}>" for nt in MM_TILES)


def fx_mmqx_names(qt: int) -> tuple[str, ...]:
    """mmqx with fixed-point sums (fixed_point.cu fx_mmqx_kernel), every NT."""
    return tuple(f"fx_mmqx_kernel<{int(qt)},{nt},{tuning.MMQX_WARPS},{tuning.MMQX_STAGES}>" for nt in MM_TILES)


def fx_mvq_names(qt: int, nr: int, u: int) -> tuple[str, ...]:
    """The fixed-point matvec in the i16 matvec's pieces (fixed_point.cu fx_mvq_kernel) at every
    B, at one of the i16 matvec's launches (NR rows a CTA, U pieces a lane a trip), then its
    three-matrix form (fx_mvqg_kernel) likewise."""
    return tuple(f"{k}<{int(qt)},{b},{nr},{u}>" for k in ("fx_mvq_kernel", "fx_mvqg_kernel") for b in MATVEC_ROWS)


def fx_mv_names(qt: int, tpr: int) -> tuple[str, ...]:
    """The fixed-point matvec read directly (fixed_point.cu fx_mv_kernel) at every B, ``tpr``
    lanes a weight row."""
    return tuple(f"fx_mv_kernel<{int(qt)},{b},{tpr}>" for b in MATVEC_ROWS)


def fx_mvs_names(qt: int) -> tuple[str, ...]:
    """The fixed-point matvec staged as mmq stages (fx_mvs_kernel) at every B."""
    return tuple(f"fx_mvs_kernel<{int(qt)},{b}>" for b in MATVEC_ROWS)


def fx_mmq_names(qt: int) -> tuple[str, ...]:
    """mmq with fixed-point sums (fx_mmq_kernel), one 16-row tile per warp."""
    return tuple(f"fx_mmq_kernel<{int(qt)},{nt},1>" for nt in MM_TILES)


def attn_names(g: int, hd: int) -> tuple[str, ...]:
    """attention's split kernels: plain, tree rows masked in place, tree rows in their paths'
    order (the batch-invariant mode)."""
    return (f"attn_split_kernel<{g},{hd}>", f"attn_tree_split_kernel<{g},{hd}>",
            f"attn_ordered_tree_split_kernel<{g},{hd}>")


def attn_walk_names(g: int, hd: int) -> tuple[str, ...]:
    """The batch-invariant mode's walking split kernels (plain rows, tree rows in their paths'
    order): a module of their own, compiled only where the mode runs."""
    return f"attn_walk_split_kernel<{g},{hd}>", f"attn_walk_ordered_tree_split_kernel<{g},{hd}>"


def extern_kernels() -> dict[str, tuple[str, ...]]:
    """The extern "C" kernels (no instantiation) of each source."""
    return {
        "matvec.cu": ("quantize_x2_kernel",),
        "mm.cu": ("mm_split_x_kernel",),
        "mmq.cu": ("quantize_mmq_kernel",),
        "norm_rope_kv.cu": ("rmsnorm_kernel", "rmsnorm_q2_kernel", "add_kernel", "swiglu_kernel", "swiglu_q2_kernel",
                            "rope_kernel", "rope_kv_kernel", "kv_append_kernel", "kv_move_kernel"),
        "attention.cu": ("attn_combine_kernel",),
        "selection.cu": ("argmax_kernel", "rep_penalty_kernel", "topk_kernel"),
    }


def matvec_kind(q: QuantType) -> str:
    """Which matvec production takes for a type: "i16" where it has integer products (every
    block-quantized type), else "f32" (F32, F16, BF16)."""
    return "i16" if q.dp4a else "f32"


def type_modules(q: QuantType, tables) -> list[tuple[str, tuple[str, ...]]]:
    """(source, instantiation names) of every module production compiles for matrices of type
    ``q`` on the device entries ``tables``: its matvec (f32 or i16) at each launch
    configuration (and the i16 one's matvec_rows), its dequantizer at its cut, its tensor-core
    matmul (mmq for the K-quants, mm at each of the other types' cuts) and the K-quants'
    fixed-point matvec and mmq on the tables of the batch-invariant mode's fixed form."""
    out = []
    qt = int(q.qtype)
    if matvec_kind(q) == "i16":
        for nr, u in sorted({(nr, u) for t in tables for nr, _, u in t.all_i16_launches()}):
            out.append(("matvec.cu", i16_names(qt, nr, u)))
        out.append(("matvec_rows.cu", rows_names(qt)))
    else:
        for nr, u in sorted({(nr, u) for t in tables for nr, _, u in t.all_mv_launches()}):
            out.append(("matvec.cu", mv_names(qt, nr, u)))
    for cut in sorted({t.deq_cut.get(q.qtype, "v1") for t in tables}):
        out.append(("dequant.cu", deq_names(qt, cut)))
    if q.mm_staged:
        out.append(("mmq.cu", mmq_names(qt)))
        if q.name in ("Q4_K", "Q5_K") and any(t.mmqx_min_ctas for t in tables):  # tuning.mmqx_launch
            out.append(("mmq.cu", mmqx_names(qt)))
        # the batch-invariant mode's fixed-point form (KernelOptions.invariant_fixed), on its tables
        # only: its quantizer of x (extern "C"), its matvec (in the i16 matvec's pieces at each
        # of its launches, staged, or direct: lanes a row follow the row length) and mmq
        fixed = [t for t in tables if t.invariant_fixed]
        if fixed:
            out.append(("fixed_point.cu", ()))
            kinds = {t.fx_matvec_kernel for t in fixed}
            if "pieces" in kinds:
                for nr, u in sorted({(nr, u) for t in fixed for B in MATVEC_ROWS
                                     for nr, _, u in t.fx_mvq_launches(q.qtype, B)}):
                    out.append(("fixed_point.cu", fx_mvq_names(qt, nr, u)))
            if "staged" in kinds:
                out.append(("fixed_point.cu", fx_mvs_names(qt)))
            if "direct" in kinds:
                out += [("fixed_point.cu", fx_mv_names(qt, tpr)) for tpr in tuning.FX_LANES_PER_ROW]
            out.append(("fixed_point.cu", fx_mmq_names(qt)))
            if any(t.mmqx_min_ctas for t in fixed):
                out.append(("fixed_point.cu", fx_mmqx_names(qt)))
    else:
        out += [("mm.cu", mm_names(qt, cut)) for cut, _, _ in q.mm_cuts]
    return out


def production(tunings=None) -> dict[str, list[tuple[str, ...]]]:
    """Every module production compiles, as {source: [instantiation names of each module]}: each
    supported type's (``type_modules``) for every device entry (``tunings``, default all) and its
    batch-invariant fixed form, the attention at ATTENTION_SHAPES, and the extern "C" kernels
    (an empty name list)."""
    tables = list(tunings if tunings is not None else tuning.TUNINGS.values())
    tables += [tuning.batch_invariant(t, fixed=True) for t in tables if not t.batch_invariant]
    out: dict[str, list[tuple[str, ...]]] = {name: [()] for name in extern_kernels()}
    out["dequant.cu"] = []
    out["matvec_rows.cu"] = []
    out["fixed_point.cu"] = []
    for q in QUANT_TYPES.values():
        for source, names in type_modules(q, tables):
            out[source].append(names)
    out["attention.cu"] += [attn_names(g, hd) for g, hd in ATTENTION_SHAPES]
    out["attention.cu"] += [attn_walk_names(g, hd) for g, hd in ATTENTION_SHAPES]
    return out
