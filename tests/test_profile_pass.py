"""scripts/profile_pass.py without a GPU: the aggregation and table from synthetic event times,
and the recording wrapper walking a real pass of a tiny model on the CPU backend (the CUDA
events and the spin kernel are the parts only the GPU run checks)."""

from __future__ import annotations

import numpy as np
import pytest

import profile_pass as pp  # scripts/ (tests/conftest.py puts it on sys.path)
from ntx.daemons.compute.backend import Pick
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.cpu_backend import CpuBackend
from ntx.daemons.compute.model import LlamaModel
from ntx.shared.gguf_index import open_model
from tests.synth_models import write_tiny

Q = "matmul attn_q Q4_K [64x64]"
DOWN = "matmul ffn_down Q6_K [64x128]"


def _rep(q_us: list[float], down_us: list[float], attn_us: list[float]) -> list[pp.Sample]:
    """One recorded pass of len(q_us) layers: q, attention, down per layer (1000 and 3000 weight bytes)."""
    rep: list[pp.Sample] = [("embed", 1.0, 0)]
    for q, a, d in zip(q_us, attn_us, down_us):
        rep += [(Q, q, 1000), ("attention", a, 0), (DOWN, d, 3000)]
    return rep


def test_aggregate_takes_per_operation_medians_over_reps():
    reps = [_rep([10, 10], [30, 30], [5, 5]), _rep([12, 12], [31, 31], [5, 6]), _rep([50, 50], [29, 29], [4, 5])]
    prof = pp.aggregate(reps)
    ops = {op["op"]: op for op in prof["ops"]}
    # per-rep totals of q: 20, 24, 100 -> median 24 (the outlier rep does not move it)
    assert ops[Q]["total_us"] == 24.0 and ops[Q]["calls"] == 2 and ops[Q]["per_call_us"] == 12.0
    assert ops[DOWN]["total_us"] == 60.0 and ops["attention"]["total_us"] == 10.0 and ops["embed"]["total_us"] == 1.0
    # the pass is the sum of the medians; shares add up to 1; largest first
    assert prof["kernels_ms"] == pytest.approx((24 + 60 + 10 + 1) / 1e3)
    assert sum(op["share"] for op in prof["ops"]) == pytest.approx(1.0, abs=1e-3)
    assert [op["op"] for op in prof["ops"]] == [DOWN, Q, "attention", "embed"]
    # GB/s of weight bytes: q read 2 x 1000 bytes in 24 µs
    assert ops[Q]["weight_gbps"] == pytest.approx(2000 / 24e-6 / 1e9, abs=0.1)
    assert ops["attention"]["weight_gbps"] is None
    assert prof["weight_bytes"] == 8000 and prof["ops_per_pass"] == 7
    kinds = {k["kind"]: k for k in prof["by_kind"]}
    assert kinds["matmul"]["calls"] == 4 and kinds["matmul"]["total_us"] == 84.0
    assert kinds["matmul"]["share"] == pytest.approx(84 / 95, abs=1e-4)


def test_aggregate_refuses_passes_that_ran_different_operations():
    with pytest.raises(ValueError, match="different operations"):
        pp.aggregate([_rep([1, 1], [1, 1], [1, 1]), _rep([1], [1], [1])])
    with pytest.raises(ValueError, match="no recorded operations"):
        pp.aggregate([])


def test_table_shows_the_engine_pass_against_the_kernels():
    prof = pp.aggregate([_rep([10] * 2, [30] * 2, [5] * 2)])
    prof.update(engine_pass="graph", engine_pass_ms=0.1, exposed_ops=3)
    text = pp.format_profile("8B decode", prof)
    lines = text.splitlines()
    assert lines[0] == "== 8B decode: medians of 1 passes"
    assert lines[1].startswith("graph pass 0.100 ms vs sum of kernels 0.091 ms: +0.009 ms (+9.0% of the pass)")
    assert "WARNING: in some pass the GPU caught up with Python in 3 of 7 operations" in text
    down_row = next(line for line in lines if line.endswith(DOWN))
    assert down_row.split()[:4] == ["65.9%", "60.0", "2", "30.00"]
    assert lines[-1] == "by kind: matmul 87.9%, attention 11.0%, embed 1.1%"


