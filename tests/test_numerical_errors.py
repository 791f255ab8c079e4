"""Logits that cannot be sampled from (NaN, +inf, nothing finite) fail the request that produced
them with ``numerical_error``; the engine, the compute daemon and every other request go on.

Before: a model whose numbers break (an ``rms_eps`` of NaN passes the index; a NaN weight does
anyway) crashed compute on the first sampled token (an empty top-k list), and four such
requests used up the pipeline's restarts."""

from __future__ import annotations

import math
import os
import pathlib
import struct

import numpy as np
import pytest

from ntx.ctl.client import ClientError
from ntx.ctl.local import build_local_engine
from ntx.daemons.compute.backend import Picked
from ntx.daemons.compute.sampler import NumericalError, Sampler, SamplingParams
from ntx.shared.messages import EngineRequest
from ntx.shared.config import EngineOptions

from .pipeline_util import running_pipeline

try:
    from .synth_models import gguf_reader, write_tiny
except ImportError:  # tests/ is not a package
    from synth_models import gguf_reader, write_tiny

# every sampling path: greedy (top-1), top-k, the whole row, the whole row with the penalty
PARAMS = [dict(temperature=0.0), dict(temperature=0.8, top_k=40), dict(temperature=0.8, top_p=0.9),
          dict(temperature=0.8, repetition_penalty=1.1)]


def poison_f32_tensor(path: os.PathLike, name: str, value: float) -> None:
    """Overwrite every element of the F32 tensor ``name`` with ``value`` (e.g. NaN), in place.
    A bad weight rather than a bad ``rms_eps``: the index may refuse the latter (issue 12,
    item 9), while no index can check every weight."""
    t = next(t for t in gguf_reader(path).tensors if t.name == name)
    assert t.tensor_type.name == "F32", t.tensor_type
    with open(path, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(struct.pack("<f", value) * (int(t.n_bytes) // 4))


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> pathlib.Path:
    path = write_tiny(tmp_path_factory.mktemp("nan"), "nan.gguf")
    poison_f32_tensor(path, "output_norm.weight", math.nan)
    return path


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_sampler_refuses_nan_and_inf_rows(params, bad):
    row = np.random.default_rng(0).normal(0, 3, 500)  # [V]
    row[17] = bad
    with pytest.raises(NumericalError, match="NaN" if math.isnan(bad) else r"\+inf"):
        Sampler(SamplingParams(**params)).sample(row)


def test_sampler_refuses_a_row_with_nothing_finite_and_empty_candidates():
    with pytest.raises(NumericalError, match="no finite value"):
        Sampler(SamplingParams(temperature=0.8)).sample(np.full(50, -np.inf))
    empty = Picked(ids=np.zeros(0, np.int64), vals=np.zeros(0))  # what top-k gives for a NaN row
    with pytest.raises(NumericalError, match="NaN"):
        Sampler(SamplingParams(temperature=0.0)).sample_picked(empty)


def test_sampler_still_draws_around_masked_tokens():
    row = np.full(50, -np.inf)
    row[[3, 9]] = [1.0, 2.0]
    assert Sampler(SamplingParams(temperature=0.0)).sample(row) == 9
    assert Sampler(SamplingParams(temperature=1.0, seed=1)).sample(row) in (3, 9)


def test_engine_fails_each_nan_request_and_keeps_serving(nan_model):
    engine = build_local_engine(str(nan_model))
    for i, params in enumerate(PARAMS * 2):  # more requests than a pipeline's restarts
        engine.submit(EngineRequest(id=f"r{i}", prompt_tokens=[1, 2, 3], params=SamplingParams(max_tokens=4, **params)))
    events = []
    while engine.has_work:
        events.extend(engine.step())
    assert [e["type"] for e in events] == ["error"] * len(PARAMS) * 2
    assert {e["code"] for e in events} == {"numerical_error"}
    assert "not finite" in events[0]["message"]
    assert engine.core.model.backend.seq_pages == {} and engine.core.model.backend.kv_stats().pages_in_use == 0  # every KV page was freed


@pytest.mark.slow
def test_pipeline_survives_nan_logits_without_restarts(nan_model, tmp_path):
    """Five requests with NaN logits through the daemon pipeline, with max_restarts 1: each gets
    ``numerical_error``, the compute daemon stays the same process."""
    with running_pipeline(str(nan_model), tmp_path, "--max-restarts", "1", name="nan") as p:
        compute_pid = p.status()["daemons"]["compute"]["pid"]
        for params in PARAMS + PARAMS[:1]:
            with p.client() as c, pytest.raises(ClientError) as err:
                c.complete("hello", raw=True, max_tokens=3, **params)
            assert err.value.code == "numerical_error", err.value
        st = p.status()
        assert st["state"] == "ready" and st["restarts"] == 0
        assert st["daemons"]["compute"]["pid"] == compute_pid


def test_a_nan_draft_model_drafts_nothing_and_the_target_answers_alone(nan_model, tmp_path):
    """A draft model whose logits are NaN has no candidates to propose (it crashed compute on an
    empty top-k list); its requests go on undrafted, with the target's own tokens."""
    target = write_tiny(tmp_path, "target.gguf")  # the same shape and vocabulary as nan_model
    tokens = []
    for kw in ({"draft_model": str(nan_model)}, {}):
        engine = build_local_engine(str(target), options=EngineOptions(**kw))
        engine.submit(EngineRequest(id="a", prompt_tokens=[1, 2, 3], params=SamplingParams(temperature=0.0, max_tokens=6)))
        events = []
        while engine.has_work:
            events.extend(engine.step())
        assert events[-1]["type"] == "done", events[-1]
        tokens.append(events[-1]["tokens"])
    assert tokens[0] == tokens[1]
