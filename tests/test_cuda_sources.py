"""The CUDA side's cupy-free parts: the sources NVRTC compiles and the per-device launch tables.

These run without a GPU (and without cupy): scripts/compile_check.py depends on both, and a
stale header in cupy's cache or a launch table naming a cut a type lacks would only show on the
GPU machine otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.cuda import sources, tuning
from ntx.shared.quant_types import QUANT_TYPES


@pytest.mark.parametrize("name", sources.SOURCES)
def test_kernel_source_inlines_the_common_header(name):
    src = sources.kernel_source(name)
    header = (sources.CUDA_DIR / "common.cuh").read_text()
    assert '#include "common.cuh"' not in src
    assert header.strip() in src  # the cache key (the source text) covers the header
    assert src.count("__device__ __forceinline__ float warp_sum(") == 1
    assert '#line 1 "common.cuh"' in src and f'"{name}"' in src  # errors name the right file


def test_kernel_source_names_a_missing_header(tmp_path, monkeypatch):
    (tmp_path / "k.cu").write_text('#include "nope.cuh"\n')
    monkeypatch.setattr(sources, "CUDA_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="k.cu:1: included header nope.cuh"):
        sources.kernel_source("k.cu")


def test_tuning_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import ntx.daemons.compute.cuda.tuning, ntx.daemons.compute.cuda.sources\n"
            "import ntx.daemons.compute.cuda.instances, ntx.daemons.compute.cuda.memory, ntx.daemons.compute.probes\n"
            "import ntx.shared.kernel_options")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tuning_entries_by_device_name():
    assert tuning.for_device("NVIDIA H200") is tuning.H200
    assert tuning.for_device("Some Other GPU") is tuning.DEFAULT
    for t in tuning.TUNINGS.values():
        for B in range(1, tuning.MAX_MATVEC_B + 1):
            for q in QUANT_TYPES:
                nr, nw, u = t.mv(q, B)
                assert nr in tuning.MV_ROWS_PER_CTA and 1 <= nw <= tuning.MV_MAX_WARPS and u in tuning.MV_UNROLLS
                nr, nw, u = t.i16(q, B)
                assert nr in tuning.MV_ROWS_PER_CTA and 1 <= nw <= tuning.MV_MAX_WARPS and u in tuning.MV_UNROLLS
        assert all(cut in QUANT_TYPES[q].cuts for q, cut in t.deq_cut.items())
        for D in (1, 2048, 4096, 1 << 20):  # rmsnorm_kernel: a multiple of 32 threads, <= 1024
            assert t.rmsnorm_block(D) % 32 == 0 and t.rmsnorm_block(D) <= 1024


@pytest.mark.parametrize("n_rows,n_cols", [(14336, 4096), (4096, 4096), (4096, 14336), (1024, 4096),
                                           (128256, 4096), (1024, 8192), (37, 256), (96, 16384)])
@pytest.mark.parametrize("B", [3, 8, 32, 64])
def test_mmq_launch_fills_the_device_within_the_row(B, n_rows, n_cols):
    """The int8 tensor-core matmul's launch: one warp per 16-row tile side by side, 2..8 warps
    (a power of two) and KS CTAs over the block columns, every warp with at least one 256-column
    block column, and about mmq_target_warps warps on a matrix unless its row is too short."""
    t = tuning.H200
    wr, wk, ks = t.mmq_launch(B, n_rows, n_cols // 32)
    blocks = n_cols // 256
    assert wr == 1 and wk in (2, 4, 8) and 1 <= ks <= 16
    assert wk * ks <= max(2, blocks)  # a row of one block column still gets the smallest launch
    tiles = -(-n_rows // 16)
    if tiles * 8 * 16 >= t.mmq_target_warps and blocks >= 16:
        assert tiles * wk * ks >= t.mmq_target_warps // 2


SHAPES_8B_70B = [(14336, 4096), (4096, 4096), (4096, 14336), (1024, 4096), (128256, 4096),
                 (28672, 8192), (8192, 8192), (8192, 28672), (1024, 8192)]


@pytest.mark.parametrize("n_rows,n_cols", SHAPES_8B_70B)
def test_mmqx_takes_the_matrices_of_many_rows_one_launch_at_every_row_count(n_rows, n_cols):
    """mmqx (x staged once per CTA) takes Q4_K/Q5_K matrices of at least mmqx_min_ctas CTAs of
    128 rows (the 8B's gate/up of 14336 rows, the 70B's of 28672) without split-K, and those
    that K split in two brings there with 32 block columns a CTA or more (the 70B's down), the
    same launch at every row count (so the mode's mmq/mm form keeps one order a row); never Q6_K
    nor another matrix outside the fixed form; and its stages fit an SM's shared memory."""
    from ntx.daemons.compute.cuda.memory import mmqx_smem_bytes
    from ntx.shared.quant_types import quant_type

    for table in (tuning.H200, tuning.batch_invariant(tuning.H200)):
        for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            launches = {table.mmqx_launch(qt, B, n_rows, n_cols // 256) for B in range(1, 65)}
            ctas = -(-n_rows // (16 * tuning.MMQX_WARPS))
            if qt != QT.Q6_K and ctas >= table.mmqx_min_ctas:
                assert launches == {(tuning.MMQX_WARPS, tuning.MMQX_STAGES, 1)}, (table.name, qt, n_rows)
            elif qt != QT.Q6_K and 2 * ctas >= table.mmqx_min_ctas and n_cols // 256 >= 64:
                assert launches == {(tuning.MMQX_WARPS, tuning.MMQX_STAGES, 2)}, (table.name, qt, n_rows)
            else:
                assert launches == {None}, (table.name, qt, n_rows)
    assert tuning.H200.mmqx_launch(QT.Q4_K, 64, 14336, 16) is not None  # the 8B's gate and up
    assert replace(tuning.H200, mmqx_min_ctas=0).mmqx_launch(QT.Q4_K, 64, 14336, 16) is None
    assert tuning.H200.mmqx_launch(QT.Q4_K, 1, 8192, 112)[2] == 2  # the 70B's down: K in two
    assert tuning.H200.mmqx_launch(QT.Q4_K, 64, 4096, 56) is None  # the 8B's down: mmq outside the fixed form
    assert tuning.H200.mmqx_launch(QT.Q4_K, 64, 8192, 32) is None  # the 70B's q and o: mmq outside the fixed form
    assert tuning.batch_invariant(tuning.H200, fixed=True).mmqx_launch(QT.Q4_K, 64, 1024, 32) is None  # 70B k, v
    for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        for nt in range(1, 9):
            for sum_bytes in (4, 8):
                assert mmqx_smem_bytes(quant_type(qt), nt, tuning.MMQX_WARPS, tuning.MMQX_STAGES, sum_bytes) <= 227 << 10


@pytest.mark.parametrize("n_rows,n_cols", SHAPES_8B_70B)
def test_mmqx_in_the_fixed_form(n_rows, n_cols):
    """The fixed form (sums exact in any order: any launch keeps a row's bits) also takes mmqx
    for Q6_K's matrices of many rows past 8 rows, and for Q4_K/Q5_K rows of 32 blocks or more
    past 32 rows with K split so that the CTAs come to about mmqx_min_ctas, 8 block columns a
    CTA at least (not the 70B's k and v: 8 CTAs of 32 blocks); its scratch holds the split's
    64-bit partials."""
    from ntx.daemons.compute.cuda.memory import gemm_scratch_bytes
    from ntx.shared.quant_types import quant_type

    fixed = tuning.batch_invariant(tuning.H200, fixed=True)
    ctas, nb = -(-n_rows // (16 * tuning.MMQX_WARPS)), n_cols // 256
    for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        for B in range(1, 65):
            got = fixed.mmqx_launch(qt, B, n_rows, nb)
            ks = -(-fixed.mmqx_min_ctas // ctas)
            if ctas >= fixed.mmqx_min_ctas:
                want = (tuning.MMQX_WARPS, tuning.MMQX_STAGES, 1) if qt != QT.Q6_K or B > 8 else None
            elif qt != QT.Q6_K and ks == 2 and nb >= 64:  # both forms' rule: at every B
                want = (tuning.MMQX_WARPS, tuning.MMQX_STAGES, 2)
            elif qt != QT.Q6_K and B > 32 and nb >= 32 and nb // ks >= 8:
                want = (tuning.MMQX_WARPS, tuning.MMQX_STAGES, ks)
            else:
                want = None
            assert got == want, (qt, B, n_rows, n_cols)
            if got is not None and got[2] > 1 and B >= 3:
                scratch = gemm_scratch_bytes(quant_type(qt), n_rows, n_cols, B, fixed)
                assert scratch["fx split-k partials"] == got[2] * B * n_rows * 8
                assert scratch["split-k counters"] == ctas * 4


@pytest.mark.parametrize("n_rows,n_cols", SHAPES_8B_70B)
def test_mmq_choice_is_mmqx_where_it_runs_else_mmq(n_rows, n_cols):
    """KernelTuning.mmq_choice, the one choice mm_plan, fx_mmq and gemm_scratch_bytes share:
    mmqx's (WR, NS, KS) with one warp over the columns where mmqx_launch gives a launch, else
    mmq_launch's (WR, WK, KS) with no stages; and the scratch gemm sizes is that launch's split."""
    from ntx.daemons.compute.cuda.memory import gemm_scratch_bytes
    from ntx.shared.quant_types import quant_type

    nb = n_cols // 256
    for table in (tuning.H200, tuning.batch_invariant(tuning.H200), tuning.batch_invariant(tuning.H200, fixed=True)):
        for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            for B in (3, 8, 9, 33, 64):
                c = table.mmq_choice(qt, B, n_rows, nb)
                staged = table.mmqx_launch(qt, B, n_rows, nb)
                if staged is not None:
                    assert c == tuning.MmqChoice(True, staged[0], 1, staged[1], staged[2])
                else:
                    wr, wk, ks = table.mmq_launch(B, n_rows, nb * 8)
                    assert c == tuning.MmqChoice(False, wr, wk, 0, ks)
                scratch = gemm_scratch_bytes(quant_type(qt), n_rows, n_cols, B, table)
                fx_form = table.invariant_fixed and B > table.fx_matvec_rows
                partials = "fx split-k partials" if fx_form else "split-k partials"
                tiles = -(-n_rows // (16 * c.wr))
                if c.ks > 1:
                    assert scratch[partials] == c.ks * B * n_rows * (8 if "fx" in partials else 4)
                    assert scratch["split-k counters"] == tiles * 4
                else:
                    assert partials not in scratch


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q8_0", "F16"])
def test_scratch_is_counted_for_the_planner(tmp_path, qtype):
    """The layout's scratch covers what every product of up to 64 rows of x asks for, at every
    row count (not only the buckets': the head multiplies any number of logit rows), as the
    launchers size it (memory.gemm_scratch_bytes: mmq's planes padded to 8 rows, the i16
    planes, mm's f16 halves, split-K partials): the planner must not give that memory to layers."""
    import synth_gguf as sg

    from ntx.daemons.compute.cuda.memory import gemm_scratch_bytes, matrix_shapes, mmq_planes_bytes, scratch_regions
    from ntx.shared.gguf_index import open_model
    from ntx.shared.quant_types import quant_type

    path = tmp_path / "m.gguf"
    sg.write_llama_gguf(path, sg.preset_config("tiny", n_layers=2, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                                                vocab_size=1024, type=qtype, seed=1))
    index = open_model(path)
    regions = {r.name: r.nbytes for r in scratch_regions(matrix_shapes(index), 64, index.hparams.n_embd)}
    for qt, n_rows, n_cols in matrix_shapes(index):
        for T in range(1, 65):
            for purpose, nbytes in gemm_scratch_bytes(quant_type(qt), n_rows, n_cols, T, tuning.H200).items():
                assert regions[purpose] >= nbytes, (qt, n_rows, n_cols, T, purpose)
    assert regions["gemm accumulate"] == 64 * index.hparams.n_embd * 4
    assert mmq_planes_bytes(3, 4096) == 8 * 4096 * 2 + 8 * 4096 // 32 * 8  # padded to 8 rows


def test_the_grid_forms_stand_ins_are_production_with_int32_sums(tmp_path):
    """dev/cuda/fx_grid.py writes its variants by editing production's text; each edit must still
    find what it replaces (it stops otherwise), and the variant's headers must be the ones the
    runtime inlines (sources.kernel_source looks beside the including file first)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fx_grid", sources.CUDA_DIR.parents[2] / "dev" / "cuda" / "fx_grid.py")
    fx_grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fx_grid)
    for shared, chain, step in ((False, False, False), (True, False, False), (None, False, False), (False, True, False),
                                (None, False, True)):
        d = fx_grid.write_variant(tmp_path / f"{shared}-{chain}-{step}", shared_every_type=shared, chain=chain, step=step)
        src = sources.kernel_source(d / "fixed_point.cu")
        assert src.count("float mm_value(int s)") == 1  # the variant's common.cuh, reached through its tensor_core.cuh
        assert src.count("fxg_of(bv") == 3 and "fx_of(bv" not in (d / "mmq.cu").read_text()
        assert "struct MmqSum<true> { typedef int T; }" in src and "long long* __restrict__ part" not in src
        assert ("{ return NT > 5; }" in src) == (shared is True)
        assert ("mmq_fx_shared_sums(int QT, int NT) { return false; }" in src) == (shared is None)
        assert (d / "smem_bytes_per_thread_tile").is_file() == (shared is True)
        # the chained grid: both kernels' block values start at the FADD's constant, and no FADD is left at the end
        assert src.count("[nt][3] = 12582912.f;") == (2 if chain else 0)
        assert ("__fadd_rn(v, 12582912.f)" in src) == (not chain)
        # the step grid: both kernels' chains go to the sums, every step (8 of Q4_K/Q5_K's, 2 of Q6_K's) rounded into them
        assert src.count("steps into the sums") == (2 if step else 0)
        assert src.count("if constexpr (FX) ac[") == (10 if step else 0) and src.count("float* ac = chain(") == (0 if step else 4)
    # the scaled grid: the conversion is one FFMA with the x row's factor and the weight row's constant,
    # in all three places; the tables' stand-ins are made only in the fixed form's kernels (if constexpr (FX))
    for lazy in (False, True):
        d = fx_grid.write_variant(tmp_path / f"scaled-{lazy}", shared_every_type=False, scaled=True, lazy=lazy)
        src = sources.kernel_source(d / "fixed_point.cu")
        assert "fmaf(v, sx, cw)" in src and "__fadd_rn(v, 12582912.f)" not in src
        assert src.count("fxg_of(bv") == 3 and src.count("fxg_sxs[8 * nt + 2 * tig + (e & 1)]") == 3
        assert src.count("__shared__ float fxg_sx_table") == 2
        assert src.count("fxg_first") == (4 if lazy else 0) and (src.count("__syncthreads();\n    }\n    mm_staged_walk") == (0 if lazy else 1))