class _ListRecorder:
    """EventRecorder's interface with made-up times: 1 µs per operation."""

    def __init__(self):
        self.labels: list[tuple[str, int]] = []
        self.begun = 0
        self.exposed = 0
        self.queued_s = 0.001

    def begin(self):
        self.begun += 1
        self.labels.clear()

    def mark(self, label, weight_bytes):
        self.labels.append((label, weight_bytes))

    def finish(self):
        return [(label, 1.0, nbytes) for label, nbytes in self.labels]


class _CpuWithDeviceHead(CpuBackend):
    """The cuda backend's head entry point (final norm + head, logits left where computed)."""

    def _logits_dev(self, ws):
        return self.logits(ws)


def _top(logits, k):
    return np.argsort(-logits, axis=1)[:, :k]


def _fuses(T, w):
    """CudaBackend.attention_fuses's row rule: up to 8 rows the attention and W_o are one op."""
    return T <= 8


def test_profiled_pass_records_every_operation_of_the_model(tmp_path):
    index = open_model(write_tiny(tmp_path))
    hp = index.hparams
    backend = _CpuWithDeviceHead(index)
    model = LlamaModel(index, backend)
    for s in (1, 2):
        backend.alloc_sequence(s, 16)
    batch = StepBatch([SeqChunk(1, 0, (5,)), SeqChunk(2, 0, (7,))])
    recorder = _ListRecorder()
    prof = pp.profile_pass(model, batch, [Pick(1)] * 2, reps=3, recorder=recorder, topk=_top, fused_attention=_fuses)
    assert model.backend is backend  # handed back
    assert recorder.begun == 4  # one warm-up pass, then the 3 recorded
    labels = [label for label, _ in recorder.labels]
    # a norm and the products of its output (q, k, v; gate, up) are one operation: the backend
    # quantizes x once, in the norm's kernel; the down projection adds into x in its own; the
    # rotation stores the keys; the attention quantizes its output for W_o
    layer = ["matmul attn_q", "rope+kv_write", "matmul attn_output", "matmul ffn_gate",
             "matmul ffn_down"]
    assert len(labels) == 1 + hp.n_layers * len(layer) + 2
    assert labels[0] == "embed" and labels[-1] == "topk" and labels[-2].startswith("head rmsnorm+matvec ")
    assert [" ".join(lb.split()[:2]) if lb.startswith("matmul") else lb for lb in labels[1:1 + len(layer)]] == layer
    ts = index.layers[0].tensors
    qkv_label = "matmul " + " + ".join(f"{n} {ts[n].type_name} [{ts[n].shape[0]}x{ts[n].shape[1]}]"
                                       for n in ("attn_q", "attn_k", "attn_v")) + " with its rms_norm"
    assert qkv_label in labels
    assert any(lb.endswith(" with its add_rms_norm") for lb in labels)
    assert any(lb.startswith("matmul ffn_down") and lb.endswith(" with its swiglu + add") for lb in labels)
    assert any(lb.startswith("matmul attn_output") and lb.endswith(" with its attention") for lb in labels)
    qkv = [op for op in prof["ops"] if op["op"].startswith("matmul attn_q")]  # one label per layer's types
    assert sum(op["calls"] for op in qkv) == hp.n_layers and sum(op["total_us"] for op in qkv) == hp.n_layers
    assert prof["engine_pass"] == "eager" and prof["engine_pass_ms"] > 0 and prof["reps"] == 3
    assert prof["kernels_ms"] == pytest.approx(len(labels) / 1e3)
    # a prefill of 9 rows: the backend runs the attention and W_o apart, and so does the profile
    backend.alloc_sequence(3, 16)
    pp.profile_pass(model, StepBatch([SeqChunk(3, 0, tuple(range(9)))]), [Pick(1)], reps=1, recorder=recorder,
                    topk=_top, fused_attention=_fuses)
    labels = [label for label, _ in recorder.labels]
    assert labels.count("attention") == hp.n_layers and not any(lb.endswith(" with its attention") for lb in labels)
    assert labels.index("attention") + 1 == next(i for i, lb in enumerate(labels) if lb.startswith("matmul attn_output"))
