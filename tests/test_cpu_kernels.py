"""The CPU backend's compiled kernels (daemons/compute/cpu_kernels.py, cpu_ops.py) against the
float32 numpy reference, for every type and shape class; then the whole model on the real
SmolLM2, quantized against the reference.

Tolerances. The packed forms hold GGUF's values exactly, so dequantizing them is bit for bit
gguf-py's. A product with x rounded to int8 per 32 values (as llama.cpp's CPU kernels do) errs by
at most half a step of that rounding per activation, amax/254 of its block: on random weights a
product's largest error is measured at 0.3-0.7% of its largest output; the bound is 2%. F32, F16
and BF16 matrices multiply float32 x through BLAS: only float32 rounding (bound 1e-5). On SmolLM2 the 30 layers' int8 rounding moves the prompt's logits by about
4% of the largest logit; the bound that matters is what the model predicts: the same top token
where the reference has a clear winner, and the mean log-likelihood of real text within 1%.
"""

from __future__ import annotations

import itertools
import os
import pathlib

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

import synth_gguf as sg
from ntx.daemons.compute import cpu_kernels as ck
from ntx.daemons.compute.backend import make_backend
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.cpu_backend import CpuBackend
from ntx.daemons.compute.model import LlamaModel
from ntx.daemons.compute.quants import dequantize
from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import open_model
from ntx.shared.kernel_options import KernelOptions

try:
    from .synth_models import rel_err
except ImportError:
    from synth_models import rel_err

INT8_TOL = 0.02
FLOAT_TOL = 1e-5
# max |int8 - float32| / max |float32| over a tiny synthetic model's logits: measured 0.010 for a
# Qwen2 shape and 0.016 for the Llama one of the same seed (the activations' int8 rounding)
QWEN2_INT8_TOL = 0.05
# (rows, columns): whole groups of 128 rows (lanes_for), and the last one padded
SHAPES = [(256, 256), (192, 512), (96, 256), (40, 512), (33, 256)]


