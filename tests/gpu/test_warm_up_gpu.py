"""The cuda backend's row buckets and warm-up on the GPU: after the warm-up a first request of
every bucket (prompt chunks, batched decode rows, verify trees) records no graph and compiles no
kernel module; the warm-up writes no KV cache entry; the planner's layout is what the backend
holds (its arena) and every bucket's workspace lies in it, all buckets in one (memory.bucket_regions);
greedy tokens with padded, captured passes (of several buckets, one after another in that one
workspace) equal those of eager passes at their own size, each in an arena of its own
(``use_graphs=False``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from ntx.daemons.compute.batch import SeqChunk, StepBatch  # noqa: E402
from ntx.daemons.compute.cuda import runtime  # noqa: E402
from ntx.daemons.compute.cuda.backend import CudaBackend  # noqa: E402
from ntx.daemons.compute.cuda.buckets import MAX_GRAPH_ROWS, bucket_sizes  # noqa: E402
from ntx.daemons.compute.cuda.memory import backend_layout  # noqa: E402
from ntx.daemons.compute.factory import build_engine  # noqa: E402
from ntx.daemons.compute.sampler import SamplingParams  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402
from ntx.shared.gguf_index import open_model  # noqa: E402
from ntx.shared.messages import EngineOutput, EngineRequest  # noqa: E402
import synth_gguf as sg  # noqa: E402  (scripts/synth_gguf, on sys.path through tests/conftest.py)

MAX_BATCH = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("warm") / "warm-q4km.gguf"
    cfg = sg.preset_config("tiny", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                           vocab_size=1024, type="Q4_K_M", seed=13)
    sg.write_llama_gguf(path, cfg)
    return str(path)


def _run(engine, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, from the engine core's outputs."""
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=n)))
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for ev in engine.step():
            assert isinstance(ev, EngineOutput), ev
            tokens.setdefault(ev.id, []).extend(ev.tokens)
    return tokens


def _prefill_s(engine, prompt: list[int]) -> float:
    """Seconds of the prompt's pass (the request's first step); the request then runs to its end."""
    engine.submit(EngineRequest("p", prompt, SamplingParams(temperature=0.0, max_tokens=3)))
    t0 = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t0
    while engine.has_work:
        engine.step()
    return seconds


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 1000, n)]


def _inside(a, arena) -> bool:
    start = arena.memory.data.ptr
    return start <= a.data.ptr and a.data.ptr + a.nbytes <= start + arena.nbytes


def test_warm_up_builds_every_bucket_and_touches_no_cache(model):
    eng = build_engine(model, "cuda", EngineOptions(max_batch=MAX_BATCH, ctx=256, self_draft=[0, 1], draft_tokens=6,
                                                    draft_width=3))
    be = eng.model.backend
    sizes = bucket_sizes(MAX_GRAPH_ROWS)
    assert sorted(be.works) == sizes
    whole, draft = ("layers", 0, 4, True, 0), ("layers", 0, 2, True, 0)  # the model's one run; the self-draft's span
    for rows in sizes:  # plain passes of every bucket, trees from 2 rows on
        assert (whole, rows, False) in be.graphs and ((whole, rows, True) in be.graphs) == (rows > 1)
    assert {rows for key, rows, trees in be.graphs if key == draft} == {r for r in sizes if r <= MAX_BATCH}
    # inert rows only: not one key or value was written in any chunk of the page pool
    assert be.kvp.chunks
    assert all(float(cp.abs(k).max()) == 0.0 and float(cp.abs(v).max()) == 0.0 for k, v in be.kvp.chunks.values())
    # the planner's layout is what the backend holds, and every bucket's workspace lies in it
    assert be.arena.nbytes == backend_layout(open_model(model), be.max_ctx).total_bytes
    assert all(_inside(a, be.arena) for w in be.works.values()
               for a in (w.tokens, w.positions, w.cache_positions, w.slots, w.kv_lens, w.tree_base, w.tree_mask,
                         w.x, w.h, w.q, w.k, w.v, w.attn, w.o, w.gate, w.up, w.act, *w.attn_ws, w.logits))
    # the buckets share one pass workspace: each views the first bytes of the same regions
    for name in ("tokens", "tree_mask", "x", "act"):
        assert len({getattr(w, name).data.ptr for w in be.works.values()}) == 1, name
    assert len({w.attn_ws[1].data.ptr for w in be.works.values()}) == 1


