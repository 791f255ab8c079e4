"""Batch invariance (issue 28 item 3): a row's logits do not depend on how many other rows share
its pass, so greedy output is the same alone, batched, and with speculation.

Here, without a GPU: the cuda backend's batch-invariant mode (``--kernels batch-invariant=on``)
as choices a planner can check (one matrix-product path per weight format at every row count,
one matvec launch for every batch size, attention's key splits independent of the rows, the
memory layout that follows; in the mode's rows form, ``invariant-rows=on``, the i16 matvec then
matvec_rows for the block-quantized types, one warps-per-CTA per type at every batch size), and
the cpu backend's invariance through a real model: one sequence's logits, bit for bit, whether
its pass holds it alone or 8, 64 or 512 rows of other sequences that join and leave (prompts,
decode rows, a 511-row token tree).
``sequence_logits_alone`` and ``sequence_logits_batched`` are shared with the GPU test
(tests/gpu/test_batch_invariant_gpu.py), which runs the same passes on the cuda backend.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.cuda import tuning
from ntx.daemons.compute.cuda.buckets import bucket_sizes
from ntx.daemons.compute.cuda.memory import (BUCKET_PREFIX, attention_rows, attention_splits, backend_layout,
                                             backend_tuning, cuda_memory_costs, eager_layout, gemm_path,
                                             gemm_scratch_bytes, i16_planes_bytes, invariant_path, pass_regions)
from ntx.shared.errors import ConfigError
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.quant_types import QUANT_TYPES

INVARIANT = tuning.batch_invariant(tuning.H200)
ROWS_FORM = tuning.batch_invariant(tuning.H200, rows=True)  # invariant-rows=on
FIXED_FORM = tuning.batch_invariant(tuning.H200, fixed=True)  # invariant-fixed=on
ROW_COUNTS = range(1, 513)  # every pass size up to the widest verified tree
WANT_PATH = {"F32": "matvec", "BF16": "matvec", "F16": "mm", "Q4_0": "mm", "Q4_1": "mm", "Q5_0": "mm",
             "Q5_1": "mm", "Q8_0": "mm", "Q4_K": "mmq", "Q5_K": "mmq", "Q6_K": "mmq"}


# ------------------------------------------------------------------------------ the cuda mode's choices
def test_the_switch_parses_shows_and_picks_the_invariant_table():
    on = KernelOptions.parse("batch-invariant=on")
    assert on.batch_invariant and not KernelOptions().batch_invariant
    assert "batch-invariant=on" in on.describe() and KernelOptions.parse(on.describe()) == on
    assert backend_tuning(on) == INVARIANT and backend_tuning(KernelOptions()) is tuning.DEFAULT
    assert backend_tuning(None) is tuning.DEFAULT


@pytest.mark.parametrize("name", sorted(WANT_PATH))
def test_one_gemm_path_per_format_at_every_row_count(name):
    """The mode's gemm takes one path per format, whatever T (never cuBLAS, never the i16 matvec
    beside a tensor-core matmul), where the default table takes two or three."""
    q = next(q for q in QUANT_TYPES.values() if q.name == name)
    for n_cols in (256, 576, 1536, 4096, 14336):
        if n_cols % q.kernel_col_multiple:  # no such rows of this format
            continue
        paths = {gemm_path(q, n_cols, T, INVARIANT) for T in ROW_COUNTS}
        assert paths == {invariant_path(q, n_cols, T) for T in ROW_COUNTS} == {WANT_PATH[name]}, (name, n_cols, paths)
        assert len({gemm_path(q, n_cols, T, tuning.H200) for T in ROW_COUNTS}) > 1  # the default mixes paths
    if name == "F16":  # rows mm cannot cut (n_cols / 8 steps not a multiple of 4): the matvec
        assert {gemm_path(q, 40, T, INVARIANT) for T in ROW_COUNTS} == {"matvec"}


def test_one_matvec_launch_for_every_batch_size_and_type():
    """A matvec row's order of additions follows its launch's warps: the mode's table has one
    launch for every B, no per-type override, the default's widest one."""
    for q in QUANT_TYPES.values():
        assert {INVARIANT.mv(q.qtype, B) for B in range(1, tuning.MAX_MATVEC_B + 1)} == {
            tuning.H200.mv_launch[tuning.MAX_MATVEC_B]}
        assert {INVARIANT.i16(q.qtype, B) for B in range(1, tuning.MAX_MATVEC_B + 1)} == {
            tuning.H200.i16_launch[tuning.MAX_MATVEC_B]}
    assert tuning.H200.i16_launch_override  # what the mode drops: the default's B = 1 launches differ
    # every launch of the mode is one the default compiles already
    assert INVARIANT.all_mv_launches() <= tuning.H200.all_mv_launches()
    assert INVARIANT.all_i16_launches() <= tuning.H200.all_i16_launches()


