"""The host's backend: the Llama forward pass on the CPU, and its numerically plain reference.

Float32 activations, with the order of operations llama.cpp uses for GGUF ``llama`` models:
RMSNorm, RoPE in its "normal" mode (adjacent pairs, because the GGUF converter permuted Q and K),
grouped-query attention over a per-sequence KV cache, SwiGLU, tied or separate output head.

The matrix products run one of two ways (``KernelOptions.cpu_quantized``):

* quantized (the default): numba kernels on the weights in a canonical form of their GGUF type
  (``cpu_kernels``), activations rounded to int8 per 32 values as llama.cpp's CPU kernels do;
* reference: every matrix dequantized to float32 and multiplied by numpy, each operation as its
  formula: what the tests hold the other kernels to.

Resident layers are converted once; streamed layers are converted from the slot each pass.
A matrix is a ``Weight`` whose ``data`` is a ``cpu_kernels.PackedMatrix`` (quantized) or the
float32 array (reference, type F32).
"""

from __future__ import annotations

import dataclasses
import mmap
import time
from typing import Any, Sequence

import numpy as np

from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute import cpu_kernels, cpu_ops
from ntx.daemons.compute.backend import Backend, Weight, Workspace, rope_pair_source
from ntx.shared.kv_sizing import PAGE_TOKENS, KvSizing
from ntx.daemons.compute.batch import StepBatch
from ntx.daemons.compute.quants import dequantize
from ntx.shared.gguf_index import LayerInfo, ModelIndex, TensorInfo
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.plan import MemoryCosts
from ntx.shared.shm import ShmSegment


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x: [T, D], w: [D]
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)) * w


