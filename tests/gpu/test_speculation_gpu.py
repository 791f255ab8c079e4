"""Speculative decoding on the cuda backend: greedy output identical with and without it, for
the self-draft (its resident layers, graph-captured like a decode pass), a draft model and the
lookahead."""

from __future__ import annotations

import os
import pathlib

import pytest

pytestmark = pytest.mark.gpu

from ntx.ctl.local import LocalEngine  # noqa: E402
from ntx.daemons.compute.factory import build_engine  # noqa: E402
from ntx.daemons.compute.lookahead import RECYCLE_K  # noqa: E402
from ntx.daemons.compute.sampler import SamplingParams  # noqa: E402
from ntx.shared.messages import EngineRequest  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402
import synth_gguf as sg  # noqa: E402  (scripts/synth_gguf, on sys.path through tests/conftest.py)


def _models(tmp: pathlib.Path) -> list[str]:
    path = tmp / "spec-q4km.gguf"
    cfg = sg.preset_config("tiny", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                           vocab_size=1024, type="Q4_K_M", seed=11)
    sg.write_llama_gguf(path, cfg)
    smol = os.environ.get("NTX_TEST_MODEL")
    return [str(path)] + ([smol] if smol and os.path.exists(smol) else [])


def _tokens(engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[dict | None]]:
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=n)))
    done = {}
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                done[ev["id"]] = ev
            assert ev["type"] != "error", ev
    return [done[f"r{i}"]["tokens"] for i in range(len(prompts))], [done[f"r{i}"].get("speculation") for i in range(len(prompts))]


@pytest.mark.parametrize("drafter,width", [("self-all", 1), ("self-half", 1), ("model", 1), ("self-half", 3),
                                           ("model", None)])
def test_greedy_identical_with_each_drafter(tmp_path, drafter, width):
    """Chains (width 1) and trees (width 3: a chain with two siblings at each depth; None: the
    shape chosen as it measures); every pass takes the same activation path (int8 by default),
    whatever its rows."""
    for model in _models(tmp_path):
        n_layers = 4 if "spec-q4km" in model else 30
        # one sequence drafting 6 nodes (a 7-row verify pass), then two drafting 3 (8 rows); ids
        # within the synthetic model's 1024-token vocabulary
        for prompts, k in (([[504, 357, 282, 464, 314]], 6), ([[504, 357, 282, 464], [17, 300, 4, 61]], 3)):
            plain = LocalEngine(build_engine(model, "cuda", options=EngineOptions(max_batch=4, ctx=256)))
            want, _ = _tokens(plain, prompts, 24)
            kw = {"self-all": dict(self_draft=True), "self-half": dict(self_draft=list(range(n_layers // 2))),
                  "model": dict(draft_model=model)}[drafter]
            spec = LocalEngine(build_engine(model, "cuda", options=EngineOptions(
                max_batch=4, ctx=256, draft_tokens=k, draft_width=min(width, k) if width else None, **kw)))
            got, counts = _tokens(spec, prompts, 24)
            assert got == want, (model, drafter, k, width)
            assert all(c and c["verify_passes"] > 0 for c in counts)
            if drafter != "self-half" and width == 1:
                assert all(c["acceptance_rate"] == 1.0 for c in counts), counts


def test_greedy_identical_with_the_lookahead(tmp_path):
    """``--draft lookahead`` with fixed trees (every pass carries the window and the pool's
    n-grams, as where a verify pass's rows are free): the same tokens as plain, in passes of up
    to 64 rows (past 64, default kernels round otherwise than one row does: docs/PERFORMANCE.md,
    "Chains over 64 drafted tokens leave the recording"), and the window's rows read back, each
    greedy verify row ranking its top 8 (the device's top-k in place of its top-1) for the
    recycled tokens."""
    for model in _models(tmp_path):
        # one sequence drafting 63 nodes (a 64-row verify pass), then two drafting 15 (32 rows)
        for prompts, k in (([[504, 357, 282, 464, 314]], 63), ([[504, 357, 282, 464], [17, 300, 4, 61]], 15)):
            plain = LocalEngine(build_engine(model, "cuda", options=EngineOptions(max_batch=4, ctx=256)))
            want, _ = _tokens(plain, prompts, 48)
            spec = LocalEngine(build_engine(model, "cuda", options=EngineOptions(
                max_batch=4, ctx=256, draft="lookahead", draft_tokens=k, draft_width=1, draft_fixed=True)))
            got, counts = _tokens(spec, prompts, 48)
            assert got == want, (model, k)
            assert all(c and c["verify_passes"] > 0 for c in counts)
            d = spec.core.drafter
            assert d.window_passes > 0 and len(d.pool) > 0, d.report()
            assert max(map(len, d.recycled.by_token.values())) == RECYCLE_K, d.report()