@pytest.mark.parametrize("n_kv,max_ctx", [(1, 64), (3, 1024), (8, 4096), (8, 131072), (32, 8192)])
def test_attention_splits_do_not_depend_on_the_rows(n_kv, max_ctx):
    """The key splits fix the order a row's keys merge in: the one-row count at every T (the
    default's shrink as rows grow)."""
    one_row = attention_splits(1, n_kv, max_ctx)
    assert {attention_splits(T, n_kv, max_ctx, INVARIANT) for T in ROW_COUNTS} == {one_row}
    assert one_row % tuning.ATTN_SPLIT_STEP == 0 and one_row <= tuning.H200.attn_max_splits
    # the mode's launch walks those splits over the warps the default launches for T rows
    # (attention.cu attn_walk): a multiple of the CTA's warps, never more than the splits
    for T in ROW_COUNTS:
        grid = INVARIANT.attn_grid_splits(T, n_kv, max_ctx)
        assert grid == tuning.H200.attn_splits(T, n_kv, max_ctx) and grid % tuning.ATTN_SPLIT_STEP == 0
        assert grid <= one_row
    from ntx.daemons.compute.cuda.instances import attn_walk_names, production

    assert attn_walk_names(4, 128) in production()["attention.cu"]


def test_gemm_scratch_beyond_one_launch_is_one_launchs():
    """Above MAX_MM_ROWS the mode multiplies in chunks of that many rows: the scratch of a wider
    product is a 64-row product's."""
    q4k = next(q for q in QUANT_TYPES.values() if q.name == "Q4_K")
    want = gemm_scratch_bytes(q4k, 14336, 4096, tuning.MAX_MM_ROWS, INVARIANT)
    for T in (65, 200, 512):
        assert gemm_scratch_bytes(q4k, 14336, 4096, T, INVARIANT) == want
    assert "mmq x planes" in gemm_scratch_bytes(q4k, 14336, 4096, 1, INVARIANT)  # mmq from one row


# ------------------------------------------------------------------------------ the rows form
def test_the_rows_form_parses_only_with_the_mode():
    rows = KernelOptions.parse("batch-invariant=on,invariant-rows=on")
    assert rows.batch_invariant and rows.invariant_rows and KernelOptions.parse(rows.describe()) == rows
    assert backend_tuning(rows) == ROWS_FORM and ROWS_FORM.invariant_rows and not INVARIANT.invariant_rows
    with pytest.raises(ConfigError, match="batch-invariant=on"):
        KernelOptions.parse("invariant-rows=on")


@pytest.mark.parametrize("name", sorted(WANT_PATH))
def test_the_rows_form_takes_the_i16_matvec_then_matvec_rows(name):
    """The rows form: the block-quantized types take the i16 matvec to 8 rows and matvec_rows
    (the matvec's f32 steps in its order) past that, never mmq, mm or cuBLAS; the float types
    as in the mode's other form."""
    q = next(q for q in QUANT_TYPES.values() if q.name == name)
    for n_cols in (256, 576, 1536, 4096, 14336):
        if n_cols % q.kernel_col_multiple:
            continue
        got = {T: gemm_path(q, n_cols, T, ROWS_FORM) for T in ROW_COUNTS}
        assert got == {T: invariant_path(q, n_cols, T, rows=True) for T in ROW_COUNTS}
        if q.dp4a:
            assert got == {T: "i16" if T <= tuning.MAX_MATVEC_B else "rows" for T in ROW_COUNTS}, (name, n_cols)
        else:
            assert set(got.values()) == {WANT_PATH[name]}, (name, n_cols)


