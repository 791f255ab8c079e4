"""The CUDA kernel library against float64 numpy references (run on the GPU machine).

Every test draws fresh random inputs, pre-fills outputs with NaN so an unwritten element fails,
and compares with the relative error ||out - ref|| / ||ref||; a NaN or inf never passes.
Tolerances: 1e-5 for f32 arithmetic (the f32 matvec, the tensor-core matmul (exact integer
weights times x split into two f16 halves), rmsnorm, rope, attention against the f16 values the
cache holds, swiglu, get_rows); the i16 products (the i16 matvec, mmq) by the two-plane rounding
bound (``check_i16``); 1e-3 for results rounded to f16 once (dequantize_f16: f16 has an 11-bit
significand, so each element is off by <= 2^-11 relative); 2e-3 for the f16 cuBLAS GEMM path
(both operands rounded to f16).
Quantized weights are random valid GGUF blocks (random bytes, finite f16 scales), referenced by
gguf-py's own dequantize. Every call runs in one standalone KernelContext (``CTX``: default
KernelOptions, scratch made on first use). The KV kernels take pages (``KvPages.from_dense`` of
dense caches, every page at a random place of the pool, row s holding what slot s of the dense
cache held) and are checked against references over the dense caches. The kernel variants
production does not launch are tested in dev/cuda/test_lab_kernels.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from ntx.daemons.compute.batch import SeqChunk  # noqa: E402
from ntx.daemons.compute.cuda import attention as A  # noqa: E402
from ntx.daemons.compute.cuda import dequant as DQ  # noqa: E402
from ntx.daemons.compute.cuda import gemm as G  # noqa: E402
from ntx.daemons.compute.cuda import matvec as MV  # noqa: E402
from ntx.daemons.compute.cuda import mm as MM  # noqa: E402
from ntx.daemons.compute.cuda import norm_rope_kv as N  # noqa: E402
from ntx.daemons.compute.cuda import memory, runtime, tuning  # noqa: E402
from ntx.daemons.compute.cuda import selection as S  # noqa: E402
from ntx.daemons.compute.cuda.kv_pages import KvPages  # noqa: E402
from ntx.shared.kv_sizing import pages_for_positions  # noqa: E402
from ntx.shared.quant_types import quant_type, row_nbytes  # noqa: E402

pytestmark = pytest.mark.gpu

QT = GGMLQuantizationType
CTX = runtime.standalone()
ALL_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
# byte offsets of the f16 scale fields in one block
F16_FIELDS = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
              QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


@pytest.fixture
def rng(request):
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)


def random_weights(qt: QT, n_rows: int, n_cols: int, rng) -> np.ndarray:
    """Random valid GGUF bytes of a [n_rows, n_cols] tensor of type qt (uint8, flat)."""
    if qt == QT.F32:
        return rng.standard_normal((n_rows, n_cols)).astype(np.float32).reshape(-1).view(np.uint8)
    if qt == QT.F16:
        return (rng.standard_normal((n_rows, n_cols)) * 0.5).astype(np.float16).reshape(-1).view(np.uint8)
    if qt == QT.BF16:
        f = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).reshape(-1).view(np.uint8)
    bs, ts = GGML_QUANT_SIZES[QT(int(qt))]
    nb = n_rows * (n_cols // bs)
    blocks = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    for off in F16_FIELDS[qt]:
        sign = rng.choice([-1.0, 1.0], size=nb)
        scale = (rng.uniform(0.002, 0.05, size=nb) * sign).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(-1)


def W(raw, qt: QT, n_rows: int, n_cols: int):
    """The Weight of GGUF bytes ``raw`` (host or device) of [n_rows, n_cols] of type qt."""
    return G.weight(raw if isinstance(raw, cp.ndarray) else cp.asarray(raw), qt, n_rows, n_cols)


def reference_matrix(qt: QT, raw: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    rb = row_nbytes(qt, n_cols)
    w = gguf_dequantize(raw.reshape(n_rows, rb), QT(int(qt)))
    w = np.asarray(w, dtype=np.float64).reshape(n_rows, n_cols)
    assert np.all(np.isfinite(w))
    return w


def relerr(out, ref) -> float:
    out = cp.asnumpy(out) if isinstance(out, cp.ndarray) else np.asarray(out)
    out = out.astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), f"{np.count_nonzero(~np.isfinite(out))} non-finite outputs"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def nan_f32(shape):
    return cp.full(shape, cp.nan, dtype=cp.float32)


def test_device_is_there():
    props = cp.cuda.runtime.getDeviceProperties(0)
    print("device:", props["name"], "cc", props["major"], props["minor"])
    assert props["major"] >= 7


# ------------------------------------------------------------------------------ matvec
def _cols(qt: QT, big: bool) -> int:
    bs = GGML_QUANT_SIZES[QT(int(qt))][0]
    if bs == 256:
        return 10240 if big else 768        # 40 / 3 super-blocks per row
    if bs == 32:
        return 4096 if big else 160         # 128 / 5 blocks per row
    return 4104 if big else 40              # float types: multiples of 8


FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]  # the f32 matvec's types; the others take the i16 product


def check_f32_matvec(qt: QT, B: int, big: bool, rng, matvec) -> None:
    """``matvec(weight, x, out)`` of a [37 or 261, n] matrix of qt (row counts no multiple of any
    rows-per-CTA) writes out and matches the float64 product to 1e-5 (f32 arithmetic)."""
    n_rows = 261 if big else 37
    n_cols = _cols(qt, big)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((B, n_cols)).astype(np.float32)
    out = nan_f32((B, n_rows))
    assert matvec(W(raw, qt, n_rows, n_cols), cp.asarray(x), out) is out
    assert relerr(out, x.astype(np.float64) @ ref_w.T) < 1e-5


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", [1, 2, 4, 8])
@pytest.mark.parametrize("qt", FLOAT_TYPES, ids=lambda q: q.name)
def test_matvec(qt, B, big, rng):
    check_f32_matvec(qt, B, big, rng, lambda w, x, out: MV.matvec(CTX, w, x, out=out))


def unaligned_weight(qt: QT, rng):
    """(weight, x [2, n_cols], the exact matrix) of a [19, n_cols] tensor of qt that starts at an
    odd multiple of 2 bytes (34) into its buffer."""
    n_rows, n_cols = 19, _cols(qt, False)
    raw = random_weights(qt, n_rows, n_cols, rng)
    buf = cp.zeros(raw.size + 64, dtype=cp.uint8)
    buf[34:34 + raw.size] = cp.asarray(raw)
    x = rng.standard_normal((2, n_cols)).astype(np.float32)
    return W(buf[34:34 + raw.size], qt, n_rows, n_cols), x, reference_matrix(qt, raw, n_rows, n_cols)


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q6_K], ids=lambda q: q.name)
def test_matvec_unaligned_base(qt, rng):
    """2-byte-aligned types read correctly from a tensor that starts at an odd offset of 2."""
    w, x, ref_w = unaligned_weight(qt, rng)
    out = nan_f32((2, w.n_rows))
    MV.matvec(CTX, w, cp.asarray(x), out=out)
    check_i16(out, x, ref_w)


def test_matvec_1d_and_stream(rng):
    qt, n_rows, n_cols = QT.Q4_K, 100, 512
    raw = random_weights(qt, n_rows, n_cols, rng)
    x = rng.standard_normal(n_cols).astype(np.float32)
    s = cp.cuda.Stream(non_blocking=True)
    out = nan_f32((n_rows,))
    cp.cuda.Device().synchronize()  # inputs were written on the legacy stream
    MV.matvec(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out, stream=s)
    s.synchronize()
    check_i16(out.reshape(1, -1), x.reshape(1, -1), reference_matrix(qt, raw, n_rows, n_cols))
    f16 = random_weights(QT.F16, n_rows, n_cols, rng)
    out2 = nan_f32((n_rows,))
    MV.matvec(CTX, W(f16, QT.F16, n_rows, n_cols), cp.asarray(x), out=out2, stream=s)
    s.synchronize()
    assert relerr(out2, reference_matrix(QT.F16, f16, n_rows, n_cols) @ x.astype(np.float64)) < 1e-5


DP4A_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", [1, 2, 5, 8])
@pytest.mark.parametrize("qt", DP4A_TYPES, ids=lambda q: q.name)
def test_matvec_i16(qt, B, big, rng):
    """i16 variant (x as two int8 planes): each x element within max|x_group| / 64516 of its own,
    so every output within that bound of the exact product, and ~2e-5 relative in norm;
    Gaussian rows with a few large outliers (the groups' max sets the step)."""
    n_rows = 261 if big else 37
    n_cols = _cols(qt, big)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((B, n_cols)).astype(np.float32)
    x[:, ::97] *= 30.0
    out = nan_f32((B, n_rows))
    assert MV.matvec(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(x), out=out) is out
    check_i16(out, x, ref_w)


def check_i16(out, x, ref_w):
    """Every output within the two-plane rounding bound of the exact product (each x element
    within max|x_group| / 64516 of its own), and ~2e-5 relative in norm (under 2e-4: rows with
    a x30 outlier per 97 columns, the group's max sets the step, reached 1.01e-4 on a 37-row Q4_1
    matrix)."""
    B, n_cols = x.shape
    exact = x.astype(np.float64) @ ref_w.T
    amax = np.abs(x.astype(np.float64)).reshape(B, n_cols // 32, 32).max(axis=2)
    step = np.repeat(amax / 64516.0, 32, axis=1)  # [B, n_cols]: d2 / 2
    bound = (1.0 + 1e-3) * step @ np.abs(ref_w).T
    slack = 1e-6 * np.linalg.norm(exact) / np.sqrt(exact.size)
    over = np.abs(cp.asnumpy(out) - exact) - bound - slack
    assert np.all(over <= 0), f"{np.count_nonzero(over > 0)} outputs beyond the two-plane rounding bound"
    assert relerr(out, exact) < 2e-4


def test_matvec_capture_without_workspace_is_an_error(rng):
    """A matvec whose scratch (the i16 planes of its x) does not exist yet on the capturing
    stream refuses to allocate inside a capture."""
    B, n_cols = 7, 32 * 41  # a size no other test uses
    w = W(random_weights(QT.Q8_0, 5, n_cols, rng), QT.Q8_0, 5, n_cols)
    x = cp.asarray(rng.standard_normal((B, n_cols)).astype(np.float32))
    out = cp.empty((B, 5), cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    MV.matvec(CTX, w, x, out=out)  # compile outside the capture (the default stream's scratch)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="workspace"):
                MV.matvec(CTX, w, x, out=out, stream=s)
        finally:
            s.end_capture()


# ------------------------------------------------------------------------------ tensor-core matmul
MM_TYPES = [QT.F16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]  # the f16 matmul's; the K-quants take mmq


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", [1, 2, 7, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("qt", MM_TYPES, ids=lambda q: q.name)
def test_mm(qt, B, big, rng):
    """The tensor-core matmul to f32 accuracy at every tile count (B up to 64 rows of x), row
    counts that are no multiple of a CTA's rows, and rows long enough for split-K (big)."""
    n_rows = 300 if big else 37
    n_cols = _cols(qt, big) if qt != QT.F16 else (4096 if big else 64)
    assert MM.mm_supported(qt, n_cols)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((B, n_cols)).astype(np.float32)
    out = nan_f32((B, n_rows))
    assert MM.mm(CTX, W(raw, qt, n_rows, n_cols), cp.asarray(x), out=out) is out
    ref = x.astype(np.float64) @ ref_w.T
    assert relerr(out, ref) < 1e-5


def test_mm_odd_q8_0_blocks_and_unsupported(rng):
    """Q8_0 rows of an odd number of blocks take the v1 decoder; types mm does not decode say so."""
    n_cols = 32 * 41
    raw = random_weights(QT.Q8_0, 50, n_cols, rng)
    x = rng.standard_normal((5, n_cols)).astype(np.float32)
    out = MM.mm(CTX, W(raw, QT.Q8_0, 50, n_cols), cp.asarray(x))
    assert relerr(out, x.astype(np.float64) @ reference_matrix(QT.Q8_0, raw, 50, n_cols).T) < 1e-5
    assert not MM.mm_supported(QT.BF16, 4096) and not MM.mm_supported(QT.F16, 40)
    assert not MM.mm_supported(QT.Q4_K, 4096)  # the K-quants take mmq
    with pytest.raises(ValueError, match="does not decode BF16"):
        MM.mm(CTX, W(cp.zeros(2 * 8 * 64, cp.uint8), QT.BF16, 8, 64), cp.zeros((2, 64), cp.float32))
    with pytest.raises(ValueError, match="1..64 rows"):
        MM.mm(CTX, W(raw, QT.Q8_0, 50, n_cols), cp.zeros((65, n_cols), cp.float32))


def check_split_k(mul, kind: str, qt: QT, rng) -> None:
    """``mul(weight, x, out=None, stream=)`` (a matmul of ``kind``) of 24 rows by a [96, 16384]
    matrix of qt, a shape that splits K: repeated calls are bit-identical, and a captured graph
    of it replays for new x exactly as eager calls compute."""
    B, n_rows, n_cols = 24, 96, 16384
    launch = tuning.DEFAULT.mm_launch if kind == "mm" else tuning.DEFAULT.mmq_launch
    assert launch(B, n_rows, n_cols // 32)[2] > 1  # split-K at this shape
    raw = cp.asarray(random_weights(qt, n_rows, n_cols, rng))
    w = W(raw, qt, n_rows, n_cols)
    x = cp.asarray(rng.standard_normal((B, n_cols)).astype(np.float32))
    out = cp.empty((B, n_rows), cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    first = cp.asnumpy(mul(w, x, stream=s))
    for _ in range(3):
        np.testing.assert_array_equal(cp.asnumpy(mul(w, x, stream=s)), first)
    ref = cp.asnumpy(x).astype(np.float64) @ reference_matrix(qt, cp.asnumpy(raw), n_rows, n_cols).T
    assert relerr(first, ref) < (1e-5 if kind == "mm" else 1e-4)
    s.synchronize()
    with s:
        s.begin_capture()
        try:
            mul(w, x, out=out, stream=s)
        finally:
            graph = s.end_capture()
    for _ in range(2):
        x.set(rng.standard_normal((B, n_cols)).astype(np.float32), stream=s)
        out.fill(cp.nan)
        graph.launch(stream=s)
        eager = mul(w, x, stream=s)
        s.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(eager))


@pytest.mark.parametrize("kind,qt", [("mm", QT.Q8_0), ("mmq", QT.Q4_K)])
def test_mm_split_k_deterministic_and_graph_replay(kind, qt, rng):
    """With split-K (several CTAs per row tile, the last one adding the partial sums in order)
    repeated calls are bit-identical, and a captured graph of them replays for new x exactly as
    eager calls compute."""
    check_split_k(lambda w, x, **kw: getattr(MM, kind)(CTX, w, x, **kw), kind, qt, rng)


def test_gemm_takes_mm_and_matches_matvec(rng):
    """gemm from mm_min_rows rows on takes the tensor-core matmul for the types mmq does not
    decode; its rows equal the f32 matvec's of the same x to f32 rounding (F16: the f32 matvec is
    its product below mm's rows, so no batch size moves a result beyond the last bits)."""
    qt, n_rows, n_cols = QT.F16, 200, 2048
    assert qt not in MM.MMQ_TYPES and 40 >= runtime.tuning().mm_min_rows
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    x = cp.asarray(rng.standard_normal((40, n_cols)).astype(np.float32))
    batched = cp.asnumpy(G.gemm(CTX, w, x))
    alone = np.stack([cp.asnumpy(MV.matvec(CTX, w, x[i])) for i in range(40)])
    scale = np.abs(alone).max()
    assert np.abs(batched - alone).max() <= 1e-5 * scale


MMQ_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("B", [1, 2, 7, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("qt", MMQ_TYPES, ids=lambda q: q.name)
def test_mmq(qt, B, big, rng):
    """The int8 tensor-core matmul at every tile count, row counts that are no multiple of a
    tile, rows long enough for split-K (big): within the two-plane rounding bound of the exact
    product, and equal to the i16 matvec of the same x up to f32 rounding (same activations)."""
    n_rows = 300 if big else 37
    n_cols = 4096 if big else 256
    assert MM.mmq_supported(qt, n_cols)
    raw = random_weights(qt, n_rows, n_cols, rng)
    w = W(raw, qt, n_rows, n_cols)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((B, n_cols)).astype(np.float32)
    x[:, ::97] *= 30.0
    out = nan_f32((B, n_rows))
    assert MM.mmq(CTX, w, cp.asarray(x), out=out) is out
    check_i16(out, x, ref_w)
    i16 = np.concatenate([cp.asnumpy(MV.matvec(CTX, w, cp.asarray(x[i:i + 8]))) for i in range(0, B, 8)])
    assert np.abs(cp.asnumpy(out) - i16).max() <= 4e-6 * np.abs(i16).max()


def _table_ctx(**changes):
    """A context whose launch table is the device's with ``changes`` (this context alone)."""
    from dataclasses import replace

    table = replace(CTX.tuning(), **changes)
    ctx = runtime.standalone()
    ctx.tuning = lambda: table
    return ctx


@pytest.mark.parametrize("n_rows,n_cols,min_ctas,ks", [(300, 4096, 1, 1), (1037, 512, 1, 1), (300, 16384, 5, 2)])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K], ids=lambda q: q.name)
def test_mmqx_x_staged_once_per_cta(qt, n_rows, n_cols, min_ctas, ks, rng):
    """mmqx_kernel (x staged once per CTA; tuning.mmqx_launch), taken here by every matrix
    (mmqx_min_ctas 1), and with K split in two where its CTAs are half of mmqx_min_ctas (the
    70B's down's rule, here 3 CTAs of 64 block columns against 5): within the two-plane rounding
    bound of the exact product and within f32 rounding of mmq_kernel at every tile count; and a
    row's bits are the same alone and among 2 to 64 rows (its order depends on the matrix's
    shape only: the batch-invariant mode's mmq/mm form relies on it). 1037 rows: a CTA's last
    warps past the matrix's end."""
    ctx = _table_ctx(mmqx_min_ctas=min_ctas)
    assert {ctx.tuning().mmqx_launch(qt, B, n_rows, n_cols // 256)[2] for B in range(1, 65)} == {ks}
    raw = random_weights(qt, n_rows, n_cols, rng)
    w = W(raw, qt, n_rows, n_cols)
    ref_w = reference_matrix(qt, raw, n_rows, n_cols)
    x = rng.standard_normal((64, n_cols)).astype(np.float32)
    x[:, ::97] *= 30.0
    xd = cp.asarray(x)
    plain = _table_ctx(mmqx_min_ctas=0)
    alone = np.stack([cp.asnumpy(MM.mmq(ctx, w, xd[i:i + 1]))[0] for i in range(64)])
    for B in (1, 2, 8, 9, 17, 33, 64):
        out = nan_f32((B, n_rows))
        assert MM.mmq(ctx, w, xd[:B], out=out) is out
        got = cp.asnumpy(out)
        np.testing.assert_array_equal(got, alone[:B], err_msg=f"mmqx {qt.name} B={B}: a row differs from itself alone")
        check_i16(out, x[:B], ref_w)
        want = cp.asnumpy(MM.mmq(plain, w, xd[:B]))
        assert np.abs(got - want).max() <= 4e-6 * np.abs(want).max(), B


def test_mmq_unsupported_and_gemm_routing(rng):
    """mmq names what it does not decode; gemm takes it for the K-quants from mmq_min_rows rows
    on (the i16 matvec below), matching the i16 matvec row by row."""
    assert not MM.mmq_supported(QT.Q8_0, 4096) and not MM.mmq_supported(QT.Q4_K, 128 * 3)
    with pytest.raises(ValueError, match="does not decode Q8_0"):
        MM.mmq(CTX, W(cp.zeros(34 * 8 * 2, cp.uint8), QT.Q8_0, 8, 64), cp.zeros((2, 64), cp.float32))
    qt, n_rows, n_cols = QT.Q4_K, 200, 2048
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    with pytest.raises(ValueError, match="1..64 rows"):
        MM.mmq(CTX, w, cp.zeros((65, n_cols), cp.float32))
    x = cp.asarray(rng.standard_normal((40, n_cols)).astype(np.float32))
    assert runtime.tuning().mmq_min_rows <= 40 and G.path(CTX, w, 40) == "mmq" and G.path(CTX, w, 1) == "i16"
    batched = cp.asnumpy(G.gemm(CTX, w, x))
    np.testing.assert_array_equal(batched, cp.asnumpy(MM.mmq(CTX, w, x)))
    alone = np.stack([cp.asnumpy(MV.matvec(CTX, w, x[i])) for i in range(40)])
    assert np.abs(batched - alone).max() <= 4e-6 * np.abs(alone).max()


# ------------------------------------------------------------------------------ dequantize / gemm / get_rows
@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
def test_dequantize_f16(qt, rng):
    n_rows, n_cols = 37, _cols(qt, False) * 2
    raw = random_weights(qt, n_rows, n_cols, rng)
    out = cp.full((n_rows, n_cols), cp.nan, dtype=cp.float16)
    DQ.dequantize_f16(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), out=out)
    ref = reference_matrix(qt, raw, n_rows, n_cols)
    tol = 0.0 if qt == QT.F16 else 1e-3
    assert relerr(out, ref) <= tol
    # element-wise: each value is the f16 rounding of the reference
    np.testing.assert_array_equal(cp.asnumpy(out), ref.astype(np.float32).astype(np.float16))


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
def test_get_rows(qt, rng):
    n_rows, n_cols = 50, _cols(qt, False)
    raw = random_weights(qt, n_rows, n_cols, rng)
    ids = np.array([3, 0, 49, 3, 17, 17, 8], dtype=np.int32)
    out = nan_f32((ids.size, n_cols))
    DQ.get_rows(CTX, W(cp.asarray(raw), qt, n_rows, n_cols), cp.asarray(ids), out=out)
    ref = reference_matrix(qt, raw, n_rows, n_cols)[ids]
    assert relerr(out, ref) < 1e-6


def gemm_case(qt: QT, T: int, rng):
    """(weight, x [T, n_cols], the exact matrix) of a random [300, n_cols] matrix of qt."""
    n_rows, n_cols = 300, _cols(qt, False) * 4
    raw = random_weights(qt, n_rows, n_cols, rng)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    return W(raw, qt, n_rows, n_cols), x, reference_matrix(qt, raw, n_rows, n_cols)


@pytest.mark.parametrize("T", [3, 20, 37, 64, 128])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.F16], ids=lambda q: q.name)
def test_gemm(qt, T, rng):
    """Every path: the tensor-core matmuls (mmq for the K-quants from mmq_min_rows, mm from
    mm_min_rows for the types it decodes), the matvec (i16 for the block-quantized types, f32
    for the float types) in chunks of 8 rows below them; beyond 64 rows dequantize-to-f16 +
    cuBLAS."""
    w, x, ref_w = gemm_case(qt, T, rng)
    n_cols = w.n_cols
    out = nan_f32((T, w.n_rows))
    G.gemm(CTX, w, cp.asarray(x), out=out)
    ref = x.astype(np.float64) @ ref_w.T
    via_mmq = MM.mmq_supported(qt, n_cols)  # i16 activations from its rows on, i16 below
    via_mm = not via_mmq and MM.mm_supported(qt, n_cols) and T >= runtime.tuning().mm_min_rows
    i16 = T <= MM.MAX_MM_ROWS and (via_mmq or not via_mm and quant_type(qt).dp4a)
    assert relerr(out, ref) < (1e-4 if i16 else 1e-5 if T <= MM.MAX_MM_ROWS else 2e-3)


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda q: q.name)
def test_gemm_dequant_in_row_chunks(qt, rng, monkeypatch):
    """Beyond 64 rows the cuBLAS path copies W to f16 a chunk of rows at a time
    (``memory.dequant_chunk_rows``, DEQUANT_W16_BYTES): made small here, 1000 rows go in pieces
    of 256 (the last 232), each written to its own rows of out. The same result as one whole
    copy within f32 rounding (cuBLAS picks its kernels by shape, so not always the same bits),
    and the exact product within the two f16 roundings."""
    n_rows, n_cols, T = 1000, 512, 100
    raw = random_weights(qt, n_rows, n_cols, rng)
    w = W(raw, qt, n_rows, n_cols)
    x = cp.asarray(rng.standard_normal((T, n_cols)).astype(np.float32))
    whole = G.gemm_dequant(CTX, w, x)
    monkeypatch.setattr(tuning, "DEQUANT_W16_BYTES", 256 * n_cols * 2)
    assert memory.dequant_chunk_rows(n_rows, n_cols) == 256
    out = nan_f32((T, n_rows))
    G.gemm_dequant(CTX, w, x, out=out)
    assert relerr(out, cp.asnumpy(whole)) < 1e-6
    ref = cp.asnumpy(x).astype(np.float64) @ reference_matrix(qt, raw, n_rows, n_cols).T
    assert relerr(out, ref) < 2e-3


# ------------------------------------------------------------------------------ layer ops
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("D", [1000, 4096, 8192])
def test_rmsnorm(D, fused, rng):
    T, eps = 5, 1e-5
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    out = nan_f32((T, D))
    if fused:
        res = rng.standard_normal((T, D)).astype(np.float32)
        res_d = cp.asarray(res)
        N.rmsnorm(CTX, cp.asarray(x), cp.asarray(w), eps, residual=res_d, out=out)
        h = x.astype(np.float64) + res
        assert relerr(res_d, h) < 1e-7
    else:
        N.rmsnorm(CTX, cp.asarray(x), cp.asarray(w), eps, out=out)
        h = x.astype(np.float64)
    ref = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + eps) * w
    assert relerr(out, ref) < 1e-5


def rope_ref(x, pos, rope_dim, base, ff):
    x = x.astype(np.float64).copy()
    i = np.arange(rope_dim // 2)
    inv = base ** (-2.0 * i / rope_dim)
    if ff is not None:
        inv = inv / ff.astype(np.float64)
    theta = pos.astype(np.float64)[:, None] * inv[None, :]  # [T, rope_dim/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0:rope_dim:2].copy(), x[..., 1:rope_dim:2].copy()
    x[..., 0:rope_dim:2] = x0 * c - x1 * s
    x[..., 1:rope_dim:2] = x0 * s + x1 * c
    return x


@pytest.mark.parametrize("with_ff", [False, True])
@pytest.mark.parametrize("hd,rope_dim", [(128, 128), (128, 64), (64, 64)])
def test_rope(hd, rope_dim, with_ff, rng):
    T, H, base = 9, 6, 500000.0
    x = rng.standard_normal((T, H, hd)).astype(np.float32)
    pos = np.concatenate([[0, 1, 2], rng.integers(0, 131072, size=T - 3)]).astype(np.int32)
    ff = rng.uniform(1.0, 8.0, size=rope_dim // 2).astype(np.float32) if with_ff else None
    xd = cp.asarray(x)
    N.rope_inplace(CTX, xd, cp.asarray(pos), rope_dim, base, None if ff is None else cp.asarray(ff))
    ref = rope_ref(x, pos, rope_dim, base, ff)
    assert relerr(xd, ref) < 1e-5
    if rope_dim < hd:
        np.testing.assert_array_equal(cp.asnumpy(xd)[..., rope_dim:], x[..., rope_dim:])


@pytest.mark.parametrize("with_ff", [False, True])
def test_rope_qk_one_launch(with_ff, rng):
    """q and k (8B-shaped: 32 and 8 heads) rotated in one launch, as the backend does: over
    several CTAs per token (40 heads * 64 pairs > one CTA's 1024 pairs) and many tokens."""
    T, Hq, Hk, hd, base = 70, 32, 8, 128, 500000.0
    q = rng.standard_normal((T, Hq, hd)).astype(np.float32)
    k = rng.standard_normal((T, Hk, hd)).astype(np.float32)
    pos = np.concatenate([[0, 1, 131071], rng.integers(0, 131072, size=T - 3)]).astype(np.int32)
    ff = rng.uniform(1.0, 8.0, size=hd // 2).astype(np.float32) if with_ff else None
    qd, kd = cp.asarray(q), cp.asarray(k)
    ffd = None if ff is None else cp.asarray(ff)
    N.rope_qk_inplace(CTX, qd, kd, cp.asarray(pos), hd, base, ffd)
    assert relerr(qd, rope_ref(q, pos, hd, base, ff)) < 1e-5
    assert relerr(kd, rope_ref(k, pos, hd, base, ff)) < 1e-5
    # the same through two single launches: the same bits (one table, one formula)
    q1, k1 = cp.asarray(q), cp.asarray(k)
    N.rope_inplace(CTX, q1, cp.asarray(pos), hd, base, ffd)
    N.rope_inplace(CTX, k1, cp.asarray(pos), hd, base, ffd)
    np.testing.assert_array_equal(cp.asnumpy(q1), cp.asnumpy(qd))
    np.testing.assert_array_equal(cp.asnumpy(k1), cp.asnumpy(kd))
    np.testing.assert_array_equal(N.rope_inv_freq(hd, base, ff)[:3], base ** (-np.arange(3) * 2.0 / hd)
                                  / (1.0 if ff is None else ff[:3].astype(np.float64)))


def neox_rope_ref(x, pos, rope_dim, base):
    """NEOX RoPE (Qwen2): dims i and i + rope_dim/2 rotated as a pair."""
    x = x.astype(np.float64).copy()
    half = rope_dim // 2
    theta = pos.astype(np.float64)[:, None] * (base ** (-2.0 * np.arange(half) / rope_dim))[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., :half].copy(), x[..., half:rope_dim].copy()
    x[..., :half] = x0 * c - x1 * s
    x[..., half:rope_dim] = x0 * s + x1 * c
    return x


@pytest.mark.parametrize("hd,rope_dim,biases", [(128, 128, True), (128, 64, True), (64, 64, False), (128, 0, True)])
def test_qkv_bias_pairs_makes_neox_rope_the_normal_rotation(hd, rope_dim, biases, rng):
    """Qwen2's layer: biases added, then each head's halves reordered into adjacent pairs, so that
    the NORMAL rotation that follows is NEOX's in that order, and q . k is unchanged by it."""
    T, Hq, Hk, base = 7, 12, 2, 1000000.0
    q = rng.standard_normal((T, Hq, hd)).astype(np.float32)
    k = rng.standard_normal((T, Hk, hd)).astype(np.float32)
    v = rng.standard_normal((T, Hk, hd)).astype(np.float32)
    bq, bk, bv = (rng.standard_normal(n * hd).astype(np.float32) if biases else None for n in (Hq, Hk, Hk))
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    dev = [None if b is None else cp.asarray(b) for b in (bq, bk, bv)]
    N.qkv_bias_pairs(CTX, qd, kd, vd, *dev, rope_dim=rope_dim)
    qb, kb, vb = (x + (0 if b is None else b.reshape(x.shape[1:])) for x, b in ((q, bq), (k, bk), (v, bv)))
    np.testing.assert_array_equal(cp.asnumpy(vd), vb)  # v: its bias alone, never reordered
    if rope_dim == 0:
        np.testing.assert_array_equal(cp.asnumpy(qd), qb)
        np.testing.assert_array_equal(cp.asnumpy(kd), kb)
        return
    src = np.arange(hd)
    src[0:rope_dim:2], src[1:rope_dim:2] = np.arange(rope_dim // 2), np.arange(rope_dim // 2) + rope_dim // 2
    np.testing.assert_array_equal(cp.asnumpy(qd), qb[..., src])
    np.testing.assert_array_equal(cp.asnumpy(kd), kb[..., src])
    pos = rng.integers(0, 32768, size=T).astype(np.int32)
    N.rope_qk_inplace(CTX, qd, kd, cp.asarray(pos), rope_dim, base)
    assert relerr(qd, neox_rope_ref(qb, pos, rope_dim, base)[..., src]) < 1e-5
    scores = np.einsum("thd,sgd->tshg", cp.asnumpy(qd).astype(np.float64), cp.asnumpy(kd).astype(np.float64))
    want = np.einsum("thd,sgd->tshg", neox_rope_ref(qb, pos, rope_dim, base), neox_rope_ref(kb, pos, rope_dim, base))
    assert relerr(scores, want) < 1e-5


def test_rope_table_made_before_capture(rng):
    """The frequency table is made on a call's first eager run: capturing a call whose table
    does not exist yet is an error that says so, not an allocation inside the graph."""
    x = cp.asarray(rng.standard_normal((2, 4, 64)).astype(np.float32))
    pos = cp.asarray(np.array([3, 9], dtype=np.int32))
    s = cp.cuda.Stream(non_blocking=True)
    base = 12345.678  # a base no other test uses
    with s:
        s.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="eagerly before capture"):
                N.rope_inplace(CTX, x, pos, 64, base)
        finally:
            s.end_capture()
    ref = rope_ref(cp.asnumpy(x), np.array([3, 9]), 64, base, None)
    N.rope_inplace(CTX, x, pos, 64, base, stream=s)  # eager: makes the table
    with s:
        s.begin_capture()
        N.rope_inplace(CTX, x, pos, 64, base, stream=s)
        g = s.end_capture()
    s.synchronize()
    assert relerr(x, ref) < 1e-5
    g.launch(s)
    s.synchronize()
    assert relerr(x, rope_ref(ref, np.array([3, 9]), 64, base, None)) < 1e-5


def test_swiglu(rng):
    g = (rng.standard_normal((7, 14336)) * 3).astype(np.float32)
    u = rng.standard_normal((7, 14336)).astype(np.float32)
    out = nan_f32(g.shape)
    N.swiglu(CTX, cp.asarray(g), cp.asarray(u), out=out)
    gd = g.astype(np.float64)
    assert relerr(out, gd / (1 + np.exp(-gd)) * u) < 1e-5


# ------------------------------------------------------------------------------ KV pages + attention
def attn_ref(q, ck, cv, slots, kv_lens, n_kv, seen=None):
    """float64 reference over the cache's own (f16) values, ck, cv the dense caches f16
    [n_rows, n_kv, max_ctx, hd]. seen: per row, None (every key in [0, kv_lens[t])) or the bool
    [kv_lens[t]] of the keys it sees."""
    T, H, hd = q.shape
    G = H // n_kv
    out = np.zeros((T, H, hd))
    for t in range(T):
        L = int(kv_lens[t])
        keys = np.arange(L) if seen is None or seen[t] is None else np.flatnonzero(seen[t])
        for h in range(H):
            k = ck[slots[t], h // G, keys].astype(np.float64)
            v = cv[slots[t], h // G, keys].astype(np.float64)
            s = k @ q[t, h].astype(np.float64) / math.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = p @ v / p.sum()
    return out


def kv_pages(ck, cv, rng) -> KvPages:
    """One layer (layer 0) of pages holding the dense host caches ck, cv f16 [n_rows, n_kv,
    max_ctx, hd] (max_ctx a multiple of 32), every page at a random place of the pool: row s
    holds what slot s of a dense cache held, so the references index ck, cv as before."""
    return KvPages.from_dense(ck[None], cv[None], rng)


def kv_dense(kv: KvPages, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every row of ``layer`` read back through the page tables: host f16 [n_rows, n_kv,
    max_positions, hd] keys and values, the dense caches ``from_dense`` took (every row holds
    all its pages)."""
    rows = [kv.dense(layer, r, kv.max_positions) for r in range(kv.n_rows)]
    return np.stack([k for k, _ in rows]), np.stack([v for _, v in rows])


def chunk_nonzeros(kv: KvPages) -> tuple[int, int]:
    """Nonzero key and value elements in the whole pool, pages in no row's table included."""
    return (sum(int(cp.count_nonzero(k)) for k, _ in kv.chunks.values()),
            sum(int(cp.count_nonzero(v)) for _, v in kv.chunks.values()))


def chunk_bits(kv: KvPages) -> list[np.ndarray]:
    """Every chunk's keys, then values, as host uint16 (so that NaN compares by its bits)."""
    return [cp.asnumpy(a).view(np.uint16) for pair in kv.chunks.values() for a in pair]


def test_kv_append(rng):
    n_slots, n_kv, max_ctx, hd = 4, 2, 64, 128
    zeros = np.zeros((n_slots, n_kv, max_ctx, hd), dtype=np.float16)
    kv = kv_pages(zeros, zeros, rng)
    T = 5
    k = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    slots = np.array([2, 0, 3, 1, 2], dtype=np.int32)
    pos = np.array([7, 0, 63, 5, 8], dtype=np.int32)
    N.kv_append(CTX, cp.asarray(k), cp.asarray(v), kv, 0, cp.asarray(slots), cp.asarray(pos))
    ck_h, cv_h = kv_dense(kv)
    exp_k = np.zeros_like(ck_h)
    exp_v = np.zeros_like(cv_h)
    for t in range(T):
        exp_k[slots[t], :, pos[t]] = k[t].astype(np.float16)
        exp_v[slots[t], :, pos[t]] = v[t].astype(np.float16)
    np.testing.assert_array_equal(ck_h, exp_k)
    np.testing.assert_array_equal(cv_h, exp_v)
    # nothing stored anywhere else: the pool's page that no row holds stays zero too
    assert chunk_nonzeros(kv) == (np.count_nonzero(exp_k), np.count_nonzero(exp_v))


@pytest.mark.parametrize("rope_dim,with_ff", [(128, False), (128, True), (64, False)])
def test_rope_kv_append_equals_rope_then_append(rope_dim, with_ff, rng):
    """The fused rotation and cache store (one launch per layer) gives the bits of rope_qk_inplace
    then kv_append: q and k rotated alike, k and v stored at the cache positions (which differ
    from the RoPE positions in a tree), rows of an out-of-range slot or position not stored.
    The two sets of pages lie in different places of their pools."""
    n_slots, Hq, n_kv, max_ctx, hd, base = 4, 32, 8, 64, 128, 500000.0
    T = 37  # several CTAs per token (32 * 64 + 8 * 64 pairs), a ragged tail
    q = rng.standard_normal((T, Hq, hd)).astype(np.float32)
    k = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    pos = rng.integers(0, 131072, size=T).astype(np.int32)
    slots = rng.integers(0, n_slots, size=T).astype(np.int32)
    cpos = rng.permutation(max_ctx)[:T].astype(np.int32)
    slots[3], cpos[5], slots[7] = -1, max_ctx, n_slots  # not stored
    ff = cp.asarray(rng.uniform(1.0, 8.0, size=rope_dim // 2).astype(np.float32)) if with_ff else None
    dev = [cp.asarray(a) for a in (q, k, v, pos, slots, cpos)]
    ref_q, ref_k, ref_v = (cp.asarray(a) for a in (q, k, v))
    zeros = np.zeros((n_slots, n_kv, max_ctx, hd), dtype=np.float16)
    ref_kv = kv_pages(zeros, zeros, rng)
    N.rope_qk_inplace(CTX, ref_q, ref_k, dev[3], rope_dim, base, ff)
    N.kv_append(CTX, ref_k, ref_v, ref_kv, 0, dev[4], dev[5])
    kv = kv_pages(zeros, zeros, rng)
    N.rope_kv_append(CTX, dev[0], dev[1], dev[2], kv, 0, dev[3], dev[4], dev[5], rope_dim, base, ff)
    for got, want in ((dev[0], ref_q), (dev[1], ref_k), (dev[2], ref_v)):
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))
    for got, want in zip(kv_dense(kv), kv_dense(ref_kv)):
        np.testing.assert_array_equal(got, want)
    assert chunk_nonzeros(kv)[0] == (T - 3) * n_kv * hd  # 34 rows stored, every element nonzero
    assert relerr(dev[0], rope_ref(q, pos, rope_dim, base, None if ff is None else cp.asnumpy(ff))) < 1e-5


def _random_cache(rng, n_slots, n_kv, max_ctx, hd):
    ck = rng.standard_normal((n_slots, n_kv, max_ctx, hd)).astype(np.float16)
    cv = rng.standard_normal((n_slots, n_kv, max_ctx, hd)).astype(np.float16)
    return ck, cv


@pytest.mark.parametrize("G,hd", [(4, 128), (1, 128), (3, 64), (8, 128)])
def test_attention_decode(G, hd, rng):
    n_slots, n_kv, max_ctx = 6, 2, 1024
    ck, cv = _random_cache(rng, n_slots, n_kv, max_ctx, hd)
    ck[0, :, 0] = 60.0  # a dominant score somewhere: softmax must stay finite
    lens = np.array([1, 33, 100, 257, 1024], dtype=np.int32)
    slots = np.array([5, 0, 2, 3, 1], dtype=np.int32)
    T, H = lens.size, n_kv * G
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    out = nan_f32((T, H, hd))
    A.attention(CTX, cp.asarray(q), kv_pages(ck, cv, rng), 0, cp.asarray(slots), cp.asarray(lens), out=out)
    assert relerr(out, attn_ref(q, ck, cv, slots, lens, n_kv)) < 1e-5


@pytest.mark.parametrize("n_splits", [None, 4, 64])
def test_attention_prefill_causal(n_splits, rng):
    """One sequence's chunk of T positions after 50 cached ones: append, then causal attention."""
    n_slots, n_kv, max_ctx, hd, G = 3, 2, 512, 128, 4
    ck_h, cv_h = _random_cache(rng, n_slots, n_kv, max_ctx, hd)
    kv = kv_pages(ck_h, cv_h, rng)
    T, p0, slot = 37, 50, 1
    H = n_kv * G
    pos = np.arange(p0, p0 + T, dtype=np.int32)
    slots = np.full(T, slot, dtype=np.int32)
    k = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    N.kv_append(CTX, cp.asarray(k), cp.asarray(v), kv, 0, cp.asarray(slots), cp.asarray(pos))
    out = nan_f32((T, H, hd))
    A.attention(CTX, cp.asarray(q), kv, 0, cp.asarray(slots), cp.asarray(pos + 1), out=out, n_splits=n_splits)
    ck_h[slot, :, p0:p0 + T] = k.transpose(1, 0, 2).astype(np.float16)
    cv_h[slot, :, p0:p0 + T] = v.transpose(1, 0, 2).astype(np.float16)
    assert relerr(out, attn_ref(q, ck_h, cv_h, slots, pos + 1, n_kv)) < 1e-5


@pytest.mark.parametrize("G,hd", [(4, 128), (1, 64), (8, 256), (2, 96)])
def test_attention_short_rows_many_splits(G, hd, rng):
    """Decode rows of a few keys in a cache sized for 4096 (64 splits, as the 8B decodes): only
    the splits that own a tile run and only those are merged. Lengths around the 32-key tile,
    one past max_ctx (clamped), a bad slot (output 0); the workspace starts as NaN, so a merged
    split that was never written would show. hd 96: a lane's 3 V elements loaded one by one."""
    n_slots, n_kv, max_ctx = 3, 2, 4096
    ck, cv = _random_cache(rng, n_slots, n_kv, max_ctx, hd)
    lens = np.array([1, 2, 31, 32, 33, 64, 65, 100, 4096, 5000, 7], dtype=np.int32)
    slots = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 1, 3], dtype=np.int32)  # 3: outside the page table
    T, H = lens.size, n_kv * G
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    S = 64
    ws = (cp.full(T * H * S * 2, cp.nan, cp.float32), cp.full(T * H * S * hd, cp.nan, cp.float32))
    out = nan_f32((T, H, hd))
    args = (cp.asarray(q), kv_pages(ck, cv, rng), 0, cp.asarray(slots), cp.asarray(lens))
    A.attention(CTX, *args, out=out, n_splits=S, workspace=ws)
    good = slots < n_slots
    ref = attn_ref(q[good], ck, cv, slots[good], np.minimum(lens[good], max_ctx), n_kv)
    assert relerr(out[cp.asarray(good)], ref) < 1e-5
    assert float(cp.abs(out[cp.asarray(~good)]).max()) == 0.0
    # rows of up to 128 keys: split s holds tile s whether there are 4 splits or 64, so the
    # partials, and the merge of the used ones, are the same to the bit
    short = cp.asarray(lens <= 128)
    out4 = A.attention(CTX, *args, n_splits=4)
    np.testing.assert_array_equal(cp.asnumpy(out4[short]), cp.asnumpy(out[short]))


def test_attention_graph_replay_across_lengths(rng):
    """One captured decode attention (64 splits) replayed as the row grows from 1 key to past
    several tiles: each replay merges only the splits its length uses, and matches eager."""
    n_slots, n_kv, max_ctx, hd, G = 2, 2, 4096, 128, 4
    kv = kv_pages(*_random_cache(rng, n_slots, n_kv, max_ctx, hd), rng)
    T, H = 2, n_kv * G
    q = cp.asarray(rng.standard_normal((T, H, hd)).astype(np.float32))
    slots = cp.asarray(np.array([1, 0], dtype=np.int32))
    lens = cp.asarray(np.array([1, 1], dtype=np.int32))
    S = 64
    ws = A.attention_workspace(T, H, hd, S)
    out = nan_f32((T, H, hd))
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    A.attention(CTX, q, kv, 0, slots, lens, out=out, n_splits=S, workspace=ws, stream=s)  # compile
    s.synchronize()
    with s:
        s.begin_capture()
        A.attention(CTX, q, kv, 0, slots, lens, out=out, n_splits=S, workspace=ws, stream=s)
        g = s.end_capture()
    for L in ([1, 2], [64, 33], [65, 300], [2048, 4096], [3, 1]):
        lens.set(np.array(L, dtype=np.int32), stream=s)
        g.launch(s)
        s.synchronize()
        eager = A.attention(CTX, q, kv, 0, slots, lens, n_splits=S, stream=s)
        s.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(eager), err_msg=f"lengths {L}")


def test_attention_empty_length_is_zero(rng):
    zeros = np.zeros((1, 1, 64, 64), dtype=np.float16)
    kv = kv_pages(zeros, zeros, rng)
    q = cp.asarray(rng.standard_normal((1, 2, 64)).astype(np.float32))
    out = nan_f32((1, 2, 64))
    A.attention(CTX, q, kv, 0, cp.zeros(1, cp.int32), cp.zeros(1, cp.int32), out=out)
    assert float(cp.abs(out).max()) == 0.0


@pytest.mark.parametrize("n_splits", [None, 64])
def test_attention_bit_identical_over_page_layouts(n_splits, rng):
    """Pages may sit anywhere: the same caches paged twice, each page at another random place
    of pools cut into chunks of other sizes, give attention outputs equal to the bit (the plain
    kernel and the tree kernel), and both match the reference."""
    n_slots, n_kv, max_ctx, hd, G = 3, 2, 1024, 128, 4
    ck, cv = _random_cache(rng, n_slots, n_kv, max_ctx, hd)
    layouts = [KvPages.from_dense(ck[None], cv[None], np.random.default_rng(seed), chunk_pages=cpg)
               for seed, cpg in ((1, 3), (2, 5))]
    assert not np.array_equal(cp.asnumpy(layouts[0].page_table), cp.asnumpy(layouts[1].page_table))
    lens = np.array([1, 31, 32, 33, 100, 517, 1024], dtype=np.int32)
    slots = np.array([0, 1, 2, 0, 1, 2, 1], dtype=np.int32)
    T, H = lens.size, n_kv * G
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    no_tree = dict(tree_base=cp.full(T, -1, dtype=cp.int32), tree_mask=cp.zeros((T, 1), dtype=cp.uint32))
    for tree_args in ({}, no_tree):
        outs = [cp.asnumpy(A.attention(CTX, cp.asarray(q), kv, 0, cp.asarray(slots), cp.asarray(lens),
                                       n_splits=n_splits, **tree_args)) for kv in layouts]
        np.testing.assert_array_equal(outs[0], outs[1])
        assert relerr(outs[0], attn_ref(q, ck, cv, slots, lens, n_kv)) < 1e-5


@pytest.mark.parametrize("n_splits", [None, 64])
def test_no_page_past_a_rows_length_is_touched(n_splits, rng):
    """Rows hold only the pages their lengths reach (-1 after them in their page-table rows, as
    the engine's rows are), lengths ending mid-page, every position from a row's length on NaN:
    attention reads neither a missing page nor the positions past a length in the last page
    (its output is finite and matches the reference), and kv_append and rope_kv_append store a
    token at a position without a page nowhere, beside one at a position with a page."""
    n_rows, n_kv, max_ctx, hd, G = 4, 2, 1024, 128, 4
    ck, cv = _random_cache(rng, n_rows, n_kv, max_ctx, hd)
    lens = np.array([1, 40, 95, 700], dtype=np.int32)
    for r, L in enumerate(lens):
        ck[r, :, L:] = np.nan
        cv[r, :, L:] = np.nan
    kv = kv_pages(ck, cv, rng)
    full = cp.asnumpy(kv.page_table)
    for r, L in enumerate(lens):
        kv.set_row(r, [int(p) for p in full[r, : pages_for_positions(int(L))]])
    kv.stream.synchronize()
    assert (cp.asnumpy(kv.page_table) < 0).sum(axis=1).tolist() == [31, 30, 29, 10]
    slots = np.arange(n_rows, dtype=np.int32)
    T, H = n_rows, n_kv * G
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    ref = attn_ref(q, ck, cv, slots, lens, n_kv)
    no_tree = dict(tree_base=cp.full(T, -1, dtype=cp.int32), tree_mask=cp.zeros((T, 1), dtype=cp.uint32))
    for tree_args in ({}, no_tree):
        out = nan_f32((T, H, hd))
        A.attention(CTX, cp.asarray(q), kv, 0, cp.asarray(slots), cp.asarray(lens), out=out, n_splits=n_splits,
                    **tree_args)
        assert relerr(out, ref) < 1e-5
    # row 1 (40 positions: pages 0 and 1): position 40 + i has a page (and holds NaN), 100 has none
    row, missing = 1, 100
    for i, fused in enumerate((False, True)):
        k = rng.standard_normal((2, n_kv, hd)).astype(np.float32)
        v = rng.standard_normal((2, n_kv, hd)).astype(np.float32)
        rows_d = cp.asarray(np.full(2, row, dtype=np.int32))
        cpos_d = cp.asarray(np.array([40 + i, missing], dtype=np.int32))
        before = chunk_bits(kv)
        if fused:
            q2 = cp.asarray(rng.standard_normal((2, H, hd)).astype(np.float32))
            N.rope_kv_append(CTX, q2, cp.asarray(k), cp.asarray(v), kv, 0, cpos_d, rows_d, cpos_d, hd, 10000.0)
        else:
            N.kv_append(CTX, cp.asarray(k), cp.asarray(v), kv, 0, rows_d, cpos_d)
        kv.stream.synchronize()
        changed = [int(np.count_nonzero(a != b)) for a, b in zip(chunk_bits(kv), before)]  # k, v, k, v, ...
        assert (sum(changed[0::2]), sum(changed[1::2])) == (n_kv * hd, n_kv * hd), "fused" if fused else "kv_append"
        got_k, got_v = kv.dense(0, row, 40 + i + 1)
        np.testing.assert_array_equal(got_v[:, 40 + i], v[0].astype(np.float16))
        if not fused:
            np.testing.assert_array_equal(got_k[:, 40 + i], k[0].astype(np.float16))


# ------------------------------------------------------------------------------ token trees
def random_parents(n: int, rng) -> tuple[int, ...]:
    """A random tree of n rows: each row's parent is an earlier row."""
    return (-1,) + tuple(int(rng.integers(0, j)) for j in range(1, n))


def _tree_pass(rng, G, hd, chunks, slots_of, n_slots=5, max_ctx=1024, n_splits=None):
    """One attention pass over ``chunks`` (SeqChunk, trees or plain, one page-table row each):
    their keys and values appended at their cache positions, then attention with the tree
    arguments. Returns (out, reference)."""
    n_kv = 2
    H = n_kv * G
    ck_h, cv_h = _random_cache(rng, n_slots, n_kv, max_ctx, hd)
    kv = kv_pages(ck_h, cv_h, rng)
    T = sum(c.n_tokens for c in chunks)
    trees = [c for c in chunks if c.parents is not None]
    n_words = A.tree_mask_words(max([c.n_tokens for c in trees], default=1))
    slots = np.concatenate([np.full(c.n_tokens, slots_of[i], np.int32) for i, c in enumerate(chunks)])
    cpos = np.concatenate([np.arange(c.start_pos, c.end_pos, dtype=np.int32) for c in chunks])
    base = np.full(T, -1, np.int32)
    mask = np.zeros((T, n_words), np.uint32)
    seen = []
    r0 = 0
    for c in chunks:
        vis = c.visible()
        for j in range(c.n_tokens):
            L = c.start_pos + j + 1
            if vis is None:
                seen.append(None)
            else:
                s = np.ones(L, dtype=bool)
                s[c.start_pos:] = vis[j, : j + 1]
                seen.append(s)
        if vis is not None:
            base[r0 : r0 + c.n_tokens] = c.start_pos
            mask[r0 : r0 + c.n_tokens] = A.pack_tree_mask(vis, n_words)
        r0 += c.n_tokens
    k = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    N.kv_append(CTX, cp.asarray(k), cp.asarray(v), kv, 0, cp.asarray(slots), cp.asarray(cpos))
    out = nan_f32((T, H, hd))
    A.attention(CTX, cp.asarray(q), kv, 0, cp.asarray(slots), cp.asarray(cpos + 1), out=out, n_splits=n_splits,
                tree_base=cp.asarray(base), tree_mask=cp.asarray(mask))
    ck_h[slots, :, cpos] = k.astype(np.float16)
    cv_h[slots, :, cpos] = v.astype(np.float16)
    return out, attn_ref(q, ck_h, cv_h, slots, cpos + 1, n_kv, seen)


@pytest.mark.parametrize("n_splits", [None, 4, 64])
@pytest.mark.parametrize("G,hd", [(4, 128), (1, 64), (8, 128), (3, 256)])
def test_attention_tree_mask(G, hd, n_splits, rng):
    """Random trees (up to 64 rows, one at cache position 0) beside a plain decode row and a
    causal prompt chunk, each sequence in its own page-table row: a tree row sees the prefix,
    its ancestors and itself, nothing else."""
    chunks = [
        SeqChunk(0, 300, tuple(range(64)), parents=random_parents(64, rng)),
        SeqChunk(1, 77, (1,)),  # a decode row
        SeqChunk(2, 0, tuple(range(33)), parents=random_parents(33, rng)),  # a tree with no prefix
        SeqChunk(3, 40, tuple(range(9))),  # a causal chunk
        SeqChunk(4, 900, tuple(range(5)), parents=(-1, 0, 0, 1, 1)),
    ]
    out, ref = _tree_pass(rng, G, hd, chunks, slots_of=[3, 0, 4, 1, 2], n_splits=n_splits)
    assert relerr(out, ref) < 1e-5


def test_attention_tree_513_rows(rng):
    """The largest tree (512 drafted tokens and the root): 17 mask words per row, several of a
    row's 32-key tiles seen through no bit at all."""
    chunks = [SeqChunk(0, 200, tuple(range(513)), parents=random_parents(513, rng)), SeqChunk(1, 10, (3,))]
    out, ref = _tree_pass(rng, 4, 128, chunks, slots_of=[1, 0])
    assert relerr(out, ref) < 1e-5


def test_attention_tree_kernel_plain_rows_bit_identical(rng):
    """Rows outside trees (tree_base = -1) and a chain (every row sees every earlier row) give,
    through the tree kernel, exactly the plain kernel's output."""
    n_slots, n_kv, max_ctx, hd, G = 2, 2, 512, 128, 4
    kv = kv_pages(*_random_cache(rng, n_slots, n_kv, max_ctx, hd), rng)
    T = 21
    q = cp.asarray(rng.standard_normal((T, n_kv * G, hd)).astype(np.float32))
    slots = cp.asarray(np.array([0] * 20 + [1], dtype=np.int32))
    lens = cp.asarray(np.array(list(range(101, 121)) + [333], dtype=np.int32))
    plain = A.attention(CTX, q, kv, 0, slots, lens)
    chain = A.pack_tree_mask(SeqChunk(0, 100, tuple(range(20)), parents=tuple(range(-1, 19))).visible(), 1)
    base = np.array([100] * 20 + [-1], dtype=np.int32)
    mask = np.concatenate([chain, np.zeros((1, 1), np.uint32)])
    tree = A.attention(CTX, q, kv, 0, slots, lens, tree_base=cp.asarray(base), tree_mask=cp.asarray(mask))
    np.testing.assert_array_equal(cp.asnumpy(tree), cp.asnumpy(plain))
    with pytest.raises(ValueError, match="go together"):
        A.attention(CTX, q, kv, 0, slots, lens, tree_base=cp.asarray(base))


def test_pack_tree_mask_bits():
    vis = SeqChunk(0, 0, tuple(range(40)), parents=(-1,) + tuple(range(39))).visible()  # a chain
    m = A.pack_tree_mask(vis, 2)
    assert m.dtype == np.uint32 and m.shape == (40, 2)
    assert m[0, 0] == 1 and m[0, 1] == 0 and m[31, 0] == 0xFFFFFFFF and m[31, 1] == 0
    assert m[39, 0] == 0xFFFFFFFF and m[39, 1] == 0xFF
    with pytest.raises(ValueError, match="mask words"):
        A.pack_tree_mask(vis, 1)


def test_kv_move_every_layer_in_order(rng):
    """The accepted path's keys and values move down in every layer, k and v, only in the
    sequence's row (across a page boundary, in pages at random places); moves whose destination
    is an earlier move's source see the moved-out value, not the moved-in one."""
    n_layers, n_slots, n_kv, max_ctx, hd = 3, 3, 2, 64, 128
    shape = (n_layers, n_slots, n_kv, max_ctx, hd)
    ck_h = rng.standard_normal(shape).astype(np.float16)
    cv_h = rng.standard_normal(shape).astype(np.float16)
    kv = KvPages.from_dense(ck_h, cv_h, rng)
    src = [21, 23, 24, 30, 63]
    dst = [20, 21, 23, 24, 25]  # 21, 23, 24: earlier sources
    slot = 1
    N.kv_move(CTX, kv, slot, src, dst)
    want_k, want_v = ck_h.copy(), cv_h.copy()
    for s_, d_ in zip(src, dst):
        want_k[:, slot, :, d_] = want_k[:, slot, :, s_]
        want_v[:, slot, :, d_] = want_v[:, slot, :, s_]
    for layer in range(n_layers):
        got_k, got_v = kv_dense(kv, layer)
        np.testing.assert_array_equal(got_k, want_k[layer], err_msg=f"keys of layer {layer}")
        np.testing.assert_array_equal(got_v, want_v[layer], err_msg=f"values of layer {layer}")
    N.kv_move(CTX, kv, slot, [], [])  # nothing to move
    for bad_src, bad_dst in (([5, 4], [1, 2]), ([5, 6], [5, 3]), ([5, 64], [1, 2]), ([5], [1, 2])):
        with pytest.raises(ValueError):
            N.kv_move(CTX, kv, slot, bad_src, bad_dst)
    with pytest.raises(ValueError, match="row"):
        N.kv_move(CTX, kv, n_slots, [21], [20])


# ------------------------------------------------------------------------------ sampling
def test_argmax_ties(rng):
    B, V = 4, 128256
    lg = rng.standard_normal((B, V)).astype(np.float32)
    lg[0, [7, 9000, 128000]] = 50.0        # tie: lowest id wins
    lg[1, :] = 1.25                        # all equal -> 0
    lg[2, V - 1] = 99.0                    # last element
    lg[3, [5, 6]] = np.nan                 # NaN never wins
    out = cp.full(B, -1, dtype=cp.int32)
    S.argmax(CTX, cp.asarray(lg), out=out)
    got = cp.asnumpy(out)
    assert got.tolist() == [7, 0, V - 1, int(np.nanargmax(lg[3]))]


def topk_ref(lg, k):
    ids = np.arange(lg.shape[0])
    order = np.lexsort((ids, -lg.astype(np.float64)))[:k]
    return lg[order], order.astype(np.int32)


@pytest.mark.parametrize("k", [1, 40, 256])
def test_topk(k, rng):
    V = 128256
    rows = [
        rng.standard_normal(V).astype(np.float32),
        np.round(rng.standard_normal(V) * 2).astype(np.float32),  # massive ties
        np.full(V, -np.inf, dtype=np.float32),                    # almost all -inf
        (rng.standard_normal(V) * 1e-3 - 5).astype(np.float32),   # all negative, close together
    ]
    rows[2][rng.choice(V, 10, replace=False)] = rng.standard_normal(10).astype(np.float32)
    lg = np.stack(rows)
    vals = nan_f32((lg.shape[0], k))
    ids = cp.full((lg.shape[0], k), -1, dtype=cp.int32)
    S.topk(CTX, cp.asarray(lg), k, values=vals, ids=ids)
    vals_h, ids_h = cp.asnumpy(vals), cp.asnumpy(ids)
    for b in range(lg.shape[0]):
        rv, ri = topk_ref(lg[b], k)
        np.testing.assert_array_equal(ids_h[b], ri, err_msg=f"row {b}")
        np.testing.assert_array_equal(vals_h[b], rv, err_msg=f"row {b}")


def test_topk_small_vocab(rng):
    lg = rng.standard_normal((3, 300)).astype(np.float32)
    v, i = S.topk(CTX, cp.asarray(lg), 256)
    for b in range(3):
        rv, ri = topk_ref(lg[b], 256)
        np.testing.assert_array_equal(cp.asnumpy(i)[b], ri)
        np.testing.assert_array_equal(cp.asnumpy(v)[b], rv)


@pytest.mark.parametrize("per_row", [False, True])
def test_repetition_penalty(per_row, rng):
    B, V, n = 3, 1000, 24
    lg = rng.standard_normal((B, V)).astype(np.float32) * 4
    hist = rng.integers(0, V, size=(B, n)).astype(np.int32)
    hist[0, 5] = hist[0, 2]  # duplicates are penalized once
    hist[0, 9] = hist[0, 2]
    hist[1, 10:] = -1        # padding
    pen = np.array([1.3, 1.1, 2.0], dtype=np.float32) if per_row else np.float32(1.3)
    lgd = cp.asarray(lg)
    S.apply_repetition_penalty(CTX, lgd, cp.asarray(hist), cp.asarray(pen) if per_row else 1.3)
    ref = lg.astype(np.float64).copy()
    for b in range(B):
        p = float(pen[b]) if per_row else 1.3
        for tok in set(int(t) for t in hist[b] if t >= 0):
            ref[b, tok] = ref[b, tok] / p if ref[b, tok] > 0 else ref[b, tok] * p
    assert relerr(lgd, ref) < 1e-7


# ------------------------------------------------------------------------------ CUDA graph replay
def test_graph_replay_matches_eager(rng):
    """A decode step (norm, Q4_K/Q6_K projections, rope, kv append, attention, SwiGLU, argmax)
    captured once replays for new positions/lengths read from device memory, bit-identical to eager."""
    D, n_kv, G, hd, F, V = 256, 2, 4, 64, 512, 1000
    H = n_kv * G
    n_slots, max_ctx, B = 3, 256, 2
    dev = lambda a: cp.asarray(a)  # noqa: E731
    wq = dev(random_weights(QT.Q4_K, H * hd, D, rng))
    wk = dev(random_weights(QT.Q4_K, n_kv * hd, D, rng))
    wv = dev(random_weights(QT.Q6_K, n_kv * hd, D, rng))
    wo = dev(random_weights(QT.Q4_K, D, H * hd, rng))
    wg = dev(random_weights(QT.Q4_K, F, D, rng))
    wu = dev(random_weights(QT.Q4_K, F, D, rng))
    wout = dev(random_weights(QT.Q6_K, V, D, rng))
    norm_w = dev(rng.standard_normal(D).astype(np.float32))
    x_in = dev(rng.standard_normal((B, D)).astype(np.float32))
    ck0, cv0 = _random_cache(rng, n_slots, n_kv, max_ctx, hd)
    slots = dev(np.array([2, 0], dtype=np.int32))
    positions = cp.zeros(B, dtype=cp.int32)
    kv_lens = cp.zeros(B, dtype=cp.int32)
    splits = A.attention_splits(B, n_kv, max_ctx)

    def make_bufs():
        return dict(
            kv=kv_pages(ck0, cv0, rng), h=cp.empty((B, D), cp.float32),
            q=cp.empty((B, H * hd), cp.float32), k=cp.empty((B, n_kv * hd), cp.float32),
            v=cp.empty((B, n_kv * hd), cp.float32), att=cp.empty((B, H, hd), cp.float32),
            o=cp.empty((B, D), cp.float32), g=cp.empty((B, F), cp.float32), u=cp.empty((B, F), cp.float32),
            a=cp.empty((B, F), cp.float32), logits=cp.empty((B, V), cp.float32), tok=cp.empty(B, cp.int32),
            ws=A.attention_workspace(B, H, hd, splits))

    def step(b, s):
        N.rmsnorm(CTX, x_in, norm_w, 1e-5, out=b["h"], stream=s)
        MV.matvec(CTX, W(wq, QT.Q4_K, H * hd, D), b["h"], out=b["q"], stream=s)
        MV.matvec(CTX, W(wk, QT.Q4_K, n_kv * hd, D), b["h"], out=b["k"], stream=s)
        MV.matvec(CTX, W(wv, QT.Q6_K, n_kv * hd, D), b["h"], out=b["v"], stream=s)
        q3, k3, v3 = b["q"].reshape(B, H, hd), b["k"].reshape(B, n_kv, hd), b["v"].reshape(B, n_kv, hd)
        N.rope_qk_inplace(CTX, q3, k3, positions, hd, 10000.0, stream=s)
        N.kv_append(CTX, k3, v3, b["kv"], 0, slots, positions, stream=s)
        A.attention(CTX, q3, b["kv"], 0, slots, kv_lens, out=b["att"], n_splits=splits, workspace=b["ws"], stream=s)
        MV.matvec(CTX, W(wo, QT.Q4_K, D, H * hd), b["att"].reshape(B, H * hd), out=b["o"], stream=s)
        MV.matvec(CTX, W(wg, QT.Q4_K, F, D), b["o"], out=b["g"], stream=s)
        MV.matvec(CTX, W(wu, QT.Q4_K, F, D), b["o"], out=b["u"], stream=s)
        N.swiglu(CTX, b["g"], b["u"], out=b["a"], stream=s)
        MV.matvec(CTX, W(wout, QT.Q6_K, V, D), b["o"], out=b["logits"], stream=s)
        S.argmax(CTX, b["logits"], out=b["tok"], stream=s)

    s = cp.cuda.Stream(non_blocking=True)
    gb, eb = make_bufs(), make_bufs()  # their pages at different places: the same bits all the same
    # compile/load every kernel eagerly first (on scratch buffers), then capture
    warm = make_bufs()
    cp.cuda.Device().synchronize()  # buffers were filled on the legacy stream; s does not wait for it
    positions.set(np.array([3, 4], dtype=np.int32))
    kv_lens.set(np.array([4, 5], dtype=np.int32))
    step(warm, s)
    s.synchronize()
    with s:
        s.begin_capture()
        step(gb, s)
        graph = s.end_capture()
    for pos in ([10, 20], [11, 21], [200, 5]):
        p = np.array(pos, dtype=np.int32)
        positions.set(p, stream=s)
        kv_lens.set(p + 1, stream=s)
        graph.launch(stream=s)
        s.synchronize()
        step(eb, s)
        s.synchronize()
        for name in ("h", "q", "att", "o", "a", "logits", "tok"):
            np.testing.assert_array_equal(cp.asnumpy(gb[name]), cp.asnumpy(eb[name]), err_msg=f"{name} at {pos}")
        for name, got, want in zip(("keys", "values"), kv_dense(gb["kv"]), kv_dense(eb["kv"])):
            np.testing.assert_array_equal(got, want, err_msg=f"{name} at {pos}")
        assert np.all(np.isfinite(cp.asnumpy(gb["logits"])))
    # the graph really used the new positions: attention at 200 differs from at 11
    assert not np.array_equal(kv_dense(gb["kv"])[0][2, :, 200], ck0[2, :, 200])


@pytest.mark.parametrize("T", [1, 2, 5, 16, 40, 64])
def test_gemm_group_equals_gemm_each(T, rng):
    """gemm_group (x quantized once for the matrices that take the same quantized x) gives each
    product exactly as gemm alone does, for a mix of types (Q4_K and Q6_K share mmq's or the i16
    matvec's planes; Q8_0 takes its own path)."""
    n_cols = 512
    # three Q4_K: one mvq2g_kernel launch of three segments where the path is the i16 matvec
    specs = [(QT.Q4_K, 96), (QT.Q6_K, 32), (QT.Q8_0, 64), (QT.Q4_K, 200), (QT.Q4_K, 40), (QT.Q6_K, 16)]
    raws = [cp.asarray(random_weights(qt, n, n_cols, rng)) for qt, n in specs]
    x = cp.asarray(rng.standard_normal((T, n_cols)).astype(np.float32))
    outs = [nan_f32((T, n)) for _, n in specs]
    got = G.gemm_group(CTX, x, [(W(raw, qt, n, n_cols), out) for raw, (qt, n), out in zip(raws, specs, outs)])
    assert all(g is o for g, o in zip(got, outs))
    for raw, (qt, n), out in zip(raws, specs, outs):
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(G.gemm(CTX, W(raw, qt, n, n_cols), x)))


@pytest.mark.parametrize("T", [1, 2, 3, 8])
def test_rmsnorm_i16_is_rmsnorm_then_i16_quantize(T, rng):
    """The fused norm (rmsnorm_q2_kernel) writes the norm and its i16 planes with the same bits
    as rmsnorm and then quantize_x2_kernel, with and without the residual add."""
    D = 2048
    x = cp.asarray(rng.standard_normal((T, D)).astype(np.float32))
    w = cp.asarray(rng.standard_normal(D).astype(np.float32))
    res0 = cp.asarray(rng.standard_normal((T, D)).astype(np.float32))
    for residual in (None, res0):
        r_got = None if residual is None else residual.copy()
        h = nan_f32((T, D))
        planes = [cp.asnumpy(p) for p in N.rmsnorm_i16(CTX, x, w, 1e-5, residual=r_got, out=h)]  # the scratch is reused
        r_want = None if residual is None else residual.copy()
        h_want = N.rmsnorm(CTX, x, w, 1e-5, residual=r_want)
        want = [cp.asnumpy(p) for p in MV.i16_quantize(CTX, h_want)]
        np.testing.assert_array_equal(cp.asnumpy(h), cp.asnumpy(h_want))
        if residual is not None:
            np.testing.assert_array_equal(cp.asnumpy(r_got), cp.asnumpy(r_want))
        for g, e in zip(planes, want):
            np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("T", [1, 2, 5])
def test_norm_gemm_group_equals_norm_then_gemm(T, rng):
    """norm_gemm_group (the planes made in the norm's kernel where the group takes the i16 matvec,
    products of one type in one launch) gives the norm, the residual and every product with the
    bits of rmsnorm and then gemm of each matrix."""
    D = 512
    specs = [(QT.Q4_K, 96), (QT.Q4_K, 64), (QT.Q6_K, 32)]
    raws = [cp.asarray(random_weights(qt, n, D, rng)) for qt, n in specs]
    x = cp.asarray(rng.standard_normal((T, D)).astype(np.float32))
    w = cp.asarray(rng.standard_normal(D).astype(np.float32))
    res0 = cp.asarray(rng.standard_normal((T, D)).astype(np.float32))
    for residual in (None, res0):
        r_want = None if residual is None else residual.copy()
        h_want = N.rmsnorm(CTX, x, w, 1e-5, residual=r_want)
        want = [cp.asnumpy(G.gemm(CTX, W(raw, qt, n, D), h_want)) for raw, (qt, n) in zip(raws, specs)]
        r_got = None if residual is None else residual.copy()
        h = nan_f32((T, D))
        outs = [nan_f32((T, n)) for _, n in specs]
        G.norm_gemm_group(CTX, x, w, 1e-5, h, [(W(raw, qt, n, D), o) for raw, (qt, n), o in zip(raws, specs, outs)],
                          residual=r_got)
        np.testing.assert_array_equal(cp.asnumpy(h), cp.asnumpy(h_want))
        if residual is not None:
            np.testing.assert_array_equal(cp.asnumpy(r_got), cp.asnumpy(r_want))
        for o, e in zip(outs, want):
            np.testing.assert_array_equal(cp.asnumpy(o), e)


@pytest.mark.parametrize("T", [1, 2, 5, 70])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.F16])
def test_gemm_accumulate_is_gemm_then_add(T, qt, rng):
    """gemm(accumulate=True): out += x W^T with the bits of the product and a separate add, on
    every path (the i16 matvec's epilogue; mmq, mm, matvec and cuBLAS through a scratch)."""
    n, D = 96, 512
    raw = cp.asarray(random_weights(qt, n, D, rng))
    x = cp.asarray(rng.standard_normal((T, D)).astype(np.float32))
    y0 = cp.asarray(rng.standard_normal((T, n)).astype(np.float32))
    want = cp.asnumpy(y0 + G.gemm(CTX, W(raw, qt, n, D), x))
    got = y0.copy()
    assert G.gemm(CTX, W(raw, qt, n, D), x, out=got, accumulate=True) is got
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    added = N.add(CTX, y0, y0)
    np.testing.assert_array_equal(cp.asnumpy(added), cp.asnumpy(y0 + y0))


@pytest.mark.parametrize("T", [1, 2, 5])
def test_swiglu_gemm_add_equals_swiglu_then_gemm_add(T, rng):
    """swiglu_gemm_add (act's i16 planes made in the swiglu's kernel where the product takes the
    i16 matvec) gives act and out += act W^T with the bits of swiglu, gemm and add."""
    n, F = 96, 1024
    for qt in (QT.Q4_K, QT.Q6_K, QT.F16):
        raw = cp.asarray(random_weights(qt, n, F, rng))
        gate = cp.asarray(rng.standard_normal((T, F)).astype(np.float32))
        up = cp.asarray(rng.standard_normal((T, F)).astype(np.float32))
        y0 = cp.asarray(rng.standard_normal((T, n)).astype(np.float32))
        act_want = N.swiglu(CTX, gate, up)
        want = cp.asnumpy(y0 + G.gemm(CTX, W(raw, qt, n, F), act_want))
        act, got = nan_f32((T, F)), y0.copy()
        G.swiglu_gemm_add(CTX, gate, up, act, W(raw, qt, n, F), got)
        np.testing.assert_array_equal(cp.asnumpy(act), cp.asnumpy(act_want))
        np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.parametrize("G,hd", [(4, 128), (1, 64), (2, 96), (8, 256)])
def test_attention_planes_are_i16_quantize_of_its_output(G, hd, rng):
    """The combine kernel's planes (attention(planes=...)) have the bits of i16_quantize of the
    attention's output, for head dims of one warp's float4s and more (256) or fewer (64, 96)."""
    n_slots, n_kv, max_ctx = 3, 2, 512
    kv = kv_pages(*_random_cache(rng, n_slots, n_kv, max_ctx, hd), rng)
    lens = np.array([1, 40, 512], dtype=np.int32)
    slots = np.array([2, 0, 1], dtype=np.int32)
    T, H = lens.size, n_kv * G
    q = cp.asarray(rng.standard_normal((T, H, hd)).astype(np.float32))
    want_out = A.attention(CTX, q, kv, 0, cp.asarray(slots), cp.asarray(lens))
    want = [cp.asnumpy(p) for p in MV.i16_quantize(CTX, want_out.reshape(T, H * hd))]
    planes = MV.i16_planes(CTX, T, H * hd)
    for p in planes:
        p.fill(0xFF)  # every entry written, none left over from i16_quantize
    out = nan_f32((T, H, hd))
    A.attention(CTX, q, kv, 0, cp.asarray(slots), cp.asarray(lens), out=out, planes=planes)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(want_out))
    for g, e in zip(planes, want):
        np.testing.assert_array_equal(cp.asnumpy(g), e)