def rope_inv_freq(hp, divisors: np.ndarray | None) -> np.ndarray:
    """Angular speeds [rope_dim/2] float64 of llama's RoPE: base^(-2i/rope_dim) / divisors[i]
    (``backend.rope_divisors``: Llama 3.1 factors, linear scaling)."""
    half = hp.rope_dim // 2
    inv_freq = hp.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / hp.rope_dim)
    if divisors is not None:
        inv_freq = inv_freq / divisors.astype(np.float64)
    return inv_freq


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the first rope_dim dims. x: [T, H, hd]."""
    rope_dim = inv_freq.shape[0] * 2
    theta = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, rope_dim/2]
    cos = np.cos(theta).astype(np.float32)[:, None, :]
    sin = np.sin(theta).astype(np.float32)[:, None, :]
    out = x.copy()
    x0 = x[..., 0:rope_dim:2]
    x1 = x[..., 1:rope_dim:2]
    out[..., 0:rope_dim:2] = x0 * cos - x1 * sin
    out[..., 1:rope_dim:2] = x0 * sin + x1 * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def page_spans(pages: Sequence[int], start: int, end: int) -> list[tuple[int, int, int, int]]:
    """Positions [start, end) of a sequence whose page table is ``pages``, cut at page
    boundaries: (page id, first offset, end offset, first position) per piece."""
    out = []
    p = start
    while p < end:
        i, off = divmod(p, PAGE_TOKENS)
        n = min(PAGE_TOKENS - off, end - p)
        out.append((pages[i], off, off + n, p))
        p += n
    return out


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11 does not name it
_CAUSAL = np.zeros((1, 1), dtype=np.bool_)  # the compiled attention's "no tree" visibility


class _CpuWorkspace(Workspace):
    """A pass's buffers as fresh float32 arrays (numpy needs no capture, so none are kept), and
    (quantized kernels) the int8 copies of h and act that the products read."""

    def __init__(self, batch: StepBatch, hp, quantized: bool = False) -> None:
        self.batch = batch
        self.tokens = np.asarray(batch.tokens, dtype=np.int64)  # [T]; Backend.feed_tokens replaces it
        self.allocate(batch.n_tokens, hp, lambda name, shape: np.empty(shape, dtype=np.float32))
        if quantized:
            self.h_q8 = cpu_kernels.QuantizedActivations(self.h, quantize=False)
            self.act_q8 = cpu_kernels.QuantizedActivations(self.act, quantize=False)


class CpuBackend(Backend):
    """The forward pass on the host: compiled kernels on the quantized weights, or (reference)
    float32 numpy with every operation as its formula."""

    name = "cpu"

    def __init__(self, index: ModelIndex, max_seqs: int = 16, max_ctx: int = 4096, kv: KvSizing | None = None,
                 kernels: KernelOptions | None = None, kv_of: Backend | None = None,
                 kv_layers: Sequence[int] | None = None) -> None:
        """``kv_of``: another backend whose pages this one mirrors for the layers ``kv_layers``
        (the plan's cpu tier, ``host_tier.py``): sequences, rows and pages are that backend's,
        keys and values of those layers this one's; ``max_seqs``, ``max_ctx`` and ``kv`` are then
        that backend's too."""
        super().__init__(index)
        self.quantized = (kernels or KernelOptions()).cpu_quantized and cpu_kernels.available()
        self.threads = cpu_kernels.set_threads() if self.quantized else 0
        # KV pages: per chunk in use, keys and values [L, chunk_pages, Hkv, PAGE_TOKENS, hd] float32,
        # views of the pool's mapped arrays (_kv_map: memory only where written)
        self.kv_chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.kv_keys: np.ndarray | None = None  # every chunk's keys, then values: see _kv_map
        self.kv_values: np.ndarray | None = None
        self.kv_regions: list[mmap.mmap] = []
        self.row_pages: dict[int, tuple[int, ...]] = {}
        self.row_page_ids: dict[int, np.ndarray] = {}  # the same page tables as int64 arrays
        self.kv_layers = list(range(self.hp.n_layers)) if kv_layers is None else sorted(kv_layers)
        if kv_of is None:
            self._init_kv(max_seqs, min(max_ctx, index.hparams.n_ctx_train), kv)
        else:
            kv_of.attach_kv_mirror(self)
        self.inv_freq: np.ndarray | None = None
        # where each dim of a q, k head comes from when RoPE's halves are made pairs (qkv_bias_pairs)
        self.pair_source = rope_pair_source(self.hp.head_dim, self.hp.rope_dim)
        self.tok_embd: np.ndarray | None = None
        self.out_norm: np.ndarray | None = None
        self.out_head: np.ndarray | None = None
        self.slot_segments: list[ShmSegment] = []
        self.ws: _CpuWorkspace | None = None
        self.attn_scale = np.float32(1.0 / np.sqrt(self.hp.head_dim))

    @staticmethod
    def _held_bytes(t: TensorInfo) -> int:
        """What a tensor takes here: a matrix in its kernels' canonical form, a vector float32."""
        if len(t.shape) == 2 and cpu_kernels.available():
            return cpu_kernels.packed_bytes(t.ggml_type, t.shape[0], t.shape[1])
        return t.n_elements * 4

    @classmethod
    def memory_costs(cls, index: ModelIndex, *, max_seqs: int, max_ctx: int, max_pass_rows: int,
                     kernels: KernelOptions | None = None) -> MemoryCosts:
        """Resident layers and globals are kept in the kernels' canonical forms (the float32
        reference, ``cpu-quantized=off``, holds up to 8x more; counted as the defaults whatever
        ``kernels`` says, as before); the KV pages are float32."""
        hp = index.hparams
        layer_bytes = tuple(sum(cls._held_bytes(t) for t in layer.tensors.values()) for layer in index.layers)
        return MemoryCosts(
            memory_name="compute memory",
            layer_bytes=layer_bytes,
            globals_bytes=sum(cls._held_bytes(t) for t in index.globals.values()),  # a tied head shares token_embd
            kv_bytes_per_token=2 * hp.n_layers * hp.kv_dim * 4,
            kv_tokens=min(max_ctx, hp.n_ctx_train) * max_seqs,
            workspace_bytes=max(layer_bytes),  # a streamed layer dequantized
        )

    # -- weights -------------------------------------------------------------------------------
    def _matrix(self, raw: np.ndarray, t: TensorInfo) -> Weight:
        """A matrix [N, K] from its GGUF bytes, as this backend's products take it (fresh arrays,
        never views of ``raw``)."""
        n, k = t.shape
        if self.quantized:
            packed = cpu_kernels.pack(raw[: t.nbytes], t.ggml_type, n, k)
            return Weight(int(t.ggml_type), n, k, t.nbytes // n, packed)
        return Weight(int(QT.F32), n, k, k * 4, dequantize(raw, t.ggml_type, t.shape))

    def load_globals(self, raw: dict[str, np.ndarray], rope_divisors: np.ndarray | None) -> None:
        g = self.index.globals
        self.tok_embd = self._matrix(raw["token_embd"], g["token_embd"])  # [V, D]
        self.out_norm = dequantize(raw["output_norm"], g["output_norm"].ggml_type, g["output_norm"].shape)  # [D]
        self.out_head = self._matrix(raw["output"], g["output"]) if "output" in raw else self.tok_embd  # [V, D]
        self.set_rope(rope_divisors)

    def set_rope(self, rope_divisors: np.ndarray | None) -> None:
        """The RoPE frequencies (``Backend.load_globals``'s ``rope_divisors``): all a backend that
        runs layers but no embedding nor head needs of the globals (the cpu tier's)."""
        self.inv_freq = rope_inv_freq(self.hp, rope_divisors)

    # Products of one x that a kept layer runs as one (cpu_kernels.FusedProduct), in the order
    # llama_block asks for them
    FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_q", "attn_k"), ("ffn_gate", "ffn_up"))

    def prepare_layer(self, layer: LayerInfo, buf: Any, *, keep: bool) -> dict[str, Any]:
        # buf: [image_bytes] uint8, the layer's image; the result owns fresh arrays either way.
        w: dict[str, Any] = {}
        for name, t in layer.tensors.items():
            off = layer.image_offset(name)
            raw = buf[off : off + t.nbytes]
            w[name] = self._matrix(raw, t) if len(t.shape) == 2 else dequantize(raw, t.ggml_type, t.shape)
        if keep and self.quantized:  # a streamed layer is packed every pass: no second copy for it
            self._fuse(w)
        return w

    def _fuse(self, w: dict[str, Any]) -> None:
        """Hold the layer's q, k, v (or q, k) and its gate, up end to end where their formats
        allow it; each Weight's data becomes a view of the whole, tagged with it (``_products``)."""
        fused: set[str] = set()
        for names in self.FUSED:
            if fused & set(names) or not all(isinstance(w.get(n), Weight) for n in names):
                continue
            group = cpu_kernels.fuse([w[n].data for n in names])
            if group is None:
                continue
            for n, part in zip(names, group.parts):
                part.fused = group
                w[n] = dataclasses.replace(w[n], data=part)
            fused |= set(names)

    # -- KV pages and slots --------------------------------------------------------------------
    def _kv_alloc_chunk(self, chunk: int) -> None:
        if self.kv_keys is None:
            self.kv_keys, self.kv_values = self._kv_map(), self._kv_map()
        self.kv_chunks[chunk] = (self.kv_keys[chunk], self.kv_values[chunk])

    def _kv_map(self) -> np.ndarray:
        """Keys or values of every chunk the pool may ever hold, [max_chunks, L, chunk_pages,
        Hkv, PAGE_TOKENS, hd] float32, in anonymous memory that the system provides only where
        it is written (a freed chunk's pages are given back: ``_kv_free_chunk``). One array, so
        that the compiled attention reads any page without a list of chunks."""
        hp, sizing = self.hp, self.kv_sizing
        shape = (sizing.max_chunks, hp.n_layers, sizing.chunk_pages, hp.n_head_kv, PAGE_TOKENS, hp.head_dim)
        nbytes = int(np.prod(shape)) * 4
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self.kv_regions.append(region)
        return np.frombuffer(region, dtype=np.float32).reshape(shape)

    def _kv_free_chunk(self, chunk: int) -> None:
        """The chunk's memory goes back to the system (its whole memory pages; a page shared with
        a neighbour chunk stays: a KV page is always written before it is read)."""
        del self.kv_chunks[chunk]
        chunk_bytes = self.kv_keys[0].nbytes
        first = -(-chunk * chunk_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (chunk + 1) * chunk_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            for region in self.kv_regions:
                region.madvise(mmap.MADV_DONTNEED, first, end - first)

    def _kv_set_row(self, row: int, pages) -> None:
        self.row_pages[row] = tuple(pages)
        self.row_page_ids[row] = np.asarray(pages, dtype=np.int64)

    def _page(self, page: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Page ``page`` of layer ``layer``: keys and values [Hkv, PAGE_TOKENS, hd] (views)."""
        c, i = divmod(page, self.kv_sizing.chunk_pages)
        k, v = self.kv_chunks[c]
        return k[layer, i], v[layer, i]

    def _pages_of(self, seq_id: int) -> tuple[int, ...]:
        return self.row_pages[self.seq_row[seq_id]]

    def alloc_slots(self, n: int, nbytes: int, name_prefix: str) -> tuple[list[np.ndarray], list[str]]:
        """Slots in POSIX shared memory, opened by the dma daemon by name."""
        segs = [ShmSegment.create(f"{name_prefix}{i}", nbytes) for i in range(n)]
        self.slot_segments.extend(segs)
        return [s.array() for s in segs], [s.name for s in segs]

    def close(self) -> None:
        for seg in self.slot_segments:
            seg.close()
            seg.unlink()
        self.slot_segments = []

    def warm_up(self, runs, spec, log, eager_ops=None) -> None:
        """The compiled kernels built (or loaded from numba's cache) before the first request."""
        if self.quantized:
            t0 = time.monotonic()
            log("warm-up: compiling the CPU kernels (a minute or two the first time on a machine; cached after)")
            cpu_ops.compile_all(self.hp.head_dim)
            log(f"warm-up: CPU kernels ready in {time.monotonic() - t0:.2f} s ({self.threads} threads)")

    # -- operations ----------------------------------------------------------------------------
    def begin_pass(self, batch: StepBatch) -> _CpuWorkspace:
        self.ws = _CpuWorkspace(batch, self.hp, self.quantized)  # the pass the compiled operations serve
        return self.ws

    def embed(self, ws: Workspace) -> np.ndarray:
        table = self.tok_embd.data
        if isinstance(table, np.ndarray):
            ws.x[...] = table[ws.tokens]  # x: [T, D]
        else:
            ws.x[...] = cpu_kernels.dequantize_rows(table, np.asarray(ws.tokens, dtype=np.int64))
        return ws.x

    def rms_norm(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> np.ndarray:
        out[...] = rms_norm(x, w, self.hp.rms_eps)
        return out

    def matmul(self, w: Weight, x: Any, out: np.ndarray) -> np.ndarray:
        """out = x @ w.T. x: [T, K] float32, or (quantized) ``cpu_kernels.QuantizedActivations``."""
        if isinstance(w.data, np.ndarray):
            out[...] = x @ w.data.T  # [T, K] @ [K, N]
            return out
        return cpu_kernels.matmul(w.data, x, out)

    def matmuls(self, x: np.ndarray, products) -> None:
        """x is rounded to int8 once for every product (quantized kernels)."""
        if self.quantized:
            x = cpu_kernels.QuantizedActivations(x)
        for w, out in products:
            self.matmul(w, x, out=out)

    # The compiled operations (quantized): one call each, writing into the pass's buffers, the
    # products' int8 activations made in the same call as the values they round.
    def _products(self, qx: cpu_kernels.QuantizedActivations, products) -> None:
        group = getattr(products[0][0].data, "fused", None)
        if group is not None and len(products) >= len(group.parts) and all(
                w.data is part for (w, _), part in zip(products, group.parts)):
            group.product(qx, [out for _, out in products[: len(group.parts)]])
            products = products[len(group.parts):]
        for w, out in products:
            if w.data.form == "f32":
                self.matmul(w, qx.x, out=out)
            else:
                w.data.product(qx, out)

    def norm_matmuls(self, x, w, h, products, delta=None) -> None:
        ws = self.ws
        if not self.quantized or h is not getattr(ws, "h", None):
            return super().norm_matmuls(x, w, h, products, delta)
        qx = ws.h_q8
        cpu_ops.add_norm_quantize(x, x if delta is None else delta, delta is not None, w, self.hp.rms_eps, h,
                                  qx.xq, qx.xd, qx.xs)
        self._products(qx, products)

    def swiglu_matmul_add(self, gate, up, act, w, out, tmp):
        ws = self.ws
        if not self.quantized or act is not getattr(ws, "act", None):
            return super().swiglu_matmul_add(gate, up, act, w, out, tmp)
        qx = ws.act_q8
        cpu_ops.swiglu_quantize(gate, up, act, qx.xq, qx.xd, qx.xs)
        self._products(qx, ((w, tmp),))
        np.add(out, tmp, out=out)
        return out

    def rope_kv_write(self, layer_idx: int, q, k, v, ws: Workspace) -> None:
        if not self.quantized:
            return super().rope_kv_write(layer_idx, q, k, v, ws)
        hp, batch = self.hp, ws.batch
        cpu_ops.rope(q, batch.positions, self.inv_freq, hp.n_head, hp.head_dim)
        cpu_ops.rope(k, batch.positions, self.inv_freq, hp.n_head_kv, hp.head_dim)
        for chunk, r0 in zip(batch.chunks, batch.row_starts):
            rows = slice(r0, r0 + chunk.n_tokens)
            cpu_ops.kv_store(self.kv_keys, self.kv_values, layer_idx, self.row_page_ids[self.seq_row[chunk.seq_id]],
                             self.kv_sizing.chunk_pages, chunk.start_pos, k[rows], v[rows], hp.n_head_kv,
                             hp.head_dim)

    def qkv_bias_pairs(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, biases, ws: Workspace) -> None:
        hp = self.hp
        for x, b in zip((q, k, v), biases):
            if b is not None:
                np.add(x, b, out=x)  # x: [T, width] += b: [width]
        if hp.rope_neox:
            for x, heads in ((q, hp.n_head), (k, hp.n_head_kv)):
                x3 = x.reshape(ws.T, heads, hp.head_dim)
                x3[...] = x3[:, :, self.pair_source]

    def rope(self, q: np.ndarray, k: np.ndarray, ws: Workspace) -> None:
        hp, T = self.hp, ws.T
        pos = ws.batch.positions
        q[...] = apply_rope(q.reshape(T, hp.n_head, hp.head_dim), pos, self.inv_freq).reshape(T, -1)
        k[...] = apply_rope(k.reshape(T, hp.n_head_kv, hp.head_dim), pos, self.inv_freq).reshape(T, -1)

    def kv_write(self, layer_idx: int, k: np.ndarray, v: np.ndarray, ws: Workspace) -> None:
        hp = self.hp
        batch = ws.batch
        for chunk, r0 in zip(batch.chunks, batch.row_starts):
            pages = self._pages_of(chunk.seq_id)
            for page, o0, o1, p0 in page_spans(pages, chunk.start_pos, chunk.end_pos):
                rows = slice(r0 + p0 - chunk.start_pos, r0 + p0 - chunk.start_pos + o1 - o0)
                kp, vp = self._page(page, layer_idx)  # [Hkv, PAGE_TOKENS, hd]
                kp[:, o0:o1] = k[rows].reshape(o1 - o0, hp.n_head_kv, hp.head_dim).transpose(1, 0, 2)
                vp[:, o0:o1] = v[rows].reshape(o1 - o0, hp.n_head_kv, hp.head_dim).transpose(1, 0, 2)

    def _gather(self, seq_id: int, layer_idx: int, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's keys and values at positions [0, n_positions) of a layer, gathered from
        its pages: [Hkv, n_positions, hd] each."""
        pages = self._pages_of(seq_id)[: -(-n_positions // PAGE_TOKENS)]
        ks, vs = zip(*(self._page(p, layer_idx) for p in pages))
        return np.concatenate(ks, axis=1)[:, :n_positions], np.concatenate(vs, axis=1)[:, :n_positions]

    def attention(self, layer_idx: int, q: np.ndarray, ws: Workspace, out: np.ndarray) -> np.ndarray:
        """Each row sees its sequence's cache up to its own cache position; a tree chunk's row
        sees, of the chunk's own rows, only its ancestors and itself (``SeqChunk.visible``)."""
        hp = self.hp
        batch = ws.batch
        if self.quantized:
            for chunk, r0 in zip(batch.chunks, batch.row_starts):
                n = chunk.n_tokens
                vis = None if chunk.parents is None else chunk.visible()
                cpu_ops.attention(q[r0 : r0 + n], out[r0 : r0 + n], self.kv_keys, self.kv_values, layer_idx,
                                  self.row_page_ids[self.seq_row[chunk.seq_id]], self.kv_sizing.chunk_pages,
                                  chunk.start_pos, _CAUSAL if vis is None else vis, vis is not None, hp.n_head,
                                  hp.n_head_kv, hp.head_dim, self.attn_scale)
            return out
        group = hp.n_head // hp.n_head_kv
        scale = np.float32(1.0 / np.sqrt(hp.head_dim))
        for chunk, r0 in zip(batch.chunks, batch.row_starts):
            n = chunk.n_tokens
            keys, vals = self._gather(chunk.seq_id, layer_idx, chunk.end_pos)  # [Hkv, S, hd] each
            qc = q[r0 : r0 + n].reshape(n, hp.n_head_kv, group, hp.head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, n, hd]
            scores = np.matmul(qc, keys[:, None].transpose(0, 1, 3, 2)) * scale  # [Hkv, G, n, S]
            q_pos = np.arange(chunk.start_pos, chunk.end_pos)[:, None]  # cache positions
            k_pos = np.arange(chunk.end_pos)[None, :]
            seen = k_pos <= q_pos  # [n, S]
            vis = chunk.visible()
            if vis is not None:  # a tree: the prefix, and the row's own branch of the chunk
                seen = np.concatenate([np.ones((n, chunk.start_pos), dtype=bool), vis], axis=1)
            scores = np.where(seen, scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            att = np.matmul(p, vals[:, None])  # [Hkv, G, n, hd]
            out[r0 : r0 + n] = att.transpose(2, 0, 1, 3).reshape(n, hp.q_dim)
        return out

    def kv_keep(self, seq_id: int, src_positions: list[int], dst_positions: list[int]) -> None:
        # the contract the cuda move checks, checked here too so that CI catches a caller breaking it
        if len(src_positions) != len(dst_positions) or any(
                d >= s for s, d in zip(src_positions, dst_positions)) or any(
                b <= a for a, b in zip(src_positions, src_positions[1:])):
            raise ValueError(f"kv_keep: {src_positions} -> {dst_positions}: positions must be increasing, "
                             "each destination below its source")
        pages, cp = self._pages_of(seq_id), self.kv_sizing.chunk_pages
        layers = slice(None) if len(self.kv_layers) == self.hp.n_layers else self.kv_layers  # only those it holds
        for src, dst in zip(src_positions, dst_positions):  # in order: dst[i] < src[i], both increasing
            (sc, si), so = divmod(pages[src // PAGE_TOKENS], cp), src % PAGE_TOKENS
            (dc, di), do = divmod(pages[dst // PAGE_TOKENS], cp), dst % PAGE_TOKENS
            for s_arr, d_arr in zip(self.kv_chunks[sc], self.kv_chunks[dc]):  # keys, then values
                d_arr[layers, di, :, do] = s_arr[layers, si, :, so]  # [L, Hkv, hd]

    def swiglu(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> np.ndarray:
        out[...] = silu(gate) * up
        return out

    def add(self, x: np.ndarray, y: np.ndarray, out: np.ndarray) -> np.ndarray:
        np.add(x, y, out=out)
        return out

    def logits(self, ws: Workspace) -> np.ndarray:
        h = rms_norm(ws.x[ws.batch.logit_rows], self.out_norm, self.hp.rms_eps)  # h: [N_out, D]
        out = np.empty((h.shape[0], self.out_head.n_rows), dtype=np.float32)  # [N_out, V]
        return self.matmul(self.out_head, h, out)
