"""The warm-up, on the CPU: every engine is warmed up before it serves (the compute daemon
before it says ready) with the shapes its passes can take, a failure is one clear line, and on
the cpu backend it is a no-op. The GPU side (no graph recorded and no kernel compiled by a first
request, tokens unchanged) is tests/gpu/test_warm_up_gpu.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ntx.ctl.instance import InstancePaths
from ntx.daemons.compute.backend import WarmUp
from ntx.daemons.compute.cpu_backend import CpuBackend
from ntx.daemons.compute.factory import build_engine
from ntx.daemons.compute.model import LlamaModel
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.config import EngineOptions
from ntx.shared.errors import NtxError
from ntx.shared.messages import EngineRequest

from .pipeline_util import running_pipeline, wait_for

try:
    from .synth_models import write_tiny
except ImportError:  # tests/ is not a package
    from synth_models import write_tiny


# ------------------------------------------------------------------------------ warm-up
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("warm"), type="Q8_0"))


def _greedy(engine, prompt: list[int], n: int) -> list[int]:
    """The greedy tokens of ``prompt`` from an engine core's outputs."""
    engine.submit(EngineRequest("g", prompt, SamplingParams(temperature=0.0, max_tokens=n)))
    tokens: list[int] = []
    while engine.has_work:
        for out in engine.step():
            tokens += out.tokens
    return tokens


def test_the_cpu_warm_up_compiles_the_kernels_and_runs_no_pass(tiny):
    lines: list[str] = []
    warm = build_engine(tiny, "cpu", EngineOptions(max_batch=2, ctx=64), log=lines.append)
    cold = build_engine(tiny, "cpu", EngineOptions(max_batch=2, ctx=64), warm_up=False)
    assert len(lines) == 3 and lines[0].startswith("warm-up: compiling the CPU kernels"), lines
    assert lines[1].startswith("warm-up: CPU kernels ready in ") and lines[2].startswith("warm-up done in "), lines
    assert warm.model.next_pass_id == 0  # no pass ran
    assert _greedy(warm, [1, 2, 3, 4], 8) == _greedy(cold, [1, 2, 3, 4], 8)
    reference: list[str] = []  # the numpy reference has nothing to build
    build_engine(tiny, "cpu", EngineOptions(max_batch=2, ctx=64, kernels="cpu-quantized=off"), log=reference.append)
    assert len(reference) == 1 and reference[0].startswith("warm-up done in "), reference


def test_build_engine_warms_every_model_with_the_engines_shapes(tiny, monkeypatch):
    """What the warm-up is asked to cover: the largest pass (a prompt chunk beside every
    other sequence's decode row, or every sequence with its tree), trees only when speculation may make them, the eager
    prompt-chunk size, the self-draft's layers at one row per sequence, a draft model too."""
    calls: list[tuple] = []
    monkeypatch.setattr(LlamaModel, "warm_up", lambda self, spec, log, draft_layers=(), draft_rows=0:
                        calls.append((self, spec, tuple(draft_layers), draft_rows)))
    eng = build_engine(tiny, "cpu", EngineOptions(max_batch=3, ctx=64, prefill_chunk_tokens=32))
    assert [(c[1], c[2], c[3]) for c in calls] == [(WarmUp(max_rows=32 + 2, trees=False, eager_rows=(32,)), (), 3)]
    assert calls[0][0] is eng.model

    calls.clear()
    build_engine(tiny, "cpu", EngineOptions(max_batch=3, ctx=64, prefill_chunk_tokens=600))
    assert calls[0][1].eager_rows == (600, 128, 256, 512)  # the full chunk, and smaller last chunks

    calls.clear()
    eng = build_engine(tiny, "cpu", EngineOptions(max_batch=2, ctx=64, prefill_chunk_tokens=16, self_draft=[0],
                                                  draft_tokens=4))
    assert [(c[1], c[2], c[3]) for c in calls] == [(WarmUp(max_rows=16 + 1, trees=True, eager_rows=(16,)), (0,), 2)]

    calls.clear()
    build_engine(tiny, "cpu", EngineOptions(max_batch=2, ctx=64, self_draft=True, draft_tokens=4, draft_width=1))
    assert calls[0][1].trees is False  # chains only: no tree mask ever

    calls.clear()  # trees beside no chunk outgrow it: 8 sequences drafting 4 tokens
    build_engine(tiny, "cpu", EngineOptions(max_batch=8, ctx=64, prefill_chunk_tokens=16, self_draft=[0], draft_tokens=4))
    assert calls[0][1].max_rows == 8 * (1 + 4)

    calls.clear()
    eng = build_engine(tiny, "cpu", EngineOptions(max_batch=2, ctx=64, prefill_chunk_tokens=16, draft_model=tiny))
    assert len(calls) == 2 and calls[1][0] is eng.drafter.model
    assert calls[1][1] == WarmUp(max_rows=64, eager_rows=(16,))