def _matrix(qt: QT, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random valid GGUF bytes of an [n, k] matrix of type ``qt`` and their float32 values."""
    block_elems, _ = GGML_QUANT_SIZES[qt]
    raw = sg.make_blocks(qt, n * k // block_elems, 0.05, np.random.default_rng(seed)).reshape(-1)
    return raw, dequantize(raw, qt, (n, k))


@pytest.mark.parametrize("type_name", [t.name for t in ck.SUPPORTED_TYPES])
def test_packed_rows_dequantize_bit_for_bit(type_name):
    qt = QT[type_name]
    for n, k in SHAPES:
        raw, ref = _matrix(qt, n, k, n + k)
        w = ck.pack(raw, qt, n, k)
        assert w.lanes == ck.lanes_for(n) or w.form == "f32"
        rows = np.array([0, n - 1, n // 2, 1], dtype=np.int64)
        assert np.array_equal(ck.dequantize_rows(w, rows), ref[rows])
        assert np.array_equal(ck.dequantize_rows(w, np.arange(n)), ref)
        if w.form != "f32":
            assert w.nbytes == ck.packed_bytes(qt, n, k)


@pytest.mark.parametrize("type_name", [t.name for t in ck.SUPPORTED_TYPES])
def test_products_match_the_float_reference(type_name):
    qt = QT[type_name]
    rng = np.random.default_rng(7)
    for n, k in SHAPES:
        raw, ref = _matrix(qt, n, k, n * k)
        w = ck.pack(raw, qt, n, k)
        for T in (1, 3, 20):
            x = rng.standard_normal((T, k)).astype(np.float32)
            out = np.empty((T, n), np.float32)
            ck.matmul(w, x, out)
            tol = FLOAT_TOL if w.form == "f32" else INT8_TOL
            assert rel_err(out, x @ ref.T) < tol, (type_name, n, k, T)


def test_a_row_gets_the_same_bits_alone_or_batched_and_on_any_thread_count(monkeypatch):
    """Each output is one thread's fixed sequence of operations: its bits depend neither on the
    other rows nor on whether the product ran in parallel."""
    raw, _ = _matrix(QT.Q4_K, 512, 1024, 3)
    w = ck.pack(raw, QT.Q4_K, 512, 1024)
    x = np.random.default_rng(4).standard_normal((40, 1024)).astype(np.float32)
    batched = ck.matmul(w, x, np.empty((40, 512), np.float32))
    alone = ck.matmul(w, x[3:4], np.empty((1, 512), np.float32))
    assert np.array_equal(alone[0], batched[3])
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        monkeypatch.setattr(ck, "PARALLEL_FROM_MACS", 0)
        parallel = ck.matmul(w, x, np.empty((40, 512), np.float32))
        monkeypatch.setattr(ck, "PARALLEL_FROM_MACS", 1 << 62)
        serial = ck.matmul(w, x, np.empty((40, 512), np.float32))
    finally:
        numba.set_num_threads(threads)
    assert np.array_equal(parallel, serial) and np.array_equal(parallel, batched)


@pytest.mark.parametrize("type_name", [t.name for t in ck.C4_TYPES + ck.C8_TYPES])
def test_the_vnni_layout_gives_the_int16_layouts_bits(type_name, monkeypatch):
    """Where the CPU has AVX-512 VNNI, quantized matrices take the c4v / c8v layouts (vpdpbusd;
    the signed 8-bit values shifted by 128 and the shift's sum taken off exactly), Q6_K the c6v
    one (6 bits a value, shifted by 32, rebuilt in registers); their products and rows are bit for
    bit the int16 kernels', at one row and several (taken up to 8 at a time through the
    weights), rows not a multiple of 128 included, and each
    holds what ``packed_bytes`` says (c6v a quarter less than c8's values)."""
    if not ck._host_has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI: only the int16 layout runs here")
    qt = QT[type_name]
    for n, k in ((256, 512), (40, 512), (576, 256)):
        raw, _ = _matrix(qt, n, k, n + k)
        monkeypatch.setattr(ck, "VNNI", True)
        v = ck.pack(raw, qt, n, k)
        assert v.nbytes == ck.packed_bytes(qt, n, k)
        monkeypatch.setattr(ck, "VNNI", False)
        i16 = ck.pack(raw, qt, n, k)
        assert i16.nbytes == ck.packed_bytes(qt, n, k)
        assert (v.form, i16.form) in (("c4v", "c4"), ("c8v", "c8"), ("c6v", "c8"))
        assert (v.form == "c6v") == (qt == QT.Q6_K)
        if v.form == "c6v":
            assert v.q.nbytes * 4 == i16.q.nbytes * 3
        else:
            assert v.nbytes == i16.nbytes
        for T in (1, 2, 3, 4, 7, 9, 13):  # rows go through the weights up to 8 at a time
            x = np.random.default_rng(T).standard_normal((T, k)).astype(np.float32)
            assert np.array_equal(ck.matmul(v, x, np.empty((T, n), np.float32)), ck.matmul(i16, x, np.empty((T, n), np.float32)))
        rows = np.arange(n, dtype=np.int64)
        assert np.array_equal(ck.dequantize_rows(v, rows), ck.dequantize_rows(i16, rows))


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q4_K"), ("Q4_1", "Q4_1"), ("Q6_K", "Q6_K"), ("Q8_0", "Q8_0")])
def test_fused_products_give_each_matrix_its_own_bits(types):
    """q, k and v (or gate and up) held end to end and multiplied as one product give each
    matrix's outputs bit for bit, rows not a multiple of 128 included; the parts are views."""
    rows = (576, 192, 192)[: len(types)]
    mats = [ck.pack(_matrix(QT[t], n, 512, i)[0], QT[t], n, 512) for i, (t, n) in enumerate(zip(types, rows))]
    alone = [ck.pack(_matrix(QT[t], n, 512, i)[0], QT[t], n, 512) for i, (t, n) in enumerate(zip(types, rows))]
    group = ck.fuse(mats)
    assert group is not None and all(np.shares_memory(p.q, group.whole.q) for p in group.parts)
    x = ck.QuantizedActivations(np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32))
    outs = [np.empty((3, n), np.float32) for n in rows]
    group.product(x, outs)
    for w, part, out in zip(alone, group.parts, outs):
        assert np.array_equal(out, ck.matmul(w, x, np.empty_like(out)))
        assert np.array_equal(ck.dequantize_rows(part, np.arange(part.n_rows)), ck.dequantize_rows(w, np.arange(w.n_rows)))


def test_matrices_of_different_forms_are_not_fused():
    """A Q4_K_M layer's v is often Q6_K beside a Q4_K q and k: those three stay apart."""
    q4k = ck.pack(_matrix(QT.Q4_K, 256, 512, 1)[0], QT.Q4_K, 256, 512)
    q6k = ck.pack(_matrix(QT.Q6_K, 128, 512, 2)[0], QT.Q6_K, 128, 512)
    assert ck.fuse([q4k, q6k]) is None and ck.fuse([q4k]) is None


def test_a_type_without_a_kernel_is_one_clear_error():
    with pytest.raises(ConfigError, match="no CPU kernel for Q2_K .*supported: Q4_0"):
        ck.pack(np.zeros(84 * 4, np.uint8), QT.Q2_K, 4, 256)


def test_thread_count_comes_from_the_environment(monkeypatch):
    threads = numba.get_num_threads()
    try:
        monkeypatch.setenv("NTX_CPU_THREADS", "1")
        assert ck.set_threads() == 1 and numba.get_num_threads() == 1
        monkeypatch.setenv("NTX_CPU_THREADS", "lots")
        with pytest.raises(ConfigError, match="NTX_CPU_THREADS='lots' is not a number"):
            ck.set_threads()
        with pytest.raises(ConfigError, match="at most"):
            ck.set_threads(numba.config.NUMBA_NUM_THREADS + 1)
    finally:
        numba.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# The whole model on the real SmolLM2: quantized (the default) against the float32 reference

_seq_ids = itertools.count(5000)
TEXT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "draft_tasks" / "summarise.txt"


@pytest.fixture(scope="module")
def smol_pair(smollm2_path):
    idx = open_model(smollm2_path)
    quantized = LlamaModel(idx, make_backend("cpu", idx, max_seqs=4, max_ctx=512))
    reference = LlamaModel(idx, make_backend("cpu", idx, max_seqs=4, max_ctx=512,
                                             kernels=KernelOptions(cpu_quantized=False)))
    assert quantized.backend.quantized and not reference.backend.quantized
    return quantized, reference


def _logits(model: LlamaModel, chunks: list[tuple[int, int, list[int]]]) -> list[np.ndarray]:
    batch = StepBatch([SeqChunk(s, p, tuple(t), all_logits=True) for s, p, t in chunks])
    logits = model.forward(batch)
    return [logits[sl] for sl in batch.logit_slices()]


def _decode_one_by_one(model: LlamaModel, tokens: list[int]) -> np.ndarray:
    sid = next(_seq_ids)
    model.backend.alloc_sequence(sid, len(tokens) + 8)
    try:
        return np.concatenate([_logits(model, [(sid, i, [t])])[0] for i, t in enumerate(tokens)])
    finally:
        model.backend.free_sequence(sid)


def _prefill(model: LlamaModel, tokens: list[int]) -> np.ndarray:
    sid = next(_seq_ids)
    model.backend.alloc_sequence(sid, len(tokens) + 8)
    try:
        return _logits(model, [(sid, 0, tokens)])[0]
    finally:
        model.backend.free_sequence(sid)


def _mean_nll(logits: np.ndarray, targets: list[int]) -> float:
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1)) + z.max(axis=1)
    return float(np.mean(lse - z[np.arange(len(targets)), targets]))


