"""The cuda backend: the operations of the Llama block on the GPU with ntx's own kernels (``kernels.py``).

Weights are used exactly as GGUF stores them: a resident layer is uploaded once (its slot-layout
buffer, no repacking), a streamed layer is read straight from the device slot the dma daemon
filled. Every matrix product dequantizes on the fly (``kernels.gemm``: matvec for up to 8 rows,
dequantize-to-f16 + cuBLAS beyond).

Launch overhead: one Python-launched kernel costs about 10 µs, as much as a small layer's whole
work, so the model asks for its runs of resident layers to be captured (``run_captured``): one
CUDA graph per run and number of rows T, recorded on the second call (the first compiles every
kernel it needs) and replayed after. All buffers of a pass live in a per-T workspace and every
position, length and cache slot is read from device memory, so one graph replays every decode
step. Streamed layers run eagerly between graph segments: their slot changes from pass to pass.

KV cache: per layer f16 [max_seqs, n_kv, max_ctx, hd]; a sequence owns one cache slot. A row's
keys and values go to its cache position (``StepBatch.cache_positions``), which differs from its
RoPE position only in a token tree. A pass with trees (speculative verification) hands attention
each tree row's tree mask; such passes have chunks of several rows, so they are never captured.
After verification ``kv_keep`` moves the accepted path down in every layer in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.backend import Backend, Pick, Picked, Workspace
from ntx.daemons.compute.batch import StepBatch
from ntx.daemons.compute.cuda import kernels as K
from ntx.daemons.compute.cuda.memory import cuda_memory_costs
from ntx.daemons.compute.quants import dequantize
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import LayerInfo, ModelIndex
from ntx.shared.plan import MemoryCosts

_MAX_GRAPH_T = K.MAX_MATVEC_B


@dataclass
class _Mat:
    raw: Any  # uint8 device view of the tensor's GGUF bytes
    qtype: int
    n_rows: int
    n_cols: int


class _Work(Workspace):
    """Every buffer one pass of T rows needs, so that a pass allocates nothing (capturable), and
    the rows' tokens, positions, cache slots and key counts on the device. ``tree_base`` and
    ``tree_mask`` (kernels.attention's tree arguments) are set per pass, only for passes with
    trees of more than one row; None otherwise."""

    def __init__(self, T: int, hp, n_splits: int) -> None:
        self.tokens = cp.zeros(T, dtype=cp.int32)
        self.positions = cp.zeros(T, dtype=cp.int32)  # RoPE positions
        self.cache_positions = cp.zeros(T, dtype=cp.int32)  # where each row's K/V are stored
        self.slots = cp.zeros(T, dtype=cp.int32)
        self.kv_lens = cp.ones(T, dtype=cp.int32)  # cache_positions + 1
        self.tree_base: Any = None  # int32 [T]: cache position of the row's tree root, -1 outside trees
        self.tree_mask: Any = None  # uint32 [T, W]: bit i = the row sees its tree's row i
        self.allocate(T, hp, lambda shape: cp.zeros(shape, dtype=cp.float32))
        self.n_splits = n_splits
        self.attn_ws = K.attention_workspace(T, hp.n_head, hp.head_dim, n_splits)


def _tree_rows(batch: StepBatch) -> tuple[np.ndarray | None, np.ndarray | None]:
    """kernels.attention's tree arguments for ``batch`` on the host: (tree_base int32 [T],
    tree_mask uint32 [T, W]), or (None, None) when no chunk is a tree of more than one row (a
    one-row tree sees the prefix and itself, as a plain row does)."""
    trees = [(c, r0) for c, r0 in zip(batch.chunks, batch.row_starts) if c.parents is not None and c.n_tokens > 1]
    if not trees:
        return None, None
    n_words = K.tree_mask_words(max(c.n_tokens for c, _ in trees))
    tree_base = np.full(batch.n_tokens, -1, dtype=np.int32)
    tree_mask = np.zeros((batch.n_tokens, n_words), dtype=np.uint32)
    for c, r0 in trees:
        tree_base[r0 : r0 + c.n_tokens] = c.start_pos
        tree_mask[r0 : r0 + c.n_tokens] = K.pack_tree_mask(c.visible(), n_words)
    return tree_base, tree_mask


class CudaBackend(Backend):
    """The Llama block's operations as ntx's CUDA kernels on one stream, the KV cache reserved
    up front for ``max_seqs`` sequences of ``max_ctx`` positions, graphs of resident runs."""

    name = "cuda"

    def __init__(self, index: ModelIndex, max_seqs: int = 16, max_ctx: int = 4096, use_graphs: bool = True) -> None:
        super().__init__(index)
        hp = self.hp
        self.max_seqs = max_seqs
        self.max_ctx = min(max_ctx, hp.n_ctx_train)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.use_graphs = use_graphs
        with self.stream:
            self.kv = [K.alloc_kv_cache(max_seqs, hp.n_head_kv, self.max_ctx, hp.head_dim) for _ in range(hp.n_layers)]
            self.kv_table = K.kv_cache_table(self.kv)  # every layer's cache addresses, for kv_keep
        self.free_cache_slots = list(range(max_seqs - 1, -1, -1))
        self.seq_slot: dict[int, int] = {}
        self.works: dict[int, _Work] = {}
        self.graphs: dict[tuple, Any] = {}
        self.ipc_slots: list[Any] = []

    @classmethod
    def memory_costs(cls, index: ModelIndex, *, max_seqs: int, max_ctx: int, prefill_chunk_tokens: int) -> MemoryCosts:
        return cuda_memory_costs(index, max_seqs=max_seqs, max_ctx=max_ctx, prefill_chunk_tokens=prefill_chunk_tokens)

    # -- weights -------------------------------------------------------------------------------
    def load_globals(self, raw: dict[str, np.ndarray], rope_divisors: np.ndarray | None) -> None:
        g = self.index.globals
        with self.stream:
            emb = g["token_embd"]
            self.embd = _Mat(cp.asarray(raw["token_embd"]), int(emb.ggml_type), emb.shape[0], emb.shape[1])
            self.out_norm = cp.asarray(dequantize(raw["output_norm"], g["output_norm"].ggml_type, g["output_norm"].shape))
            if "output" in raw:
                o = g["output"]
                self.head = _Mat(cp.asarray(raw["output"]), int(o.ggml_type), o.shape[0], o.shape[1])
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
                off = layer.slot_offset(name)
                view = dev[off : off + t.nbytes]
                if len(t.shape) == 1:
                    if t.ggml_type == QT.F32:
                        w[name] = view.view(cp.float32)
                    else:  # a norm stored in another type: decode once on the host
                        host = dequantize(cp.asnumpy(view), t.ggml_type, t.shape)
                        w[name] = cp.asarray(host)
                else:
                    w[name] = _Mat(view, int(t.ggml_type), t.shape[0], t.shape[1])
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

    # -- KV cache ------------------------------------------------------------------------------
    def alloc_sequence(self, seq_id: int, capacity_tokens: int) -> None:
        if capacity_tokens > self.max_ctx:
            raise NtxError(f"sequence needs {capacity_tokens} positions but the KV cache holds {self.max_ctx}")
        if not self.free_cache_slots:
            raise NtxError(f"all {self.max_seqs} KV cache slots are in use")
        self.seq_slot[seq_id] = self.free_cache_slots.pop()

    def free_sequence(self, seq_id: int) -> None:
        slot = self.seq_slot.pop(seq_id, None)
        if slot is not None:
            self.free_cache_slots.append(slot)

    def kv_keep(self, seq_id: int, src_positions: list[int], dst_positions: list[int]) -> None:
        """The accepted path of a verified tree: K and V at ``src_positions`` move to
        ``dst_positions`` in every layer, one kernel launch on the pass stream."""
        K.kv_move(self.kv, self.seq_slot[seq_id], src_positions, dst_positions, table=self.kv_table,
                  stream=self.stream)

    # -- one pass ------------------------------------------------------------------------------
    def _work(self, T: int) -> _Work:
        """Decode-sized workspaces are kept (graphs point into them); prefill-sized ones are made
        per pass and go back to cupy's pool, so a stream of prompt lengths does not pile up."""
        w = self.works.get(T)
        if w is None:
            with self.stream:
                w = _Work(T, self.hp, K.attention_splits(T, self.hp.n_head_kv, self.max_ctx))
            if T <= _MAX_GRAPH_T:
                self.works[T] = w
        return w

    def begin_pass(self, batch: StepBatch) -> _Work:
        T = batch.n_tokens
        work = self._work(T)
        slots = np.empty(T, dtype=np.int32)
        for c, r0 in zip(batch.chunks, batch.row_starts):
            slots[r0 : r0 + c.n_tokens] = self.seq_slot[c.seq_id]
        tree_base, tree_mask = _tree_rows(batch)
        with self.stream:
            work.tokens.set(batch.tokens, stream=self.stream)
            work.positions.set(batch.positions, stream=self.stream)
            work.cache_positions.set(batch.cache_positions, stream=self.stream)
            work.kv_lens.set(batch.cache_positions + 1, stream=self.stream)
            work.slots.set(slots, stream=self.stream)
            work.tree_base = cp.asarray(tree_base) if tree_base is not None else None
            work.tree_mask = cp.asarray(tree_mask) if tree_mask is not None else None
        work.batch = batch
        # decode steps of up to _MAX_GRAPH_T rows replay graphs; prompt chunks and trees run eagerly
        work.capturable = self.use_graphs and T <= _MAX_GRAPH_T and all(c.n_tokens == 1 for c in batch.chunks)
        return work

    def scope(self):
        return self.stream

    def run_captured(self, key, ws: Workspace, run) -> None:
        """Replay the graph of ``run`` for (key, T); record it on the first capturable call,
        after one eager run that compiles every kernel it needs (and does this pass's work)."""
        if not ws.capturable:
            run()
            return
        key = (key, ws.T)
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

    # -- operations ----------------------------------------------------------------------------
    def embed(self, ws: _Work):
        e = self.embd
        return K.get_rows(e.raw, e.qtype, e.n_rows, e.n_cols, ws.tokens, out=ws.x)

    def rms_norm(self, x, w, out):
        return K.rmsnorm(x, w, self.hp.rms_eps, out=out)

    def add_rms_norm(self, x, delta, w, out):
        return K.rmsnorm(delta, w, self.hp.rms_eps, residual=x, out=out)  # x += delta; out = norm(x)

    def matmul(self, w: _Mat, x, out):
        return K.gemm(w.raw, w.qtype, w.n_rows, w.n_cols, x, out=out)

    def rope(self, q, k, ws: _Work) -> None:
        hp, T = self.hp, ws.T
        K.rope_inplace(q.reshape(T, hp.n_head, hp.head_dim), ws.positions, hp.rope_dim, hp.rope_base, self.freq_factors)
        K.rope_inplace(k.reshape(T, hp.n_head_kv, hp.head_dim), ws.positions, hp.rope_dim, hp.rope_base, self.freq_factors)

    def kv_write(self, layer_idx: int, k, v, ws: _Work) -> None:
        hp, T = self.hp, ws.T
        ck, cv = self.kv[layer_idx]
        K.kv_append(k.reshape(T, hp.n_head_kv, hp.head_dim), v.reshape(T, hp.n_head_kv, hp.head_dim),
                    ck, cv, ws.slots, ws.cache_positions)

    def attention(self, layer_idx: int, q, ws: _Work, out):
        hp, T = self.hp, ws.T
        ck, cv = self.kv[layer_idx]
        K.attention(q.reshape(T, hp.n_head, hp.head_dim), ck, cv, ws.slots, ws.kv_lens,
                    out=out.reshape(T, hp.n_head, hp.head_dim), n_splits=ws.n_splits, workspace=ws.attn_ws,
                    tree_base=ws.tree_base, tree_mask=ws.tree_mask)
        return out

    def swiglu(self, gate, up, out):
        return K.swiglu(gate, up, out=out)

    def add(self, x, y, out):
        return cp.add(x, y, out=out)

    # -- the head --------------------------------------------------------------------------------
    def _logits_dev(self, work: _Work):
        """Final norm and head on the device: f32 [N, V] for ``batch.logit_rows``."""
        hp = self.hp
        rows = work.batch.logit_rows
        with self.stream:
            if len(rows) == work.T:
                h_in = work.x
            else:
                h_in = work.x[cp.asarray(rows)]
            h = K.rmsnorm(cp.ascontiguousarray(h_in), self.out_norm, hp.rms_eps)  # h: [N, D]
            n = h.shape[0]
            out = cp.empty((n, self.head.n_rows), dtype=cp.float32)  # [N, V]
            # The head is the largest matrix: read it once per 8 rows rather than dequantizing all
            # of it to an f16 copy (1 GB for a 128k vocabulary at d=4096).
            for i in range(0, n, K.MAX_MATVEC_B):
                j = min(i + K.MAX_MATVEC_B, n)
                K.matvec(self.head.raw, self.head.qtype, self.head.n_rows, self.head.n_cols, h[i:j], out=out[i:j])
        return out

    def logits(self, ws: _Work) -> np.ndarray:
        out = self._logits_dev(ws)
        host = cp.asnumpy(out, stream=self.stream)
        self.stream.synchronize()
        return host

    def pick(self, ws: _Work, picks: list[Pick]) -> list[Picked]:
        """Selection on the device: one top-k kernel over the rows that want candidates (k the
        largest asked), a log-normaliser where asked, and only those k entries (and whole rows
        where k == 0) cross to the host: a decode step copies a few bytes, not [N, V] floats."""
        lg = self._logits_dev(ws)  # [N, V]
        n, V = lg.shape
        result: list[Picked] = [Picked() for _ in range(n)]
        cand = [i for i, p in enumerate(picks) if p.k > 0]
        full = [i for i, p in enumerate(picks) if p.k == 0]
        tok_rows = [j for j, i in enumerate(cand) if picks[i].token is not None]  # rows of ``cand``
        tok_vals = None
        with self.stream:
            if cand:
                k = min(max(picks[i].k for i in cand), V)
                sub = lg if len(cand) == n else lg[cp.asarray(cand)]
                vals_d, ids_d = K.topk(cp.ascontiguousarray(sub), k)  # [C, k] each
                lse_rows = [j for j, i in enumerate(cand) if picks[i].lse]
                lse_d = None
                if lse_rows:
                    m = vals_d[:, :1]  # the row maxima: the top-1 values, [C, 1]
                    lse_d = cp.log(cp.exp(sub - m).sum(axis=1)) + m[:, 0]  # [C]
                vals = cp.asnumpy(vals_d, stream=self.stream)
                ids = cp.asnumpy(ids_d, stream=self.stream)
                lse = cp.asnumpy(lse_d, stream=self.stream) if lse_d is not None else None
                if tok_rows:  # the asked tokens' logits, gathered on the device: [len(tok_rows)]
                    tok_ids = cp.asarray([picks[cand[j]].token for j in tok_rows])
                    tok_vals = cp.asnumpy(sub[cp.asarray(tok_rows), tok_ids], stream=self.stream)
            rows_full = cp.asnumpy(lg[cp.asarray(full)], stream=self.stream) if full else None
        self.stream.synchronize()
        tok_val = dict(zip(tok_rows, tok_vals.tolist())) if tok_rows else {}
        for j, i in enumerate(cand):
            kk = picks[i].k
            result[i] = Picked(ids=ids[j, :kk].astype(np.int64), vals=vals[j, :kk].astype(np.float64),
                               lse=float(lse[j]) if picks[i].lse else None, token_val=tok_val.get(j))
        for j, i in enumerate(full):
            result[i] = Picked(row=rows_full[j])
        return result
