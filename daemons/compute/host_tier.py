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

import numpy as np

from ntx.daemons.compute import cpu_kernels
from ntx.daemons.compute.backend import Backend, Workspace
from ntx.daemons.compute.cpu_backend import CpuBackend
from ntx.shared.align import aligned_empty
from ntx.shared.gguf_index import ModelIndex
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.layer_bytes import read_layer, read_layer_into
from ntx.shared.plan import (HostRates, PassRoads, spread_pick, tier_share_pass_s, tier_streamed_in_pass,
                             tier_wide_rows_for)


PREPARE_THREADS = 8  # layers unpacked at once when the tier is loaded (each holds its temporaries)
# the pass widths (rows) at which the cores are timed at start (``HostTier.time_widths``): those
# that may keep part of the tier on the host (``HostTier.SHARE_ROWS``, the widest)
TIMED_WIDTHS = (1, 2, 4, 8, 16)


def share_enabled() -> bool:
    """Whether a pass of several rows may keep part of the tier on the cores
    (``HostTier.streamed_in``): ``NTX_TIER_SHARE=on``, off by default. Measured on the H200 (70B at
    24 GiB, batch 8, two leases) at 0.92x streaming the whole tier: while the cores computed a
    layer of 8 rows (25 ms), dma filled the ring's two slots and then waited (blocked 29% of the
    pass), so the link idled where the model had it copying (docs/PERFORMANCE.md, "Part of the
    tier in passes of a few rows"). The share is now weighed through the ring's slots
    (``plan.ring_pass_s``), which replays those runs within 3%; not yet measured on the GPU."""
    return os.environ.get("NTX_TIER_SHARE", "").strip().lower() in ("on", "1", "yes")


