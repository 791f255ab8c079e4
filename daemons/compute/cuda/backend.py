"""The cuda backend: the operations of the Llama block on the GPU with ntx's own kernels (the
family modules of this folder: gemm, norm_rope_kv, attention, selection).

Weights are used exactly as GGUF stores them: a resident layer is uploaded once (its layer-image
buffer, no repacking), a streamed layer is read straight from the device slot the dma daemon
filled; each matrix becomes a ``Weight`` once, when the layer is prepared. Every matrix product
dequantizes on the fly (``gemm.gemm`` takes its path by format and rows, chosen once and kept).

Memory: every pass buffer, scratch and workspace lives in one arena (``arena.py``) carved from
``memory.backend_layout``, the layout the planner sums; a pass above the buckets gets an arena of
its own (``memory.eager_layout``) for its life. The KV cache is apart (one pair per layer).

Launch overhead: one Python-launched kernel costs about 10 µs, as much as a small layer's whole
work, so the model asks for its runs of resident layers to be captured (``run_captured``): one
CUDA graph per run, row bucket and kind of pass (with or without token trees), replayed after.
A pass of up to ``buckets.MAX_GRAPH_ROWS`` rows runs at the size of its row bucket in the kept
workspace all buckets share (``memory.bucket_regions``: passes run one at a time), padded with
inert rows (``buckets.py``): decode steps, prompt chunks and verify trees of every size below
the limit share a few graphs. Every position, length, cache slot and tree mask is read
from device memory, so one graph replays every pass of its bucket. Larger passes run eagerly at
their own size. Streamed layers run eagerly between graph segments: their slot changes from pass
to pass.

No request pays for compiling or capturing: ``warm_up`` (before the daemon reports ready) runs
every capture request on inert passes of every bucket, eagerly then captured, and the eager
paths and the head once, so every kernel is compiled and every graph recorded up front.

KV cache: pages of 32 positions for every layer (``kv_pages.py``), taken from a pool as sequences
grow; a sequence owns a row of the page table, which a pass's ``slots`` field names. A row's
keys and values go to its cache position (``StepBatch.cache_positions``), which differs from its
RoPE position only in a token tree. A pass with trees (speculative verification) hands attention
each tree row's tree mask (the masked kernel: a graph of its own). After verification
``kv_keep`` moves the accepted path down in every layer in one launch.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Sequence

import cupy as cp
import cupyx
import numpy as np
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.backend import Backend, CaptureRun, PendingPicks, Pick, Picked, WarmUp, Weight, Workspace
from ntx.daemons.compute.batch import StepBatch
from ntx.daemons.compute.cuda import attention as attn_ops
from ntx.daemons.compute.cuda import gemm, instances, runtime, selection
from ntx.daemons.compute.cuda import norm_rope_kv as nrk
from ntx.daemons.compute.cuda.arena import Arena, ArenaScratch
from ntx.daemons.compute.cuda.buckets import (MAX_GRAPH_ROWS, PassRows, bucket_sizes, inert_rows, pass_rows,
                                              row_bucket, tree_chunks)
from ntx.daemons.compute.cuda.dequant import get_rows
from ntx.daemons.compute.cuda.kv_pages import KvPages
from ntx.daemons.compute.cuda.memory import (BUCKET_PREFIX, ROW_FIELDS, attention_rows, attention_splits,
                                             backend_layout, cuda_memory_costs, eager_layout, tree_mask_words)
from ntx.daemons.compute.quants import dequantize
from ntx.shared.align import aligned_empty
from ntx.shared.gguf_index import LayerInfo, ModelIndex
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.kv_sizing import KvSizing, pages_for_positions
from ntx.shared.plan import MemoryCosts
from ntx.shared.quant_types import QUANT_TYPES


class _Work(Workspace):
    """Every buffer one pass of ``rows`` rows needs, views of an arena's regions (``prefix``:
    ``BUCKET_PREFIX``, the workspace every bucket's passes share, or none: an eager pass's own
    arena), so that a pass allocates nothing (capturable), and the rows' tokens, positions,
    cache slots, key counts and tree masks on the device. ``rows`` is the pass's
    bucket (its real rows first, inert ones after) or, above the buckets, its own row count.
    ``head``: the arena holding the head's buffers. ``has_trees``: attention takes
    ``tree_base``/``tree_mask`` this pass; ``logit_rows``: the rows whose logits the head
    computes."""

    def __init__(self, rows: int, hp, n_splits: int, arena: Arena, prefix: str = "", head: Arena | None = None,
                 attn_rows: int | None = None) -> None:
        self.rows = rows
        # the kept arena's pass workspace is every bucket's (memory.bucket_regions): a bucket
        # views the first bytes of each region; an eager pass's arena is its size exactly
        part = prefix == BUCKET_PREFIX

        def view(name: str, shape: tuple[int, ...], dtype) -> cp.ndarray:
            return arena.view(prefix + name, shape, dtype, part=part)

        self.arena = arena  # an eager pass's own arena lives as long as its workspace
        # the rows' int32 fields, one device array (and one pinned host twin) so that a pass
        # copies them in one transfer: six pageable copies took ~50 µs of every decode step
        self._fields_dev = view("row fields", (len(ROW_FIELDS), rows), cp.int32)
        self._fields_host = cupyx.empty_pinned((len(ROW_FIELDS), rows), dtype=np.int32)
        self._fields_copied = None  # the event after the last copy: the host twin is free again
        (self.tokens, self.positions,  # RoPE positions
         self.cache_positions,  # where each row's K/V are stored
         self.slots, self.kv_lens,  # kv_lens: cache_positions + 1
         self.tree_base) = self._fields_dev  # cache position of the row's tree root, -1 outside trees
        self.kv_lens.fill(1)
        self.tree_base.fill(-1)
        # bit i: the row sees its tree's row i
        self.tree_mask = view("tree mask", (rows, tree_mask_words(rows)), cp.uint32)
        self.has_trees = False
        self.logit_rows = np.zeros(0, dtype=np.int64)
        self.allocate(rows, hp, lambda name, shape: view(name, shape, cp.float32))
        self.n_splits = n_splits
        # attention's partials: for every row, or for the rows one attention launch takes
        # (memory.attention_rows: the batch-invariant mode's wide passes)
        n = (attn_rows if attn_rows is not None else rows) * hp.n_head * n_splits
        self.attn_ws = (view("attention ml", (n * 2,), cp.float32),
                        view("attention acc", (n * hp.head_dim,), cp.float32))
        head = head if head is not None else arena
        head_rows = head.layout.region("logits").nbytes // (4 * hp.n_vocab)
        self.head_h = head.view("head h", (head_rows, hp.n_embd), cp.float32)  # the final norm's rows
        self.logits = head.view("logits", (head_rows, hp.n_vocab), cp.float32)

    @property
    def T(self) -> int:
        return self.rows

    def set_rows(self, host: PassRows, tree_mask: np.ndarray | None, stream) -> None:
        """Copy a pass's rows (``buckets.PassRows``, ``rows`` long) and its tree mask (uint32
        [rows, W], None without trees) into the device arrays the graphs read."""
        if self._fields_copied is not None:
            self._fields_copied.synchronize()  # (long done: the pass that read them has ended)
        for i, name in enumerate(ROW_FIELDS):
            self._fields_host[i] = getattr(host, name)
        self._fields_dev.set(self._fields_host, stream=stream)
        self._fields_copied = stream.record()
        if tree_mask is not None:
            self.tree_mask.set(tree_mask, stream=stream)
        self.has_trees = host.has_trees


def _tree_mask(batch: StepBatch, rows: int) -> np.ndarray | None:
    """attention's tree mask for ``batch`` padded to ``rows``: uint32 [rows, W] with W
    for trees of up to ``rows`` rows, zero outside trees; None when the batch has no tree."""
    trees = tree_chunks(batch)
    if not trees:
        return None
    n_words = tree_mask_words(rows)
    mask = np.zeros((rows, n_words), dtype=np.uint32)
    for i, r0 in trees:
        c = batch.chunks[i]
        mask[r0 : r0 + c.n_tokens] = attn_ops.pack_tree_mask(c.visible(), n_words)
    return mask


class CudaBackend(Backend):
    """The Llama block's operations as ntx's CUDA kernels on one stream, the paged KV cache
    (``kv_pages.KvPages``: ``max_seqs`` page-table rows of up to ``max_ctx`` positions, the pool
    ``kv`` sizes), every pass buffer and scratch in one arena, graphs of resident runs;
    ``kernels``: the kernel switches (KernelOptions)."""

    name = "cuda"
    queues_passes = True

    def __init__(self, index: ModelIndex, max_seqs: int = 16, max_ctx: int = 4096, use_graphs: bool = True,
                 kernels: KernelOptions | None = None, kv: KvSizing | None = None, embed_in_host: bool = False) -> None:
        """``embed_in_host``: the token embedding stays in page-locked host memory, read in place
        (the plan's ``embed_in_host``: its VRAM holds a layer more where layers stream)."""
        super().__init__(index)
        if embed_in_host and "output" not in index.globals:
            raise ValueError("a tied embedding is the head, read whole every pass: it cannot stay in host memory")
        self.embed_in_host = embed_in_host
        hp = self.hp
        self.max_ctx = min(max_ctx, hp.n_ctx_train)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.use_graphs = use_graphs
        self.max_graph_rows = MAX_GRAPH_ROWS if use_graphs else 0  # passes up to this are bucketed and captured
        self.kernels = kernels if kernels is not None else KernelOptions()
        # the device's table, or its batch-invariant form (the ctx below launches from the same)
        self.tuning = (runtime.invariant_tuning(runtime.tuning(), self.kernels.invariant_rows,
                                                self.kernels.invariant_fixed)
                       if self.kernels.batch_invariant else runtime.tuning())
        with self.stream:
            self.arena = Arena(backend_layout(index, self.max_ctx, self.max_graph_rows, self.tuning))
        self.scratch = ArenaScratch(self.arena)
        self.ctx = runtime.KernelContext(runtime.Launcher(self.kernels), self.scratch)
        sizing = kv if kv is not None else KvSizing.for_positions(self.kv_page_bytes(), max_seqs * self.max_ctx)
        self.kvp = KvPages(hp.n_layers, hp.n_head_kv, hp.head_dim, sizing.chunk_pages, sizing.max_chunks, max_seqs,
                           pages_for_positions(self.max_ctx), self.stream)
        self._init_kv(max_seqs, self.max_ctx, sizing)
        self.works: dict[int, _Work] = {}  # by bucket: the graphs point into them
        self.graphs: dict[tuple, Any] = {}  # (run key, bucket rows, has_trees) -> cupy Graph
        self.ipc_slots: list[Any] = []
        self.tier_stage = None  # the cpu tier's staging buffer for its layers in wide passes (layer_from_host)
        self._stage_stream = None  # its copies' stream
        self._stage_free = None  # event: the kernels of the last layer staged there have run

    @classmethod
    def memory_costs(cls, index: ModelIndex, *, max_seqs: int, max_ctx: int, max_pass_rows: int,
                     kernels: KernelOptions | None = None) -> MemoryCosts:
        return cuda_memory_costs(index, max_seqs=max_seqs, max_ctx=max_ctx, max_pass_rows=max_pass_rows,
                                 kernels=kernels)

    # -- weights -------------------------------------------------------------------------------
    def load_globals(self, raw: dict[str, np.ndarray], rope_divisors: np.ndarray | None) -> None:
        g = self.index.globals
        with self.stream:
            emb = g["token_embd"]
            table = _mapped_host(raw["token_embd"]) if self.embed_in_host else cp.asarray(raw["token_embd"])
            self.embd = gemm.weight(table, emb.ggml_type, emb.shape[0], emb.shape[1])
            self.out_norm = cp.asarray(dequantize(raw["output_norm"], g["output_norm"].ggml_type, g["output_norm"].shape))
            if "output" in raw:
                o = g["output"]
                self.head = gemm.weight(cp.asarray(raw["output"]), o.ggml_type, o.shape[0], o.shape[1])
            else:
                self.head = self.embd
            # the kernel divides each pair's angle by these (backend.rope_divisors)
            self.freq_factors = cp.asarray(rope_divisors) if rope_divisors is not None else None
        self.stream.synchronize()

    def prepare_layer(self, layer: LayerInfo, buf: Any, *, keep: bool) -> dict[str, Any]:
        with self.stream:
            # a device slot is used in place; host bytes (resident layers, in-process streaming) go up once
            dev = buf if isinstance(buf, cp.ndarray) else cp.asarray(buf)
            w: dict[str, Any] = {"_buf": dev}
            for name, t in layer.tensors.items():
                off = layer.image_offset(name)
                view = dev[off : off + t.nbytes]
                if len(t.shape) == 1:
                    if t.ggml_type == QT.F32:
                        w[name] = view.view(cp.float32)
                    else:  # a norm stored in another type: decode once on the host
                        host = dequantize(cp.asnumpy(view), t.ggml_type, t.shape)
                        w[name] = cp.asarray(host)
                else:
                    w[name] = gemm.weight(view, t.ggml_type, t.shape[0], t.shape[1])
        if keep:
            self.stream.synchronize()
        return w

    # -- device slots shared with the dma daemon through CUDA IPC ------------------------------------
    def alloc_slots(self, n: int, nbytes: int, name_prefix: str) -> tuple[list[Any], list[bytes]]:
        """n device buffers of nbytes each (plain cudaMalloc, so IPC handles cover them whole);
        the dma daemon opens them by their CUDA IPC handles. ``name_prefix`` is not needed."""
        bufs, handles = [], []
        for _ in range(n):
            mem = cp.cuda.Memory(nbytes)  # its own cudaMalloc, not a pool sub-allocation
            self.ipc_slots.append(mem)
            ptr = cp.cuda.MemoryPointer(mem, 0)
            bufs.append(cp.ndarray((nbytes,), dtype=cp.uint8, memptr=ptr))
            handles.append(bytes(cp.cuda.runtime.ipcGetMemHandle(mem.ptr)))
        return bufs, handles

    def sync(self) -> None:
        """Wait for the work queued so far (before a slot goes back to the dma daemon)."""
        self.stream.synchronize()

    # -- KV pages ------------------------------------------------------------------------------
    def _kv_alloc_chunk(self, chunk: int) -> None:
        self.kvp.alloc_chunk(chunk)

    def _kv_free_chunk(self, chunk: int) -> None:
        self.kvp.free_chunk(chunk)

    def _kv_set_row(self, row: int, pages) -> None:
        self.kvp.set_row(row, pages)

    def kv_keep(self, seq_id: int, src_positions: list[int], dst_positions: list[int]) -> None:
        """The accepted path of a verified tree: K and V at ``src_positions`` move to
        ``dst_positions`` in every layer, one kernel launch on the pass stream."""
        nrk.kv_move(self.ctx, self.kvp, self.seq_row[seq_id], src_positions, dst_positions, stream=self.stream)

    # -- one pass ------------------------------------------------------------------------------
    def _work(self, rows: int, keep: bool) -> _Work:
        """The workspace of ``rows`` rows: a bucket's, kept in the backend's arena (graphs point
        into it), or above the buckets an arena of the pass's own (``memory.eager_layout``),
        freed with it, so a stream of prompt lengths does not pile up; its head runs in the kept
        arena's buffers a chunk of rows at a time (``_head_chunks``). The kernels' scratch looks
        in that pass's arena first (``ArenaScratch.eager``)."""
        self.scratch.eager = None  # the last eager pass's arena goes back before a new one is made
        w = self.works.get(rows)
        if w is None:
            splits = attention_splits(rows, self.hp.n_head_kv, self.max_ctx, self.tuning)
            attn_rows = attention_rows(rows, self.tuning)
            with self.stream:
                if keep:
                    w = self.works[rows] = _Work(rows, self.hp, splits, self.arena, prefix=BUCKET_PREFIX,
                                                 attn_rows=attn_rows)
                else:  # the head's buffers: the kept arena's (the largest bucket's) where graphs are on
                    own_head = not self.max_graph_rows
                    w = _Work(rows, self.hp, splits,
                              Arena(eager_layout(self.hp, rows, self.max_ctx, self.tuning, own_head=own_head)),
                              head=None if own_head else self.arena, attn_rows=attn_rows)
        if not keep:
            self.scratch.eager = w.arena
        return w

    def begin_pass(self, batch: StepBatch) -> _Work:
        T = batch.n_tokens
        bucket = row_bucket(T, self.max_graph_rows)
        work = self._work(bucket or T, keep=bucket is not None)
        host = pass_rows(batch, [self.seq_row[c.seq_id] for c in batch.chunks], work.rows)
        if self.kernels.batch_invariant and host.has_trees:
            # tree rows see their path in its order (attention.attention): their logical length
            host.kv_lens = np.where(host.tree_base >= 0, host.positions + 1, host.kv_lens).astype(np.int32)
        work.set_rows(host, _tree_mask(batch, work.rows), self.stream)
        work.batch = batch
        work.logit_rows = batch.logit_rows
        work.capturable = bucket is not None
        return work

    def scope(self):
        return self.stream

    def run_captured(self, key, ws: Workspace, run) -> None:
        """Replay the graph of ``run`` for (key, bucket, trees or not); record it on the first
        call, after one eager run that compiles every kernel it needs (and does this pass's
        work). The warm-up makes that first call for every bucket before any request."""
        if not ws.capturable:
            run()
            return
        key = (key, ws.rows, ws.has_trees)
        g = self.graphs.get(key)
        if g is not None:
            g.launch(self.stream)
            return
        with self.stream:
            run()
        self.stream.synchronize()
        with self.stream:
            self.stream.begin_capture()
            try:
                run()
            finally:
                g = self.stream.end_capture()
        self.graphs[key] = g

    # -- warm-up -------------------------------------------------------------------------------
    def _inert_pass(self, rows: int, trees: bool, keep: bool) -> _Work:
        """A pass of ``rows`` inert rows (no cache slot: nothing read or written in the KV cache),
        every row a logit row; ``trees``: attention takes the masked kernel."""
        work = self._work(rows, keep=keep)
        host = inert_rows(rows)
        host.has_trees = trees
        work.set_rows(host, np.zeros(work.tree_mask.shape, dtype=np.uint32) if trees else None, self.stream)
        work.logit_rows = np.arange(rows, dtype=np.int64)
        work.capturable = keep
        return work

    def _warm_head(self, work: _Work) -> None:
        """The head and every kind of device selection (top-k, log-normaliser, a gathered token,
        a whole row; all logit rows or some) on ``work``'s rows: their kernels compiled."""
        n = work.rows
        picks = [Pick(1), Pick(40, lse=True, token=0), Pick(0)][:n] + [Pick(1)] * max(0, n - 3)
        self.pick(work, picks)
        if n > 1:
            work.logit_rows = np.arange(1, n, dtype=np.int64)  # a subset: the gathered path
            self.pick(work, [Pick(1)] * (n - 1))

    def warm_up(self, runs: Sequence[CaptureRun], spec: WarmUp, log: Callable[[str], None],
                eager_ops: Callable[[Workspace], None] | None = None) -> None:
        """Compile and record, before the first request, what a pass of ``spec`` can need
        (``Backend.warm_up``): for every bucket up to the engine's largest pass, each run eagerly
        then captured, without and (``spec.trees``) with token trees, and the head; an eager pass
        of each of ``spec.eager_rows`` (the >bucket path: cuBLAS and its kernels); the kernels
        of streamed-only matrix types. Inert rows only: no KV cache entry is touched."""
        t0 = time.monotonic()
        if spec.compile_qtypes:
            self._compile(sorted(spec.compile_qtypes))
            log(f"warm-up: kernels of streamed-only types {sorted(spec.compile_qtypes)} compiled "
                f"in {time.monotonic() - t0:.2f} s")
        with self.stream:
            t = time.monotonic()
            # largest first: smaller passes then reuse its freed memory (cupy's pool keeps it)
            eager = sorted({r for r in spec.eager_rows if r > self.max_graph_rows}, reverse=True)
            for rows in eager:  # before the graphs: a later pass must not grow a buffer a graph points into
                work = self._inert_pass(rows, trees=False, keep=False)
                for _, run in runs:
                    run(work)
                if eager_ops is not None:
                    eager_ops(work)
                self._warm_head(work)
            self.stream.synchronize()
            if eager:
                log(f"warm-up: {len(eager)} eager pass(es) of {', '.join(map(str, eager))} rows "
                    f"in {time.monotonic() - t:.2f} s")
            t = time.monotonic()
            n_graphs = len(self.graphs)
            top = row_bucket(min(spec.max_rows, self.max_graph_rows), self.max_graph_rows) if self.max_graph_rows else 0
            buckets = [b for b in bucket_sizes(self.max_graph_rows) if b <= top]  # those the engine's passes reach
            kinds = (False, True) if spec.trees else (False,)
            for rows in buckets or [1, 2]:  # without graphs: one plain and one tree pass, eagerly
                for trees in kinds:
                    if trees and rows < 2:
                        continue  # a one-row tree is a plain row
                    work = self._inert_pass(rows, trees, keep=bool(buckets))
                    for key, run in runs:
                        self.run_captured(key, work, lambda run=run, work=work: run(work))
                    if eager_ops is not None:
                        eager_ops(work)
                    self._warm_head(work)
            self.stream.synchronize()
        trees_note = " with and without trees" if spec.trees else ""
        if buckets:
            log(f"warm-up: {len(buckets)} row bucket(s) up to {buckets[-1]} rows x {len(runs)} run(s){trees_note}: "
                f"{len(self.graphs) - n_graphs} graph(s) recorded in {time.monotonic() - t:.2f} s")
        else:
            log(f"warm-up: graphs off, passes of 1 and 2 rows{trees_note} run eagerly in {time.monotonic() - t:.2f} s")

    def _compile(self, qtypes) -> None:
        """Compile (or load from cupy's disk cache) the modules the products of matrices of
        ``qtypes`` take on this device (instances.type_modules), and every source's extern "C"
        kernels (the quantizers of x among them)."""
        with self.stream:
            for qt in qtypes:
                for source, names in instances.type_modules(QUANT_TYPES[qt], [self.tuning]):
                    runtime.module(source, names)
            for source in instances.extern_kernels():
                runtime.module(source, ())

    # -- operations ----------------------------------------------------------------------------
    def embed(self, ws: _Work):
        return get_rows(self.ctx, self.embd, ws.tokens, out=ws.x)

    def rms_norm(self, x, w, out):
        return nrk.rmsnorm(self.ctx, x, w, self.hp.rms_eps, out=out)

    def add_rms_norm(self, x, delta, w, out):
        return nrk.rmsnorm(self.ctx, delta, w, self.hp.rms_eps, residual=x, out=out)  # x += delta; out = norm(x)

    def matmul(self, w: Weight, x, out):
        return gemm.gemm(self.ctx, w, x, out=out)

    def matmuls(self, x, products) -> None:
        gemm.gemm_group(self.ctx, x, list(products))

    def norm_matmuls(self, x, w, h, products, delta=None) -> None:
        if delta is None:
            gemm.norm_gemm_group(self.ctx, x, w, self.hp.rms_eps, h, list(products))
        else:  # x += delta; h = norm(x)
            gemm.norm_gemm_group(self.ctx, delta, w, self.hp.rms_eps, h, list(products), residual=x)

    def swiglu_matmul_add(self, gate, up, act, w: Weight, out, tmp):
        return gemm.swiglu_gemm_add(self.ctx, gate, up, act, w, out)

    def qkv_bias_pairs(self, q, k, v, biases, ws: _Work) -> None:
        hp, T = self.hp, ws.T
        nrk.qkv_bias_pairs(self.ctx, q.reshape(T, hp.n_head, hp.head_dim), k.reshape(T, hp.n_head_kv, hp.head_dim),
                           v.reshape(T, hp.n_head_kv, hp.head_dim), *biases,
                           rope_dim=hp.rope_dim if hp.rope_neox else 0)

    def rope(self, q, k, ws: _Work) -> None:
        hp, T = self.hp, ws.T
        nrk.rope_qk_inplace(self.ctx, q.reshape(T, hp.n_head, hp.head_dim), k.reshape(T, hp.n_head_kv, hp.head_dim),
                            ws.positions, hp.rope_dim, hp.rope_base, self.freq_factors)  # one launch for both

    def kv_write(self, layer_idx: int, k, v, ws: _Work) -> None:
        hp, T = self.hp, ws.T
        nrk.kv_append(self.ctx, k.reshape(T, hp.n_head_kv, hp.head_dim), v.reshape(T, hp.n_head_kv, hp.head_dim),
                      self.kvp, layer_idx, ws.slots, ws.cache_positions)

    def rope_kv_write(self, layer_idx: int, q, k, v, ws: _Work) -> None:
        hp, T = self.hp, ws.T
        nrk.rope_kv_append(self.ctx, q.reshape(T, hp.n_head, hp.head_dim), k.reshape(T, hp.n_head_kv, hp.head_dim),
                           v.reshape(T, hp.n_head_kv, hp.head_dim), self.kvp, layer_idx, ws.positions, ws.slots,
                           ws.cache_positions, hp.rope_dim, hp.rope_base, self.freq_factors)

    def attention(self, layer_idx: int, q, ws: _Work, out):
        hp, T = self.hp, ws.T
        trees = ws.has_trees
        attn_ops.attention(self.ctx, q.reshape(T, hp.n_head, hp.head_dim), self.kvp, layer_idx, ws.slots, ws.kv_lens,
                           out=out.reshape(T, hp.n_head, hp.head_dim), n_splits=ws.n_splits, workspace=ws.attn_ws,
                           tree_base=ws.tree_base if trees else None, tree_mask=ws.tree_mask if trees else None)
        return out

    def attention_matmul(self, layer_idx: int, q, ws: _Work, attn, w: Weight, out):
        hp, T = self.hp, ws.T
        trees = ws.has_trees
        return attn_ops.attention_gemm(self.ctx, q.reshape(T, hp.n_head, hp.head_dim), self.kvp, layer_idx, ws.slots,
                                       ws.kv_lens,
                                       attn.reshape(T, hp.n_head, hp.head_dim), w, out, n_splits=ws.n_splits,
                                       workspace=ws.attn_ws, tree_base=ws.tree_base if trees else None,
                                       tree_mask=ws.tree_mask if trees else None)

    def attention_fuses(self, T: int, w: Weight) -> bool:
        """Whether ``attention_matmul`` of T rows by ``w`` is one fused operation (profile_pass
        times it as one)."""
        return attn_ops.attention_gemm_fuses(self.ctx, T, w)

    def swiglu(self, gate, up, out):
        return nrk.swiglu(self.ctx, gate, up, out=out)

    def add(self, x, y, out):
        return nrk.add(self.ctx, x, y, out=out)

    def topk(self, logits, k: int):
        """The head's device selection (``selection.topk``) on this backend's kernels."""
        return selection.topk(self.ctx, logits, k)

    # -- the head --------------------------------------------------------------------------------
    def _logits_dev(self, work: _Work, rows: np.ndarray | None = None):
        """Final norm and head on the device: f32 [N, V] for ``rows`` (``work.logit_rows``), at
        most the head buffer's rows (``_head_chunks``), in that buffer."""
        hp = self.hp
        rows = work.logit_rows if rows is None else rows
        n = len(rows)
        if n > work.logits.shape[0]:
            raise ValueError(f"the head takes {work.logits.shape[0]} rows at a time, not {n} (_head_chunks)")
        with self.stream:
            start = int(rows[0]) if n else 0
            if np.array_equal(rows, np.arange(start, start + n)):
                h_in = work.x[start:start + n]  # consecutive rows (a prompt chunk, every row): no gather
            else:
                h_in = work.x[cp.asarray(rows)]
            h = nrk.rmsnorm(self.ctx, h_in, self.out_norm, hp.rms_eps, out=work.head_h[:n])  # h: [N, D]
            out = work.logits[:n]  # [N, V]
            # The head is the largest matrix: gemm reads it quantized for up to MAX_GRAPH_ROWS rows
            # at once, never through an f16 copy of all of it (1 GB for a 128k vocabulary at d=4096).
            for i in range(0, n, MAX_GRAPH_ROWS):
                j = min(i + MAX_GRAPH_ROWS, n)
                gemm.gemm(self.ctx, self.head, h[i:j], out=out[i:j])
        return out

    @staticmethod
    def _head_chunks(work: _Work) -> list[tuple[int, int]]:
        """[a, b) ranges of ``work.logit_rows`` the head computes one after another: as many as
        its buffer holds at a time (MAX_GRAPH_ROWS, the largest bucket's: an eager pass's head
        shares the kept arena's buffer, ``memory.eager_layout``), so that a 512-row verify pass
        does not hold [512, V] logits (250 MiB for a 128k vocabulary)."""
        n, cap = len(work.logit_rows), work.logits.shape[0]
        return [(a, min(a + cap, n)) for a in range(0, n, cap)] or [(0, 0)]

    def logits(self, ws: _Work) -> np.ndarray:
        host = np.empty((len(ws.logit_rows), self.hp.n_vocab), dtype=np.float32)
        for a, b in self._head_chunks(ws):
            host[a:b] = cp.asnumpy(self._logits_dev(ws, ws.logit_rows[a:b]), stream=self.stream)
        self.stream.synchronize()
        return host

    def pick(self, ws: _Work, picks: list[Pick]) -> list[Picked]:
        return self.pick_launch(ws, picks).result()

    def pick_launch(self, ws: _Work, picks: list[Pick]) -> _PendingPicks:
        """Selection on the device: one top-k kernel over the rows that want candidates (k the
        largest asked), a log-normaliser where asked, and only those k entries (and whole rows
        where k == 0) cross to the host, into pinned buffers, without waiting: a decode step
        copies a few bytes, not [N, V] floats, and the host may queue the next pass meanwhile.
        Rows beyond the head buffer's go through it a chunk at a time (``_head_chunks``), their
        candidates gathered on the device."""
        n, V = len(ws.logit_rows), self.hp.n_vocab
        cand = [i for i, p in enumerate(picks) if p.k > 0]
        full = [i for i, p in enumerate(picks) if p.k == 0]
        tok_rows = [j for j, i in enumerate(cand) if picks[i].token is not None]  # rows of ``cand``
        k = min(max(picks[i].k for i in cand), V) if cand else 0
        want_lse = any(picks[i].lse for i in cand)
        parts: dict[str, list] = {"vals": [], "ids": [], "lse": [], "tok_vals": []}
        full_rows: list[np.ndarray] = []  # pinned [F_chunk, V] each, in ``full``'s order
        got: dict = {}
        with self.stream:
            for a, b in self._head_chunks(ws):
                lg = self._logits_dev(ws, ws.logit_rows[a:b])  # [b - a, V]
                c_cand = [i - a for i in cand if a <= i < b]
                c_full = [i - a for i in full if a <= i < b]
                if c_cand:
                    sub = lg if len(c_cand) == b - a else lg[cp.asarray(c_cand)]
                    vals_d, ids_d = selection.topk(self.ctx, cp.ascontiguousarray(sub), k)  # [C, k] each
                    parts["vals"].append(vals_d)
                    parts["ids"].append(ids_d)
                    if want_lse:
                        m = vals_d[:, :1]  # the row maxima: the top-1 values, [C, 1]
                        parts["lse"].append(cp.log(cp.exp(sub - m).sum(axis=1)) + m[:, 0])  # [C]
                    c_tok = [j for j, i in enumerate(c_cand) if picks[i + a].token is not None]
                    if c_tok:  # the asked tokens' logits, gathered on the device: [len(c_tok)]
                        tok_ids = cp.asarray([picks[c_cand[j] + a].token for j in c_tok])
                        parts["tok_vals"].append(sub[cp.asarray(c_tok), tok_ids])
                if c_full:
                    one: dict = {}
                    _to_host(one, "rows", lg[cp.asarray(c_full)], self.stream)
                    full_rows.extend(one["rows"])
            joined = {name: (p[0] if len(p) == 1 else cp.concatenate(p)) for name, p in parts.items() if p}
            top1 = joined["ids"][:, 0] if cand and len(cand) == n else None  # [N]: greedy rows' next tokens, for feed_tokens
            for name, arr in joined.items():
                _to_host(got, name, arr, self.stream)
            if full_rows:
                got["rows"] = full_rows
            done = self.stream.record()
        return _PendingPicks(picks, n, cand, full, tok_rows, got, done, top1)

    def feed_tokens(self, ws: _Work, top1) -> None:
        """ws.tokens[:n] = top1 [n] on the pass stream, after ``begin_pass``'s copy of the rows:
        the previous pass's top-1 ids never visit the host before this pass reads them."""
        n = int(top1.shape[0])
        if n > ws.rows:
            raise ValueError(f"feed_tokens: {n} tokens for a pass of {ws.rows} rows")
        with self.stream:
            ws.tokens[:n] = top1

    def hidden_to_host(self, ws: _Work) -> np.ndarray:
        """ws.x's T rows [T, D] on the host, after the pass's work so far (a synchronous copy on the
        pass stream: the cpu tier's layers read it next)."""
        host = cp.asnumpy(ws.x[: ws.batch.n_tokens], stream=self.stream)
        self.stream.synchronize()
        return host

    def hidden_from_host(self, ws: _Work, x: np.ndarray) -> None:
        """ws.x[:T] = x [T, D], queued on the pass stream before the layers that follow."""
        ws.x[: x.shape[0]].set(np.ascontiguousarray(x, dtype=np.float32), stream=self.stream)

    def to_host(self, a, n_rows: int) -> np.ndarray:
        host = cp.asnumpy(a[:n_rows], stream=self.stream)
        self.stream.synchronize()
        return host

    def kv_from_host(self, layer_idx: int, k: np.ndarray, v: np.ndarray, ws: _Work) -> None:
        """The host rows' K/V up to the device and into the cache (inert rows store nothing)."""
        n = k.shape[0]
        ws.k[:n].set(np.ascontiguousarray(k, dtype=np.float32), stream=self.stream)
        ws.v[:n].set(np.ascontiguousarray(v, dtype=np.float32), stream=self.stream)
        with self.stream:
            self.kv_write(layer_idx, ws.k, ws.v, ws)

    def pin_host(self, buf: np.ndarray) -> None:
        """Page-lock ``buf`` (cudaHostRegister) so that its copies run at the link's speed, until
        ``buf`` goes: then it is unregistered before its pages are unmapped, so that a later
        mapping at the same addresses can be registered again (CUDA would say "already mapped")."""
        ptr = buf.ctypes.data
        cp.cuda.runtime.hostRegister(ptr, buf.nbytes, 0)
        weakref.finalize(buf, _host_unregister, ptr)

    def layer_from_host(self, layer: LayerInfo, buf: np.ndarray) -> dict[str, Any]:
        """A cpu-tier layer's image (page-locked by ``pin_host``) copied into the backend's one
        staging buffer and prepared there. The copy runs on a stream of its own, after the kernels
        of the buffer's last layer (``host_layer_done``) and not after those queued since, so it
        overlaps the layers between two tier layers; the pass stream waits for it. (Queued on the
        pass stream itself, the copies of a batch-64 pass's 19 tier layers ran apart from
        compute, and the link idled while the layers between them computed: 0.84x the pass
        without a tier on the H200. Kernels reading the layer in place from mapped host memory
        instead got 37-40 GB/s against the copy's 51-54: dev/cuda/bench_mapped_weights.py.)"""
        if self.tier_stage is None:  # the largest layer's image: every layer fits
            self.tier_stage = cp.ndarray((self.index.max_layer_image_bytes,), dtype=cp.uint8,
                                         memptr=cp.cuda.MemoryPointer(cp.cuda.Memory(self.index.max_layer_image_bytes), 0))
            self._stage_stream = cp.cuda.Stream(non_blocking=True)
        dst = self.tier_stage[: buf.nbytes]
        if self._stage_free is not None:
            self._stage_stream.wait_event(self._stage_free)
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, buf.ctypes.data, buf.nbytes, 1, self._stage_stream.ptr)
        self.stream.wait_event(self._stage_stream.record())
        return self.prepare_layer(layer, dst, keep=False)

    def host_layer_done(self) -> None:
        """The kernels of ``layer_from_host``'s last layer are queued: the staging buffer is
        free for the next copy once they have run."""
        self._stage_free = self.stream.record()


CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


def _mapped_host(raw: np.ndarray) -> cp.ndarray:
    """``raw``'s bytes in page-locked host memory that kernels read in place, as a uint8 device
    array (the embedding's table, of which a pass gathers a few rows: a row crosses the link
    per token, 4.5 KB for a 70B's Q4_K row). Registered mapped; the device reads it at its host
    address where the device says it can (sm_90 with one address space: the H200); the pages
    are unregistered when the array goes."""
    if not cp.cuda.runtime.deviceGetAttribute(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, cp.cuda.Device().id):
        raise RuntimeError("this GPU cannot read registered host memory at its host address: "
                           "the embedding cannot stay in host memory (raise --vram-budget)")
    host = aligned_empty(raw.nbytes)
    host[:] = np.asarray(raw).reshape(-1).view(np.uint8)
    ptr = host.ctypes.data
    cp.cuda.runtime.hostRegister(ptr, host.nbytes, 2)  # cudaHostRegisterMapped
    weakref.finalize(host, _host_unregister, ptr)
    return cp.ndarray((host.nbytes,), dtype=cp.uint8,
                      memptr=cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, host.nbytes, host), 0))


def _host_unregister(ptr: int) -> None:
    """pin_host's undo, when its buffer goes (at exit the context may be gone first: nothing to undo then)."""
    try:
        cp.cuda.runtime.hostUnregister(ptr)
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass


