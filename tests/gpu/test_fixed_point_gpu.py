"""The fixed-point products (fixed_point.py, the batch-invariant mode's fixed form) on the GPU:
one set of bits for a row from every kernel, launch and split, and results within the i16
activations' rounding bound of the exact product. The mode's model and engine tests take this
form too (test_batch_invariant_gpu.py, FORMS).

Run: python -m pytest -q tests/gpu/test_fixed_point_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from dataclasses import replace  # noqa: E402

from ntx.daemons.compute.cuda import fixed_point as FX  # noqa: E402
from ntx.daemons.compute.cuda import runtime  # noqa: E402
from ntx.daemons.compute.cuda.tuning import FX_LANES_PER_ROW, FX_MATVEC_KERNELS  # noqa: E402

from .test_kernels import CTX, QT, W, check_i16, random_weights, reference_matrix, rng  # noqa: E402,F401


@pytest.mark.parametrize("n_rows,n_cols", [(203, 4096), (64, 14336), (1040, 512)])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_fixed_point_rows_are_alike_in_every_kernel_at_any_rows(qt, n_rows, n_cols, rng):
    """Each row of x gets one set of bits from the fixed-point matvec at 1-8 rows
    (in the i16 matvec's pieces at its launch for each B, direct at every lanes-a-row, staged at
    several warps a CTA) and from the fixed-point mmq at
    1-64 rows, at the device's launch and at split-K launches (the sums are integers: no order
    can change them); and the results are
    within the two-plane rounding bound of the exact product (check_i16: the same activations as
    mmq), which catches a wrong word, scale or group (a block value read wrong is far outside it).
    The K-quants at 4096 columns: 16 blocks a row; 14336: 56 (two a lane at 32 lanes); 512: 2."""
    raw = random_weights(qt, n_rows, n_cols, rng)
    w = W(raw, qt, n_rows, n_cols)
    x_host = rng.standard_normal((64, n_cols)).astype(np.float32)
    x_host[:, ::97] *= 30.0
    x = cp.asarray(x_host)
    alone = np.stack([cp.asnumpy(FX.fx_matvec_direct(CTX, w, x[i:i + 1]))[0] for i in range(64)])  # [64, n_rows]
    check_i16(alone, x_host, reference_matrix(qt, raw, n_rows, n_cols))
    for tpr in FX_LANES_PER_ROW:
        for B in (1, 3, 8):
            for i in (0, 56):
                np.testing.assert_array_equal(cp.asnumpy(FX.fx_matvec_direct(CTX, w, x[i:i + B], tpr=tpr)), alone[i:i + B],
                                              err_msg=f"fx_matvec {qt.name} [{n_rows}, {n_cols}] tpr={tpr} rows {i}+{B}")
    for B in range(1, 9):  # the matvec in the i16 matvec's pieces, at its launch for each B
        for i in (0, 56):
            np.testing.assert_array_equal(cp.asnumpy(FX.fx_matvec_pieces(CTX, w, x[i:i + B])), alone[i:i + B],
                                          err_msg=f"fx_matvec_pieces {qt.name} [{n_rows}, {n_cols}] rows {i}+{B}")
    for warps, splits in ((None, None), (1, 1), (3, 2), (8, 1), (2, 4)):  # the staged matvec: a lane a row
        for B in (1, 2, 8):
            np.testing.assert_array_equal(
                cp.asnumpy(FX.fx_matvec_staged(CTX, w, x[:B], warps=warps, splits=splits)), alone[:B],
                err_msg=f"fx_matvec_staged {qt.name} [{n_rows}, {n_cols}] warps={warps} splits={splits} B={B}")
    for B in (1, 2, 8, 9, 16, 33, 64):
        np.testing.assert_array_equal(cp.asnumpy(FX.fx_mmq(CTX, w, x[:B])), alone[:B],
                                      err_msg=f"fx_mmq {qt.name} [{n_rows}, {n_cols}] B={B}")
        for config in ((1, 8, 1), (2, 4, 2), (1, 2, 4)):
            np.testing.assert_array_equal(cp.asnumpy(FX.fx_mmq(CTX, w, x[:B], config=config)), alone[:B],
                                          err_msg=f"fx_mmq {qt.name} [{n_rows}, {n_cols}] B={B} at {config}")


@pytest.mark.parametrize("n_rows,n_cols", [(203, 4096), (300, 8192), (300, 16384)])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_fixed_point_mmqx_gives_fx_mmq_bits(qt, n_rows, n_cols, rng):
    """fx_mmqx_kernel (x staged once per CTA; tuning.mmqx_launch) gives every row
    fx_mmq_kernel's bits: the same block values, integer sums. Taken by every matrix here
    (mmqx_min_ctas 1: Q4_K/Q5_K at every row count, Q6_K past 8); by the split in two of rows of
    64 blocks or more at every row count (mmqx_min_ctas 5 for 3 CTAs: the 70B's down's rule),
    else the long-rows rule; then by the long-rows rule alone (mmqx_min_ctas 12 for 3 CTAs:
    Q4_K/Q5_K of 32 blocks a row past 32 rows, K split in four)."""
    x = cp.asarray(rng.standard_normal((64, n_cols)).astype(np.float32))
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    nb, k45 = n_cols // 256, qt != QT.Q6_K
    for min_ctas in (1, 5, 12):
        table = replace(runtime.invariant_tuning(CTX.tuning(), False, True), mmqx_min_ctas=min_ctas)
        ctx = runtime.standalone()
        ctx.tuning = lambda: table
        taken = 0
        for B in (1, 3, 8, 9, 16, 33, 40, 64):
            staged = table.mmqx_launch(qt, B, n_rows, n_cols // 256)
            taken += staged is not None
            want = cp.asnumpy(FX.fx_mmq(CTX, w, x[:B], config=(1, 2, 1)))
            np.testing.assert_array_equal(cp.asnumpy(FX.fx_mmq(ctx, w, x[:B])), want,
                                          err_msg=f"fx_mmq {qt.name} [{n_rows}, {n_cols}] B={B} at {staged}")
        ctas = -(-n_rows // 128)
        ks = -(-min_ctas // ctas)
        if min_ctas == 1:
            want_taken = 8 if k45 else 5
        elif k45 and ks == 2 and nb >= 64:
            want_taken = 8
        else:
            want_taken = 3 if k45 and nb >= 32 and nb // ks >= 8 else 0
        assert taken == want_taken, (min_ctas, n_rows, n_cols)


@pytest.mark.parametrize("kind", FX_MATVEC_KERNELS)
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_fixed_point_accumulate_through_every_matvec(kind, qt, rng):
    """fx_matvec(accumulate=True) adds the product to out with one f32 addition, whichever
    kernel the device table names (fx_matvec_kernel): pieces in its epilogue (peeled at one row),
    staged and direct through a scratch product and ``add``. So out is out + the product's bits,
    as numpy's f32 addition gives them (no multiply there for a contraction to merge)."""
    n_rows, n_cols = 203, 4096
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    x = cp.asarray(rng.standard_normal((8, n_cols)).astype(np.float32))
    start = rng.standard_normal((8, n_rows)).astype(np.float32)
    table = replace(CTX.tuning(), fx_matvec_kernel=kind)
    ctx = runtime.standalone()
    ctx.tuning = lambda: table  # this context alone takes the kernel (the process's table unchanged)
    for B in (1, 2, 3, 8):
        product = cp.asnumpy(FX.fx_matvec_direct(CTX, w, x[:B]))
        out = cp.asarray(start[:B])
        FX.fx_matvec(ctx, w, x[:B], out, accumulate=True)
        np.testing.assert_array_equal(cp.asnumpy(out), start[:B] + product,
                                      err_msg=f"fx_matvec {kind} accumulate {qt.name} B={B}")


