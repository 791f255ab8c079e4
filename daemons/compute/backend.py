"""The backend seam: the operations a Llama block is written in, filled by numpy (cpu) or cupy (cuda).

The model (``model.py``) writes the Llama block once, as math over these operations (norm,
matmul, rope, KV write, masked attention, swiglu, add), and orders the work: embed, each layer
from wherever its bytes are, the head. Backends implement operations, never the model. Anything
that needs the whole sequence of operations — a CUDA graph of the resident layers — is an
explicit request of the model (``run_captured``), not a side effect of call order.

Layers reach a backend as a byte buffer in the image layout of ``ntx.shared.gguf_index`` (the
layer's file span(s), page-aligned), whoever filled it: the file, the dma daemon's pinned RAM,
or a streamed ring slot. ``prepare_layer`` turns that buffer into the weights the operations
take: each matrix a ``Weight``, made and checked once, then passed through as it is.

Every operation of a pass reads and writes the buffers of one ``Workspace`` (``begin_pass``):
the hidden state ``x`` and the block's intermediates, each named for what it holds, plus the
pass's token rows (positions and sequences). Operations write into the ``out`` they are given
and allocate nothing, so a GPU backend can capture them; their results are those buffers.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ntx.daemons.compute.batch import StepBatch
from ntx.daemons.compute.kv_pages import KvPool, KvPoolStats, SeqPages
from ntx.shared.kv_sizing import PAGE_TOKENS, KvSizing, pages_for_positions
from ntx.shared.gguf_index import HParams, LayerInfo, ModelIndex, open_model
from ntx.shared.config import InstanceConfig
from ntx.shared.errors import NtxError
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.plan import HostRates, MemoryCosts, Plan, make_plan, tier_wide_rows_for

MAX_PICK_K = 256  # the most candidates a backend selects per row; beyond it the whole row is copied


@dataclass(frozen=True, eq=False)
class Weight:
    """A matrix W [n_rows, n_cols] as a backend holds it: its format (``qtype``, the GGUF type
    of ``data``'s rows), shape and ``row_bytes``, and ``data`` (the cuda backend: a uint8 device
    view of the tensor's GGUF bytes; the cpu backend: the dequantized float32 array, ``qtype``
    F32). Made and checked once, when the layer is prepared (``prepare_layer``, ``load_globals``);
    operations take it as it is and look their plans up by ``format_key`` (a streamed layer's
    weights are new each pass, their format and shape are not). Compared by identity."""

    qtype: int
    n_rows: int
    n_cols: int
    row_bytes: int
    data: Any

    @property
    def format_key(self) -> tuple[int, int, int]:
        """(type, rows, columns): what a plan for this matrix depends on."""
        return (self.qtype, self.n_rows, self.n_cols)


@dataclass(frozen=True)
class Pick:
    """What the engine needs from one row of logits: its ``k`` largest entries (ids and values,
    best first, ties to the lower id), with ``lse`` also the row's log-normaliser
    (log-probabilities are value - lse); ``k == 0``: the whole row. ``token``: also this id's
    value, wherever it ranks (the prompt token a scored prompt row predicts)."""

    k: int
    lse: bool = False
    token: int | None = None


@dataclass
class Picked:
    """One row's answer to a ``Pick``: ``row`` [V] when the whole row was asked for, else
    ``ids`` [k] int64 and ``vals`` [k] float64 best first, and ``lse`` and ``token_val`` (the
    value of the Pick's ``token``) when asked."""

    ids: np.ndarray | None = None
    vals: np.ndarray | None = None
    lse: float | None = None
    row: np.ndarray | None = None
    token_val: float | None = None


def ranked_of(picked: Picked, k: int) -> list[int]:
    """Up to ``k`` of one row's best token ids, best first (what ``verified`` learns from): the
    ids the pick selected, or the whole row's top-k; [] where the row had no finite logits."""
    if picked.ids is not None:
        return [int(t) for t in picked.ids[:k]]
    if picked.row is not None and np.isfinite(picked.row).any():
        return [int(t) for t in top_entries(np.where(np.isfinite(picked.row), picked.row, -np.inf), k)]
    return []


class PendingPicks:
    """A pass's ``Picked`` rows on their way to the host: ``result()`` waits for them. ``top1``:
    each logit row's best token id [N] where the backend keeps it (a device array on a GPU),
    for ``feed_tokens`` to hand to the next pass before the host has seen it; None when some
    row asked for a whole row (no top-1 was selected). This default has its rows already."""

    def __init__(self, picked: list[Picked]) -> None:
        self._picked = picked
        self.top1 = None if any(p.ids is None or not len(p.ids) for p in picked) else \
            np.array([int(p.ids[0]) for p in picked], dtype=np.int64)

    def result(self) -> list[Picked]:
        return self._picked


def top_entries(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of ``row`` [V], best first, ties to the lower id."""
    n = row.shape[0]
    if k >= n:
        return np.lexsort((np.arange(n), -row))
    if k == 1:  # greedy: one pass over the row (argmax takes the first of equal maxima, as below)
        best = int(np.argmax(row))
        # a NaN is the maximum for both: the partition below then selects nothing
        return np.zeros(0, np.int64) if np.isnan(row[best]) else np.array([best], np.int64)
    kth = np.partition(row, n - k)[n - k]  # the k-th largest value
    cand = np.flatnonzero(row >= kth)  # ascending ids, >= k of them (ties at kth)
    return cand[np.lexsort((cand, -row[cand]))[:k]]


def log_normaliser(row: np.ndarray) -> float:
    """log(sum(exp(row))) in float64, stable."""
    x = np.asarray(row, dtype=np.float64)
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))


def pick_on_host(logits: np.ndarray, picks: list[Pick]) -> list[Picked]:
    """``Pick`` answered from logits [N, V] already on the host."""
    out = []
    for row, p in zip(logits, picks):
        if p.k == 0:
            out.append(Picked(row=row))
            continue
        ids = top_entries(row, p.k)
        out.append(Picked(ids=ids.astype(np.int64), vals=row[ids].astype(np.float64),
                          lse=log_normaliser(row) if p.lse else None,
                          token_val=float(row[p.token]) if p.token is not None else None))
    return out


def rope_divisors(hp: HParams, rope_freqs: np.ndarray | None) -> np.ndarray | None:
    """The one RoPE scaling formula: pair i turns by theta = pos * base^(-2i/rope_dim) / d[i].

    d = the Llama 3.1 frequency factors (the ``rope_freqs`` tensor) times the linear scaling
    factor, whichever the model has; None when it has neither (d = 1). d: float32 [rope_dim/2].
    """
    d = None if rope_freqs is None else np.asarray(rope_freqs, dtype=np.float32).reshape(-1)
    factor = hp.rope_scaling.factor
    if hp.rope_scaling.kind == "linear" and factor not in (0.0, 1.0):
        d = (d if d is not None else np.ones(hp.rope_dim // 2, dtype=np.float32)) * np.float32(factor)
    return d


def rope_pair_source(head_dim: int, rope_dim: int) -> np.ndarray:
    """[head_dim] int64: the dim of a NEOX-rotated head (halves paired) that each dim of the
    adjacent-pair order takes: 2i <- i, 2i+1 <- i + rope_dim/2, the dims past rope_dim kept
    (``Backend.qkv_bias_pairs``)."""
    half = rope_dim // 2
    src = np.arange(head_dim, dtype=np.int64)
    src[0:rope_dim:2] = np.arange(half)
    src[1:rope_dim:2] = np.arange(half) + half
    return src


class Workspace:
    """The buffers of one pass (backend arrays), named for what they hold, and its token rows.

    ``x`` [T, D] is the hidden state; ``h`` [T, D] a normed copy; ``q`` [T, H*hd], ``k`` and
    ``v`` [T, Hkv*hd]; ``attn`` [T, H*hd] the attention output; ``o`` [T, D] a projection back
    to the model width; ``gate``, ``up``, ``act`` [T, F] the feed-forward. ``batch`` says which
    sequence and position each row is. ``capturable``: the backend can record this pass's
    operations once and replay them (same T, nothing allocated, positions read on the device).
    """

    x: Any
    h: Any
    q: Any
    k: Any
    v: Any
    attn: Any
    o: Any
    gate: Any
    up: Any
    act: Any
    batch: StepBatch
    capturable: bool = False

    @property
    def T(self) -> int:
        return self.batch.n_tokens

    @staticmethod
    def buffer_widths(hp: HParams) -> tuple[tuple[str, int], ...]:
        """(name, width) of every buffer of a pass, each [T, width] float32: what ``allocate``
        makes and the cuda backend's memory layout (cuda/memory.py) lists."""
        D, F = hp.n_embd, hp.n_ff
        return (("x", D), ("h", D), ("q", hp.q_dim), ("k", hp.kv_dim), ("v", hp.kv_dim),
                ("attn", hp.q_dim), ("o", D), ("gate", F), ("up", F), ("act", F))

    def allocate(self, T: int, hp: HParams, alloc: Callable[[str, tuple[int, ...]], Any]) -> None:
        """Make every buffer for T rows with ``alloc(name, shape)`` (float32 arrays of a backend)."""
        for name, width in self.buffer_widths(hp):
            setattr(self, name, alloc(name, (T, width)))


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up (``Backend.warm_up``) must build so that no request pays for it: the passes
    of up to ``max_rows`` rows the engine can run, with token trees too when ``trees``
    (speculation on), eager passes of each of ``eager_rows`` rows (prompt chunks above the
    captured sizes), and the matrix kernels of ``compile_qtypes`` (types only streamed layers
    have: they run eagerly, outside the warm passes)."""

    max_rows: int
    trees: bool = False
    eager_rows: tuple[int, ...] = ()
    compile_qtypes: frozenset[int] = frozenset()


CaptureRun = tuple[Hashable, Callable[[Workspace], None]]  # a run_captured key and the run, given a workspace

class Backend(ABC):
    """The operations of a Llama forward pass on one kind of device, and the memory it holds:
    global tensors, resident layers, KV caches, device slots for streamed layers, workspaces."""

    name: str = "?"
    # Whether ``pick_launch`` returns before the pass has run (a device with its own queue): the
    # engine then queues greedy decode one pass ahead of the host (EngineCore's run_ahead).
    queues_passes: bool = False

    def __init__(self, index: ModelIndex) -> None:
        self.index = index
        self.hp = index.hparams

    # -- the paged KV cache: accounting here (kv_pages.KvPool), memory in the subclass ----------
    def kv_page_bytes(self) -> int:
        """Bytes of one page's keys and values in every layer, as this backend stores them."""
        return PAGE_TOKENS * self.memory_costs(self.index, max_seqs=1, max_ctx=PAGE_TOKENS,
                                               max_pass_rows=1).kv_bytes_per_token

    def _init_kv(self, max_seqs: int, max_ctx: int, sizing: KvSizing | None) -> None:
        """Sequence rows for ``max_seqs`` sequences of up to ``max_ctx`` positions, and the page
        pool ``sizing`` describes (None: enough for every row at ``max_ctx``, never growing)."""
        self.max_seqs = max_seqs
        self.max_pages = pages_for_positions(max_ctx)  # page-table entries per sequence row
        if sizing is None:
            sizing = KvSizing.for_positions(self.kv_page_bytes(), max_seqs * max_ctx)
        if sizing.max_chunks < sizing.n_chunks:
            raise ValueError(f"a KV pool of {sizing.n_chunks} chunks cannot be capped at {sizing.max_chunks}")
        self.kv_sizing = sizing
        self.kv_pool = KvPool(sizing.chunk_pages, 0, namespace=sizing.namespace)
        self.free_rows = list(range(max_seqs - 1, -1, -1))
        self.seq_row: dict[int, int] = {}  # sequence id -> its page-table row
        self.seq_pages: dict[int, SeqPages] = {}
        self.kv_mirrors: list[Backend] = []  # backends holding other layers' K/V in the same pages
        for _ in range(sizing.n_chunks):
            self.grow_kv()

    def attach_kv_mirror(self, mirror: Backend) -> None:
        """``mirror`` keeps the K/V of some layers (the plan's cpu tier: ``host_tier.py``) in
        pages of its own memory, numbered as this backend's: it shares this backend's sequence
        rows and page accounting, and from now on allocates, frees and maps pages as this one
        does (``_kv_alloc_chunk``, ``_kv_free_chunk``, ``_kv_set_row``)."""
        mirror.max_seqs, mirror.max_pages, mirror.kv_sizing = self.max_seqs, self.max_pages, self.kv_sizing
        mirror.kv_pool, mirror.free_rows, mirror.seq_row, mirror.seq_pages = (self.kv_pool, self.free_rows,
                                                                              self.seq_row, self.seq_pages)
        mirror.kv_mirrors = []
        for chunk in self.kv_pool.chunk_ids():
            mirror._kv_alloc_chunk(chunk)
        for seq_id, row in self.seq_row.items():
            mirror._kv_set_row(row, self.seq_pages[seq_id].page_ids)
        self.kv_mirrors.append(mirror)

    def _chunk_added(self, chunk: int) -> None:
        for b in (self, *self.kv_mirrors):
            b._kv_alloc_chunk(chunk)

    def _chunk_freed(self, chunk: int) -> None:
        for b in (self, *self.kv_mirrors):
            b._kv_free_chunk(chunk)

    def _row_set(self, row: int, pages: Sequence[int]) -> None:
        for b in (self, *self.kv_mirrors):
            b._kv_set_row(row, pages)

    @abstractmethod
    def _kv_alloc_chunk(self, chunk: int) -> None:
        """Memory for chunk ``chunk``'s pages (its keys and values in every layer)."""

    @abstractmethod
    def _kv_free_chunk(self, chunk: int) -> None:
        """Give chunk ``chunk``'s memory back (none of its pages is in use)."""

    @abstractmethod
    def _kv_set_row(self, row: int, pages: Sequence[int]) -> None:
        """Sequence row ``row`` now holds ``pages`` (its page table, in position order)."""

    def kv_stats(self) -> KvPoolStats:
        return self.kv_pool.stats()

    @property
    def kv_can_grow(self) -> bool:
        return self.kv_pool.n_chunks < self.kv_sizing.max_chunks

    def grow_kv(self) -> int:
        """One more chunk of pages (memory freed elsewhere, e.g. by a demoted layer); its id."""
        if not self.kv_can_grow:
            raise ValueError(f"the KV pool holds its most chunks already ({self.kv_sizing.max_chunks})")
        chunk = self.kv_pool.add_chunk()
        self._chunk_added(chunk)
        return chunk

    def shrink_kv(self) -> int | None:
        """Give back the highest chunk none of whose pages is in use (its cached pages evicted);
        its id, or None when every chunk holds a page in use."""
        chunks = self.kv_pool.releasable_chunks()
        if not chunks:
            return None
        self.kv_pool.release_chunk(chunks[0])
        self._chunk_freed(chunks[0])
        return chunks[0]

    def open_sequence(self, seq_id: int, prompt_tokens: Sequence[int], n_positions: int, reuse: bool = True) -> int:
        """A page-table row and pages for positions [0, n_positions) of a new sequence whose
        prompt is ``prompt_tokens``, reusing the cached pages of its longest matching prefix when
        ``reuse``. Returns how many leading prompt tokens already have their keys and values.
        Raises ``KvPoolExhausted`` (nothing taken) when the pages do not fit, NtxError when
        every row is taken."""
        if not self.free_rows:
            raise NtxError(f"all {self.max_seqs} sequence rows are in use")
        seq, reused = self.kv_pool.new_sequence(list(prompt_tokens) if reuse else [], n_positions)
        row = self.free_rows.pop()
        self.seq_row[seq_id], self.seq_pages[seq_id] = row, seq
        self._row_set(row, seq.page_ids)
        return reused

    def grow_sequence(self, seq_id: int, n_positions: int) -> bool:
        """Pages for positions [0, n_positions) of the sequence; False (nothing taken) if they
        do not fit."""
        seq = self.seq_pages[seq_id]
        n = seq.n_pages
        if not seq.ensure(n_positions):
            return False
        if seq.n_pages != n:
            self._row_set(self.seq_row[seq_id], seq.page_ids)
        return True

    def commit_sequence(self, seq_id: int, tokens: Sequence[int]) -> None:
        """The sequence's keys and values at positions [0, len(tokens)) are written and final:
        its full pages among them join the prefix cache."""
        self.kv_pool.commit(self.seq_pages[seq_id], tokens)

    def alloc_sequence(self, seq_id: int, capacity_tokens: int) -> None:
        """A row and pages for ``capacity_tokens`` positions, no prefix reuse (the draft model)."""
        if capacity_tokens > self.max_pages * PAGE_TOKENS:
            raise NtxError(f"sequence needs {capacity_tokens} positions but a sequence row holds "
                           f"{self.max_pages * PAGE_TOKENS}")
        self.open_sequence(seq_id, (), capacity_tokens, reuse=False)

    def free_sequence(self, seq_id: int) -> None:
        """The sequence's row and pages go back (its committed pages stay cached for reuse)."""
        seq = self.seq_pages.pop(seq_id, None)
        if seq is not None:
            self.kv_pool.release(seq)
            self.free_rows.append(self.seq_row.pop(seq_id))

    # -- what the planner reserves ---------------------------------------------------------------
    @classmethod
    @abstractmethod
    def memory_costs(cls, index: ModelIndex, *, max_seqs: int, max_ctx: int, max_pass_rows: int,
                     kernels: KernelOptions | None = None) -> MemoryCosts:
        """What this backend would hold for ``index``: each layer resident, the globals, the KV
        cache per token and how many tokens to reserve, the workspace for passes of up to
        ``max_pass_rows`` rows (``EngineOptions.largest_pass_rows``) under the kernel switches
        ``kernels`` (None: the defaults). Needs no device."""

    # -- weights, caches, slots ------------------------------------------------------------------
    @abstractmethod
    def load_globals(self, raw: dict[str, np.ndarray], rope_divisors: np.ndarray | None) -> None:
        """Take the non-layer tensors (``token_embd``, ``output_norm``, optional ``output``) from
        their raw GGUF bytes (uint8 arrays) and the RoPE divisors (``rope_divisors``)."""

    @abstractmethod
    def prepare_layer(self, layer: LayerInfo, buf: Any, *, keep: bool) -> Any:
        """Make runnable weights from a layer-image buffer. ``keep``: the weights stay for the
        life of the model (resident), so a backend may convert them once; otherwise the buffer is
        handed back right after the layer ran, and nothing may keep a reference to it."""

    @abstractmethod
    def alloc_slots(self, n: int, nbytes: int, name_prefix: str) -> tuple[list[Any], list[Any]]:
        """``n`` slot buffers of ``nbytes`` that another process (dma) fills with streamed layers,
        and for each a descriptor that process opens it by (a shared-memory name on cpu, a CUDA
        IPC handle on cuda). The backend owns them until ``close``."""

    def close(self) -> None:
        """Free what the backend holds outside its own process's memory (shared segments)."""

    # -- one pass --------------------------------------------------------------------------------
    @abstractmethod
    def begin_pass(self, batch: StepBatch) -> Workspace:
        """The workspace of a pass over ``batch``'s T rows, its token rows in place."""

    def scope(self) -> AbstractContextManager:
        """Entered around a whole pass (the cuda backend's stream)."""
        return nullcontext()

    def run_captured(self, key: Hashable, ws: Workspace, run: Callable[[], None]) -> None:
        """Run ``run`` (operations on ``ws``); a backend that can record it replays the recording
        on later calls with the same ``key`` and T when ``ws.capturable``. Default: just run."""
        run()

    def sync(self) -> None:
        """Wait until the work queued so far is done (before a streamed slot is handed back)."""

    def warm_up(self, runs: Sequence[CaptureRun], spec: WarmUp, log: Callable[[str], None],
                eager_ops: Callable[[Workspace], None] | None = None) -> None:
        """Before the first request: compile every kernel and record every graph that a pass of
        ``spec`` can need, by running each of ``runs`` (the model's ``run_captured`` requests) on
        passes that touch no KV cache, and the head; ``eager_ops`` (operations that need no
        weights, for layers that run outside ``runs``) eagerly on those passes. One ``log`` line
        per stage. Raises on failure. Default: nothing to build (the cpu backend)."""

    # -- operations (each writes ``out`` and returns it; shapes as in ``Workspace``) -------------
    @abstractmethod
    def embed(self, ws: Workspace) -> Any:
        """ws.x = the token embeddings of the pass's tokens. x: [T, D]"""

    @abstractmethod
    def rms_norm(self, x: Any, w: Any, out: Any) -> Any:
        """out = x / sqrt(mean(x^2) + eps) * w, per row. x: [T, D], w: [D]"""

    def add_rms_norm(self, x: Any, delta: Any, w: Any, out: Any) -> Any:
        """x += delta; out = rms_norm(x, w): the residual add and the next norm (one kernel on a GPU)."""
        self.add(x, delta, out=x)
        return self.rms_norm(x, w, out=out)

    @abstractmethod
    def matmul(self, w: Weight, x: Any, out: Any) -> Any:
        """out = x @ w.T with w the layer's matrix [N, K] as stored. x: [T, K] -> out: [T, N]"""

    def matmuls(self, x: Any, products: Sequence[tuple[Weight, Any]]) -> None:
        """out = x @ w.T for each (w, out) of ``products``, all of the same x [T, K] (a layer's
        q, k and v; its gate and up). A GPU backend quantizes x once for all of them."""
        for w, out in products:
            self.matmul(w, x, out=out)

    def norm_matmuls(self, x: Any, w: Any, h: Any, products: Sequence[tuple[Weight, Any]], delta: Any = None) -> None:
        """h = rms_norm(x, w) (with delta: x += delta first, as ``add_rms_norm``), then
        ``matmuls(h, products)``: a layer's norm and the products of its output, one operation
        so that a GPU backend can quantize h for the products in the norm's own kernel."""
        if delta is None:
            self.rms_norm(x, w, out=h)
        else:
            self.add_rms_norm(x, delta, w, out=h)
        self.matmuls(h, products)

    def swiglu_matmul_add(self, gate: Any, up: Any, act: Any, w: Weight, out: Any, tmp: Any) -> Any:
        """act = swiglu(gate, up), then out += act @ w.T: a layer's feed-forward output into the
        residual, one operation so that a GPU backend can quantize act for the product in the
        swiglu's own kernel and add in the product's. tmp, of out's shape, may hold the product
        on the way."""
        self.swiglu(gate, up, out=act)
        self.matmul(w, act, out=tmp)
        return self.add(out, tmp, out=out)

    def rope_kv_write(self, layer_idx: int, q: Any, k: Any, v: Any, ws: Workspace) -> None:
        """``rope(q, k)`` then ``kv_write(k, v)``: one operation so that a GPU backend can store
        the rotated keys in the rotation's own kernel (a launch fewer per layer)."""
        self.rope(q, k, ws)
        self.kv_write(layer_idx, k, v, ws)

    def attention_matmul(self, layer_idx: int, q: Any, ws: Workspace, attn: Any, w: Weight, out: Any) -> Any:
        """attn = ``attention(q)``, then out = attn @ w.T: one operation so that a GPU backend can
        quantize the attention output for the product in the attention's own kernel."""
        self.attention(layer_idx, q, ws, out=attn)
        return self.matmul(w, attn, out=out)

    @abstractmethod
    def qkv_bias_pairs(self, q: Any, k: Any, v: Any, biases: tuple[Any, Any, Any], ws: Workspace) -> None:
        """In place, for a Qwen2 model: q [T, H*hd], k, v [T, Hkv*hd] += their biases ([H*hd],
        [Hkv*hd]; None: none), then, where ``hp.rope_neox``, each q and k head's first rope_dim
        dims reordered so that dim i and dim i + rope_dim/2 become the adjacent pair (2i, 2i+1).

        Why reorder instead of a second RoPE: the rotation of the halves is the rotation of
        adjacent pairs in that order, and q and k reordered alike give the same scores (a
        dot product does not care about the order of its terms), so every rope, attention and
        cache kernel serves both layouts unchanged; the cache holds the reordered keys. llama.cpp's
        converter does the same reordering once on a Llama's weight rows; a Qwen2 GGUF keeps
        the checkpoint's order, and ntx reorders the products' outputs instead (a streamed
        layer's bytes go to the device as the file has them)."""

    @abstractmethod
    def rope(self, q: Any, k: Any, ws: Workspace) -> None:
        """Rotate q [T, H*hd] and k [T, Hkv*hd] in place at the rows' positions."""

    @abstractmethod
    def kv_write(self, layer_idx: int, k: Any, v: Any, ws: Workspace) -> None:
        """Store k, v [T, Hkv*hd] in each row's sequence cache at the row's cache position
        (``batch.cache_positions``; RoPE positions differ from them only in a tree)."""

    @abstractmethod
    def attention(self, layer_idx: int, q: Any, ws: Workspace, out: Any) -> Any:
        """Grouped-query attention of q [T, H*hd] over each row's sequence cache, scaled by
        1/sqrt(hd): a row sees its sequence's cache positions up to its own; a row of a tree
        chunk sees, of its chunk's rows, only its ancestors and itself. -> out [T, H*hd]"""

    @abstractmethod
    def kv_keep(self, seq_id: int, src_positions: list[int], dst_positions: list[int]) -> None:
        """Move the sequence's keys and values at ``src_positions`` to ``dst_positions`` in every
        layer (dst[i] < src[i], both increasing): the accepted path of a verified tree closes
        ranks behind the cached prefix, the rejected branches stay behind as dead entries."""

    @abstractmethod
    def swiglu(self, gate: Any, up: Any, out: Any) -> Any:
        """out = silu(gate) * up, elementwise. [T, F]"""

    @abstractmethod
    def add(self, x: Any, y: Any, out: Any) -> Any:
        """out = x + y, elementwise."""

    # -- the head --------------------------------------------------------------------------------
    @abstractmethod
    def logits(self, ws: Workspace) -> np.ndarray:
        """Final norm and head for the rows in ``batch.logit_rows``: [N_out, V] float32 on host."""

    def pick(self, ws: Workspace, picks: list[Pick]) -> list[Picked]:
        """Final norm and head for ``batch.logit_rows``, reduced per row as ``picks`` asks
        (one Pick per logit row). A GPU backend selects on the device and copies k entries
        instead of the vocabulary; this default takes the host logits."""
        return pick_on_host(self.logits(ws), picks)

    def pick_launch(self, ws: Workspace, picks: list[Pick]) -> PendingPicks:
        """``pick`` without waiting: the head and the selection queued, their rows coming back
        as ``PendingPicks.result()``. A GPU backend returns while the pass still runs, so the
        host can queue the next pass meanwhile (``LlamaModel.launch`` with ``feed``); this
        default picks at once."""
        return PendingPicks(self.pick(ws, picks))

    def feed_tokens(self, ws: Workspace, top1: Any) -> None:
        """The pass's tokens (one per row, ``ws``'s first rows) become ``top1`` [T], a previous
        pass's ``PendingPicks.top1``: greedy decode's next tokens, handed over where they are
        (on a GPU, without a round trip through the host). Called after ``begin_pass``, before
        the pass's first operation."""
        ws.tokens = np.asarray(top1, dtype=np.int64)[: ws.T]

    # -- the hidden state to and from the host (the plan's cpu tier runs between these) ----------
    def hidden_to_host(self, ws: Workspace) -> np.ndarray:
        """The pass's hidden state as a host array [T, D] float32, once the work queued so far
        has written it: ``ws.x`` itself on a backend that computes on the host (the default)."""
        return ws.x

    def hidden_from_host(self, ws: Workspace, x: np.ndarray) -> None:
        """``ws.x``'s first T rows = ``x`` [T, D] (what ``hidden_to_host`` gave, updated)."""
        if x is not ws.x:
            ws.x[: x.shape[0]] = x

    def to_host(self, a: Any, n_rows: int) -> np.ndarray:
        """The first ``n_rows`` rows of a pass buffer as a host array, once written."""
        return np.asarray(a[:n_rows])

    def kv_from_host(self, layer_idx: int, k: np.ndarray, v: np.ndarray, ws: Workspace) -> None:
        """Store host keys (rotated) and values [n, Hkv*hd] of the pass's first n rows in this
        backend's cache for ``layer_idx``: the cpu tier keeps the two caches of its layers alike."""
        n = k.shape[0]
        ws.k[:n], ws.v[:n] = k, v
        self.kv_write(layer_idx, ws.k, ws.v, ws)

    def pin_host(self, buf: np.ndarray) -> None:
        """Make host buffer ``buf`` fast to copy from (page-locked on a GPU; nothing here)."""

    def layer_from_host(self, layer: LayerInfo, buf: np.ndarray) -> Any:
        """Weights for one pass of a layer whose image ``buf`` is in host memory (a cpu-tier
        layer computed here in a wide pass): ``prepare_layer`` without keeping it."""
        return self.prepare_layer(layer, buf, keep=False)

    def host_layer_done(self) -> None:
        """The operations on ``layer_from_host``'s last weights are queued: a backend that
        stages them in one buffer may copy the next layer there once those have run."""


def backend_class(name: str) -> type[Backend]:
    """The backend class called ``name`` ("cpu" or "cuda"); cuda only where a GPU and cupy are."""
    if name == "cpu":
        from ntx.daemons.compute.cpu_backend import CpuBackend

        return CpuBackend
    if name == "cuda":
        from ntx.daemons.compute.cuda_check import require_cuda

        require_cuda()
        from ntx.daemons.compute.cuda.backend import CudaBackend  # noqa: PLC0415 (optional dep)

        return CudaBackend
    from ntx.shared.errors import ConfigError

    raise ConfigError(f"unknown backend {name!r} (choose cuda or cpu)")


def memory_costs(name: str, index: ModelIndex, *, max_seqs: int, max_ctx: int, max_pass_rows: int,
                 kernels: KernelOptions | None = None) -> MemoryCosts:
    """``Backend.memory_costs`` of the backend called ``name``, without a device (planning on a
    machine that only starts the pipeline, or in CI), under the kernel switches ``kernels``."""
    if name == "cuda":
        from ntx.daemons.compute.cuda.memory import cuda_memory_costs

        return cuda_memory_costs(index, max_seqs=max_seqs, max_ctx=max_ctx, max_pass_rows=max_pass_rows,
                                 kernels=kernels)
    return backend_class(name).memory_costs(index, max_seqs=max_seqs, max_ctx=max_ctx,
                                            max_pass_rows=max_pass_rows, kernels=kernels)


def plan_for(index: ModelIndex, cfg: InstanceConfig, rates: HostRates | None = None,
             log: Callable[[str], None] | None = None) -> Plan:
    """The tier plan of an instance: ``cfg``'s budgets against what its backend reports it holds
    (for the model, and for the draft model first when there is one). The cpu tier's layers hold
    what the cpu backend would (``host_layer_bytes``); with ``--cpu-layers auto`` on cuda, when
    layers would stream, the link's and the host's speeds are measured here (``measure_rates``,
    a few seconds; ``log`` says so) unless ``rates`` are given."""
    sizes = dict(max_seqs=cfg.max_batch, max_ctx=cfg.ctx_for(index.hparams.n_ctx_train),
                 max_pass_rows=cfg.largest_pass_rows, kernels=cfg.kernel_options)
    draft = None
    if cfg.draft_model:
        draft = memory_costs(cfg.backend, open_model(cfg.draft_model), **sizes)
    costs = memory_costs(cfg.backend, index, **sizes)
    host_bytes = None
    # packed for the host's kernels; on cuda the file bytes too (wide passes)
    if cfg.cpu_layers != 0 and cfg.cpu_tier_barred is None:
        packed = memory_costs("cpu", index, **sizes).layer_bytes
        host_bytes = tuple(b + (layer.image_bytes if tier_wide_rows_for(cfg.backend) is not None else 0)
                           for b, layer in zip(packed, index.layers))
    plan = make_plan(index, cfg, costs, draft, rates, host_bytes)
    if rates is None and cfg.backend == "cuda" and cfg.cpu_layers is None and cfg.cpu_tier_barred is None \
            and plan.streamed_layers:
        say = log or (lambda line: None)
        say("measuring the link and the host's cores for the cpu tier (--cpu-layers auto)")
        try:
            rates = measure_rates(index, plan.streamed_layers)
        except Exception as e:  # noqa: BLE001 - the plan without a cpu tier still serves
            say(f"could not measure them ({type(e).__name__}: {e}): no cpu tier (give --cpu-layers N to set one)")
            return plan
        plan = make_plan(index, cfg, costs, draft, rates, host_bytes)
    return plan


def measure_rates(index: ModelIndex, candidates: list[int]) -> HostRates:
    """The speeds the cpu tier's split needs (``HostRates``), on this machine now: the link with
    pinned memory and the host's cores on three of ``candidates`` (the layers the tier may take;
    ``probes.probe_layers``: every kind of layer among them, timed apart and weighed by their
    bytes), each road alone and while the other runs (``probes.roads_together``), and the host
    memory's read bandwidth (``probes.host_read_gbps``)."""
    import os

    from ntx.daemons.compute.probes import host_read_gbps, probe_layers, roads_together

    layers = probe_layers(index, list(candidates), 3)
    key = (index.layers[layers[0]].spans[0].path, tuple(layers), tuple(candidates))
    if key not in _MEASURED_RATES:  # a benchmark plans many instances of one model in a process
        roads = roads_together(index, layers, mix_of=list(candidates))
        _MEASURED_RATES[key] = HostRates(
            link_gbps=roads["link"], cpu_gbps=roads["cpu"],
            mem_gbps=host_read_gbps(512 << 20, 3, len(os.sched_getaffinity(0))),
            how=f"measured at start (layers {', '.join(map(str, layers))})",
            cpu_beside_link_gbps=roads["cpu_beside_link"], link_beside_cpu_gbps=roads["link_beside_cpu"],
            gpu_gbps=roads["gpu"])
    return _MEASURED_RATES[key]


_MEASURED_RATES: dict[tuple[str, int], HostRates] = {}


def make_backend(name: str, index: ModelIndex, max_seqs: int = 16, max_ctx: int = 4096,
                 kernels: KernelOptions | None = None, kv: KvSizing | None = None,
                 embed_in_host: bool = False) -> Backend:
    """The backend called ``name``, with page-table rows for ``max_seqs`` sequences of up to
    ``max_ctx`` positions and the KV page pool ``kv`` (None: pages for every row at ``max_ctx``);
    the cuda backend reserves its arena up front; ``kernels``: the kernel switches (None: the
    defaults); ``embed_in_host``: the plan keeps the token embedding in host memory (a backend
    whose ``memory_costs`` offered it: ``MemoryCosts.host_globals_bytes``)."""
    extra = {"embed_in_host": True} if embed_in_host else {}
    return backend_class(name)(index, max_seqs=max_seqs, max_ctx=max_ctx, kernels=kernels, kv=kv, **extra)