def timed_width(n_rows: int) -> int:
    """``n_rows`` rounded up to a timed width (past the widest, to a multiple of it): passes of
    nearby widths (a batch's verify trees vary by a row or two) share their tier's share and
    what was learnt of them."""
    top = TIMED_WIDTHS[-1]
    return next((w for w in TIMED_WIDTHS if w >= n_rows), -(-n_rows // top) * top)


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
                 staged: bool = True, rates: HostRates | None = None) -> None:
        """``wide_rows``: passes of more rows run these layers on ``backend`` instead (None: the
        backend's default, ``plan.tier_wide_rows_for``: ``WIDE_PASS_ROWS`` beside a GPU). Their bytes
        then come with the pass's streamed layers (the model's stream, ``wide_ops``), or where
        nothing streams (``staged``) from their file bytes kept (pinned) here, copied by
        ``run`` through the backend's one staging buffer. The keys and values of the tier's
        layers are kept in both caches, each path writing both, so that either path can run any
        pass. ``rates``: the speeds the plan sized the tier by; with them, a stream and the
        experiment on (``share_enabled``), a pass of a few rows streams only the share of the tier
        that the cores' slower arithmetic there makes worth moving (``streamed_in``), instead of
        all of it past ``wide_rows``."""
        self.index = index
        self.layers = sorted(layers)
        self.layer_set = frozenset(self.layers)
        self.backend = backend
        self.cpu = CpuBackend(index, kernels=kernels, kv_of=backend, kv_layers=self.layers)
        if self.cpu.quantized and backend.name != "cpu":  # beside a GPU pipeline: spare its other threads
            self.cpu.threads = cpu_kernels.set_threads(spare=cpu_kernels.TIER_SPARE_CORES)
        self.cpu.set_rope(rope_divisors)
        self.wide_rows = wide_rows if wide_rows is not None else tier_wide_rows_for(backend.name)
        self.rates = rates
        # the cores' time for a pass of n rows over a one-row pass's, at TIMED_WIDTHS (time_widths)
        self.width_cost: dict[int, float] = {}
        # width -> (streamed_in's layers, the slowdown and the pass's roads they were chosen by)
        self._split: dict[int, tuple[tuple[int, ...], float, PassRoads | None]] = {}
        self._predicted_s: dict[int, tuple[float, float]] = {}  # width -> (its share's pass, the whole tier's)
        # width -> the cores' seconds per file byte in this tier's passes of that width (running mean)
        self._s_per_byte: dict[int, float] = {}
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
        if (self.rates is not None and not self.staged and self.wide_rows is not None and self.cpu.quantized
                and share_enabled()):
            t0 = time.monotonic()
            self.time_widths()
            log(f"warm-up: the cpu tier's cores timed at {'/'.join(map(str, self.width_cost))} rows in "
                f"{time.monotonic() - t0:.2f} s: {'/'.join(f'{c:.2f}' for c in self.width_cost.values())}x "
                "a one-row pass's time (what passes of several rows leave on them)")
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
        if self.staged and self.is_wide(n):
            # the host's cores would be compute-bound here: the backend runs these layers, each
            # copied from host memory, and the tier's cache gets their K/V too (with a stream, the
            # layers of a wide pass that leave the host come through it instead: streamed_in)
            be = self.backend
            tee = self.wide_ops(ws, pass_id)
            for i in range(first, end):
                llama_block(tee, i, be.layer_from_host(self.index.layers[i], self.raw[i]), ws)
                be.host_layer_done()
            return
        t0 = time.perf_counter()
        hws.x = self.backend.hidden_to_host(ws)  # x: [T, D] float32 on the host
        t_host = time.perf_counter()  # the GPU's layers before these have ended
        ops = self.cpu if self.wide_rows is None else _KvTee(self.cpu, lambda i, k, v: self.backend.kv_from_host(
            i, k[:n], v[:n], ws))
        for i in range(first, end):
            llama_block(ops, i, self.weights[i], hws)
            self.bytes_read += self.layer_bytes[i]
        if self.rates is not None and n > 1 and self.width_cost:
            self._learn_width(n, time.perf_counter() - t_host, sum(self.layer_bytes[i] for i in range(first, end)))
        self.backend.hidden_from_host(ws, hws.x)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.runs += 1
        self.last_pass_s[pass_id] = self.last_pass_s.get(pass_id, 0.0) + dt
        while len(self.last_pass_s) > 32:
            del self.last_pass_s[next(iter(self.last_pass_s))]

    def is_wide(self, n_rows: int) -> bool:
        """Whether a pass of ``n_rows`` rows runs these layers on the backend (all of them where
        nothing else streams, ``staged``; with a stream, ``streamed_in`` says which)."""
        return self.wide_rows is not None and n_rows > self.wide_rows

    def streamed_in(self, n_rows: int, roads: Callable[[], PassRoads]) -> tuple[int, ...]:
        """The tier's layers that a pass of ``n_rows`` rows takes from the model's stream and runs
        on the backend (the rest run here); ``roads()``: the pass's layers in order, each one's
        road and bytes, and the ring's slots, asked only where a share is chosen.

        By default (and without the plan's rates or the widths' times, ``time_widths``): all of
        them in a pass wider than ``wide_rows``, none otherwise. With ``share_enabled`` (an
        experiment), in passes of up to ``SHARE_ROWS`` rows: the share that ends the pass soonest
        layer by layer through the ring's slots (``plan.tier_streamed_in_pass``), where it beats
        streaming the whole tier by ``MIN_GAIN``. Streaming all of it makes a pass of 8 rows on
        the 70B at 24 GiB cost 1.8x a one-row pass, which is what a share would win back.
        ``NTX_TIER_WIDE_STREAMED=N`` (tests): N of them, spread, in a pass wider than
        ``wide_rows`` (its rows rounded up to a timed width, as the speeds' choice is)."""
        if self.staged or self.wide_rows is None or n_rows <= 1:
            return ()
        fixed = os.environ.get("NTX_TIER_WIDE_STREAMED", "").strip()
        if not fixed and (self.rates is None or not self.width_cost or not share_enabled()):
            return tuple(self.layers) if self.is_wide(n_rows) else ()
        # rounded: nearby widths ask the ring for the same layers, where a change gives up
        # what dma had copied ahead (RingStream.begin_pass)
        width = timed_width(n_rows)
        if width > self.SHARE_ROWS and not fixed:
            return tuple(self.layers)
        if fixed:
            if width not in self._split:
                picked = spread_pick(list(range(len(self.layers))), int(fixed)) if self.is_wide(width) else []
                self._split[width] = (tuple(self.layers[i] for i in picked), 0.0, None)
            return self._split[width][0]
        slowdown = self.host_slowdown(width)
        known = self._split.get(width)
        # chosen again only when the pass's roads changed (a layer demoted, the KV cache's
        # doing) or what the cores measured moved by more than RECHOOSE: each change of the
        # layers asked gives up the copies dma made ahead
        pass_roads = roads()
        if known is None or known[2] != pass_roads or abs(slowdown / known[1] - 1.0) > self.RECHOOSE:
            picked = tier_streamed_in_pass(pass_roads, self.rates, slowdown, self.MIN_GAIN)
            # the roads' TIER layers are this tier's, in layer order
            known = self._split[width] = (tuple(self.layers[j] for j in picked), slowdown, pass_roads)
            # what the ring's model predicts for the share and for the whole tier (status), to
            # hold beside the passes measured at this width
            self._predicted_s[width] = (
                tier_share_pass_s(pass_roads, self.rates, slowdown, picked),
                tier_share_pass_s(pass_roads, self.rates, slowdown, range(len(self.layers))))
        return known[0]

    RECHOOSE = 0.1  # how far the measured slowdown moves before a width's share is chosen again
    # a share is taken only where it is this much faster than streaming the whole tier (the
    # ring's model replayed the H200's batch-8 runs within 3%), and only in passes of up to
    # SHARE_ROWS rows (verify trees, small batches): the model counts the GPU's part of a pass at
    # one row's speed, and passes of 32 and 64 rows keep the GPU busy 16-20% of the time (the 70B
    # at batch 32/64 on the H200), which a share would add to the cores' chain
    MIN_GAIN = 0.05
    SHARE_ROWS = TIMED_WIDTHS[-1]
    LEARN = 0.7  # the weight of the running mean's past in _learn_width

    def host_slowdown(self, n_rows: int) -> float:
        """How many times a one-row pass's time (at the plan's speed beside the link) the cores
        take for each of the tier's bytes in a pass of ``n_rows`` rows (a timed width), at least
        1: as measured in this tier's own passes of that width (``_learn_width``: the layers'
        whole work, attention and the keys' copies too), else as the products timed alone at
        warm-up say (``width_cost``, against the one-row time beside the link: a one-row pass is
        bound by the host's memory, which the link's copies share, a wide one by the cores'
        arithmetic). On the H200's host the warm-up's products said 2.0x at 8 rows and the
        tier's passes took 2.8x: the share chosen by the first left the cores the bottleneck
        (21.98 tok/s at batch 8 against 23.74 streaming the whole tier)."""
        cpu_shared, _ = self.rates.shared_gbps()
        learned = self._s_per_byte.get(n_rows)
        if learned is not None and cpu_shared > 0:
            return max(1.0, learned * cpu_shared * 1e9)
        cost = self.width_cost[n_rows]
        return max(1.0, cost * cpu_shared / self.rates.cpu_gbps) if cpu_shared > 0 else cost

    def _learn_width(self, n_rows: int, host_s: float, nbytes: int) -> None:
        """A run of the tier's layers took the cores ``host_s`` for ``nbytes`` of them in a pass of
        ``n_rows`` rows: the running mean of its width's seconds per byte moves towards it."""
        if nbytes <= 0:
            return
        width = timed_width(n_rows)
        spb = host_s / nbytes
        old = self._s_per_byte.get(width)
        self._s_per_byte[width] = spb if old is None else self.LEARN * old + (1 - self.LEARN) * spb

    def time_widths(self, widths: Sequence[int] = TIMED_WIDTHS, min_time_s: float = 0.02) -> dict[int, float]:
        """Time the cores on the matrix products of one layer of each kind the tier holds (a
        Q4_K_M model's layers with and without Q6_K matrices) at each pass width of ``widths``,
        and keep each width's time over one row's (``width_cost``). About a second on a 70B's
        layers at start."""
        from ntx.daemons.compute.probes import layer_kinds

        layers = [group[0] for group in layer_kinds(self.index, self.layers).values()]
        products = [w.data for i in layers for w in self.weights[i].values()
                    if hasattr(w, "data") and hasattr(w.data, "n_cols")]
        if not products:
            return {}
        times: dict[int, float] = {}
        for n in widths:
            xs = {k: cpu_kernels.QuantizedActivations(np.ones((n, k), dtype=np.float32))
                  for k in {p.n_cols for p in products}}
            outs = [np.empty((n, p.n_rows), dtype=np.float32) for p in products]
            for p, out in zip(products, outs):  # untimed: each width's first call
                cpu_kernels.matmul(p, xs[p.n_cols], out)
            reps, t0 = 0, time.perf_counter()
            while True:
                for p, out in zip(products, outs):
                    cpu_kernels.matmul(p, xs[p.n_cols], out)
                reps += 1
                elapsed_s = time.perf_counter() - t0
                if elapsed_s >= min_time_s:
                    break
            times[n] = elapsed_s / reps
        base = times[min(times)]
        self.width_cost = {n: t / base for n, t in times.items()}
        self._split.clear()
        self._predicted_s.clear()
        return self.width_cost

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
                "width_cost": {str(n): round(c, 3) for n, c in self.width_cost.items()},
                # rows (rounded up to a timed width) -> how many of the tier's layers such a pass streams
                "streamed_by_rows": {str(k): len(v[0]) for k, v in sorted(self._split.items())},
                # rows -> the ring model's pass (ms) with that share and with the whole tier streamed
                "share_predicted_ms": {str(w): {"share": round(a * 1e3, 1), "whole_tier": round(b * 1e3, 1)}
                                       for w, (a, b) in sorted(self._predicted_s.items())},
                # rows -> the cores' slowdown per byte measured in such passes (host_slowdown)
                "slowdown_by_rows": {str(w): round(self.host_slowdown(w), 3) for w in sorted(self._s_per_byte)}
                if self.rates is not None else {},
                "threads": self.cpu.threads, "quantized": self.cpu.quantized,
                "recent_pass_s": round(recent[len(recent) // 2], 6) if recent else 0.0}  # median: a prompt's
        # passes (many rows, at the cores' arithmetic speed) do not colour the decode passes' figure

    def close(self) -> None:
        self.weights.clear()