def _to_host(got: dict, name: str, a, stream) -> None:
    """got[name] = a pinned host twin of device array ``a``, its copy queued on ``stream``."""
    a = cp.ascontiguousarray(a)
    host = cupyx.empty_pinned(a.shape, dtype=a.dtype)
    a.get(stream=stream, out=host, blocking=False)
    got[name] = host


class _PendingPicks(PendingPicks):
    """``CudaBackend.pick_launch``'s rows in flight: the pinned buffers their copies go to and
    the event after the last one; ``result()`` waits for it and builds the ``Picked`` rows."""

    def __init__(self, picks: list[Pick], n: int, cand: list[int], full: list[int], tok_rows: list[int],
                 got: dict[str, np.ndarray], done, top1) -> None:
        self._picks, self._n, self._cand, self._full, self._tok_rows = picks, n, cand, full, tok_rows
        self._got, self._done = got, done
        self.top1 = top1
        self._result: list[Picked] | None = None

    def result(self) -> list[Picked]:
        if self._result is not None:
            return self._result
        self._done.synchronize()
        got, picks = self._got, self._picks
        result: list[Picked] = [Picked() for _ in range(self._n)]
        tok_val = dict(zip(self._tok_rows, got["tok_vals"].tolist())) if self._tok_rows else {}
        for j, i in enumerate(self._cand):
            kk = picks[i].k
            result[i] = Picked(ids=got["ids"][j, :kk].astype(np.int64), vals=got["vals"][j, :kk].astype(np.float64),
                               lse=float(got["lse"][j]) if picks[i].lse else None, token_val=tok_val.get(j))
        for j, i in enumerate(self._full):
            result[i] = Picked(row=np.array(got["rows"][j]))  # a copy: the pinned buffer goes back to the pool
        self._result = result
        self._got = {}
        return result
