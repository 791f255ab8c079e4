"""The engine's float32 CPU forward pass against an independent float64 Llama written here
(tests/synth_models.py: weights from gguf-py's reader and ``gguf.quants.dequantize``, complex
RoPE, per-head GQA loop): the real SmolLM2 and tiny synthetic models of every matrix type.
Then the properties the pipeline relies on: prefill equals token-by-token decode, a batch equals
its sequences alone, streamed layers equal resident ones, and ntx's dequantization is gguf-py's
bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

import synth_gguf as sg
from ntx.daemons.compute.backend import make_backend
from ntx.shared.kernel_options import KernelOptions
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.model import FileLayerStream, LlamaModel
from ntx.daemons.compute.quants import dequantize
from ntx.shared.gguf_index import open_model

try:
    from .synth_models import ReferenceWeights, patch_u32_kv, reference_logits, rel_err, write_tiny
except ImportError:  # tests/ is not a package
    from synth_models import ReferenceWeights, patch_u32_kv, reference_logits, rel_err, write_tiny

QT = GGMLQuantizationType

# "The capital of France is Paris" in SmolLM2's tokenizer.
SMOL_PROMPT = [504, 3575, 282, 4649, 314, 7042]
PARIS = 7042

# Bounds on max|engine - reference| / max|reference| over all logits of a prompt.
# Both sides use the same dequantized weights (float32 values, exact in float64), so the gap is
# float32 rounding alone: each dot product of length K in [256, 1536] carries a relative error
# of about sqrt(K) * 2^-24 ~ 1e-6 (numpy sums pairwise / BLAS blocks), and the residual stream
# adds these up over the layers without growing them (RMSNorm rescales each layer's input).
# Measured: ~1e-6 on 2-layer synthetic models and ~2e-6 on SmolLM2's 30 layers (max |logit| ~27).
# The bounds leave a 10x margin and are still ~100x below what a real bug moves (ignoring the
# Llama 3.1 RoPE factors alone moves the logits by ~2.5e-3; a wrong pair layout, GQA group or
# eps by far more).
SMOL_TOL = 2e-5
SYNTH_TOL = 1e-5
# Same engine, different pass shapes (T=1 vs T=6 rows; one batch vs two): only the order of the
# float32 sums differs (BLAS picks gemv or a blocked gemm by shape), so the gap is the same
# float32 rounding as above: measured ~2e-6 on SmolLM2, bound 1e-5.
SAME_ENGINE_TOL = 1e-5

_seq_ids = itertools.count(1000)


def run_chunks(model: LlamaModel, chunks: list[tuple[int, int, list[int], bool]]) -> list[np.ndarray]:
    """One pass over ``(seq_id, start_pos, tokens, all_logits)`` chunks; logits per chunk."""
    batch = StepBatch([SeqChunk(s, p, tuple(t), all_logits=a) for s, p, t, a in chunks])
    logits = model.forward(batch)
    return [logits[sl] for sl in batch.logit_slices()]


def prefill_logits(model: LlamaModel, tokens: list[int]) -> np.ndarray:
    """Logits [T, V] of a fresh sequence prefilled with ``tokens`` in one pass."""
    sid = next(_seq_ids)
    model.backend.alloc_sequence(sid, len(tokens) + 8)
    try:
        return run_chunks(model, [(sid, 0, tokens, True)])[0]
    finally:
        model.backend.free_sequence(sid)


# The float32 numpy reference (cpu-quantized=off): what these tests hold to float64 and llama.cpp
# (tests/test_cpu_kernels.py holds the compiled kernels to it in turn).
REFERENCE_KERNELS = KernelOptions(cpu_quantized=False)


def load(path, resident_layers=None, stream=None) -> LlamaModel:
    idx = open_model(path)
    return LlamaModel(idx, make_backend("cpu", idx, kernels=REFERENCE_KERNELS), resident_layers=resident_layers,
                      stream=stream)


# ---------------------------------------------------------------------------------------------
# SmolLM2


@pytest.fixture(scope="module")
def smol_model(smollm2_path) -> LlamaModel:
    return load(smollm2_path)


@pytest.fixture(scope="module")
def smol_prefill(smol_model) -> np.ndarray:
    return prefill_logits(smol_model, SMOL_PROMPT)


def test_smollm2_matches_float64_reference(smollm2_path, smol_prefill):
    ref = reference_logits(ReferenceWeights(smollm2_path), SMOL_PROMPT)
    assert smol_prefill.shape == ref.shape == (len(SMOL_PROMPT), 49152)
    assert smol_prefill.dtype == np.float32
    err = rel_err(smol_prefill, ref)
    assert err < SMOL_TOL, err
    assert np.array_equal(smol_prefill.argmax(axis=1), ref.argmax(axis=1))
    assert int(ref[4].argmax()) == PARIS  # "The capital of France is" -> " Paris"


def test_smollm2_prefill_equals_token_by_token(smol_model, smol_prefill):
    sid = next(_seq_ids)
    smol_model.backend.alloc_sequence(sid, 16)
    try:
        rows = [run_chunks(smol_model, [(sid, i, [t], False)])[0][0] for i, t in enumerate(SMOL_PROMPT)]
    finally:
        smol_model.backend.free_sequence(sid)
    decoded = np.stack(rows)
    err = rel_err(decoded, smol_prefill)
    assert err < SAME_ENGINE_TOL, err
    assert np.array_equal(decoded.argmax(axis=1), smol_prefill.argmax(axis=1))


def test_smollm2_prefill_in_chunks_equals_one_pass(smol_model, smol_prefill):
    sid = next(_seq_ids)
    smol_model.backend.alloc_sequence(sid, 16)
    try:
        a = run_chunks(smol_model, [(sid, 0, SMOL_PROMPT[:4], True)])[0]
        b = run_chunks(smol_model, [(sid, 4, SMOL_PROMPT[4:], True)])[0]
    finally:
        smol_model.backend.free_sequence(sid)
    err = rel_err(np.concatenate([a, b]), smol_prefill)
    assert err < SAME_ENGINE_TOL, err


def test_smollm2_batch_equals_each_sequence_alone(smol_model, smol_prefill):
    """Sequence A decodes its 6th token while sequence B (another prompt) prefills positions
    3..4, in one pass; each gets the logits it gets alone."""
    be = smol_model.backend
    other = [1, 504, 2365, 1345, 282, 260]  # a different prompt
    alone_b = prefill_logits(smol_model, other[:5])
    a, b = next(_seq_ids), next(_seq_ids)
    be.alloc_sequence(a, 16)
    be.alloc_sequence(b, 16)
    try:
        run_chunks(smol_model, [(a, 0, SMOL_PROMPT[:5], False)])
        run_chunks(smol_model, [(b, 0, other[:3], False)])
        la, lb = run_chunks(smol_model, [(a, 5, SMOL_PROMPT[5:], False), (b, 3, other[3:5], True)])
    finally:
        be.free_sequence(a)
        be.free_sequence(b)
    assert la.shape == (1, 49152) and lb.shape == (2, 49152)
    assert rel_err(la[0], smol_prefill[5]) < SAME_ENGINE_TOL
    assert rel_err(lb, alone_b[3:5]) < SAME_ENGINE_TOL
    assert la[0].argmax() == smol_prefill[5].argmax()
    assert np.array_equal(lb.argmax(axis=1), alone_b[3:5].argmax(axis=1))


class RecordingStream(FileLayerStream):
    """FileLayerStream that records which layers it served, and checks the order of calls."""

    def __init__(self, index) -> None:
        super().__init__(index)
        self.acquired: list[tuple[int, int]] = []
        self.open: int | None = None

    def acquire(self, layer_idx, pass_id):
        assert self.open is None, "a layer was acquired before the previous one was released"
        self.open = layer_idx
        self.acquired.append((pass_id, layer_idx))
        return super().acquire(layer_idx, pass_id)

    def release(self, layer_idx, pass_id):
        assert self.open == layer_idx
        self.open = None


def test_smollm2_streamed_layers_equal_resident(smollm2_path, smol_prefill):
    idx = open_model(smollm2_path)
    stream = RecordingStream(idx)
    resident = list(range(0, 30, 3))
    model = LlamaModel(idx, make_backend("cpu", idx, kernels=REFERENCE_KERNELS), resident_layers=resident,
                       stream=stream)
    assert model.streamed_layers == [i for i in range(30) if i not in resident]
    got = prefill_logits(model, SMOL_PROMPT)
    assert [layer for _, layer in stream.acquired] == model.streamed_layers
    # the same bytes dequantized the same way: identical results
    assert np.array_equal(got, smol_prefill)


# ---------------------------------------------------------------------------------------------
# Synthetic models: every matrix type and the shapes the generator supports

SYNTH_PROMPT = [5, 300, 37, 400, 2, 301, 77, 9, 11, 200, 250, 120, 33, 511, 0, 64,
                97, 98, 99, 260, 261, 7, 8, 42]

SYNTH_CASES = {t: dict(type=t) for t in (*sg.MATRIX_TYPES, "Q4_K_M")} | {
    "tied": dict(tied_embeddings=True, type="Q8_0"),
    "rope_freqs": dict(rope_freqs=True, type="Q6_K"),
    "head_dim_32": dict(head_dim=32, type="Q4_K_M"),   # q_dim 128 < d_model; attn_output falls back to Q5_0
    "head_dim_128": dict(head_dim=128, type="Q5_K"),   # q_dim 512 > d_model
    "mqa": dict(n_kv_heads=1, type="Q4_0"),
    "mha": dict(n_kv_heads=4, type="Q5_1"),
    "rope_base_500k": dict(rope_base=500000.0, rope_freqs=True, type="F16"),
    # RoPE on the first 32 of 64 dims (rope.dimension_count patched after writing)
    "rope_dim_32": dict(type="Q8_0", rope_dim=32),
    # Qwen2: q, k, v biases and RoPE on each head's halves (NEOX), on all dims and on the first 32
    "qwen2": dict(arch="qwen2", type="Q4_K_M"),
    "qwen2_rope_dim_32": dict(arch="qwen2", type="Q8_0", rope_dim=32),
}


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("synth")


@pytest.mark.parametrize("case", list(SYNTH_CASES))
def test_synthetic_matches_float64_reference(synth_dir, case):
    kw = dict(SYNTH_CASES[case])
    rope_dim = kw.pop("rope_dim", None)
    path = write_tiny(synth_dir, f"{case}.gguf", **kw)
    if rope_dim is not None:
        patch_u32_kv(path, f"{kw.get('arch', 'llama')}.rope.dimension_count", rope_dim)
    idx = open_model(path)
    if rope_dim is not None:
        assert (idx.hparams.rope_dim, idx.hparams.head_dim) == (rope_dim, 64)
    types = {t.type_name for layer in idx.layers for t in layer.tensors.values() if len(t.shape) == 2}
    if kw["type"] == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= types
    else:
        assert kw["type"] in types
    hp = idx.hparams
    assert hp.tied_embeddings == kw.get("tied_embeddings", False)
    assert ("rope_freqs" in idx.globals) == kw.get("rope_freqs", False)
    if "head_dim" in kw:
        assert hp.head_dim == kw["head_dim"] != hp.n_embd // hp.n_head

    model = LlamaModel(idx, make_backend("cpu", idx, kernels=REFERENCE_KERNELS))
    got = prefill_logits(model, SYNTH_PROMPT)
    w = ReferenceWeights(path)
    ref = reference_logits(w, SYNTH_PROMPT)
    err = rel_err(got, ref)
    assert err < SYNTH_TOL, err
    assert np.array_equal(got.argmax(axis=1), ref.argmax(axis=1))
    if kw.get("rope_freqs"):
        # the comparison is sensitive to the Llama 3.1 factors: ignoring them is far outside
        without = rel_err(reference_logits(w, SYNTH_PROMPT, rope_factors=False), ref)
        assert without > 50 * SYNTH_TOL, without
    if kw.get("arch") == "qwen2":
        # ... and to Qwen2's two differences: Llama's RoPE pairs, or no biases, are far outside
        assert hp.qkv_bias and hp.rope_neox and "attn_k.bias" in idx.layers[1].tensors
        w.neox = False
        assert rel_err(reference_logits(w, SYNTH_PROMPT), ref) > 50 * SYNTH_TOL
        w.neox, w.has = True, lambda name: not name.endswith(".bias") and name in w.tensors
        assert rel_err(reference_logits(w, SYNTH_PROMPT), ref) > 50 * SYNTH_TOL
        del w.has
        # the biases are in the layer's image: a streamed layer brings them as a resident one has them
        streamed = LlamaModel(idx, make_backend("cpu", idx, kernels=REFERENCE_KERNELS), resident_layers=[0],
                              stream=FileLayerStream(idx, [1]))
        assert np.array_equal(prefill_logits(streamed, SYNTH_PROMPT), got)
    if rope_dim is not None:
        # ... and to how many dims RoPE turns: rotating all of them is far outside
        w.rope_dim = w.head_dim
        full_rope = rel_err(reference_logits(w, SYNTH_PROMPT), ref)
        assert full_rope > 50 * SYNTH_TOL, full_rope


def test_synthetic_prefill_decode_batch_and_streaming(tmp_path):
    """On a Q4_K_M split set (a layer cut across two files): prefill == token by token ==
    chunks, a mixed batch == each alone, and streamed layers == resident ones exactly."""
    single = write_tiny(tmp_path, "m.gguf", n_layers=4, type="Q4_K_M", rope_freqs=True)
    shards = sg.split_gguf(single, 3, out=tmp_path / "set.gguf")
    resident = load(shards[0])
    assert any(len(layer.spans) == 2 for layer in resident.index.layers)
    full = prefill_logits(resident, SYNTH_PROMPT)
    assert rel_err(full, reference_logits(ReferenceWeights(single), SYNTH_PROMPT)) < SYNTH_TOL

    be = resident.backend
    sid = next(_seq_ids)
    be.alloc_sequence(sid, 32)
    rows = [run_chunks(resident, [(sid, i, [t], False)])[0][0] for i, t in enumerate(SYNTH_PROMPT)]
    be.free_sequence(sid)
    assert rel_err(np.stack(rows), full) < SAME_ENGINE_TOL
    assert np.array_equal(np.stack(rows).argmax(axis=1), full.argmax(axis=1))

    other = SYNTH_PROMPT[::-1]
    other_full = prefill_logits(resident, other)
    a, b = next(_seq_ids), next(_seq_ids)
    be.alloc_sequence(a, 32)
    be.alloc_sequence(b, 32)
    run_chunks(resident, [(a, 0, SYNTH_PROMPT[:10], False)])
    lb, la = run_chunks(resident, [(b, 0, other[:7], True), (a, 10, SYNTH_PROMPT[10:11], False)])
    lb2, la2 = run_chunks(resident, [(b, 7, other[7:9], True), (a, 11, SYNTH_PROMPT[11:12], False)])
    be.free_sequence(a)
    be.free_sequence(b)
    assert rel_err(la[0], full[10]) < SAME_ENGINE_TOL and rel_err(la2[0], full[11]) < SAME_ENGINE_TOL
    assert rel_err(np.concatenate([lb, lb2]), other_full[:9]) < SAME_ENGINE_TOL

    stream = RecordingStream(resident.index)
    streamed = LlamaModel(resident.index, make_backend("cpu", resident.index, kernels=REFERENCE_KERNELS),
                          resident_layers=[0, 3], stream=stream)
    got = prefill_logits(streamed, SYNTH_PROMPT)
    assert [layer for _, layer in stream.acquired] == [1, 2]
    assert np.array_equal(got, full)
    nothing_resident = LlamaModel(resident.index, make_backend("cpu", resident.index, kernels=REFERENCE_KERNELS),
                                  resident_layers=[], stream=FileLayerStream(resident.index))
    assert np.array_equal(prefill_logits(nothing_resident, SYNTH_PROMPT), full)


# ---------------------------------------------------------------------------------------------
# Dequantization


@pytest.mark.parametrize("type_name", sg.MATRIX_TYPES)
def test_dequantize_is_gguf_py_bit_for_bit(type_name):
    qt = QT[type_name]
    block_elems, block_bytes = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(sum(map(ord, type_name)))
    rows, blocks_per_row = 6, 3
    cols = blocks_per_row * block_elems
    blocks = sg.make_blocks(qt, rows * blocks_per_row, 0.05, rng)  # [n_blocks, block_bytes] uint8
    assert blocks.shape == (rows * blocks_per_row, block_bytes)
    raw = np.ascontiguousarray(blocks).reshape(-1)
    # a slot holds more than the tensor: dequantize must use exactly the tensor's bytes
    slot = np.concatenate([raw, rng.integers(0, 256, 64, dtype=np.uint8)])

    got = dequantize(slot, qt, (rows, cols))
    want = gq.dequantize(blocks.reshape(rows, -1), qt)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    assert want.shape == (rows, cols)
    assert np.isfinite(want).all()
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    # a fresh array: the slot may be reused as soon as dequantize returns
    assert not np.shares_memory(got, slot)
    # one-dimensional tensors too (norm weights are stored like this)
    got1 = dequantize(raw[: blocks_per_row * block_bytes], qt, (cols,))
    assert got1.shape == (cols,)
    assert np.array_equal(got1.view(np.uint32), want[0].astype(np.float32).view(np.uint32))