def test_the_rows_form_keeps_one_matvec_order_per_type():
    """A matvec row's order of additions follows its launch's warps per CTA, not its rows per CTA
    nor its pieces per trip: the rows form keeps each type's launches with one warps-per-CTA at
    every B, its 8-row launch's (the default's B = 1 launches at other warps, Q6_K's and Q8_0's,
    take it), so that matvec_rows, at that warps-per-CTA, gives a row past 8 the bits it has
    alone. Every launch is one the default compiles (rows per CTA and unroll are template
    arguments, warps per CTA a launch one)."""
    for q in QUANT_TYPES.values():
        if not q.dp4a:
            continue
        nw = tuning.H200.i16(q.qtype, tuning.MAX_MATVEC_B)[1]
        for B in range(1, tuning.MAX_MATVEC_B + 1):
            nr, got_nw, u = ROWS_FORM.i16(q.qtype, B)
            want = tuning.H200.i16(q.qtype, B)
            assert got_nw == nw and (nr, u) == (want[0], want[2]), (q.name, B)
    assert {tuning.H200.i16(qt, 1)[1] for qt in (QT.Q6_K, QT.Q8_0)} != {tuning.H200.i16(QT.Q6_K, 8)[1]}
    assert ROWS_FORM.i16(QT.Q4_K, 1) == tuning.H200.i16(QT.Q4_K, 1)  # an override at the same warps stays
    assert {(nr, u) for nr, _, u in ROWS_FORM.all_i16_launches()} <= {
        (nr, u) for nr, _, u in tuning.H200.all_i16_launches()}


def test_the_rows_forms_scratch_is_one_64_row_launchs_planes():
    """matvec_rows runs in launches of MAX_MM_ROWS rows: a wider product's scratch is x's i16
    planes for 64 rows, no mmq planes or split-K partials."""
    q4k = next(q for q in QUANT_TYPES.values() if q.name == "Q4_K")
    want = {"i16 planes": i16_planes_bytes(tuning.MAX_MM_ROWS, 4096)}
    for T in (64, 65, 200, 512):
        assert gemm_scratch_bytes(q4k, 14336, 4096, T, ROWS_FORM) == want
    assert gemm_scratch_bytes(q4k, 14336, 4096, 1, ROWS_FORM) == {"i16 planes": i16_planes_bytes(1, 4096)}


# ------------------------------------------------------------------------------ the fixed form
def test_the_fixed_form_parses_only_with_the_mode_and_alone():
    fixed = KernelOptions.parse("batch-invariant=on,invariant-fixed=on")
    assert fixed.batch_invariant and fixed.invariant_fixed and KernelOptions.parse(fixed.describe()) == fixed
    assert "invariant-fixed=on" in fixed.describe() and "invariant-fixed" not in KernelOptions().describe()
    assert backend_tuning(fixed) == FIXED_FORM and FIXED_FORM.invariant_fixed and not INVARIANT.invariant_fixed
    assert "fixed" in FIXED_FORM.name and not FIXED_FORM.invariant_rows
    with pytest.raises(ConfigError, match="add batch-invariant=on"):
        KernelOptions.parse("invariant-fixed=on")
    with pytest.raises(ConfigError, match="choose one"):
        KernelOptions.parse("batch-invariant=on,invariant-rows=on,invariant-fixed=on")
    with pytest.raises(ValueError, match="one form at a time"):
        tuning.batch_invariant(tuning.H200, rows=True, fixed=True)


