"""The cuda backend's paged KV cache in device memory (kv_pages.cuh says how the kernels address
it; shared/kv_sizing.py and daemons/compute/kv_pages.py size it and keep its accounting).

Pages live in chunks, each its own allocation: keys and values f16 [n_layers, chunk_pages,
n_kv, PAGE_TOKENS, hd]. Two device tables hold the chunks' addresses (``k_chunks``,
``v_chunks``: uint64 [max_chunks]) and one the sequences' page tables (``page_table``: int32
[n_rows, max_pages], -1 where a row has no page). Every kernel reads those tables from device
memory, so the CUDA graphs recorded at warm-up replay unchanged while chunks come and go and
sequences gain pages. Every write to them is queued on the backend's stream, after the passes
already queued: a pass in flight never sees a table change under it.
"""

from __future__ import annotations

from typing import Sequence

import cupy as cp
import numpy as np

from ntx.shared.kv_sizing import PAGE_TOKENS

__all__ = ["KvPages"]


class KvPages:
    """The page memory and the tables the kernels read, for ``n_layers`` layers of ``n_kv`` heads
    of ``hd``, chunks of ``chunk_pages`` pages (at most ``max_chunks``), ``n_rows`` sequence rows
    of up to ``max_pages`` pages."""

    def __init__(self, n_layers: int, n_kv: int, hd: int, chunk_pages: int, max_chunks: int, n_rows: int,
                 max_pages: int, stream) -> None:
        self.n_layers, self.n_kv, self.hd = n_layers, n_kv, hd
        self.chunk_pages, self.max_chunks = chunk_pages, max_chunks
        self.n_rows, self.max_pages = n_rows, max_pages
        self.stream = stream
        with stream:
            self.k_chunks = cp.zeros(max(max_chunks, 1), dtype=cp.uint64)
            self.v_chunks = cp.zeros(max(max_chunks, 1), dtype=cp.uint64)
            self.page_table = cp.full((n_rows, max_pages), -1, dtype=cp.int32)
        self.chunks: dict[int, tuple[cp.ndarray, cp.ndarray]] = {}

    @property
    def max_positions(self) -> int:
        return self.max_pages * PAGE_TOKENS

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.n_layers, self.chunk_pages, self.n_kv, PAGE_TOKENS, self.hd)

    def alloc_chunk(self, chunk: int) -> None:
        """Memory for chunk ``chunk`` (zeroed), its addresses in the tables."""
        if not 0 <= chunk < self.max_chunks:
            raise ValueError(f"KV chunk {chunk} outside [0, {self.max_chunks})")
        with self.stream:
            k = cp.zeros(self.chunk_shape, dtype=cp.float16)
            v = cp.zeros(self.chunk_shape, dtype=cp.float16)
            self.k_chunks[chunk : chunk + 1].set(np.array([k.data.ptr], dtype=np.uint64), stream=self.stream)
            self.v_chunks[chunk : chunk + 1].set(np.array([v.data.ptr], dtype=np.uint64), stream=self.stream)
        self.chunks[chunk] = (k, v)

    def free_chunk(self, chunk: int) -> None:
        """Chunk ``chunk``'s memory back (no page of it is in use): after the passes queued so far,
        which may still read the table (none reads the chunk's pages)."""
        self.stream.synchronize()
        self.k_chunks[chunk : chunk + 1].fill(0)
        self.v_chunks[chunk : chunk + 1].fill(0)
        del self.chunks[chunk]

    def set_row(self, row: int, pages: Sequence[int]) -> None:
        """Row ``row``'s page table: ``pages`` then -1, copied on the stream."""
        if len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages for a row of {self.max_pages}")
        host = np.full(self.max_pages, -1, dtype=np.int32)
        host[: len(pages)] = pages
        self.page_table[row].set(host, stream=self.stream)

    def dense(self, layer: int, row: int, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values at positions [0, n_positions) of row ``row``'s sequence in ``layer``,
        as host f16 [n_kv, n_positions, hd] each (tests, not passes)."""
        self.stream.synchronize()
        pages = cp.asnumpy(self.page_table[row])[: -(-n_positions // PAGE_TOKENS)]
        ks, vs = [], []
        for page in pages:
            c, i = divmod(int(page), self.chunk_pages)
            k, v = self.chunks[c]
            ks.append(cp.asnumpy(k[layer, i]))
            vs.append(cp.asnumpy(v[layer, i]))
        return (np.concatenate(ks, axis=1)[:, :n_positions], np.concatenate(vs, axis=1)[:, :n_positions])

    @classmethod
    def from_dense(cls, caches_k: np.ndarray, caches_v: np.ndarray, rng: np.random.Generator, chunk_pages: int = 3,
                   stream=None) -> KvPages:
        """Pages holding dense per-row caches f16 [n_layers, n_rows, n_kv, max_ctx, hd] (max_ctx a
        multiple of PAGE_TOKENS), every page at a random place of the pool (tests: the kernels
        against a plain reference)."""
        L, n_rows, n_kv, max_ctx, hd = caches_k.shape
        max_pages = max_ctx // PAGE_TOKENS
        n_pages = n_rows * max_pages
        n_chunks = -(-n_pages // chunk_pages)
        kv = cls(L, n_kv, hd, chunk_pages, n_chunks, n_rows, max_pages, stream or cp.cuda.get_current_stream())
        for c in range(n_chunks):
            kv.alloc_chunk(c)
        order = rng.permutation(n_chunks * chunk_pages)[:n_pages].reshape(n_rows, max_pages)
        host_k = {c: cp.asnumpy(kv.chunks[c][0]) for c in range(n_chunks)}
        host_v = {c: cp.asnumpy(kv.chunks[c][1]) for c in range(n_chunks)}
        for r in range(n_rows):
            for i, page in enumerate(order[r]):
                c, j = divmod(int(page), chunk_pages)
                sl = slice(i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS)
                host_k[c][:, j] = caches_k[:, r, :, sl]
                host_v[c][:, j] = caches_v[:, r, :, sl]
            kv.set_row(r, [int(p) for p in order[r]])
        for c in range(n_chunks):
            kv.chunks[c][0].set(host_k[c])
            kv.chunks[c][1].set(host_v[c])
        kv.stream.synchronize()
        return kv