def test_quantized_decode_predicts_real_text_as_the_reference(smol_pair):
    """Token by token (the int8 kernels' passes) over 96 tokens of real text: the same top token
    wherever the reference's winner leads by more than 0.5, and the mean negative
    log-likelihood within 1% of the reference's."""
    quantized, reference = smol_pair
    from ntx.ctl.tokenizer import Tokenizer

    tokens = Tokenizer.from_metadata(quantized.index.metadata).encode(TEXT.read_text())[:97]
    q = _decode_one_by_one(quantized, tokens[:-1])
    r = _prefill(reference, tokens[:-1])  # [96, V] float32 reference
    top2 = np.sort(r, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() > 40
    assert np.array_equal(q.argmax(axis=1)[clear], r.argmax(axis=1)[clear])
    nll_q, nll_r = _mean_nll(q, tokens[1:]), _mean_nll(r, tokens[1:])
    assert abs(nll_q - nll_r) / nll_r < 0.01, (nll_q, nll_r)


def test_kept_layers_fuse_their_products_with_the_same_logits(smol_pair, smollm2_path, monkeypatch):
    """SmolLM2's resident layers hold q, k, v and gate, up end to end (one product each); a
    model whose layers keep them apart gives the same logits bit for bit."""
    quantized, _ = smol_pair
    w = quantized.resident[0]
    assert w["attn_q"].data.fused is w["attn_v"].data.fused and w["ffn_gate"].data.fused is w["ffn_up"].data.fused
    idx = open_model(smollm2_path)
    monkeypatch.setattr(CpuBackend, "FUSED", ())
    apart = LlamaModel(idx, make_backend("cpu", idx, max_seqs=4, max_ctx=512))
    assert getattr(apart.resident[0]["attn_q"].data, "fused", None) is None
    prompt = [504, 3575, 282, 4649, 314, 7042]
    assert np.array_equal(_prefill(apart, prompt), _prefill(quantized, prompt))
    assert np.array_equal(_decode_one_by_one(apart, prompt), _decode_one_by_one(quantized, prompt))


def test_quantized_prefill_decode_and_batch_agree_bit_for_bit(smol_pair):
    """A row gets the same bits whatever else its pass holds: a prompt prefilled in one pass,
    decoded token by token, or beside another sequence (batch invariance)."""
    quantized, _ = smol_pair
    prompt = [504, 3575, 282, 4649, 314, 7042]
    other = [1, 504, 2365, 1345, 282, 260]
    together = _prefill(quantized, prompt)
    assert np.array_equal(_decode_one_by_one(quantized, prompt), together)
    a, b = next(_seq_ids), next(_seq_ids)
    for sid in (a, b):
        quantized.backend.alloc_sequence(sid, 16)
    try:
        _logits(quantized, [(a, 0, prompt[:5])])
        _logits(quantized, [(b, 0, other[:3])])
        la, _ = _logits(quantized, [(a, 5, prompt[5:]), (b, 3, other[3:5])])
    finally:
        for sid in (a, b):
            quantized.backend.free_sequence(sid)
    assert np.array_equal(la[0], together[5])


def test_quantized_tree_rows_see_only_their_branch(smol_pair):
    """A tree chunk's rows (speculation) get the logits each branch gets as a plain chain."""
    quantized, _ = smol_pair
    prompt = [504, 3575, 282, 4649]
    tree_tokens, parents = (314, 7042, 2365, 1345), (-1, 0, 0, 2)  # branches 314-7042 and 314-2365-1345
    sid = next(_seq_ids)
    quantized.backend.alloc_sequence(sid, 32)
    try:
        _logits(quantized, [(sid, 0, prompt)])
        batch = StepBatch([SeqChunk(sid, 4, tree_tokens, all_logits=True, parents=parents)])
        tree = quantized.forward(batch)
    finally:
        quantized.backend.free_sequence(sid)
    chain_a = _prefill(quantized, prompt + [314, 7042])[4:]
    chain_b = _prefill(quantized, prompt + [314, 2365, 1345])[4:]
    assert np.array_equal(tree[[0, 1]], chain_a)
    assert np.array_equal(tree[[0, 2, 3]], chain_b)


def test_a_numba_target_without_vnni_takes_the_int16_layouts():
    """``NUMBA_CPU_NAME=generic`` (numba compiling for no CPU in particular, e.g. for a cache
    shared by several machines): VNNI is off whatever the host has, and the products run. (With
    it on, LLVM aborted the whole process on vpdpbusd.) A fresh process: numba reads its
    configuration once."""
    import subprocess
    import sys

    code = ("import numpy as np; from gguf import GGMLQuantizationType as QT; "
            "from ntx.daemons.compute import cpu_kernels as ck; "
            "rng = np.random.default_rng(0); w = ck.pack(np.zeros(256 * 256 // 256 * 144, np.uint8), QT.Q4_K, 256, 256); "
            "out = ck.matmul(w, rng.standard_normal((1, 256)).astype(np.float32), np.empty((1, 256), np.float32)); "
            "print(ck.VNNI, w.form, bool(np.all(out == 0)))")
    env = {**os.environ, "NUMBA_CPU_NAME": "generic"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "c4", "True"]


def test_qwen2_quantized_layers_follow_the_reference(tmp_path):
    """A Qwen2-shaped model (q, k, v biases, each head's halves rotated) on the int8 kernels,
    kept layers fused: prefill, decode one by one and the float32 reference agree, the first two
    bit for bit (rows are independent) and the reference within the activations' int8 rounding."""
    path = sg.write_llama_gguf(tmp_path / "qwen2.gguf", sg.preset_config(
        "tiny", n_layers=2, arch="qwen2", type="Q4_K_M", seed=3))
    idx = open_model(path)
    quantized = LlamaModel(idx, make_backend("cpu", idx, max_seqs=4, max_ctx=64))
    reference = LlamaModel(idx, make_backend("cpu", idx, max_seqs=4, max_ctx=64,
                                             kernels=KernelOptions(cpu_quantized=False)))
    assert quantized.resident[0]["attn_q"].data.fused is quantized.resident[0]["attn_v"].data.fused
    prompt = [5, 300, 37, 400, 2, 301, 77, 9, 11, 200]
    pre = _prefill(quantized, prompt)
    assert np.array_equal(pre, _decode_one_by_one(quantized, prompt))
    assert rel_err(pre, _prefill(reference, prompt)) < QWEN2_INT8_TOL