@pytest.mark.parametrize("name", sorted(WANT_PATH))
def test_the_fixed_form_takes_the_fixed_point_matvec_then_fixed_point_mmq(name):
    """The fixed form: the K-quants take the fixed-point matvec up to the table's fx_matvec_rows
    rows and fixed-point mmq past them (one set of bits: the boundary moves speed only), never
    the f32-summing kernels; every other format as in the mode's default form."""
    q = next(q for q in QUANT_TYPES.values() if q.name == name)
    for n_cols in (256, 576, 1536, 4096, 14336):
        if n_cols % q.kernel_col_multiple:
            continue
        got = {T: gemm_path(q, n_cols, T, FIXED_FORM) for T in ROW_COUNTS}
        assert got == {T: invariant_path(q, n_cols, T, fixed_rows=FIXED_FORM.fx_matvec_rows) for T in ROW_COUNTS}
        if q.mm_staged and n_cols % 256 == 0:
            assert got == {T: "fxmv" if T <= FIXED_FORM.fx_matvec_rows else "fxmmq" for T in ROW_COUNTS}, (name, n_cols)
        else:
            assert got == {T: gemm_path(q, n_cols, T, INVARIANT) for T in ROW_COUNTS}, (name, n_cols)


def test_the_fixed_forms_matvec_keeps_the_tuned_launches_and_compiles_them():
    """The fixed form's matvec (fx_mvq_kernel, "pieces": the table's default) runs at its own
    launches (fx_mvq_launch) or the i16 matvec's tuned one for each type and B, the B = 1
    overrides included (its bits do not depend on the launch), while the table's own i16
    launches stay the mode's one per B; those launches are what production compiles for the
    form's tables, and only for them."""
    from ntx.daemons.compute.cuda import instances

    assert FIXED_FORM.fx_matvec_kernel == "pieces"
    assert tuning.FX_MATVEC_KERNELS[0] == "pieces"
    for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        for B in range(1, tuning.MAX_MATVEC_B + 1):
            want = tuning.H200.fx_mvq_launch.get((qt, B)) or tuning.H200.i16(qt, B)
            assert FIXED_FORM.fx_mvq(qt, B) == want, (qt, B)
            assert FIXED_FORM.i16(qt, B) == INVARIANT.i16(qt, B)
    assert FIXED_FORM.fx_mvq(QT.Q4_K, 8) == tuning.H200.i16(QT.Q4_K, 8)
    assert FIXED_FORM.fx_mvq(QT.Q6_K, 1) != FIXED_FORM.i16(QT.Q6_K, 1)  # not the mode's one launch per B
    assert INVARIANT.fx_mvq_launch == {}  # the other forms run no fixed-point matvec
    q4k = next(q for q in QUANT_TYPES.values() if q.name == "Q4_K")
    names = {n for src, ns in instances.type_modules(q4k, [FIXED_FORM]) if src == "fixed_point.cu" for n in ns}
    for B in range(1, tuning.MAX_MATVEC_B + 1):
        nr, _, u = FIXED_FORM.fx_mvq(QT.Q4_K, B)
        assert f"fx_mvq_kernel<{int(QT.Q4_K)},{B},{nr},{u}>" in names
    assert not any(n.startswith(("fx_mvs_kernel", "fx_mv_kernel")) for n in names)
    assert not any(src == "fixed_point.cu" for src, _ in instances.type_modules(q4k, [tuning.H200, INVARIANT]))