@pytest.mark.parametrize("T", [1, 3, 8, 9])
def test_attention_gemm_equals_attention_then_gemm(T, rng):
    """attention_gemm (the planes made in the combine kernel where the product takes the i16
    matvec; T = 9: the unfused path) gives the attention output and its product with the bits
    of attention and then gemm."""
    n_slots, n_kv, group, hd, max_ctx, n = 2, 2, 4, 128, 256, 96
    kv = kv_pages(*_random_cache(rng, n_slots, n_kv, max_ctx, hd), rng)
    lens = cp.asarray(rng.integers(1, max_ctx + 1, size=T).astype(np.int32))
    slots = cp.asarray(rng.integers(0, n_slots, size=T).astype(np.int32))
    H = n_kv * group
    q = cp.asarray(rng.standard_normal((T, H, hd)).astype(np.float32))
    for qt in (QT.Q8_0, QT.Q4_K, QT.F16):
        raw = cp.asarray(random_weights(qt, n, H * hd, rng))
        attn_want = A.attention(CTX, q, kv, 0, slots, lens)
        want = cp.asnumpy(G.gemm(CTX, W(raw, qt, n, H * hd), attn_want.reshape(T, H * hd)))
        attn, got = nan_f32((T, H, hd)), nan_f32((T, n))
        assert A.attention_gemm(CTX, q, kv, 0, slots, lens, attn, W(raw, qt, n, H * hd), got) is got
        np.testing.assert_array_equal(cp.asnumpy(attn), cp.asnumpy(attn_want))
        np.testing.assert_array_equal(cp.asnumpy(got), want)
