"""The kernel variants of dev/cuda (lab.py, lab.cu) against float64 numpy references, on the GPU:
the f32 matvec of every type and cut, the dp4a (one int8 plane) and i16s (x staged in shared
memory) matvecs, every launch configuration the sweeps try, the f16 tensor-core matmul of the
K-quants (staged and direct) and mmq with two tiles a warp. The helpers and the production
kernels' tests are tests/gpu/test_kernels.py's.

    pytest dev/cuda -q     (skipped where there is no GPU and cupy)

The dp4a matvec quantizes each row of x to int8 per group of 32 columns (d = max|x| / 127,
q = round(x / d)) and multiplies exactly in integers, so it is checked twice: (1) against the
float64 product of the dequantized weights and the *dequantized int8 x* (q * d, read back from
the kernel's own workspace): 1e-5, the f32 rounding of the per-sub-block scale products and of
the f32 accumulation; (2) against the exact x, element-wise by the bound the rounding allows,
|out - W x| <= sum_c |W[r, c]| * d_group(c) / 2 (each x element moves by at most d / 2), and in
norm by 3e-2 (Gaussian rows land at ~0.3-0.9%: the rounding error is ~d / sqrt(12) ~ 0.5% of a
group's rms, and a few-term product can cancel).
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytest.importorskip("gguf")

import lab  # noqa: E402  (dev/cuda, on sys.path through its conftest.py)
from ntx.daemons.compute.cuda import gemm as G  # noqa: E402
from ntx.daemons.compute.cuda import matvec as MV  # noqa: E402
from ntx.daemons.compute.cuda import mm as MM  # noqa: E402
from ntx.daemons.compute.cuda import tuning  # noqa: E402
from ntx.daemons.compute.cuda.memory import mm_cut  # noqa: E402
from ntx.shared.quant_types import quant_type  # noqa: E402
from tests.gpu.test_kernels import (ALL_TYPES, CTX, QT, W, _cols, check_f32_matvec, check_i16, check_split_k,  # noqa: E402
                                    gemm_case, nan_f32, random_weights, reference_matrix, relerr, rng,  # noqa: F401  (rng: a fixture)
                                    unaligned_weight)

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------------------ matvec variants
@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", [1, 2, 4, 8])
@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
def test_matvec_f32_every_type(qt, B, big, rng):
    check_f32_matvec(qt, B, big, rng, lambda w, x, out: lab.matvec(CTX, w, x, out=out, variant="f32"))


@pytest.mark.parametrize("config", [(nr, nw, u) for nr in (1, 2, 4) for nw, u in ((4, 1), (8, 2))] + [(8, 2, 1)])
@pytest.mark.parametrize("qt,variant", [(QT.Q4_K, "v1"), (QT.Q4_K, "v2"), (QT.Q5_K, "v2"), (QT.Q6_K, "v1"), (QT.Q6_K, "v2"),
                                        (QT.Q8_0, "v1"), (QT.Q8_0, "v2"), (QT.F16, "v1")],
                         ids=lambda v: v.name if isinstance(v, QT) else v)
def test_matvec_configs(qt, variant, config, rng):
    """Every kernel variant and launch configuration the benchmark may pick gives the same product."""
    n_rows, n_cols = 203, _cols(qt, True)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    for B in (1, 3, 8):
        x = rng.standard_normal((B, n_cols)).astype(np.float32)
        out = nan_f32((B, n_rows))
        lab.matvec(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out, config=config, variant=variant)
        assert relerr(out, x.astype(np.float64) @ ref_w.T) < 1e-5, (B, config)


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q6_K], ids=lambda q: q.name)
def test_matvec_unaligned_base(qt, rng):
    """2-byte-aligned types read correctly from a tensor that starts at an odd offset of 2."""
    w, x, ref_w = unaligned_weight(qt, rng)
    out = nan_f32((2, w.n_rows))
    lab.matvec(CTX, w, cp.asarray(x), out=out, variant="f32")
    assert relerr(out, x.astype(np.float64) @ ref_w.T) < 1e-5
    out2 = nan_f32((2, w.n_rows))
    lab.matvec(CTX, w, cp.asarray(x), out=out2, variant="dp4a")
    check_dp4a(out2, x, ref_w)


DP4A_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def quantize_ref(x: np.ndarray):
    """numpy mirror of quantize_x_kernel (f32 arithmetic): (q int [B, n], d f32 [B, n/32])."""
    B, n = x.shape
    g = x.reshape(B, n // 32, 32).astype(np.float32)
    amax = np.abs(g).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(g * inv[..., None]).astype(np.int64)
    return q.reshape(B, n), d


def check_dp4a(out, x, ref_w, q=None, d=None):
    """out (dp4a matvec of x) against (1) the float64 product with the dequantized int8 x (1e-5) and
    (2) the exact x: element-wise by the rounding bound, in norm by 3e-2 (see the module doc)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, ref_w.shape[1])
    if q is None:
        q, d = quantize_ref(x)
    B, n = x.shape
    dcol = np.repeat(np.asarray(d, dtype=np.float64).reshape(B, n // 32), 32, axis=1)
    xd = np.asarray(q, dtype=np.float64).reshape(B, n) * dcol
    out_h = cp.asnumpy(out).astype(np.float64).reshape(B, -1) if isinstance(out, cp.ndarray) else np.asarray(out).reshape(B, -1)
    assert relerr(out_h, xd @ ref_w.T) < 1e-5
    exact = x.astype(np.float64) @ ref_w.T
    # (0.5 + 1e-4) d: the f32 products x * (127 / max|x|) carry ~127 * 2^-22 of q's rounding unit
    bound = (0.5 + 1e-4) * dcol @ np.abs(ref_w).T  # [B, n_rows]
    slack = 1e-5 * np.linalg.norm(exact) / np.sqrt(exact.size)
    over = np.abs(out_h - exact) - bound - slack
    assert np.all(over <= 0), f"{np.count_nonzero(over > 0)} outputs beyond the int8 rounding bound"
    assert relerr(out_h, exact) < 3e-2


@pytest.mark.parametrize("B", list(range(1, 9)))
def test_dp4a_quantize_x(B, rng):
    """quantize_x: |q| <= 127, |x - q d| <= d / 2, d = max|x| / 127 per group, ds = (d, d * sum q),
    equal to the numpy mirror; an all-zero group gives d = 0, q = 0."""
    n = 32 * 37
    x = (rng.standard_normal((B, n)) * rng.uniform(0.01, 100, size=(B, 1))).astype(np.float32)
    x[0, 64:96] = 0.0
    x[B - 1, 5] = 1e4  # one outlier: its group's other values round to few levels
    ws = cp.full(lab.matvec_workspace_bytes(B, n), 0xFF, dtype=cp.uint8)  # poisoned (ds = NaN)
    q_d, ds_d = lab.quantize_x(CTX, cp.asarray(x), ws)
    q, ds = cp.asnumpy(q_d).astype(np.int64), cp.asnumpy(ds_d).astype(np.float64)
    assert q.shape == (B, n) and ds.shape == (B, n // 32, 2)
    assert np.all(np.isfinite(ds))
    q_ref, d_ref = quantize_ref(x)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(ds[..., 0], d_ref)
    assert np.abs(q).max() <= 127
    dcol = np.repeat(ds[..., 0], 32, axis=1)
    assert np.all(np.abs(x - q * dcol) <= (0.5 + 1e-4) * dcol)
    sums = q.reshape(B, n // 32, 32).sum(-1)
    np.testing.assert_allclose(ds[..., 1], ds[..., 0] * sums, rtol=1e-6, atol=0)
    assert np.all(q[0, 64:96] == 0) and ds[0, 2, 0] == 0.0


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", list(range(1, 9)))
@pytest.mark.parametrize("qt", DP4A_TYPES, ids=lambda q: q.name)
def test_matvec_dp4a(qt, B, big, rng):
    """dp4a variant, every type and B, odd row counts, NaN-poisoned output and workspace; the
    reference x is the int8 x read back from the kernel's own workspace."""
    n_rows = 261 if big else 37
    n_cols = _cols(qt, big)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((B, n_cols)).astype(np.float32)
    ws = cp.full(lab.matvec_workspace_bytes(B, n_cols), 0xFF, dtype=cp.uint8)
    out = nan_f32((B, n_rows))
    res = lab.matvec(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out, variant="dp4a", xq=ws)
    assert res is out
    q_d, ds_d = lab.quantize_x(CTX, cp.asarray(x))  # the same quantization, read back
    q, d = cp.asnumpy(q_d), cp.asnumpy(ds_d)[..., 0]
    check_dp4a(out, x, ref_w, q, d)
    # the workspace holds exactly that quantization, and the shared scratch gives the same bits
    np.testing.assert_array_equal(cp.asnumpy(ws[:B * n_cols]).view(np.int8).reshape(B, n_cols), q)
    out2 = nan_f32((B, n_rows))
    lab.matvec(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out2, variant="dp4a")
    np.testing.assert_array_equal(cp.asnumpy(out2), cp.asnumpy(out))



@pytest.mark.parametrize("nw,u", [(2, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda q: q.name)
def test_matvec_i16_rows_per_cta(qt, nw, u, rng):
    """The i16 matvec at every rows-per-CTA of the sweep (8 rows: 64 accumulators at B = 8, more
    than a 2-warp CTA has threads for the final reduction), 203 rows (a partial last CTA): the
    rows per CTA decide only which CTA reads a row, never the order of its additions (the lanes'
    pieces follow warps and pieces per trip), so every NR gives the same bits; so does i16s (x
    from a shared-memory stage, each CTA several row groups in turn)."""
    n_rows, n_cols = 203, _cols(qt, True)
    raw = cp.asarray(random_weights(qt, n_rows, n_cols, rng))
    ref_w = reference_matrix(qt, cp.asnumpy(raw), n_rows, n_cols)
    for B in (1, 3, 8):
        x = rng.standard_normal((B, n_cols)).astype(np.float32)
        outs = []
        for nr in tuning.MV_ROWS_PER_CTA:
            out = nan_f32((B, n_rows))
            lab.matvec(CTX, W(raw, qt, n_rows, n_cols), cp.asarray(x), out=out, config=(nr, nw, u), variant="i16")
            outs.append(cp.asnumpy(out))
        assert relerr(outs[0], x.astype(np.float64) @ ref_w.T) < 1e-4, B
        for nr, o in zip(tuning.MV_ROWS_PER_CTA[1:], outs[1:]):
            np.testing.assert_array_equal(o, outs[0], err_msg=f"B={B} rows per CTA {nr}")
        for nr in tuning.MV_ROWS_PER_CTA:  # x staged in shared memory, CTAs looping over row groups
            out = nan_f32((B, n_rows))
            lab.matvec(CTX, W(raw, qt, n_rows, n_cols), cp.asarray(x), out=out, config=(nr, nw, u), variant="i16s")
            np.testing.assert_array_equal(cp.asnumpy(out), outs[0], err_msg=f"i16s B={B} rows per CTA {nr}")
    with pytest.raises(ValueError, match="rows per CTA"):
        lab.matvec(CTX, W(raw, qt, n_rows, n_cols), cp.asarray(x), config=(3, nw, u), variant="i16")


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_matvec_i16s_loops_over_row_groups(qt, rng):
    """More row groups than the device holds CTAs (5003 rows, one or eight a CTA): each i16s CTA
    computes several groups in turn, and every row comes out as the one-group-a-CTA i16 makes it;
    a stage too large for one CTA is an error that names i16."""
    n_rows, n_cols = 5003, 4096
    raw = cp.asarray(random_weights(qt, n_rows, n_cols, rng))
    for B in (1, 8):
        x = cp.asarray(rng.standard_normal((B, n_cols)).astype(np.float32))
        for nr, nw, u in ((1, 8, 1), (8, 4, 2)):
            ref = lab.matvec(CTX, W(raw, qt, n_rows, n_cols), x, config=(nr, nw, u), variant="i16")
            out = nan_f32((B, n_rows))
            lab.matvec(CTX, W(raw, qt, n_rows, n_cols), x, out=out, config=(nr, nw, u), variant="i16s")
            np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(ref), err_msg=f"B={B} {(nr, nw, u)}")
    wide = 65536  # 8 rows of x: 1.3 MB of stage
    with pytest.raises(ValueError, match="use i16"):
        lab.matvec(CTX, W(cp.asarray(random_weights(qt, 8, wide, rng))), qt, 8, wide,
                 cp.zeros((8, wide), cp.float32), variant="i16s")


@pytest.mark.parametrize("config", [(nr, nw, u) for nr in (1, 2, 4) for nw, u in ((4, 1), (8, 2), (4, 2))] + [(8, 2, 1)])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda q: q.name)
def test_matvec_dp4a_configs(qt, config, rng):
    """Every dp4a launch configuration the benchmark may pick gives the same product."""
    n_rows, n_cols = 203, _cols(qt, True)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    for B in (1, 3, 8):
        x = rng.standard_normal((B, n_cols)).astype(np.float32)
        out = nan_f32((B, n_rows))
        lab.matvec(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out, config=config, variant="dp4a")
        check_dp4a(out, x, ref_w)


def test_matvec_lab_i16_is_productions_and_errors(rng):
    """The lab's i16 variant at the device's launch is production's matvec, bit for bit, at every
    batch size (a row's products do not depend on the batch); the lab refuses what it lacks."""
    qt, n_rows, n_cols = QT.Q4_K, 33, 512
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    x = cp.asarray(rng.standard_normal((2, n_cols)).astype(np.float32))
    a = MV.matvec(CTX, w, x)
    b = lab.matvec(CTX, w, x, variant="i16")
    np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))
    a1 = MV.matvec(CTX, w, x[:1])
    np.testing.assert_array_equal(cp.asnumpy(a1), cp.asnumpy(a[:1]))
    with pytest.raises(ValueError):
        lab.matvec(CTX, w, x, variant="dp4a", xq=cp.empty(lab.matvec_workspace_bytes(2, n_cols) - 1, cp.uint8))
    with pytest.raises(ValueError):
        lab.matvec(CTX, W(random_weights(QT.F16, 4, 64, rng), QT.F16, 4, 64), x[:, :64].copy(), variant="dp4a")
    with pytest.raises(ValueError):
        lab.matvec(CTX, w, x, variant="nope")


@pytest.mark.parametrize("explicit_ws", [False, True], ids=["scratch", "xq"])
def test_matvec_dp4a_graph_capture(explicit_ws, rng):
    """dp4a matvecs (quantize + product) captured in a CUDA graph replay for new x, bit-identical
    to eager calls; with the shared scratch the eager call before capture makes the workspace."""
    B = 3
    mats = [(QT.Q4_K, 300, 1024), (QT.Q6_K, 129, 1024), (QT.Q8_0, 77, 4096), (QT.Q4_K, 64, 4096)]
    raws = [cp.asarray(random_weights(qt, r, c, rng)) for qt, r, c in mats]
    xs = {c: cp.empty((B, c), cp.float32) for _, _, c in mats}
    outs = [cp.empty((B, r), cp.float32) for _, r, _ in mats]
    wss = {c: lab.matvec_workspace(B, c) for _, _, c in mats} if explicit_ws else {}
    s = cp.cuda.Stream(non_blocking=True)

    def step(dst):
        for (qt, r, c), raw, o in zip(mats, raws, dst):
            lab.matvec(CTX, W(raw, qt, r, c), xs[c], out=o, stream=s, variant="dp4a", xq=wss.get(c))

    for c, xa in xs.items():
        xa[...] = cp.asarray(rng.standard_normal((B, c)).astype(np.float32))
    cp.cuda.Device().synchronize()
    step([cp.empty_like(o) for o in outs])  # eager first: compiles, makes the scratch
    s.synchronize()
    with s:
        s.begin_capture()
        try:
            step(outs)
        finally:
            graph = s.end_capture()
    for _ in range(3):
        for c, xa in xs.items():
            xa.set(rng.standard_normal((B, c)).astype(np.float32), stream=s)
        for o in outs:
            o.fill(cp.nan)
        graph.launch(stream=s)
        s.synchronize()
        eager = [nan_f32(o.shape) for o in outs]
        step(eager)
        s.synchronize()
        for (qt, r, c), raw, o, e in zip(mats, raws, outs, eager):
            np.testing.assert_array_equal(cp.asnumpy(o), cp.asnumpy(e), err_msg=qt.name)
            check_dp4a(o, cp.asnumpy(xs[c]), reference_matrix(qt, cp.asnumpy(raw), r, c))


def test_matvec_dp4a_capture_without_workspace_is_an_error(rng):
    """A dp4a matvec whose shared workspace does not exist yet refuses to allocate inside a capture."""
    B, n_cols = 7, 32 * 41  # a size no other test uses
    raw = cp.asarray(random_weights(QT.Q8_0, 5, n_cols, rng))
    x = cp.asarray(rng.standard_normal((B, n_cols)).astype(np.float32))
    out = cp.empty((B, 5), cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    lab.quantize_x(CTX, x)  # compile outside the capture
    lab.matvec(CTX, W(raw, QT.Q8_0, 5, n_cols), x, out=out, variant="dp4a", xq=lab.matvec_workspace(B, n_cols))
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="workspace"):
                lab.matvec(CTX, W(raw, QT.Q8_0, 5, n_cols), x, out=out, stream=s, variant="dp4a")
        finally:
            s.end_capture()



# ------------------------------------------------------------------------------ tensor-core matmul variants
MM_TYPES = [QT.F16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", [1, 2, 7, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("qt,staged", [(q, True) for q in MM_TYPES] + [(q, False) for q in (QT.Q4_K, QT.Q5_K, QT.Q6_K)],
                         ids=lambda v: v.name if isinstance(v, QT) else ("default" if v else "direct"))
def test_mm(qt, staged, B, big, rng):
    """The tensor-core matmul to f32 accuracy at every tile count (B up to 64 rows of x), row
    counts that are no multiple of a CTA's rows, and rows long enough for split-K (big); the
    K-quants both through the shared-memory stage (the default) and read directly."""
    n_rows = 300 if big else 37
    n_cols = _cols(qt, big) if qt != QT.F16 else (4096 if big else 64)
    assert mm_cut(quant_type(qt), n_cols) is not None
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((B, n_cols)).astype(np.float32)
    out = nan_f32((B, n_rows))
    assert lab.mm(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out, staged=staged) is out
    ref = x.astype(np.float64) @ ref_w.T
    assert relerr(out, ref) < 1e-5


def test_mm_split_k_deterministic_and_graph_replay(rng):
    """The staged f16 matmul of Q4_K with split-K: bit-identical calls, a graph that replays as
    eager calls compute (production's check, tests/gpu)."""
    check_split_k(lambda w, x, **kw: lab.mm(CTX, w, x, **kw), "mm", QT.Q4_K, rng)


def test_gemm_takes_mm_and_matches_matvec(rng):
    """With exact activations gemm from mm_from_rows rows on takes the tensor-core matmul for the
    types mmq does not decode; its rows equal the f32 matvec's of the same x to f32 rounding (no
    batch size moves a result beyond the last bits)."""
    qt, n_rows, n_cols = QT.Q8_0, 200, 2048
    assert qt not in MM.MMQ_TYPES
    raw = cp.asarray(random_weights(qt, n_rows, n_cols, rng))
    x = cp.asarray(rng.standard_normal((40, n_cols)).astype(np.float32))
    batched = cp.asnumpy(G.gemm(CTX, W(raw, qt, n_rows, n_cols), x))
    alone = np.stack([cp.asnumpy(lab.matvec(CTX, W(raw, qt, n_rows, n_cols), x[i], variant="f32")) for i in range(40)])
    scale = np.abs(alone).max()
    assert np.abs(batched - alone).max() <= 1e-5 * scale


MMQ_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.mark.parametrize("mt", lab.MMQ_TILES_PER_WARP)
@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", [1, 2, 7, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("qt", MMQ_TYPES, ids=lambda q: q.name)
def test_mmq(qt, B, big, mt, rng):
    """The int8 tensor-core matmul at every tile count, one or two 16-row tiles per warp, row
    counts that are no multiple of a tile, rows long enough for split-K (big): within the
    two-plane rounding bound of the exact product, and equal to the i16 matvec of the same x up
    to f32 rounding (same activations)."""
    n_rows = 300 if big else 37
    n_cols = 4096 if big else 256
    assert MM.mmq_supported(qt, n_cols)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((B, n_cols)).astype(np.float32)
    x[:, ::97] *= 30.0
    out = nan_f32((B, n_rows))
    wr, wk, ks = tuning.DEFAULT.mmq_launch(B, n_rows, n_cols // 32)
    assert lab.mmq(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out, config=(wr, wk, ks, mt)) is out
    check_i16(out, x, ref_w)
    i16 = np.concatenate([cp.asnumpy(lab.matvec(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x[i:i + 8]),
                                              variant="i16")) for i in range(0, B, 8)])
    assert np.abs(cp.asnumpy(out) - i16).max() <= 4e-6 * np.abs(i16).max()


@pytest.mark.parametrize("T", [3, 20, 37, 64])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda q: q.name)
def test_gemm_int8_activations(qt, T, rng):
    """gemm with int8 activations (lab.gemm_dp4a): the dp4a matvec in 8-row chunks up to 64 rows
    (beyond, and for the float types, it is production's gemm: tests/gpu)."""
    w, x, ref_w = gemm_case(qt, T, rng)
    out = nan_f32((T, w.n_rows))
    lab.gemm_dp4a(CTX, w, cp.asarray(x), out=out)
    check_dp4a(out, x, ref_w)


@pytest.mark.parametrize("tile", lab.MMQ_ROWS_TILES)
@pytest.mark.parametrize("n_rows,n_cols", [(64, 4096), (1040, 512)])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_mmq_rows_is_mmq_bits(qt, n_rows, n_cols, tile, rng):
    """mmq_rows_kernel at one and two rows gives each row's bits of mmq_kernel (production mm.mmq)
    in a 1-, 2-, 3- and 8-row pass: with split-K chains (64 rows of 4096: WK 8, KS 2) and with a
    row count that ends inside a tile (1040 rows of 512: WK 2)."""
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    x = cp.asarray(rng.standard_normal((8, n_cols)).astype(np.float32))
    wide = cp.asnumpy(MM.mmq(CTX, w, x))  # [8, n_rows]
    np.testing.assert_array_equal(cp.asnumpy(MM.mmq(CTX, w, x[:3])), wide[:3])
    for T in range(1, lab.MMQ_ROWS_MAX_B + 1):
        for i in range(0, 8 - T + 1, T):
            np.testing.assert_array_equal(cp.asnumpy(MM.mmq(CTX, w, x[i:i + T])), wide[i:i + T])
            np.testing.assert_array_equal(cp.asnumpy(lab.mmq_rows(CTX, w, x[i:i + T], tile=tile)), wide[i:i + T],
                                          err_msg=f"{qt.name} [{n_rows}, {n_cols}] tile {tile} rows {i}..{i + T - 1}")


# ------------------------------------------------------------------------------ mvq2_rows
@pytest.mark.parametrize("nw", [4, 2, 8])
@pytest.mark.parametrize("n_rows,n_cols", [(203, 4096), (64, 14336), (1040, 512)])
@pytest.mark.parametrize("qt", [q for q in ALL_TYPES if quant_type(q).dp4a], ids=lambda q: q.name)
def test_mvq2_rows_is_the_i16_matvecs_bits_at_any_rows(qt, n_rows, n_cols, nw, rng):
    """Production's matvec_rows (mvq2_rows_kernel) gives each row of x the bits of the i16 matvec
    at ``nw`` warps a CTA (whatever its rows per CTA and pieces per trip), at 1-8 rows, and the
    same bits for a row in a pass of 1, 9, 64 or 300 rows, at both tile counts: the batch-invariant
    mode's product past 8 rows; and the lab's K split of it (rows_split.cu) the same. The K-quants at 4096 columns
    and 4 warps: one piece a lane; 14336: three or four; 512: most lanes none. The 32-column blocks: a piece a block
    (Q8_0: two), up to 7 a lane."""
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    x = cp.asarray(rng.standard_normal((300, n_cols)).astype(np.float32))
    alone = np.stack([cp.asnumpy(lab.matvec(CTX, w, x[i:i + 1], variant="i16", config=(2, nw, 1)))[0]
                      for i in range(300)])  # [300, n_rows]: each row by production's matvec, alone
    for B in (1, 3, 8):
        for config in ((2, nw, 1), (8, nw, 2)):
            np.testing.assert_array_equal(cp.asnumpy(lab.matvec(CTX, w, x[:B], variant="i16", config=config)),
                                          alone[:B], err_msg=f"production's matvec at {config}, B={B}")
    launchers = {f"nt={nt}": (lambda xs, nt=nt, **kw: MV.matvec_rows(CTX, w, xs, nw=nw, nt=nt, **kw))
                 for nt in tuning.ROWS_TILES}
    launchers["split"] = lambda xs, **kw: lab.matvec_rows_split(CTX, w, xs, nw=nw, **kw)  # the lab's K split
    for name, launch in launchers.items():
        for B in (1, 3, 8, 9, 64, 300):
            np.testing.assert_array_equal(cp.asnumpy(launch(x[:B])), alone[:B],
                                          err_msg=f"{qt.name} [{n_rows}, {n_cols}] nw={nw} {name} B={B}")
        # a layer's residual add, fused as the matvec fuses it
        base = cp.asarray(rng.standard_normal((9, n_rows)).astype(np.float32))
        acc = base.copy()
        launch(x[:9], out=acc, accumulate=True)
        np.testing.assert_array_equal(cp.asnumpy(acc), cp.asnumpy(base) + alone[:9], err_msg=f"{name} accumulate")