def test_the_fixed_forms_matvec_takes_its_small_launch_for_a_small_matrix():
    """A launch whose matrices have at most fx_mvq_small_rows rows together (a layer's k or v
    alone) takes fx_mvq_small_launch (more warps for few rows), a larger one, or one whose size
    is not given, fx_mvq_launch's; the small launches are compiled too, and the other forms have
    none."""
    from ntx.daemons.compute.cuda import instances

    t = FIXED_FORM
    assert t.fx_mvq_small_launch == tuning.H200.fx_mvq_small_launch and t.fx_mvq_small_launch
    q4k = next(q for q in QUANT_TYPES.values() if q.name == "Q4_K")
    names = {n for src, ns in instances.type_modules(q4k, [t]) if src == "fixed_point.cu" for n in ns}
    for (qt, B), small in t.fx_mvq_small_launch.items():
        assert small != t.fx_mvq(qt, B)
        assert t.fx_mvq(qt, B, 1024) == t.fx_mvq(qt, B, t.fx_mvq_small_rows) == small, (qt, B)
        assert t.fx_mvq(qt, B, t.fx_mvq_small_rows + 1) == t.fx_mvq(qt, B, 4096 + 1024) == t.fx_mvq(qt, B), (qt, B)
        assert t.fx_mvq_launches(qt, B) == {small, t.fx_mvq(qt, B)}
        if qt == QT.Q4_K:
            assert f"fx_mvq_kernel<{int(qt)},{B},{small[0]},{small[2]}>" in names
    for B in range(1, tuning.MAX_MATVEC_B + 1):  # no small launch: the one launch, whatever the size
        if (QT.Q4_K, B) not in t.fx_mvq_small_launch:
            assert t.fx_mvq(QT.Q4_K, B, 1024) == t.fx_mvq(QT.Q4_K, B)
    assert INVARIANT.fx_mvq_small_launch == {}


