"""The plan's cpu tier: layers that stay in the host's RAM and are computed by the host's cores.

A layer streamed to a GPU crosses the PCIe link whole on every pass; a layer on the cpu tier
never moves: the host reads it from its own memory (tens of GB/s on a server) while the link
brings the streamed layers in. Only the hidden state crosses, [T, D] floats each way (16 KB at
batch 1 for a 4096-wide model). The two roads add up: the planner (``shared/plan.py``) splits
the layers that do not fit the GPU between them by the rates it measured, and places them
alternately, so that the copy of a streamed layer overlaps the host's work on a cpu-tier layer.

The layers run on the cpu backend's compiled kernels (``CpuBackend``) in this process: a
``CpuBackend`` that holds only these layers, whose KV pages mirror the main backend's
(``Backend.attach_kv_mirror``: the same sequences, rows and page numbers, so the prefix cache,
speculation's moves and the pool's growth stay one accounting), with the keys and values of its
layers in host memory. On the cpu backend itself the tier is the same code beside a cpu main
backend (CI runs it there).

Each pass's time on the tier and the bytes it read are kept (``report``) for ``ntxctl status``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


from ntx.daemons.compute import cpu_kernels
from ntx.daemons.compute.backend import Backend, Workspace
from ntx.daemons.compute.cpu_backend import CpuBackend
from ntx.shared.align import aligned_empty
from ntx.shared.gguf_index import ModelIndex
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.layer_bytes import read_layer, read_layer_into
from ntx.shared.plan import tier_wide_rows_for


PREPARE_THREADS = 8  # layers unpacked at once when the tier is loaded (each holds its temporaries)


class _KvTee:
    """A backend's operations for ``llama_block``, except that the keys and values a layer
    stores also go to ``mirror(layer, k, v)`` (k rotated): the other cache of a cpu-tier layer.
    A cpu backend's fused RoPE rotates k in place; another's is done in two steps so that it does."""

    def __init__(self, ops: Backend, mirror: Callable[[int, Any, Any], None]) -> None:
        self.ops = ops
        self.mirror = mirror

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def rope_kv_write(self, layer_idx: int, q: Any, k: Any, v: Any, ws: Workspace) -> None:
        if self.ops.name == "cpu":
            self.ops.rope_kv_write(layer_idx, q, k, v, ws)
        else:
            self.ops.rope(q, k, ws)
            self.ops.kv_write(layer_idx, k, v, ws)
        self.mirror(layer_idx, k, v)


class HostTier:
    """Layers ``layers`` of ``index``, prepared once in host memory and run on the host's cores
    between the passes' other layers (``run``). ``backend`` computes the rest; its hidden state
    comes to the host and goes back (``Backend.hidden_to_host`` / ``hidden_from_host``)."""

    def __init__(self, index: ModelIndex, layers: Sequence[int], backend: Backend,
                 kernels: KernelOptions | None = None, rope_divisors: Any = None,
                 progress: Callable[[int], None] | None = None, wide_rows: int | None = None,
                 staged: bool = True) -> None:
        """``wide_rows``: passes of more rows run these layers on ``backend`` instead (None: the
        backend's default, ``plan.tier_wide_rows_for``: ``WIDE_PASS_ROWS`` beside a GPU). Their bytes
        then come with the pass's streamed layers (the model's stream, ``wide_ops``), or where
        nothing streams (``staged``) from their file bytes kept (pinned) here, copied by
        ``run`` through the backend's one staging buffer. The keys and values of the tier's
        layers are kept in both caches, each path writing both, so that either path can run any
        pass."""
        self.index = index
        self.layers = sorted(layers)
        self.layer_set = frozenset(self.layers)
        self.backend = backend
        self.cpu = CpuBackend(index, kernels=kernels, kv_of=backend, kv_layers=self.layers)
        if self.cpu.quantized and backend.name != "cpu":  # beside a GPU pipeline: spare its other threads
            self.cpu.threads = cpu_kernels.set_threads(spare=cpu_kernels.TIER_SPARE_CORES)
        self.cpu.set_rope(rope_divisors)
        self.wide_rows = wide_rows if wide_rows is not None else tier_wide_rows_for(backend.name)
        self.weights: dict[int, Any] = {}
        self.raw: dict[int, Any] = {}  # the layers' file bytes, for wide passes (with wide_rows, staged)
        self.staged = staged and self.wide_rows is not None

        def prepare(i: int) -> tuple[Any, Any]:
            info = index.layers[i]
            if not self.staged:
                return self.cpu.prepare_layer(info, read_layer(info), keep=True), None
            # pages of its own: page-locking one buffer never meets another's pages
            buf = read_layer_into(info, aligned_empty(info.image_bytes))
            return self.cpu.prepare_layer(info, buf, keep=True), buf

        # numpy's unpacking releases the GIL: a 70B's tier (GBs) packs in seconds, not minutes
        with ThreadPoolExecutor(max(1, min(PREPARE_THREADS, os.cpu_count() or 1))) as pool:
            for i, (w, buf) in zip(self.layers, pool.map(prepare, self.layers)):
                self.weights[i] = w
                if buf is not None:
                    backend.pin_host(buf)
                    self.raw[i] = buf
                if progress:
                    progress(i)
        self.layer_bytes = {i: index.layers[i].nbytes for i in self.layers}  # what a pass reads, as in the file
        self.busy_s = 0.0  # host time in run(), copies of the hidden state included
        self.bytes_read = 0
        self.runs = 0
        self.wide_passes = 0  # passes whose tier layers ran on the backend
        self._last_wide_pass = -1
        self._pass_ws: tuple[int, Workspace] | None = None  # (pass id, the tier's workspace of it)
        self.last_pass_s: dict[int, float] = {}  # pass id -> its time on the tier (kept short)

    def warm_up(self, log: Callable[[str], None]) -> None:
        """The host kernels built (or loaded from numba's cache) before the first request, and
        with wide passes the backend's staging of a tier layer made once (its buffer allocated,
        the copy path run), so that no request's first wide pass pays for it (nor a verify
        pass's measured cost, by which speculation sizes its drafts)."""
        self.cpu.warm_up((), None, log)
        if self.staged and self.layers:
            first = self.layers[0]
            self.backend.layer_from_host(self.index.layers[first], self.raw[first])
            self.backend.host_layer_done()
            self.backend.sync()

    def run(self, first: int, end: int, ws: Workspace, pass_id: int) -> None:
        """Layers [first, end) (all on this tier) on the pass's hidden state ``ws.x``, in place:
        on the host's cores, or on the backend when the pass is wider than ``wide_rows``."""
        from ntx.daemons.compute.model import llama_block  # the one block; model.py imports this module

        n = ws.batch.n_tokens
        hws = self._workspace(pass_id, ws)
        if self.is_wide(n):
            # the host's cores would be compute-bound here: the backend runs these layers, each
            # copied from host memory, and the tier's cache gets their K/V too
            if not self.staged:
                raise RuntimeError("a wide pass reached the cpu tier, whose layers its stream brings (wide_ops)")
            be = self.backend
            tee = self.wide_ops(ws, pass_id)
            for i in range(first, end):
                llama_block(tee, i, be.layer_from_host(self.index.layers[i], self.raw[i]), ws)
                be.host_layer_done()
            return
        t0 = time.perf_counter()
        hws.x = self.backend.hidden_to_host(ws)  # x: [T, D] float32 on the host
        ops = self.cpu if self.wide_rows is None else _KvTee(self.cpu, lambda i, k, v: self.backend.kv_from_host(
            i, k[:n], v[:n], ws))
        for i in range(first, end):
            llama_block(ops, i, self.weights[i], hws)
            self.bytes_read += self.layer_bytes[i]
        self.backend.hidden_from_host(ws, hws.x)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.runs += 1
        self.last_pass_s[pass_id] = self.last_pass_s.get(pass_id, 0.0) + dt
        while len(self.last_pass_s) > 32:
            del self.last_pass_s[next(iter(self.last_pass_s))]

    def is_wide(self, n_rows: int) -> bool:
        """Whether a pass of ``n_rows`` rows runs these layers on the backend."""
        return self.wide_rows is not None and n_rows > self.wide_rows

    def wide_ops(self, ws: Workspace, pass_id: int) -> Backend:
        """The backend's operations for a tier layer in wide pass ``pass_id`` (its weights on the
        backend), its keys and values also written to the tier's own cache, so that a later
        narrow pass on the host's cores sees them."""
        be, n = self.backend, ws.batch.n_tokens
        hws = self._workspace(pass_id, ws)
        if pass_id != self._last_wide_pass:
            self.wide_passes, self._last_wide_pass = self.wide_passes + 1, pass_id
        return _KvTee(be, lambda i, k, v: self.cpu.kv_write(i, be.to_host(k, n), be.to_host(v, n), hws))

    def _workspace(self, pass_id: int, ws: Workspace) -> Workspace:
        """The tier's workspace for pass ``pass_id``: made by its first run of tier layers, kept
        for the pass's other runs (spread placement makes several a pass)."""
        if self._pass_ws is None or self._pass_ws[0] != pass_id:
            self._pass_ws = (pass_id, self.cpu.begin_pass(ws.batch))
        return self._pass_ws[1]

    def kv_keep(self, seq_id: int, src_positions: list[int], dst_positions: list[int]) -> None:
        """Speculation's accepted path moved in this tier's layers too (``Backend.kv_keep``)."""
        self.cpu.kv_keep(seq_id, src_positions, dst_positions)

    def report(self) -> dict:
        """For ``ntxctl status``: the tier's layers, its busy time and GB/s while busy (prompt
        passes included), the threads it runs on, its time in the last passes (median)."""
        recent = sorted(list(self.last_pass_s.values())[:-1])  # the newest may still run
        return {"layers": len(self.layers), "bytes_per_pass": sum(self.layer_bytes.values()),
                "busy_s": round(self.busy_s, 6), "bytes": self.bytes_read,
                "busy_gbps": round(self.bytes_read / self.busy_s / 1e9, 3) if self.busy_s > 0 else 0.0,
                "wide_rows": self.wide_rows, "wide_passes": self.wide_passes,
                "threads": self.cpu.threads, "quantized": self.cpu.quantized,
                "recent_pass_s": round(recent[len(recent) // 2], 6) if recent else 0.0}  # median: a prompt's
        # passes (many rows, at the cores' arithmetic speed) do not colour the decode passes' figure

    def close(self) -> None:
        self.weights.clear()