def test_fixed_point_refuses_what_it_does_not_decode(rng):
    """The fixed-point kernels take mmq's types at a multiple of 256 columns: anything else is a
    one-line error naming what they take."""
    w = W(random_weights(QT.Q8_0, 16, 256, rng), QT.Q8_0, 16, 256)
    x = cp.asarray(rng.standard_normal((1, 256)).astype(np.float32))
    for fn in (FX.fx_matvec, FX.fx_matvec_pieces, FX.fx_matvec_direct, FX.fx_matvec_staged, FX.fx_mmq):
        with pytest.raises(ValueError, match="Q4_K, Q5_K, Q6_K"):
            fn(CTX, w, x)
    wk = W(random_weights(QT.Q4_K, 16, 512, rng), QT.Q4_K, 16, 512)
    with pytest.raises(ValueError, match="lanes a row"):
        FX.fx_matvec_direct(CTX, wk, cp.asarray(rng.standard_normal((1, 512)).astype(np.float32)), tpr=4)


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_fixed_point_huge_block_values_alike_in_every_kernel(qt, rng):
    """Block values at and past the fixed point's range (a block value of 2^31 or more saturates
    the conversion, and the row's integer sum may then wrap: fixed_point.cu's range note), and a
    NaN activation, still give a row one set of bits from every kernel and row count: mmq with
    its sums in registers (Q4_K; Q6_K up to 5 tiles of x) or in shared memory (Q6_K past 5
    tiles, mmq.cu mmq_fx_shared_sums) and the matvecs, whatever the integers hold."""
    n_rows, n_cols = 96, 4096
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    x_host = rng.standard_normal((64, n_cols)).astype(np.float32)
    x_host[1:40:3, :256] *= 3e7     # the first block's values near and past 2^31
    x_host[9, 300] = np.nan         # a NaN in row 9's second block
    x = cp.asarray(x_host)
    alone = np.stack([cp.asnumpy(FX.fx_matvec_direct(CTX, w, x[i:i + 1]))[0] for i in range(64)])
    for B in (1, 2, 3, 8):
        np.testing.assert_array_equal(cp.asnumpy(FX.fx_matvec_pieces(CTX, w, x[:B])), alone[:B],
                                      err_msg=f"fx_matvec_pieces {qt.name} B={B}")
    for B in (1, 9, 33, 40, 48, 64):
        np.testing.assert_array_equal(cp.asnumpy(FX.fx_mmq(CTX, w, x[:B])), alone[:B],
                                      err_msg=f"fx_mmq {qt.name} B={B}")
        np.testing.assert_array_equal(cp.asnumpy(FX.fx_mmq(CTX, w, x[:B], config=(1, 2, 4))), alone[:B],
                                      err_msg=f"fx_mmq {qt.name} B={B} split")
    assert np.abs(alone[1:40:3]).max() > 2.0 ** 30  # the test reached the range's edge
