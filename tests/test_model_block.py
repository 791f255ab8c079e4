"""The model's order of work over the backend seam: one block for every backend, capture as an
explicit request for each run of resident layers, the pass counter and a failed pass's abort,
and the one RoPE scaling formula."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ntx.daemons.compute.backend import rope_divisors
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.cpu_backend import CpuBackend
from ntx.daemons.compute.model import FileLayerStream, LlamaModel
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import RopeScaling, open_model

PROMPT = (504, 3575, 282, 4649, 314)


class RecordingBackend(CpuBackend):
    """The cpu backend, noting what the model asks of it beyond operations."""

    def __init__(self, index) -> None:
        super().__init__(index)
        self.captures: list = []
        self.embeds = 0

    def run_captured(self, key, ws, run) -> None:
        self.captures.append(key)
        run()

    def embed(self, ws):
        self.embeds += 1
        return super().embed(ws)


class FailingStream(FileLayerStream):
    """Serves layers from the file, except ``fail_layer`` of pass ``fail_pass``."""

    def __init__(self, index, fail_pass: int, fail_layer: int, resume_at: int) -> None:
        super().__init__(index)
        self.fail_pass, self.fail_layer, self.resume_at = fail_pass, fail_layer, resume_at
        self.acquired: list[tuple[int, int]] = []
        self.aborted: list[int] = []

    def acquire(self, layer_idx, pass_id):
        if (pass_id, layer_idx) == (self.fail_pass, self.fail_layer):
            raise NtxError(f"layer {layer_idx} could not be loaded")
        self.acquired.append((pass_id, layer_idx))
        return super().acquire(layer_idx, pass_id)

    def abort_pass(self, pass_id):
        self.aborted.append(pass_id)
        return self.resume_at


@pytest.fixture(scope="module")
def index(smollm2_path):
    return open_model(smollm2_path)


def _prefill(model: LlamaModel, seq_id: int) -> np.ndarray:
    model.backend.alloc_sequence(seq_id, 64)
    return model.forward(StepBatch([SeqChunk(seq_id, 0, PROMPT)]))


def test_each_resident_run_is_one_capture_request_and_streamed_layers_run_between(index):
    resident = [0, 1, 2, 5, 6]
    be = RecordingBackend(index)
    stream = FailingStream(index, fail_pass=-1, fail_layer=-1, resume_at=0)
    model = LlamaModel(index, be, resident_layers=resident, stream=stream)
    got = _prefill(model, 1)
    assert be.captures == [("layers", 0, 3, True, 0), ("layers", 5, 7, False, 0)]  # (.., residency generation)
    assert be.embeds == 1
    assert stream.acquired == [(0, i) for i in range(30) if i not in resident]
    every = LlamaModel(index, CpuBackend(index))
    assert np.array_equal(got, _prefill(every, 1))  # same bytes, same block: the same logits


def test_a_failed_pass_is_aborted_and_numbering_resumes_where_the_stream_says(index):
    stream = FailingStream(index, fail_pass=0, fail_layer=4, resume_at=3)
    model = LlamaModel(index, CpuBackend(index), resident_layers=[0, 1, 2], stream=stream)
    with pytest.raises(NtxError, match="layer 4"):
        _prefill(model, 1)
    assert stream.aborted == [0] and model.next_pass_id == 3
    stream.acquired.clear()
    _prefill(model, 2)
    assert {p for p, _ in stream.acquired} == {3} and model.next_pass_id == 4


def test_rope_divisors_are_one_formula(index):
    hp = index.hparams
    half = hp.rope_dim // 2
    freqs = np.linspace(1.0, 8.0, half, dtype=np.float32)
    assert rope_divisors(hp, None) is None
    assert np.array_equal(rope_divisors(hp, freqs), freqs)  # Llama 3.1 factors as they are
    linear = dataclasses.replace(hp, rope_scaling=RopeScaling(kind="linear", factor=4.0))
    assert np.array_equal(rope_divisors(linear, None), np.full(half, 4.0, dtype=np.float32))
    assert np.array_equal(rope_divisors(linear, freqs), freqs * np.float32(4.0))
    assert rope_divisors(dataclasses.replace(hp, rope_scaling=RopeScaling(kind="linear", factor=1.0)), None) is None