@pytest.mark.parametrize("drafting", [False, True])
def test_first_request_of_each_bucket_records_no_graph_and_compiles_nothing(model, drafting):
    """Prompt chunks of every bucket size (alone, so the chunk is the pass), batched decode rows
    up to MAX_BATCH, a prompt beyond the buckets (the eager path), and with speculation verify
    trees of varying sizes: after the warm-up none of them records a graph or loads a module,
    and the first request of each size takes about as long as the next one."""
    kw = dict(self_draft=[0, 1], draft_tokens=6, draft_width=3) if drafting else {}
    eng = build_engine(model, "cuda", EngineOptions(max_batch=MAX_BATCH, ctx=256, **kw))
    be = eng.model.backend
    n_graphs, n_modules = len(be.graphs), len(runtime._modules)
    slow = []
    for rows in bucket_sizes(MAX_GRAPH_ROWS):  # the first prompt pass of its size, then another one
        first_s, next_s = _prefill_s(eng, _prompt(rows, rows)), _prefill_s(eng, _prompt(rows, 1000 + rows))
        if first_s > 1.5 * next_s + 0.02:  # a compile or a capture costs far more than this on a tiny model
            slow.append((rows, round(first_s, 4), round(next_s, 4)))
    _run(eng, [_prompt(3 + i, 100 + i) for i in range(MAX_BATCH)], 6)
    _run(eng, [_prompt(MAX_GRAPH_ROWS + 37, 7)], 2)
    assert len(be.graphs) == n_graphs, sorted(set(be.graphs))
    assert len(runtime._modules) == n_modules
    assert not slow, f"first requests much slower than the next (rows, first s, next s): {slow}"


@pytest.mark.parametrize("drafting", [False, True])
def test_padded_captured_passes_give_the_tokens_of_eager_passes(model, drafting):
    """Greedy tokens of a batch whose passes are not bucket sizes (prompts of 5, 6 and 2 tokens:
    a 13-row prefill; decode and verify passes of 3 sequences) with padding and graphs equal
    those of the same engine without graphs, where every pass runs at its own size in an arena
    of its own; and the logits of a padded prefill agree with the eager ones. The captured
    passes run in the workspace all buckets share (the last prefill, 16 rows, after the smaller
    buckets' decode and verify passes): a region one pass read before writing it would show."""
    kw = dict(self_draft=[0, 1], draft_tokens=4, draft_width=2) if drafting else {}
    prompts = [_prompt(5, 1), _prompt(6, 2), _prompt(2, 3)]
    index = open_model(model)
    outs = []
    for use_graphs in (True, False):
        backend = CudaBackend(index, max_seqs=4, max_ctx=256, use_graphs=use_graphs)
        eng = build_engine(index, backend, EngineOptions(max_batch=4, ctx=256, **kw))
        outs.append(_run(eng, prompts, 16))
        m = eng.model
        m.backend.alloc_sequence(99, 64)
        outs.append(m.forward(StepBatch([SeqChunk(99, 0, tuple(range(10, 23)), all_logits=True)])))
    (tok_graphs, lg_graphs), (tok_eager, lg_eager) = outs[:2], outs[2:]
    assert tok_graphs == tok_eager
    rel = float(np.linalg.norm(lg_graphs - lg_eager) / np.linalg.norm(lg_eager))
    assert lg_graphs.shape == lg_eager.shape == (13, index.hparams.n_vocab) and rel < 1e-4, rel