def test_the_fixed_forms_staged_matvec_fills_the_device_and_its_scratch_is_planned():
    """fx_mvs_launch: about fx_target_ctas CTAs, split-K where a matrix has few 32-row tiles, each
    warp two block columns or more where there are enough; the planner's scratch for each
    product holds what its launch takes (64-bit split-K partials beside the planes)."""
    t = FIXED_FORM
    for n_rows, nb in ((4096, 16), (14336, 16), (1024, 16), (4096, 56), (128256, 16), (320, 4), (96, 1)):
        warps, ks = t.fx_mvs_launch(n_rows, nb)
        tiles = -(-n_rows // 32)
        assert 1 <= warps <= tuning.FX_MVS_MAX_WARPS and 1 <= ks
        assert warps * ks <= max(1, nb // 2) or (warps, ks) == (1, 1), (n_rows, nb, warps, ks)
        assert tiles * ks < 2 * t.fx_target_ctas or ks == 1, (n_rows, nb)
    assert t.fx_mvs_launch(4096, 16)[1] > 1 and t.fx_mvs_launch(128256, 16)[1] == 1
    q4k = next(q for q in QUANT_TYPES.values() if q.name == "Q4_K")
    _, ks = t.fx_mvs_launch(4096, 16)
    staged = replace(t, fx_matvec_kernel="staged")
    assert gemm_scratch_bytes(q4k, 4096, 4096, 2, staged) == {
        "i16 planes": i16_planes_bytes(2, 4096), "fx split-k partials": ks * 2 * 4096 * 8, "split-k counters": 128 * 4}
    for kind in ("pieces", "direct"):  # no split-K: the planes alone
        assert gemm_scratch_bytes(q4k, 4096, 4096, 2, replace(t, fx_matvec_kernel=kind)) == {
            "i16 planes": i16_planes_bytes(2, 4096)}
    wide = gemm_scratch_bytes(q4k, 14336, 4096, 64, t)
    assert "mmq x planes" in wide and "i16 planes" not in wide
    for T in (65, 512):
        assert gemm_scratch_bytes(q4k, 14336, 4096, T, t) == wide


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    from tests.synth_models import write_tiny

    from ntx.shared.gguf_index import open_model

    return open_model(write_tiny(tmp_path_factory.mktemp("bi"), type="Q4_K_M", d_model=256, d_ff=512))


def test_layout_and_planner_follow_the_mode(tiny_index):
    """Each bucket's attention partials hold the one-row splits for its rows, a wide pass's those
    of one 64-row launch; no f16 copy for cuBLAS; the planner sums the same lists."""
    hp, ctx = tiny_index.hparams, 1024
    S = attention_splits(1, hp.n_head_kv, ctx)
    layout = backend_layout(tiny_index, ctx, t=INVARIANT)
    acc = layout.region(BUCKET_PREFIX + "attention acc").nbytes  # the buckets share it: the largest's
    assert acc == max(bucket_sizes()) * hp.n_head * S * hp.head_dim * 4
    for rows in bucket_sizes():
        assert pass_regions(hp, rows, ctx, t=INVARIANT)[-1].nbytes == rows * hp.n_head * S * hp.head_dim * 4
    assert "dequant w16" not in layout.offsets and "dequant w16" in backend_layout(tiny_index, ctx).offsets
    eager = eager_layout(hp, 512, ctx, INVARIANT)
    assert attention_rows(512, INVARIANT) == tuning.MAX_GRAPH_ROWS and attention_rows(512, tuning.H200) == 512
    assert eager.region("attention acc").nbytes == tuning.MAX_GRAPH_ROWS * hp.n_head * S * hp.head_dim * 4
    assert "dequant x16" not in eager.offsets
    assert pass_regions(hp, 64, ctx, t=INVARIANT) != pass_regions(hp, 64, ctx)  # the default's splits shrink
    on = KernelOptions(batch_invariant=True)
    costs = cuda_memory_costs(tiny_index, max_seqs=2, max_ctx=ctx, max_pass_rows=512, kernels=on)
    from ntx.daemons.compute.cuda.memory import ALLOCATOR_SLACK_BYTES

    assert costs.workspace_bytes == ALLOCATOR_SLACK_BYTES + layout.total_bytes + eager.total_bytes


# ------------------------------------------------------------------------------ one sequence among others
PROMPT = (5, 91, 300, 17, 44, 260)  # the watched sequence's prompt (ids within every test vocabulary)
STEPS = 6  # its decode steps after the prompt
_seq_ids = itertools.count(7000)


def _rows(rng, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(1, 500, size=n))


def _chunk_logits(model, chunks: list[SeqChunk], watched: int) -> np.ndarray:
    """The pass of ``chunks``; the logit rows of the chunk of sequence ``watched`` [n, V]."""
    batch = StepBatch(chunks)
    logits = model.forward(batch)
    i = next(i for i, c in enumerate(chunks) if c.seq_id == watched)
    return np.asarray(logits[batch.logit_slices()[i]])


def _logit_row(model, chunks: list[SeqChunk], watched: int) -> np.ndarray:
    return _chunk_logits(model, chunks, watched)[-1]


def sequence_logits_alone(model) -> tuple[list[int], np.ndarray]:
    """The watched sequence decoded greedily alone: its prompt in one pass, then one row a pass.
    Returns its tokens after the prompt and its logit rows [STEPS + 1, V]."""
    sid = next(_seq_ids)
    model.backend.alloc_sequence(sid, 1024)
    try:
        rows = [_logit_row(model, [SeqChunk(sid, 0, PROMPT)], sid)]
        tokens = []
        for i in range(STEPS):
            tokens.append(int(rows[-1].argmax()))
            rows.append(_logit_row(model, [SeqChunk(sid, len(PROMPT) + i, (tokens[-1],))], sid))
        return tokens, np.stack(rows)
    finally:
        model.backend.free_sequence(sid)


def sequence_logits_batched(model, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """The same sequence fed the same tokens, its passes shared with sequences that join and
    leave: 8, 64, 512 (a 511-row tree of another sequence), 2, 1 and 8 rows, the watched row
    first or last; then its last two steps verified as a token tree (a branch of two wrong
    tokens beside the path: the path's second row lies past them in the cache) beside a 63-row
    prompt. Returns its logit rows [STEPS + 2, V], the last two the tree's path rows (the bits
    of the last two steps alone), and each pass's row count."""
    rng = np.random.default_rng(3)
    a, b, c, d, e = (next(_seq_ids) for _ in range(5))
    for sid in (a, b, c, d, e):
        model.backend.alloc_sequence(sid, 1024)
    tree_parents = (-1,) + tuple(int(rng.integers(0, j)) for j in range(1, 511))
    b_prompt, c_prompt, d_prompt, e_prompt = _rows(rng, 2), _rows(rng, 40), _rows(rng, 22), _rows(rng, 7)
    pos = len(PROMPT)
    passes = [
        # the prompt beside another's (8 rows)
        [SeqChunk(b, 0, b_prompt), SeqChunk(a, 0, PROMPT)],
        # b's decode row, two prompts join (64 rows)
        [SeqChunk(a, pos, (tokens[0],)), SeqChunk(b, 2, (7,)), SeqChunk(c, 0, c_prompt), SeqChunk(d, 0, d_prompt)],
        # a 511-row token tree of d's (512 rows)
        [SeqChunk(d, 22, _rows(rng, 511), all_logits=True, parents=tree_parents), SeqChunk(a, pos + 1, (tokens[1],))],
        # b left; c decodes (2 rows)
        [SeqChunk(c, 40, (9,)), SeqChunk(a, pos + 2, (tokens[2],))],
        # alone again (1 row)
        [SeqChunk(a, pos + 3, (tokens[3],))],
        # e joins (8 rows)
        [SeqChunk(a, pos + 4, (tokens[4],)), SeqChunk(e, 0, e_prompt)],
        # the last two steps again as a verified tree (rows 0 and 3 the path) beside 63 rows of c's
        [SeqChunk(c, 41, _rows(rng, 63)),
         SeqChunk(a, pos + 4, (tokens[4], 311, 312, tokens[5]), all_logits=True, parents=(-1, 0, 1, 0))],
    ]
    rows, sizes = [], []
    try:
        for i, chunks in enumerate(passes):
            if i == 3:
                model.backend.free_sequence(b)  # leaves mid-generation
            if i == 4:
                model.backend.free_sequence(d)
            sizes.append(sum(ch.n_tokens for ch in chunks))
            got = _chunk_logits(model, chunks, a)
            rows += [got[0], got[3]] if i == len(passes) - 1 else [got[-1]]
    finally:
        for sid in (a, c, e):
            model.backend.free_sequence(sid)
    return np.stack(rows), sizes


@pytest.fixture(scope="module")
def cpu_model(tiny_index):
    from ntx.daemons.compute.backend import make_backend
    from ntx.daemons.compute.model import LlamaModel

    backend = make_backend("cpu", tiny_index, max_seqs=8, max_ctx=1024)
    assert backend.quantized  # the int8 kernels, the cpu backend's default
    return LlamaModel(tiny_index, backend)


def test_cpu_rows_do_not_depend_on_their_pass(cpu_model):
    """The cpu backend (invariant with or without the switch): the watched sequence's logits are
    the same bits alone and beside 7 to 511 other rows that join and leave."""
    tokens, alone = sequence_logits_alone(cpu_model)
    batched, sizes = sequence_logits_batched(cpu_model, tokens)
    assert sizes == PASS_ROWS
    assert_same_rows(alone, batched, sizes)


PASS_ROWS = [8, 64, 512, 2, 1, 8, 67]  # sequence_logits_batched's passes


def assert_same_rows(alone: np.ndarray, batched: np.ndarray, sizes: list[int]) -> None:
    """Each of the batched run's rows equals, to the bit, the alone run's row of its step (the
    last two: the tree's path rows, steps STEPS - 1 and STEPS)."""
    want = list(range(STEPS)) + [STEPS - 1, STEPS]
    assert batched.shape[0] == len(want) and alone.shape[0] == STEPS + 1
    for k, step in enumerate(want):
        x, y = alone[step], batched[k]
        assert np.array_equal(x, y), (f"step {step} in a pass of {sizes[min(k, len(sizes) - 1)]} rows differs "
                                      f"by up to {np.abs(x - y).max()}")