def test_no_pass_outgrows_the_largest_pass_the_plan_reserves(tiny):
    """A prompt chunk runs beside the other sequences' decode rows, so a pass can take more rows
    than the chunk: up to ``EngineOptions.largest_pass_rows``, the rows the warm-up covers and the
    planner reserves a workspace for, and never more. The draft trees take what the chunk leaves:
    none beside a whole chunk, all of them beside the prompt's short last chunk."""
    options = EngineOptions(max_batch=3, ctx=256, prefill_chunk_tokens=32, draft="ngram", draft_tokens=4,
                            draft_width=1, draft_fixed=True)

    def run(eng) -> tuple[list[tuple[int, int]], dict[str, list[int]]]:
        loop = [5, 9, 14, 3, 5, 9, 14, 3, 5, 9]  # a text that repeats: the lookup drafts every pass
        for rid in ("a", "b"):
            eng.submit(EngineRequest(rid, loop, SamplingParams(temperature=0.0, max_tokens=60)))
        tokens: dict[str, list[int]] = {}
        events = [e for _ in range(3) for e in eng.step()]
        eng.submit(EngineRequest("long", [(7 * i) % 200 + 1 for i in range(100)],
                                 SamplingParams(temperature=0.0, max_tokens=4)))
        passes = []  # (rows, prompt rows)
        while eng.has_work:
            events += eng.step()
            passes.append(eng.last_pass[1:])
        for e in events:
            tokens.setdefault(e.id, []).extend(e.tokens)
        return passes, tokens

    eng = build_engine(tiny, "cpu", options)
    passes, tokens = run(eng)
    assert eng.max_pass_rows == options.largest_pass_rows == 32 + 2
    assert max(rows for rows, _ in passes) == 32 + 2  # the chunk alone would not bound it
    assert [p for p in passes if p[1]] == [(34, 32)] * 3 + [(4 + 2 * (1 + 4), 4)]
    assert eng.trees_cut == 3 * 2  # both drafting sequences' trees, beside each whole chunk
    assert tokens == run(build_engine(tiny, "cpu", replace(options, draft=None)))[1]  # the plain engine's


def test_a_failing_warm_up_fails_the_build_with_one_line(tiny, monkeypatch):
    def broken(self, runs, spec, log, eager_ops=None):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(CpuBackend, "warm_up", broken)
    with pytest.raises(NtxError, match=r"^warm-up failed: RuntimeError: no kernel image is available$"):
        build_engine(tiny, "cpu", EngineOptions(max_batch=2, ctx=64))


def test_compute_daemon_warms_up_before_ready(tiny, run_dir):
    """The compute daemon's log says the warm-up's time before its ready line, and the ready
    line says how much of the setup it was."""
    with running_pipeline(tiny, run_dir, name="warm") as p:
        log = InstancePaths(p.name).log_dir / "compute.log"
        text = wait_for(lambda: log.exists() and "ready after" in log.read_text() and log.read_text(), 30,
                        "the compute daemon's ready line")
        lines = text.splitlines()
        warm = next(i for i, line in enumerate(lines) if "warm-up done in " in line)
        ready = next(i for i, line in enumerate(lines) if "ready after" in line)
        assert warm < ready
        assert "s of it warm-up)" in lines[ready]
        assert p.generate_greedy("hello", max_tokens=2)["finish_reason"] in ("length", "stop")
