"""Row buckets of the cuda backend, on the CPU: which bucket a pass runs at, that padding rows
are inert and the real rows unchanged, and that the planner counts every bucket's kept workspace.
The GPU side (graphs, tokens with padding) is tests/gpu/test_warm_up_gpu.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.cuda import buckets
from ntx.daemons.compute.cuda.buckets import INERT_SLOT, bucket_sizes, inert_rows, pass_rows, row_bucket
import synth_gguf as sg
from ntx.daemons.compute.cuda.memory import (ALLOCATOR_SLACK_BYTES, BUCKET_PREFIX, attention_splits, backend_layout,
                                             cuda_memory_costs, dequant_chunk_rows, eager_layout, pass_regions)
from ntx.shared.config import InstanceConfig
from ntx.shared.gguf_index import open_model
from ntx.shared.plan import CPU, VRAM, HostRates, make_plan

try:
    from .synth_models import write_header_only_gguf, write_tiny
except ImportError:  # tests/ is not a package
    from synth_models import write_header_only_gguf, write_tiny


# ------------------------------------------------------------------------------ buckets
def test_bucket_sizes():
    assert bucket_sizes(64) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert bucket_sizes(5) == [1, 2, 3, 4, 5]
    assert bucket_sizes(20) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 20]
    assert bucket_sizes(0) == []


@pytest.mark.parametrize("max_rows", [8, 20, 64])
def test_row_bucket_is_the_smallest_bucket_that_holds_the_pass(max_rows):
    sizes = bucket_sizes(max_rows)
    for n in range(1, max_rows + 1):
        assert row_bucket(n, max_rows) == min(b for b in sizes if b >= n), n
    assert row_bucket(max_rows + 1, max_rows) is None
    assert row_bucket(512, max_rows) is None


def test_row_bucket_examples():
    assert [row_bucket(n, 64) for n in (1, 7, 8, 9, 16, 17, 63, 64, 65)] == [1, 7, 8, 16, 16, 24, 64, 64, None]
    assert row_bucket(3, 0) is None  # no graphs: every pass at its own size
    with pytest.raises(ValueError):
        row_bucket(0, 64)


# ------------------------------------------------------------------------------ padding
TREE = SeqChunk(2, 40, (7, 8, 9, 10), all_logits=True, parents=(-1, 0, 0, 1))


def _mixed_batch() -> StepBatch:
    """A prompt chunk, a decode row, a verify tree and a one-row tree (a plain row)."""
    return StepBatch([SeqChunk(0, 0, (5, 6, 7)), SeqChunk(1, 9, (11,)), TREE,
                      SeqChunk(3, 12, (4,), parents=(-1,))])


def test_padding_keeps_the_real_rows_and_adds_inert_ones():
    batch = _mixed_batch()
    slots = [3, 0, 5, 1]
    host = pass_rows(batch, slots, 16)
    T = batch.n_tokens
    assert T == 9
    for name in ("tokens", "positions", "cache_positions", "slots", "kv_lens", "tree_base"):
        a = getattr(host, name)
        assert a.dtype == np.int32 and a.shape == (16,), name
    # the real rows: what the batch says
    np.testing.assert_array_equal(host.tokens[:T], batch.tokens)
    np.testing.assert_array_equal(host.positions[:T], batch.positions)
    np.testing.assert_array_equal(host.cache_positions[:T], batch.cache_positions)
    np.testing.assert_array_equal(host.kv_lens[:T], batch.cache_positions + 1)
    np.testing.assert_array_equal(host.slots[:T], [3, 3, 3, 0, 5, 5, 5, 5, 1])
    # only the tree of several rows is a tree: its rows see their root's cache position
    np.testing.assert_array_equal(host.tree_base[:T], [-1, -1, -1, -1, 40, 40, 40, 40, -1])
    assert host.has_trees
    # the padding: token 0 at position 0, no cache slot, one key, outside every tree
    np.testing.assert_array_equal(host.tokens[T:], 0)
    np.testing.assert_array_equal(host.positions[T:], 0)
    np.testing.assert_array_equal(host.cache_positions[T:], 0)
    np.testing.assert_array_equal(host.slots[T:], INERT_SLOT)
    np.testing.assert_array_equal(host.kv_lens[T:], 1)
    np.testing.assert_array_equal(host.tree_base[T:], -1)
    # the logit rows are the batch's own (the head reads only those)
    np.testing.assert_array_equal(batch.logit_rows, [2, 3, 4, 5, 6, 7, 8])


def test_padding_to_the_pass_size_changes_nothing_and_no_trees_without_a_tree():
    batch = StepBatch([SeqChunk(0, 3, (1,)), SeqChunk(1, 0, (2, 3))])
    host = pass_rows(batch, [4, 2], batch.n_tokens)
    np.testing.assert_array_equal(host.slots, [4, 2, 2])
    assert not host.has_trees and np.all(host.tree_base == -1)
    with pytest.raises(ValueError):
        pass_rows(batch, [4, 2], 2)


def test_inert_rows_touch_no_cache_slot():
    host = inert_rows(5)
    assert np.all(host.slots == INERT_SLOT) and np.all(host.kv_lens == 1) and not host.has_trees
    assert np.all(host.tokens == 0) and np.all(host.tree_base == -1)


# ------------------------------------------------------------------------------ memory
def test_planner_counts_the_buckets_shared_workspace(tmp_path):
    """The planner's workspace is the sum of the backend's layout (the pass workspace the
    buckets share, the scratch, the head), the arena of an eager prompt chunk, and the slack:
    one list of regions, the one the backend carves its arenas from. The shared workspace holds
    every bucket's pass (each region as large as the largest bucket's), and no more."""
    index = open_model(write_tiny(tmp_path))
    hp = index.hparams
    sizes = dict(max_seqs=4, max_ctx=256, max_pass_rows=128)
    ctx = min(256, hp.n_ctx_train)
    layout = backend_layout(index, ctx)
    shared = {r.name: r.nbytes for r in layout.regions if r.name.startswith(BUCKET_PREFIX)}
    for r in bucket_sizes(buckets.MAX_GRAPH_ROWS):  # every bucket's pass fits the shared regions
        for region in pass_regions(hp, r, ctx):
            assert shared[BUCKET_PREFIX + region.name] >= region.nbytes
    for name, nbytes in shared.items():  # each region as large as one bucket needs it
        assert nbytes == max(region.nbytes for r in bucket_sizes(buckets.MAX_GRAPH_ROWS)
                             for region in pass_regions(hp, r, ctx) if BUCKET_PREFIX + region.name == name)
    assert sorted(shared) == sorted(BUCKET_PREFIX + region.name for region in pass_regions(hp, 1, ctx))
    kept = sum(shared.values())
    apart = sum(region.nbytes for r in bucket_sizes(buckets.MAX_GRAPH_ROWS) for region in pass_regions(hp, r, ctx))
    assert sum(region.nbytes for region in pass_regions(hp, buckets.MAX_GRAPH_ROWS, ctx)) <= kept < apart / 4
    # the f32 buffers of the largest bucket's rows alone are a lower bound
    per_row = 4 * (3 * hp.n_embd + 2 * hp.q_dim + 2 * hp.kv_dim + 3 * hp.n_ff)
    assert kept >= per_row * buckets.MAX_GRAPH_ROWS
    assert layout.total_bytes >= kept + 64 * 4 * hp.n_vocab  # buckets + the head's logits of 64 rows
    assert all(off % 256 == 0 for off in layout.offsets.values())
    assert backend_layout(index, ctx, 64).total_bytes > backend_layout(index, ctx, 8).total_bytes > 0
    costs = cuda_memory_costs(index, **sizes)
    assert costs.workspace_bytes == (ALLOCATOR_SLACK_BYTES + layout.total_bytes
                                     + eager_layout(hp, 128, ctx).total_bytes)  # the same lists, summed
    for rows in (1, 8, 64, 512):
        s = attention_splits(rows, hp.n_head_kv, ctx)
        assert s % 4 == 0 and 4 <= s <= 64


def test_the_cublas_copy_and_an_eager_head_leave_the_70b_a_resident_layer(tmp_path):
    """Two buffers of the eager passes alone took most of a 70B layer's VRAM: the whole f16
    copy of the largest matrix for cuBLAS (448 MiB) and a 512-row prompt chunk's [512, V]
    logits (250 MiB). The copy is now made 128 MiB of rows at a time and an eager pass's head
    runs 64 rows at a time in the kept arena's buffers; and the cpu tier's wide passes stream its
    layers through the ring instead of a staging buffer of their own. So at 24 GiB the default
    flags kept 43 layers resident, as many as without a tier, instead of 41; and since the row
    buckets share one pass workspace (279.6 MiB apart, 41.8 MiB shared), 44 (a header-only file:
    no tensor data is written)."""
    index = open_model(write_header_only_gguf(tmp_path / "l70.gguf", sg.preset_config("llama3-70b", type="Q4_K_M")))
    hp = index.hparams
    # 70B: gate and up [28672, 8192] in 8192-row pieces, down [8192, 28672] in 2304-row ones,
    # q and o (128 MiB exactly) whole; the 8B's largest (112 MiB) whole: its bits stay as they were
    assert [dequant_chunk_rows(r, c) for r, c in ((28672, 8192), (8192, 28672), (8192, 8192), (1024, 8192))] \
        == [8192, 2304, 8192, 1024]
    assert dequant_chunk_rows(14336, 4096) == 14336 and dequant_chunk_rows(4096, 14336) == 4096
    ctx = 8192
    assert backend_layout(index, ctx).region("dequant w16").nbytes == 128 << 20
    eager = eager_layout(hp, 512, ctx)
    assert "logits" not in eager.offsets and "head h" not in eager.offsets
    own = eager_layout(hp, 512, ctx, own_head=True)  # without graphs the kept arena holds no head
    assert own.region("logits").nbytes == buckets.MAX_GRAPH_ROWS * hp.n_vocab * 4
    cfg = InstanceConfig(model=index.paths[0], backend="cuda", vram_budget=24 << 30, ram_budget=100 << 30).validate()
    costs = cuda_memory_costs(index, max_seqs=cfg.max_batch, max_ctx=cfg.ctx_for(hp.n_ctx_train),
                              max_pass_rows=cfg.largest_pass_rows)
    rates = HostRates(55.1, 42.1, 66.6, cpu_beside_link_gbps=34.4, link_beside_cpu_gbps=51.2, gpu_gbps=1000.0)
    plan = make_plan(index, cfg, costs, rates=rates)
    assert len(plan.layers_on(VRAM)) == 44 and plan.layers_on(CPU)
    apart = sum(r.nbytes for rows in bucket_sizes(buckets.MAX_GRAPH_ROWS) for r in pass_regions(hp, rows, ctx))
    shared = sum(r.nbytes for r in backend_layout(index, ctx).regions if r.name.startswith(BUCKET_PREFIX))
    assert apart - shared > 200 << 20  # what the sharing freed: about half a 70B layer
    no_tier = make_plan(index, replace(cfg, cpu_layers=0).validate(), costs, rates=rates)
    assert no_tier.layers_on(VRAM) == plan.layers_on(VRAM)
    # drafting costs no layer: its trees take what a prompt chunk leaves of a pass
    for draft in (dict(draft="ngram"), dict(draft="ngram", draft_tokens=16)):
        spec = replace(cfg, **draft).validate()
        assert spec.largest_pass_rows == cfg.largest_pass_rows
        spec_costs = cuda_memory_costs(index, max_seqs=spec.max_batch, max_ctx=spec.ctx_for(hp.n_ctx_train),
                                       max_pass_rows=spec.largest_pass_rows)
        assert make_plan(index, spec, spec_costs, rates=rates).layers_on(VRAM) == plan.layers_on(VRAM)


def test_the_planner_reserves_the_largest_pass_the_engine_runs(tmp_path):
    """A prompt chunk runs beside a decode row for every other sequence, and every sequence may
    decode with its draft, so the eager arena the planner reserves is the larger of those passes
    (``EngineOptions.largest_pass_rows``, the warm-up's ``max_rows`` too), not the prompt chunk's
    alone: at batch 64 drafting 16 tokens, 1,088 rows. Drafts beside a whole chunk would make it
    1,583 (about 350 MiB more of a 70B's arena): the engine's trees take what the chunk leaves."""
    index = open_model(write_header_only_gguf(tmp_path / "l70.gguf", sg.preset_config("llama3-70b", type="Q4_K_M")))
    hp = index.hparams
    base = dict(model=index.paths[0], backend="cuda", vram_budget=24 << 30, ram_budget=100 << 30)
    for kw, rows in (({}, 512 + 15), (dict(draft="ngram"), 512 + 15), (dict(draft="ngram", draft_tokens=16), 512 + 15),
                     (dict(max_batch=64, draft="ngram", draft_tokens=16), 64 * 17),
                     (dict(max_batch=1, self_draft=True, draft_tokens=8), 512),  # one sequence: one or the other
                     (dict(max_batch=64, draft="ngram", draft_tokens=16, prefill_chunk_tokens=8), 64 * 17)):
        cfg = InstanceConfig(**base, **kw).validate()
        assert cfg.largest_pass_rows == rows, kw
        ctx = cfg.ctx_for(hp.n_ctx_train)
        costs = cuda_memory_costs(index, max_seqs=cfg.max_batch, max_ctx=ctx, max_pass_rows=cfg.largest_pass_rows)
        assert costs.workspace_bytes == (ALLOCATOR_SLACK_BYTES + backend_layout(index, ctx).total_bytes
                                         + eager_layout(hp, rows, ctx).total_bytes), kw
    beside = eager_layout(hp, 512 + 63 * 17, 8192).total_bytes - eager_layout(hp, 64 * 17, 8192).total_bytes
    assert beside > 300 << 20
