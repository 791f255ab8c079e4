"""``ntxctl bench``: the streaming scenarios on one model in one run, each figure beside its limit.

Scenarios (each optional):

(a) the reference engine's setting: the layers that fit ``--vram-budget`` resident, the rest in
    pinned RAM, streamed over PCIe every pass — the real daemon pipeline;
(b) the same with ``--ram-budget 0``: everything beyond VRAM read from storage every pass;
(c) the naive baseline: the same non-resident layers read through mmap and copied from pageable
    memory every pass, in one process, as a simple streaming engine does;
(d) a model fully resident (``--resident-model``), decode speed against the device's copy
    bandwidth;
(check) greedy tokens of (a) against the same model with every layer resident (same weights,
    different tiers), when it fits;
(spec) speculative decoding in (a)'s setting, with the *replay* drafter (controlled acceptance,
    ``daemons/compute/replay.py``): a plain greedy run records the reference continuation and
    the 1-token pass time; then the verify-pass time of chains of K drafted tokens (every draft
    right), and end-to-end tokens/s at a chosen expected acceptance length and with every draft
    wrong, optionally paying a real draft model's cost (``--draft-model``). See ``run_spec``.

The physical limits are measured in the same run: pinned and pageable host-to-device copies,
shared memory registered with cudaHostRegister, device-to-device copy, and O_DIRECT reads of the
model file. Results: a JSON file, a PNG chart (when matplotlib is installed) and a printed table.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ntx.ctl import instance
from ntx.ctl.bench_options import BENCH_CTX, SpecOptions
from ntx.ctl.client import Client
from ntx.daemons.compute.backend import plan_for
from ntx.daemons.compute.model import FileLayerStream
from ntx.daemons.compute.replay import load_trace, trace_tokens, write_references
from ntx.shared.config import EngineOptions, InstanceConfig, format_bytes
from ntx.shared.errors import ConfigError, NtxError
from ntx.shared.gguf_index import ModelIndex, open_model
from ntx.shared.plan import CPU, RAM, SKIPPED, STORAGE, VRAM, layer_ranges
from ntx.shared.stats import bottleneck, combine, summarize

GB = 1e9
# how often a timed run reads compute's status (_PassWatch). Compute reports its clock every
# STATS_INTERVAL_S (0.5 s), so the watch keeps every pass where KEEP_PASSES passes take longer
# than that: a streamed model's (0.2-0.4 s a pass on the H200), not a small model's on the CPU
WATCH_POLL_S = 0.25
PROMPT = "The history of the transistor begins"


# ------------------------------------------------------------------------------ limits
def _timed(fn, iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def measure_copy_limits(backend: str, nbytes: int = 1 << 30) -> dict[str, float]:
    """GB/s of the copies the tiers use, on this machine now."""
    out: dict[str, float] = {}
    if backend != "cuda":
        a = np.ones(nbytes, dtype=np.uint8)
        b = np.empty_like(a)
        out["host_copy_gbps"] = nbytes / _timed(lambda: np.copyto(b, a), 3) / GB
        return out
    import cupy as cp

    from ntx.daemons.compute.probes import device_copy_gbps, host_read_gbps
    from ntx.shared.shm import ShmSegment

    out["host_read_gbps"] = host_read_gbps(nbytes, 3, len(os.sched_getaffinity(0)))  # the cpu tier's road
    dev = cp.empty(nbytes, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)

    def h2d(ptr: int) -> None:
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, ptr, nbytes, 1, stream.ptr)
        stream.synchronize()

    pinned = cp.cuda.alloc_pinned_memory(nbytes)
    out["h2d_pinned_gbps"] = nbytes / _timed(lambda: h2d(pinned.ptr), 5) / GB
    del pinned
    name = f"ntx-bench-{os.getpid()}"
    seg = ShmSegment.create(name, nbytes)
    try:
        seg.array()[:] = 1
        cp.cuda.runtime.hostRegister(seg.address, seg.nbytes, 1)
        out["h2d_shm_registered_gbps"] = nbytes / _timed(lambda: h2d(seg.address), 5) / GB
        cp.cuda.runtime.hostUnregister(seg.address)
    finally:
        seg.close()
        seg.unlink()
    pageable = np.ones(nbytes, dtype=np.uint8)
    out["h2d_pageable_gbps"] = nbytes / _timed(lambda: h2d(pageable.ctypes.data), 3) / GB
    del pageable, dev
    cp.get_default_memory_pool().free_all_blocks()
    out["d2d_copy_gbps"] = device_copy_gbps(nbytes)  # bytes read + written
    return out


def measure_disk(index: ModelIndex, layers: list[int], max_bytes: int = 4 << 30) -> dict[str, Any]:
    """O_DIRECT reads of the given layers' spans, as the reader does them (4 in flight, 8 MiB)."""
    from ntx.daemons.reader.io import SpanReader, aligned_empty

    spans = [s for i in layers for s in index.layers[i].spans]
    if not spans:
        return {}
    buf = aligned_empty(max(index.layers[i].image_bytes for i in layers))  # one slot, as the reader fills
    readers: dict[str, SpanReader] = {}
    done = 0
    t = time.perf_counter()
    for s in spans:
        r = readers.get(s.path) or readers.setdefault(s.path, SpanReader(s.path, mode="auto", queue_depth=4))
        r.read_span(s, buf)
        done += s.nbytes
        if done >= max_bytes:
            break
    dt = time.perf_counter() - t
    mode = next(iter(readers.values())).mode_in_use
    for r in readers.values():
        r.close()
    return {"disk_read_gbps": done / dt / GB, "disk_read_mode": mode, "disk_probe_bytes": done}


# ------------------------------------------------------------------------------ scenarios
def _stage_delta(before: dict, after: dict) -> dict[str, Any]:
    """Each stage's clock over the timed window only (after minus before), summarized as status does."""
    out = {}
    for name, s in after.get("stages", {}).items():
        b = before.get("stages", {}).get(name, {}).get("total", {})
        out[name] = summarize({k: s["total"][k] - b.get(k, 0.0) for k in ("busy", "starved", "blocked", "idle", "bytes")})
    return out


def _decode_passes(after: dict, first: int, last: int) -> dict[str, Any]:
    """Each stage's clock over the decode passes among ``first .. last-1``: the passes whose
    compute record shows rows and no prompt rows (the prompts' prefill passes that open the
    window are left out), from the per-pass records in the status."""
    comp = (after.get("stages", {}).get("compute", {}).get("passes") or {})
    ids = {k for k, v in comp.items() if first <= int(k) < last and v.get("rows", 0) > 0 and v.get("prefill_rows", 0) == 0}
    out = {}
    for name, s in after.get("stages", {}).items():
        parts = [v for k, v in (s.get("passes") or {}).items() if k in ids]
        if parts:
            out[name] = summarize(combine(parts))
            out[name]["n_passes"] = len(parts)
    return out


def _generate_concurrently(listen: str, batch: int, tokens: int, prompts: list[list[int]] | None = None,
                           ttfts: list[float] | None = None) -> tuple[float, int, list[list[int]]]:
    """``batch`` greedy requests at once (of PROMPT, or of ``prompts``' token ids); returns (decode
    seconds, tokens generated, tokens of each); ``ttfts`` gets each request's first-token time."""
    results: list[list[int]] = [None] * batch  # type: ignore[list-item]
    firsts: list[float] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(i: int) -> None:
        with Client(listen, event_timeout_s=1800) as c:
            toks = []
            kw = dict(tokens=prompts[i]) if prompts is not None else dict(prompt=PROMPT, raw=True)
            for ev in c.generate(temperature=0.0, max_tokens=tokens, **kw):
                if ev["type"] == "token":
                    if not toks:
                        with lock:
                            firsts.append(time.perf_counter())
                            if ttfts is not None:
                                ttfts.append(firsts[-1] - t0)
                    toks.append(ev["token"])
            results[i] = toks

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.perf_counter()
    n_after_first = sum(len(r) - 1 for r in results)
    return end - max(firsts), n_after_first, results


def _start(cfg: InstanceConfig, plan) -> dict[str, Any]:
    """Start one of the bench's instances, bound to this process (``instance.Owner``): a bench
    killed mid-run leaves no instance behind to hold the GPU and refuse the next bench."""
    return instance.start(cfg, plan, owner_pid=os.getpid())


def run_pipeline(label: str, cfg: InstanceConfig, index: ModelIndex, tokens: int, batch: int, log) -> dict[str, Any]:
    plan = plan_for(index, cfg)
    log(f"({label}) plan: " + "; ".join(plan.describe()[:3]))
    t0 = time.perf_counter()
    _start(cfg, plan)
    start_s = time.perf_counter() - t0
    ttfts: list[float] = []
    try:
        _generate_concurrently(cfg.listen, batch, 2, ttfts=ttfts)  # the first requests after ready
        time.sleep(0.6)
        before = instance.get_status(cfg.name, 10) or {}
        decode_s, n, toks = _generate_concurrently(cfg.listen, batch, tokens)
        time.sleep(0.6)  # one stats interval
        after = instance.get_status(cfg.name, 10) or {}
    finally:
        instance.stop(cfg.name, force=True)
    passes = n / batch
    first = int(before.get("stages", {}).get("compute", {}).get("n_passes", 0))
    last = int(after.get("stages", {}).get("compute", {}).get("n_passes", 0))
    stages = _decode_passes(after, first, last)
    return {
        "label": label, "plan_tiers": {t: len(plan.layers_on(t)) for t in (VRAM, CPU, RAM, STORAGE, SKIPPED)},
        "cpu_bytes_per_pass": plan.cpu_layer_bytes, "cpu_tier": after.get("stages", {}).get("compute", {}).get("cpu_tier"),
        "host_rates": _host_rates(plan),
        "skipped_layers": plan.layers_on(SKIPPED), "skipped_bytes_per_pass": plan.skipped_layer_bytes,
        "streamed_bytes_per_pass": plan.streamed_bytes_per_pass, "ram_bytes_per_pass": plan.ram_layer_bytes,
        "storage_bytes_per_pass": plan.storage_layer_bytes, "start_s": round(start_s, 2),
        "tokens_per_s": n / decode_s if decode_s > 0 else 0.0, "pass_s": decode_s / passes if passes else 0.0,
        "stages": stages, "stages_whole_window": _stage_delta(before, after),
        "bottleneck": bottleneck({k: {"recent": v} for k, v in stages.items()}),
        "status_bottleneck": after.get("bottleneck"), "status": after, "tokens": toks[0],
        "ctx": plan.ctx, "max_batch": cfg.max_batch, "kv_tokens": plan.kv_tokens,
        "first_token_s": round(max(ttfts), 4) if ttfts else None,
    }


def _host_rates(plan) -> dict | None:
    """The speeds the plan's cpu tier was sized by and the one-row pass they predict (the split's
    model, ``HostRates.pass_s``), to set beside the pass measured; None without them."""
    rates = plan.host_rates
    if rates is None:
        return None
    return {"link_gbps": rates.link_gbps, "cpu_gbps": rates.cpu_gbps, "mem_gbps": rates.mem_gbps,
            "cpu_beside_link_gbps": rates.cpu_beside_link_gbps, "link_beside_cpu_gbps": rates.link_beside_cpu_gbps,
            "gpu_gbps": rates.gpu_gbps, "how": rates.how, "predicted_pass_s": plan.predicted_pass_s}


def _streamed_in_force(plan, status: dict, index: ModelIndex) -> int:
    """Layer bytes a pass streams under the plan in force: the plan's, and the layers demoted
    since (status ``kv.demoted_layers``)."""
    demoted = (status.get("kv") or {}).get("demoted_layers") or []
    return plan.streamed_bytes_per_pass + sum(index.layers[i].nbytes for i in demoted)


def run_long_contexts(label: str, cfg: InstanceConfig, index: ModelIndex, n_seqs: int, prompt_tokens: int,
                      tokens: int, log) -> dict[str, Any]:
    """``n_seqs`` concurrent requests, each with its own ``prompt_tokens``-token prompt (random
    token ids), ``tokens`` generated each, at ``cfg``'s flags: every one must complete; decode
    throughput (after the last first token) beside what the link allows for the plan in force
    at the end (its streamed layers and those demoted for the KV cache)."""
    plan = plan_for(index, cfg)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(1, index.hparams.n_vocab, prompt_tokens)] for _ in range(n_seqs)]
    t0 = time.perf_counter()
    _start(cfg, plan)
    start_s = time.perf_counter() - t0
    ttfts: list[float] = []
    try:
        t0 = time.perf_counter()
        decode_s, n, toks = _generate_concurrently(cfg.listen, n_seqs, tokens, prompts=prompts, ttfts=ttfts)
        total_s = time.perf_counter() - t0
        time.sleep(0.6)
        after = instance.get_status(cfg.name, 10) or {}
    finally:
        instance.stop(cfg.name, force=True)
    streamed = _streamed_in_force(plan, after, index)
    kv = after.get("kv") or {}
    positions = n_seqs * (prompt_tokens + tokens)
    return {
        "label": label, "sequences": n_seqs, "prompt_tokens": prompt_tokens, "tokens": tokens, "start_s": round(start_s, 2),
        "completed": sum(1 for t in toks if t is not None and len(t) == tokens), "total_s": round(total_s, 2),
        "tokens_per_s": n / decode_s if decode_s > 0 else 0.0, "pass_s": decode_s / max(n / n_seqs, 1),
        "first_token_s": round(max(ttfts), 3) if ttfts else None, "ctx": plan.ctx,
        "streamed_bytes_per_pass": streamed, "streamed_bytes_per_pass_planned": plan.streamed_bytes_per_pass,
        "demoted_layers": kv.get("demoted_layers", []), "kv_pages_total": kv.get("pages_total"),
        "kv_bytes_in_vram": positions * plan.kv_page_bytes // 32, "kv_bytes_over_link_per_pass": 0,
        "preemptions": kv.get("preemptions"), "stages": {}, "status": after,
    }


def run_prefix_reuse(label: str, cfg: InstanceConfig, index: ModelIndex, prefix_tokens: int, new_tokens: int,
                     log) -> dict[str, Any]:
    """First-token time of a request whose ``prefix_tokens``-token prefix an earlier request left
    in the prefix cache (plus ``new_tokens`` of its own), beside a ``new_tokens``-token prompt's."""
    plan = plan_for(index, cfg)
    rng = np.random.default_rng(11)
    prefix = [int(t) for t in rng.integers(1, index.hparams.n_vocab, prefix_tokens)]
    tail = [int(t) for t in rng.integers(1, index.hparams.n_vocab, new_tokens)]
    _start(cfg, plan)
    try:
        _generate_concurrently(cfg.listen, 1, 2)  # the instance's first request
        cold: list[float] = []
        _generate_concurrently(cfg.listen, 1, 2, prompts=[prefix + tail], ttfts=cold)
        again: list[float] = []
        _generate_concurrently(cfg.listen, 1, 2, prompts=[prefix + tail[::-1]], ttfts=again)
        short: list[float] = []
        _generate_concurrently(cfg.listen, 1, 2, prompts=[tail], ttfts=short)
        time.sleep(0.6)
        after = instance.get_status(cfg.name, 10) or {}
    finally:
        instance.stop(cfg.name, force=True)
    kv = after.get("kv") or {}
    return {"label": label, "prefix_tokens": prefix_tokens, "new_tokens": new_tokens,
            "first_token_cold_s": round(cold[0], 4), "first_token_reused_s": round(again[0], 4),
            "first_token_short_s": round(short[0], 4), "reused_over_short": round(again[0] / short[0], 3),
            "prefix_hit_tokens": kv.get("prefix_hit_tokens"), "status": after}


class _MmapPageableStream(FileLayerStream):
    """The naive baseline: every pass, each non-resident layer is taken from an mmap of the file
    (page cache) and copied from that pageable memory to the device by the backend."""

    def __init__(self, index: ModelIndex) -> None:
        super().__init__(index)
        self.maps = {}
        for p in index.paths:
            with open(p, "rb") as f:
                self.maps[p] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def acquire(self, layer_idx: int, pass_id: int) -> np.ndarray:
        layer = self.index.layers[layer_idx]
        for s in layer.spans:
            s.bytes_in(self.buf)[:] = np.frombuffer(self.maps[s.path], dtype=np.uint8, count=s.nbytes, offset=s.offset)
        return self.buf


def run_in_process(label: str, model: str, base: InstanceConfig, resident: list[int] | None, tokens: int, batch: int,
                   naive: bool) -> dict[str, Any]:
    """One scenario in this process: ``model`` on ``base``'s backend with its context and kernels,
    ``resident`` layers resident (None: all), the others read from the file every pass (through
    an mmap of it when ``naive``)."""
    from ntx.ctl.local import LocalEngine
    from ntx.daemons.compute.factory import build_engine
    from ntx.shared.messages import EngineRequest
    from ntx.shared.sampling_fields import SamplingParams

    index = open_model(model)
    stream = _MmapPageableStream(index) if naive else None
    t0 = time.perf_counter()
    options = EngineOptions(max_batch=max(batch, 1), ctx=BENCH_CTX, kernels=base.kernels)
    eng = LocalEngine(build_engine(index, base.backend, options, resident_layers=resident, stream=stream))
    load_s = time.perf_counter() - t0
    ids = eng.prompt_tokens(prompt=PROMPT, raw=True)
    if not naive:  # compile kernels and capture the decode graphs before timing
        eng.submit(EngineRequest(f"{label}-warmup", ids, SamplingParams(temperature=0.0, max_tokens=3)))
        while eng.has_work:
            eng.step()
    for i in range(batch):
        eng.submit(EngineRequest(f"{label}{i}", ids, SamplingParams(temperature=0.0, max_tokens=tokens)))
    first = None
    n = 0
    toks: dict[str, list[int]] = {}
    while eng.has_work:
        evs = eng.step()
        if first is None:
            first = time.perf_counter()  # after the prefill pass
            continue
        for e in evs:
            if e["type"] == "token":
                n += 1
            if e["type"] == "done":
                toks[e["id"]] = e["tokens"]
    dt = time.perf_counter() - first
    streamed = [i for i in range(index.hparams.n_layers) if resident is not None and i not in set(resident)]
    head = index.globals.get("output", index.globals["token_embd"])
    return {
        "label": label, "tokens_per_s": n / dt if dt > 0 else 0.0, "pass_s": dt / (n / batch) if n else 0.0,
        "load_s": round(load_s, 2), "streamed_bytes_per_pass": sum(index.layers[i].nbytes for i in streamed),
        "weight_bytes_per_pass": index.layer_bytes_total + head.nbytes, "tokens": toks.get(f"{label}0", []),
        "type": index.file_type,
    }


# ------------------------------------------------------------------------------ spec (speculation)
VERIFY_GOAL_DRAFT_TOKENS = 256  # issue 10: a verify pass of 256 tokens ...
VERIFY_GOAL_RATIO = 1.15  # ... costs at most 1.15x a 1-token pass (the pass is bound by the link)
ACCEPT_GOAL_TOKENS_PER_S = 12.0  # at acceptance length ACCEPT_GOAL_LENGTH, batch 1, 70B shape at 24 GiB
ACCEPT_GOAL_LENGTH = 6.0
ALL_WRONG_GOAL_RATIO = 0.97  # every draft wrong: at least 0.97x plain (issue 28)
SPEC_PROMPT_POSITIONS = 64  # room for PROMPT's tokens in the spec runs' context


def p_wrong_for_acceptance(draft_tokens: int, length: float) -> float:
    """The p with sum_{i=1..K} (1-p)^i = ``length``: the expected accepted tokens of a replayed
    draft of K tokens, each wrong with probability p independently. Bisection on q = 1 - p (the
    sum rises with q from 0 at q = 0 to K at q = 1)."""
    if length >= draft_tokens:
        return 0.0
    if length <= 0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        q = (lo + hi) / 2
        if sum(q**i for i in range(1, draft_tokens + 1)) < length:
            lo = q
        else:
            hi = q
    return 1.0 - (lo + hi) / 2


def _greedy_request(listen: str, max_tokens: int, stop=None, **fields: Any) -> tuple[dict, float]:
    """One greedy request of PROMPT (``fields``: more of the request's, ``speculative`` say): its
    ``done`` event and its decode seconds (first token to done). ``stop()``: asked at each reply;
    once true the request is cancelled (its ``done`` then says so and holds the tokens so far)."""
    first, cancelled = None, False
    with Client(listen, event_timeout_s=600) as c:
        rid = c.submit(PROMPT, raw=True, temperature=0.0, max_tokens=max_tokens, **fields)
        for ev in c.events(rid):
            if ev["type"] == "token" and first is None:
                first = time.perf_counter()
            if stop is not None and not cancelled and ev["type"] != "done" and stop():
                c.cancel(rid)
                cancelled = True
            done = ev
    return done, time.perf_counter() - (first or time.perf_counter())


class _PassWatch:
    """Compute's per-pass clock, gathered while requests run. Its status keeps only the last
    KEEP_PASSES passes, so a verify pass followed by many one-token passes (a chain that left its
    recording: a wide pass rounded a near tie the other way) drops out of it before the request
    ends. A thread reads the status every ``poll_s`` and keeps every pass it saw, by id; a pass
    read again replaces its earlier reading (it may have been running)."""

    def __init__(self, name: str, poll_s: float | None = None) -> None:
        self.name, self.poll_s = name, WATCH_POLL_S if poll_s is None else poll_s
        self.passes: dict[int, dict] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pass-watch", daemon=True)

    def __enter__(self) -> _PassWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.add((instance.get_status(self.name, 10) or {}).get("stages", {}).get("compute", {}))
            except Exception:  # noqa: BLE001 - a reading missed; the run's own status calls say what is wrong
                continue

    def add(self, compute: dict) -> None:
        """Keep the passes of one reading of compute's status."""
        with self._lock:
            for k, v in (compute.get("passes") or {}).items():
                self.passes[int(k)] = v

    def closed(self, rows: int | None, since: int) -> int:
        """How many decode passes of ``rows`` rows (None: any) from pass id ``since`` on have
        ended (a later pass was seen)."""
        with self._lock:
            last = max(self.passes, default=-1)
            return sum(1 for k, v in self.passes.items()
                       if since <= k < last and v["prefill_rows"] == 0 and v["rows"] > 0
                       and (rows is None or v["rows"] == rows))


def _settled_status(name: str, tokens_generated: int, timeout_s: float = 60.0) -> dict:
    """The instance's status once compute has reported ``tokens_generated`` tokens and gone
    idle: its per-pass clock then holds every pass of the requests so far, the last one closed."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = instance.get_status(name, 10) or {}
        if st.get("tokens_generated", 0) >= tokens_generated and \
                st.get("stages", {}).get("compute", {}).get("state") == "idle":
            return st
        if time.monotonic() > deadline:
            raise NtxError(f"bench: compute's status did not show {tokens_generated} tokens and idle within {timeout_s:.0f} s")
        time.sleep(0.1)


def _timed_instance(cfg: InstanceConfig, index: ModelIndex, warmup_tokens: int, tokens: int,
                    plain_too: bool = False, stop_after: tuple[int, int] | None = None) -> dict[str, Any]:
    """Start ``cfg``'s instance, warm it with one greedy request of ``warmup_tokens`` (kernels
    compiled, this pass shape's graph captured), time one of ``tokens``, stop it. Returns the
    timed request's ``done`` event; its tokens/s after the first token as compute timed it (the
    ``done`` timings: no delivery lag of a loaded machine's supervisor or client in it) and as
    the client saw it; and compute's clock (busy + starved + blocked seconds) of each of its
    decode passes, by rows computed (every one: ``_PassWatch``). ``plain_too``: then the same
    request without speculation (``speculative: false``) in the same instance, its tokens/s as
    ``plain_tokens_per_s``: a baseline of the same plan on the same machine a moment later (two
    instances started one after the other differed by up to 5% on the H200 machines).
    ``stop_after`` (rows, n): the warm-up once it has run a pass of that many rows, and the timed
    request once it has run n of them, are cancelled: a verify chain that left its recording
    would otherwise go on a token a pass up to ``tokens`` (hundreds of passes at K = 512)."""
    return _timed_runs(cfg, index, [(warmup_tokens, tokens, stop_after)], plain_too)[0]


def _timed_runs(cfg: InstanceConfig, index: ModelIndex, runs: list[tuple[int, int, tuple[int, int] | None]],
                plain_too: bool = False, each: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """``_timed_instance`` for each (warmup_tokens, tokens, stop_after) of ``runs`` in turn, in
    one start of ``cfg``'s instance (on the 70B a start takes 40-60 s); ``plain_too`` after the
    last. One result each, as ``_timed_instance`` returns it, also given to ``each`` as it comes
    (so that a run cut off keeps what it measured; before ``plain_too``'s figure is in it)."""
    plan = plan_for(index, cfg)
    t0 = time.perf_counter()
    _start(cfg, plan)
    start_s = time.perf_counter() - t0
    out: list[dict[str, Any]] = []
    try:
        with _PassWatch(cfg.name) as watch:
            def stop_when(stop_after: tuple[int, int] | None, since: int, need: int):
                """Whether ``need`` passes of stop_after's rows have ended from pass id ``since`` on,
                or more decode passes than that of any rows (a chain that left its recording
                drafts nothing more)."""
                if not stop_after:
                    return None
                return lambda: watch.closed(stop_after[0], since) >= need or watch.closed(None, since) > need

            generated, next_pass = 0, 0  # compute's counts before this run
            for warmup_tokens, tokens, stop_after in runs:
                warm, _ = _greedy_request(cfg.listen, warmup_tokens, stop=stop_when(stop_after, next_pass, 1))
                before = _settled_status(cfg.name, generated + len(warm["tokens"]))
                first_pass = before["stages"]["compute"]["n_passes"]
                done, decode_s = _greedy_request(cfg.listen, tokens,
                                                 stop=stop_when(stop_after, first_pass, stop_after[1] if stop_after else 0))
                after = _settled_status(cfg.name, before["tokens_generated"] + len(done["tokens"]))
                watch.add(after["stages"]["compute"])
                generated, next_pass = after["tokens_generated"], after["stages"]["compute"]["n_passes"]
                pass_s_by_rows: dict[int, list[float]] = {}
                for k, v in sorted(watch.passes.items()):
                    if first_pass <= k < next_pass and v["rows"] > 0 and v["prefill_rows"] == 0:
                        pass_s_by_rows.setdefault(v["rows"], []).append(v["busy"] + v["starved"] + v["blocked"])
                n = len(done["tokens"])
                out.append({"done": done, "tokens_per_s": done["timings"]["decode_tokens_per_s"] or 0.0,
                            "plain_tokens_per_s": None,
                            "client_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                            "pass_s_by_rows": pass_s_by_rows, "start_s": round(start_s, 2),
                            "streamed_bytes_per_pass": plan.streamed_bytes_per_pass,
                            "plan_tiers": {t: len(plan.layers_on(t)) for t in (VRAM, RAM, STORAGE, SKIPPED)}})
                if each is not None:
                    each(out[-1])
        if plain_too:
            plain_done, _ = _greedy_request(cfg.listen, runs[-1][1], speculative=False)
            out[-1]["plain_tokens_per_s"] = plain_done["timings"]["decode_tokens_per_s"] or 0.0
    finally:
        instance.stop(cfg.name, force=True)
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _at_draft_tokens(pass_s: dict[int, float], k: int) -> tuple[float, str] | None:
    """The verify-pass time at ``k`` drafted tokens: measured, or linear between the measured
    lengths around it (and said so); None when no measured lengths bracket it."""
    if k in pass_s:
        return pass_s[k], "measured"
    below = [x for x in pass_s if x < k]
    above = [x for x in pass_s if x > k]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return pass_s[lo] + (pass_s[hi] - pass_s[lo]) * (k - lo) / (hi - lo), f"interpolated between {lo} and {hi}"


def spec_positions(opts: SpecOptions, index: ModelIndex) -> int:
    """The positions each spec run's context holds (the prompt, then the longest run's tokens);
    one line naming the fix when the model was trained for fewer, so that no chain length asked
    for goes untimed."""
    positions = opts.reference_tokens + SPEC_PROMPT_POSITIONS
    n_ctx = index.hparams.n_ctx_train
    if positions > n_ctx:
        room = n_ctx - SPEC_PROMPT_POSITIONS  # tokens a run may generate
        traces_over = [f for i, f in enumerate(opts.accept_traces) if opts.trace_run_tokens(i) > room]
        fix = (f"--spec-tokens at most {room}" if opts.accept_tokens > room else
               f"a shorter --spec-accept-trace than {os.path.basename(traces_over[0])} (a trace replays whole)"
               if traces_over else
               f"chains (--spec-verify-draft-tokens) of at most {(room - 1) // opts.verify_passes - 1} tokens at "
               f"--spec-verify-passes {opts.verify_passes}, or fewer passes")
        raise ConfigError(f"bench spec: its runs need {positions} positions but {index.name} was trained for "
                          f"{n_ctx}: {fix}")
    return positions


def run_spec(entry: dict[str, Any], base: InstanceConfig, index: ModelIndex, limits: dict, opts: SpecOptions,
             out_dir: Path, log, save) -> None:
    """The spec scenario, batch 1 in (a)'s setting, through the real daemons; fills ``entry``
    (``save()`` after each run, so a cut-off run keeps what it measured).

    (i) a plain greedy run of ``opts.reference_tokens`` tokens: plain tokens/s, the 1-token pass
    time from compute's per-pass clock, and the reference continuation (``replay.json``);
    (ii) per chain length K, replay with p = 0 and ``--draft-tokens K``, the tree fixed at that
    chain (``draft_fixed``: the tree shape's back-off would judge a wide pass that does not pay
    on this plan, a compute-bound one on the CPU say, and draft less, and its priors hold chains
    over 14 tokens back until it has measured): the mean time of the ``opts.verify_passes``
    verify passes of K + 1 rows against the 1-token pass and the link's limit for the plan, each
    run cancelled once those passes ended (a chain that left its recording would go on a token a
    pass to its max_tokens) (``opts.cases``: "verify");
    (iii) replay with chains of up to K = ``opts.accept_draft_tokens`` (the tree shape chooses the
    depth) at the p whose expected acceptance length is ``opts.accept_length``, and at p = 1
    (every draft wrong) (``opts.cases``: "controlled", "wrong"): tokens/s against plain, and the
    measured mean acceptance length (accepted tokens per verify pass); at p = 1 also against a
    plain request (``speculative: false``) of the same instance right after, by which its goal is
    judged; then for each of
    ``opts.accept_traces`` (a real drafter's passes on real text) the replay of that trace, every
    pass drafting and accepted as it was there (``_traced_replay``), the whole trace once
    (``opts.trace_run_tokens``: its first passes alone would give the start of the text's figure);
    (iv) with ``opts.batch`` > 1: that many concurrent requests, plain and with the replay of (iii) at
    both p, tokens/s of all of them together as the clients saw it.

    Every run has the same context and workspace (the largest chain's rows), so the same layers
    stream in all of them; only ``--draft-model`` moves layers out of VRAM, and its runs say so.
    """
    positions = spec_positions(opts, index)
    rows = max(base.prefill_chunk_tokens, max(opts.verify_draft_tokens) + 1, opts.accept_draft_tokens + 1)
    plain_cfg = replace(base, max_batch=1, ctx=positions, prefill_chunk_tokens=rows).validate()
    link_gbps = _link_gbps(limits)
    replay_path = (out_dir / "replay.json").resolve()
    entry.update(drafter="replay", replay_file=str(replay_path))

    # (i) plain, recording the reference
    log(f"(spec) plain greedy run of {opts.reference_tokens} tokens: the replay drafter's reference and the baseline")
    plain = _timed_instance(plain_cfg, index, 2, opts.reference_tokens)
    done = plain["done"]
    write_references(replay_path, [done["prompt_tokens"] + done["tokens"]])
    plain_pass_s = _mean(plain["pass_s_by_rows"].get(1, []))
    link_pass_s = plain["streamed_bytes_per_pass"] / (link_gbps * GB) if link_gbps else None
    entry.update(
        plan_tiers=plain["plan_tiers"], streamed_bytes_per_pass=plain["streamed_bytes_per_pass"],
        link_gbps=link_gbps, link_pass_s=link_pass_s, reference_tokens=len(done["tokens"]),
        plain={"tokens_per_s": plain["tokens_per_s"], "client_tokens_per_s": plain["client_tokens_per_s"],
               "pass_s": plain_pass_s,
               "n_passes": len(plain["pass_s_by_rows"].get(1, [])), "start_s": plain["start_s"]},
        verify=[], acceptance=[],
    )
    save()
    log(_spec_plain_line(entry))
    if len(done["tokens"]) < opts.reference_tokens:
        log(f"(spec) the plain run stopped after {len(done['tokens'])} tokens ({done['finish_reason']}): "
            "runs that need more replay what there is")

    def replay_cfg(k: int, p_wrong: float, draft_model: str | None = None, fixed: bool = False) -> InstanceConfig:
        return replace(plain_cfg, draft_tokens=k, draft_width=1, draft_fixed=fixed,  # chains of k
                       draft_replay=str(replay_path), draft_replay_p=p_wrong, draft_model=draft_model).validate()

    # (ii) verify-pass time per chain length, every draft right; the warm-up's one pass is of K + 1 rows
    ks = list(opts.verify_draft_tokens)

    def timed_chain(run: dict[str, Any], instance: int) -> None:
        k = ks[len(entry["verify"])]
        times = run["pass_s_by_rows"].get(k + 1, [])
        pass_s = _mean(times)
        entry["verify"].append({
            "draft_tokens": k, "p_wrong": 0.0, "pass_s": pass_s, "n_passes": len(times),
            "ratio_to_plain_pass": pass_s / plain_pass_s if pass_s and plain_pass_s else None,
            "ratio_to_link_pass": pass_s / link_pass_s if pass_s and link_pass_s else None,
            "accepted_per_pass": (run["done"].get("speculation") or {}).get("accepted_per_pass", 0.0),
            "start_s": run["start_s"], "instance": instance,  # which of the section's instances timed it
        })
        save()
        log(_spec_verify_line(entry["verify"][-1]))

    if "verify" in opts.cases:
        if opts.verify_passes == 1:
            # one instance for every K: it drafts chains of the longest, and a request whose max_tokens
            # leaves room for one verify pass of K drafts just K (a pass drafts only what is left)
            _timed_runs(replay_cfg(max(ks), 0.0, fixed=True), index,
                        [(k + 2, opts.verify_tokens(k), (k + 1, 1)) for k in ks], each=lambda run: timed_chain(run, 0))
        else:
            for i, k in enumerate(ks):
                timed_chain(_timed_instance(replay_cfg(k, 0.0, fixed=True), index, k + 2, opts.verify_tokens(k),
                                            stop_after=(k + 1, opts.verify_passes)), i)
        measured = {v["draft_tokens"]: v["pass_s"] for v in entry["verify"] if v["pass_s"]}
        at = _at_draft_tokens(measured, VERIFY_GOAL_DRAFT_TOKENS)
        if at and plain_pass_s:
            entry["verify_goal"] = {"draft_tokens": VERIFY_GOAL_DRAFT_TOKENS, "pass_s": at[0], "how": at[1],
                                    "ratio_to_plain_pass": at[0] / plain_pass_s, "goal_ratio": VERIFY_GOAL_RATIO,
                                    "met": at[0] / plain_pass_s <= VERIFY_GOAL_RATIO}
            log(_spec_verify_goal_line(entry["verify_goal"]))
        else:
            log(f"(spec) replay goal at {VERIFY_GOAL_DRAFT_TOKENS} drafted tokens: not judged (the measured chains "
                f"{sorted(measured)} do not bracket it, or no 1-token pass was timed)")

    # (iii) end to end at controlled acceptance, then at each real drafter's traced passes
    k = opts.accept_draft_tokens
    draft_model = os.path.abspath(opts.draft_model) if opts.draft_model else None
    cases: list[tuple[str, float, dict | None]] = []
    if "controlled" in opts.cases:
        cases.append((f"acceptance length {opts.accept_length:g}", p_wrong_for_acceptance(k, opts.accept_length), None))
    if "wrong" in opts.cases:
        cases.append(("every draft wrong", 1.0, None))
    for i, trace_file in enumerate(opts.accept_traces):
        traced = _traced_replay(trace_file, out_dir / f"replay-trace-{i}.json",
                                done["prompt_tokens"] + done["tokens"], k)
        traced["run_tokens"] = opts.trace_run_tokens(i)  # the whole trace once (cycled if --spec-tokens is more)
        cases.append((f"trace {traced['label']}", 0.0, traced))
    for case, p_wrong, traced in cases:
        cfg = replay_cfg(k, p_wrong, draft_model)
        tokens = opts.accept_tokens
        if traced is not None:  # the trace's passes as they were: every pass asks for the whole budget
            cfg = replace(cfg, draft_replay=traced["replay_file"], draft_fixed=True).validate()
            tokens = traced["run_tokens"]
        run = _timed_instance(cfg, index, k + 2, tokens, plain_too=p_wrong == 1.0)
        spec = run["done"].get("speculation") or {}
        passes = [t for r, ts in run["pass_s_by_rows"].items() if r > 1 for t in ts]
        point = {
            "case": case, "draft_tokens": k, "p_wrong": p_wrong,
            "expected_length": sum((1 - p_wrong) ** i for i in range(1, k + 1)),
            "accepted_per_pass": spec.get("accepted_per_pass", 0.0), "verify_passes": spec.get("verify_passes", 0),
            "acceptance_rate": spec.get("acceptance_rate", 0.0),
            "tokens_per_s": run["tokens_per_s"], "client_tokens_per_s": run["client_tokens_per_s"],
            "pass_s": _mean(passes),
            "ratio_to_plain": run["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None,
            "draft_model": draft_model, "streamed_bytes_per_pass": run["streamed_bytes_per_pass"],
            "link_pass_s": run["streamed_bytes_per_pass"] / (link_gbps * GB) if link_gbps else None,
            "plan_tiers": run["plan_tiers"], "start_s": run["start_s"],
        }
        if traced is not None:
            point.update(p_wrong=None, expected_length=traced["expected_length"], trace=traced)
        if p_wrong == 1.0 and traced is None:  # judged against the same instance's plain request, run right after
            same = run["plain_tokens_per_s"]
            point.update(plain_same_instance_tokens_per_s=same,
                         ratio_to_plain_same_instance=run["tokens_per_s"] / same if same else None)
            judged = point["ratio_to_plain_same_instance"]
            point.update(goal=f">= {ALL_WRONG_GOAL_RATIO}x plain (the same instance's)",
                         met=judged is not None and judged >= ALL_WRONG_GOAL_RATIO)
        elif traced is None and opts.accept_length == ACCEPT_GOAL_LENGTH:
            point.update(goal=f">= {ACCEPT_GOAL_TOKENS_PER_S:g} tok/s (70B shape, 24 GiB, batch 1)",
                         met=run["tokens_per_s"] >= ACCEPT_GOAL_TOKENS_PER_S)
        entry["acceptance"].append(point)
        save()
        log(_spec_accept_line(point, plain["tokens_per_s"]))
    if opts.batch > 1:
        _spec_batch(entry, plain_cfg, replay_cfg, index, opts, opts.batch, draft_model, log, save)


def _traced_replay(trace_file: str, replay_file: Path, reference: list[int], k: int) -> dict[str, Any]:
    """A replay file of the bench's reference with ``trace_file``'s passes (written by
    scripts/draft_acceptance.py --trace-out: a real drafter on real text), and what that trace
    says: its label, passes, the acceptance length it had and has once cut to chains of ``k``
    (the replay cuts each pass to the budget), and the tokens a decode pass it gave."""
    trace = load_trace(trace_file, "--spec-accept-trace")
    if trace is None:
        raise ConfigError(f"--spec-accept-trace {trace_file}: holds no \"trace\" (write one with "
                          "scripts/draft_acceptance.py --trace-out)")
    doc = json.loads(Path(trace_file).read_text())
    write_references(replay_file, [reference], trace=trace)
    cut = [(min(d, k), min(a, d, k)) for d, a in trace]
    drafted = [a for d, a in cut if d > 0]
    return {"label": str(doc.get("label") or Path(trace_file).stem), "file": os.path.abspath(trace_file),
            "replay_file": str(replay_file), "passes": len(trace), "tokens": trace_tokens(trace, k),
            "source_acceptance_length": doc.get("acceptance_length"),
            "source_tokens_per_decode_pass": doc.get("tokens_per_decode_pass"),
            "expected_length": sum(drafted) / len(drafted) if drafted else 0.0,
            "expected_tokens_per_decode_pass": sum(a + 1 for _, a in cut) / len(cut)}


def _with_largest_pass(cfg: InstanceConfig, rows: int) -> InstanceConfig:
    """``cfg`` with the prompt chunk that makes its largest pass ``rows`` rows
    (``EngineOptions.largest_pass_rows``: the chunk beside the other sequences' decode rows), so
    that runs with and without drafts plan the same workspace."""
    if cfg.largest_pass_rows == rows:
        return cfg
    out = replace(cfg, prefill_chunk_tokens=rows - (cfg.max_batch - 1)).validate()
    if out.largest_pass_rows != rows:
        raise ValueError(f"no prompt chunk gives a largest pass of {rows} rows at batch {cfg.max_batch}")
    return out


def _spec_batch(entry: dict[str, Any], plain_cfg: InstanceConfig, replay_cfg, index: ModelIndex, opts: SpecOptions,
                batch: int, draft_model: str | None, log, save) -> None:
    """(iv) of ``run_spec``: ``batch`` concurrent greedy requests of the same prompt (so the one
    recording serves every sequence's replay), plain and speculative; each tree of its own
    sequence verified in the same pass. Tokens/s over all requests, after the last first token."""
    k = opts.accept_draft_tokens
    tokens = max(2, opts.accept_tokens // 2)
    runs = [("plain", None)] + [(case, p) for case, p in (
        (f"acceptance length {opts.accept_length:g}", p_wrong_for_acceptance(k, opts.accept_length)),
        ("every draft wrong", 1.0))]
    entry["batch"] = {"batch": batch, "tokens_per_request": tokens, "runs": []}
    plain_tps = None
    # the same workspace in every run (the replay's largest pass: a prompt chunk beside the other
    # sequences' chains), so that the same layers stream in all of them
    rows = replace(replay_cfg(k, 1.0, draft_model), max_batch=batch).validate().largest_pass_rows
    for case, p_wrong in runs:
        cfg = plain_cfg if p_wrong is None else replay_cfg(k, p_wrong, draft_model)
        cfg = _with_largest_pass(replace(cfg, max_batch=batch), rows)
        plan = plan_for(index, cfg)
        _start(cfg, plan)
        try:
            _, _, warm = _generate_concurrently(cfg.listen, batch, k + 2)  # warm-up: this batch's shapes compiled
            decode_s, n, timed = _generate_concurrently(cfg.listen, batch, tokens)
            st = _settled_status(cfg.name, sum(len(t) for t in warm + timed))  # compute's figures include them
        finally:
            instance.stop(cfg.name, force=True)
        tps = n / decode_s if decode_s > 0 else 0.0
        plain_tps = tps if p_wrong is None else plain_tps
        run = {"case": case, "p_wrong": p_wrong, "tokens_per_s": tps, "draft_model": draft_model if p_wrong is not None else None,
               "ratio_to_plain": tps / plain_tps if p_wrong is not None and plain_tps else None,
               "speculation": st.get("speculation"), "plan_tiers": {t: len(plan.layers_on(t)) for t in (VRAM, RAM, STORAGE)}}
        if p_wrong is not None:
            run.update(goal="at least plain batch speed", met=run["ratio_to_plain"] is not None and run["ratio_to_plain"] >= 1.0)
        entry["batch"]["runs"].append(run)
        save()
        line = f"(spec) batch {batch}, {case}{' (replay)' if p_wrong is not None else ''}: {tps:.3f} tok/s"
        if run["ratio_to_plain"] is not None:
            line += f" = {run['ratio_to_plain']:.2f}x plain batch {batch}"
            spec = run["speculation"] or {}
            if spec.get("accepted_per_pass") is not None:
                line += f"; accepted per verify pass {spec['accepted_per_pass']:.2f}"
        log(line)


def _link_gbps(limits: dict) -> float | None:
    """The host-to-device link's GB/s as the streamed layers cross it (host copy on cpu)."""
    return limits.get("h2d_shm_registered_gbps") or limits.get("host_copy_gbps")


def _ms(s: float | None) -> str:
    return f"{s * 1e3:.1f} ms" if s is not None else "n/a (no such pass on compute's clock)"


def _spec_plain_line(e: dict) -> str:
    s = (f"(spec) plain: {e['plain']['tokens_per_s']:.3f} tok/s, 1-token pass {_ms(e['plain']['pass_s'])} "
         f"(compute's clock, {e['plain']['n_passes']} passes)")
    if e.get("link_pass_s"):
        s += (f"; link limit {_ms(e['link_pass_s'])}/pass ({format_bytes(e['streamed_bytes_per_pass'])} at "
              f"{e['link_gbps']:.2f} GB/s)")
    return s + f"; reference of {e['reference_tokens']} tokens -> {e['replay_file']}"


def _spec_verify_line(v: dict) -> str:
    s = f"(spec) replay verify pass, chain of {v['draft_tokens']} drafted: {_ms(v['pass_s'])}"
    if v["ratio_to_plain_pass"]:
        s += f" = {v['ratio_to_plain_pass']:.3f}x a 1-token pass"
    if v["ratio_to_link_pass"]:
        s += f", {v['ratio_to_link_pass']:.3f}x the link limit"
    s += f" (timed passes: {v['n_passes']}; accepted per pass {v['accepted_per_pass']:.2f})"
    if v["p_wrong"] == 0.0 and v["accepted_per_pass"] < v["draft_tokens"]:
        # every draft is the recording's own greedy token, so a rejection means the target's
        # wide pass rounded differently from the one-row passes that recorded it (a near tie
        # of a synthetic model flips); once the sequence leaves its recording the replay has
        # nothing to draft, so only the passes before that are timed (the run is cancelled then)
        s += ("; the target left its recording: its passes of that many rows round differently from the "
              "one-row passes that recorded it (add --kernels batch-invariant=on to keep them the same bits)")
    return s


def _spec_verify_goal_line(g: dict) -> str:
    return (f"(spec) replay goal: a {g['draft_tokens']}-token verify pass <= {g['goal_ratio']}x a 1-token pass: "
            f"{_ms(g['pass_s'])} ({g['how']}) = {g['ratio_to_plain_pass']:.3f}x: {'met' if g['met'] else 'NOT met'}")


def _spec_accept_line(a: dict, plain_tokens_per_s: float) -> str:
    if a.get("trace"):
        t = a["trace"]
        run_tokens = t.get("run_tokens", t["tokens"])
        whole = "cycled" if run_tokens > t["tokens"] else "replayed whole"
        how = (f"{a['case']}, {t['passes']} passes of {t['tokens']} tokens {whole} in {run_tokens}; expected "
               f"{a['expected_length']:.2f}, {t['expected_tokens_per_decode_pass']:.2f} tokens a decode pass")
        s = f"(spec) replay K={a['draft_tokens']} ({how}): "
    else:
        s = (f"(spec) replay K={a['draft_tokens']} p={a['p_wrong']:.4f} ({a['case']}; "
             f"expected {a['expected_length']:.2f}): ")
    s += (f"{a['tokens_per_s']:.3f} tok/s, measured acceptance length {a['accepted_per_pass']:.2f} over "
         f"{a['verify_passes']} verify passes, {_ms(a['pass_s'])}/pass")
    if a.get("link_pass_s"):
        s += f" (link limit {_ms(a['link_pass_s'])})"
    if a["ratio_to_plain"] is not None:
        s += f"; plain {plain_tokens_per_s:.3f} tok/s -> {a['ratio_to_plain']:.2f}x"
    if a.get("ratio_to_plain_same_instance") is not None:
        s += (f"; the same instance's plain request {a['plain_same_instance_tokens_per_s']:.3f} tok/s -> "
              f"{a['ratio_to_plain_same_instance']:.2f}x")
    if a["draft_model"]:
        s += f"; draft model {os.path.basename(a['draft_model'])} run and ignored (target layers in VRAM: {a['plan_tiers']['vram']})"
    if "goal" in a:
        s += f"; goal {a['goal']}: {'met' if a['met'] else 'NOT met'}"
    return s


# ------------------------------------------------------------------------------ report
def chart(report: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    sc = [s for s in report["scenarios"] if "stages" in s]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["reader", "dma", "compute"]
    for s in sc:
        axes[0].bar([f"{s['label']}:{n}" for n in names], [s["stages"].get(n, {}).get("busy_gbps", 0) for n in names])
    axes[0].set_title("per-stage GB/s while busy")
    axes[0].tick_params(axis="x", rotation=60)
    labels, busy, starved, blocked = [], [], [], []
    for s in sc:
        for n in names:
            st = s["stages"].get(n, {})
            labels.append(f"{s['label']}:{n}")
            busy.append(st.get("busy_share", 0))
            starved.append(st.get("starved_share", 0))
            blocked.append(st.get("blocked_share", 0))
    axes[1].bar(labels, busy, label="busy")
    axes[1].bar(labels, starved, bottom=busy, label="starved")
    axes[1].bar(labels, blocked, bottom=[a + b for a, b in zip(busy, starved)], label="blocked")
    axes[1].legend()
    axes[1].set_title("share of active time")
    axes[1].tick_params(axis="x", rotation=60)
    all_sc = [s for s in report["scenarios"] if "tokens_per_s" in s]  # not spec's: its figures are per run
    axes[2].bar([s["label"] for s in all_sc], [s["tokens_per_s"] for s in all_sc])
    axes[2].set_yscale("log")
    axes[2].set_title("tokens/s (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def limit_tokens_per_s(s: dict, limits: dict, batch: int) -> float | None:
    """What the link or disk allows: batch / (streamed bytes per pass / bandwidth). With a cpu
    tier the two roads together: the bytes not resident over the link's and the host's read
    bandwidth summed (what the best split of them between the roads would reach)."""
    h2d = _link_gbps(limits)
    t = 0.0
    if s.get("storage_bytes_per_pass") and limits.get("disk_read_gbps"):
        t = max(t, s["storage_bytes_per_pass"] / (limits["disk_read_gbps"] * GB))
    if s.get("cpu_bytes_per_pass") and h2d and limits.get("host_read_gbps"):
        t = max(t, (s["cpu_bytes_per_pass"] + s.get("streamed_bytes_per_pass", 0))
                / ((h2d + limits["host_read_gbps"]) * GB))
    elif s.get("streamed_bytes_per_pass") and h2d:
        t = max(t, s["streamed_bytes_per_pass"] / (h2d * GB))
    return batch / t if t > 0 else None


# the scenarios whose figures are about layers streamed at (a)'s flags
STREAMING_SCENARIOS = {"a", "a512", "b", "c", "skip", "spec", "long", "ctx", "prefix"}


def nothing_streams(plan) -> str:
    """What a run whose plan streams nothing measures, and what makes layers stream."""
    n = len(plan.layers_on(VRAM))
    return (f"nothing streams: all {n} layers fit the --vram-budget of {format_bytes(plan.vram_budget)} "
            f"({plan.memory_name}), so every scenario times compute alone (busy all the time, the link unused); "
            f"to measure streaming pass --gpu-layers N with N below {n} (e.g. --gpu-layers {n // 2}: "
            f"{n - n // 2} layers stream), or a --vram-budget too small for every layer")


def run_bench(
    base: InstanceConfig, *, tokens: int, batch: int, scenarios: list[str], resident_model: str | None, out_dir: Path,
    log=print, spec: SpecOptions | None = None, skip_layers: list[int] | None = None,
    long_opts: tuple[int, int] = (16, 2000), ctx_prompt: int = 32000,
) -> dict[str, Any]:
    """Run the chosen scenarios; write bench.json (and bench.png) into ``out_dir``. ``base``: (a)'s
    instance (its model, backend, budgets, placement, kernels, address; ``batch`` sequences at
    most), which the other scenarios vary; ``spec``: the spec scenario's options (its defaults when
    None); ``skip_layers``: what the skip scenario, (a) without those layers, leaves out."""
    if "skip" in scenarios and not skip_layers:
        raise ConfigError("the skip scenario needs --skip-layers (a list, a calibrate profile, or PROFILE:N)")
    spec_opts = (spec or SpecOptions()).validate() if "spec" in scenarios else None
    out_dir.mkdir(parents=True, exist_ok=True)
    model, backend = base.model, base.backend
    index = open_model(model)
    if spec_opts is not None:
        spec_positions(spec_opts, index)  # before any scenario runs
    plan_a = plan_for(index, base)
    log(f"model {index.name}: {index.file_type}, {index.hparams.n_layers} layers, "
        f"{format_bytes(index.layer_bytes_total)} of layers; backend {backend}")
    limits = measure_copy_limits(backend)
    streamed = plan_a.streamed_layers
    if not streamed and set(scenarios) & STREAMING_SCENARIOS:
        log(nothing_streams(plan_a))
    limits.update(measure_disk(index, streamed[::-1] or list(range(index.hparams.n_layers))[::-1]))
    log("limits: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in limits.items()))
    report: dict[str, Any] = {"model": model, "backend": backend, "batch": batch, "tokens": tokens,
                              "limits": limits, "scenarios": []}
    if backend == "cuda":
        import cupy as cp

        p = cp.cuda.runtime.getDeviceProperties(0)
        report["device"] = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    results: dict[str, dict] = {}

    def save() -> None:  # partial results survive a cut-off run
        (out_dir / "bench.json").write_text(json.dumps(report, indent=2))

    for sc in scenarios:
        if sc == "spec":
            entry: dict[str, Any] = {"label": "spec"}
            report["scenarios"].append(entry)
            run_spec(entry, base, index, limits, spec_opts, out_dir, log, save)
            continue
        if sc in ("long", "ctx", "prefix"):
            entry = (run_long_contexts("long", base, index, long_opts[0], long_opts[1], tokens, log) if sc == "long"
                     else run_long_contexts("ctx", replace(base, max_batch=1), index, 1, ctx_prompt, tokens, log)
                     if sc == "ctx" else run_prefix_reuse("prefix", base, index, long_opts[1], 16, log))
            if sc != "prefix":
                h2d = _link_gbps(limits)
                entry["limit_tokens_per_s"] = (entry["sequences"] / (entry["streamed_bytes_per_pass"] / (h2d * GB))
                                               if h2d and entry["streamed_bytes_per_pass"] else None)
                entry["ratio_to_limit"] = (entry["tokens_per_s"] / entry["limit_tokens_per_s"]
                                           if entry["limit_tokens_per_s"] else None)
            report["scenarios"].append(entry)
            log(_kv_line(entry))
            save()
            continue
        if sc == "a":
            results["a"] = run_pipeline("a", base, index, tokens, batch, log)
        elif sc == "a512":
            cfg_512 = replace(base, ctx=BENCH_CTX, max_batch=max(batch, 1))
            results["a512"] = run_pipeline("a512", cfg_512, index, tokens, batch, log)
        elif sc == "skip":
            cfg_skip = replace(base, skip_layers=skip_layers)
            results["skip"] = run_pipeline("skip", cfg_skip, index, tokens, batch, log)
        elif sc == "b":
            cfg_b = replace(base, ram_budget=0)
            results["b"] = run_pipeline("b", cfg_b, index, tokens, batch, log)
        elif sc == "c":
            results["c"] = run_in_process("c", model, base, plan_a.layers_on(VRAM), tokens, batch, naive=True)
        elif sc == "d" and resident_model:
            results["d"] = run_in_process("d", resident_model, base, None, tokens, batch, naive=False)
        elif sc == "check":
            results["check"] = run_in_process("check", model, base, None, tokens, 1, naive=False)
        else:
            continue
        r = results[sc]
        lim = limit_tokens_per_s(r, limits, batch) if sc in ("a", "a512", "b", "c", "skip") else None
        r["limit_tokens_per_s"] = lim
        r["ratio_to_limit"] = r["tokens_per_s"] / lim if lim else None
        if sc == "d":
            copy = limits.get("d2d_copy_gbps")
            r["weight_gbps"] = r["weight_bytes_per_pass"] * r["tokens_per_s"] / batch / GB
            r["share_of_copy_bw"] = r["weight_gbps"] / copy if copy else None
        report["scenarios"].append(r)
        log(_line(r))
        save()
    if "a" in results and "a512" in results and results["a512"]["tokens_per_s"]:
        report["a_over_a512"] = results["a"]["tokens_per_s"] / results["a512"]["tokens_per_s"]
        log(f"(a) at the default flags / (a512) at --ctx {BENCH_CTX} --max-batch {max(batch, 1)}: "
            f"{report['a_over_a512']:.3f}")
    if "a" in results and "c" in results and results["c"]["tokens_per_s"]:
        report["a_over_c"] = results["a"]["tokens_per_s"] / results["c"]["tokens_per_s"]
        log(f"(a)/(c): {report['a_over_c']:.1f}x")
    if "a" in results and "skip" in results and results["a"]["tokens_per_s"]:
        report["skip_over_a"] = results["skip"]["tokens_per_s"] / results["a"]["tokens_per_s"]
        log(f"(skip)/(a): {report['skip_over_a']:.2f}x with {len(skip_layers)} of {index.hparams.n_layers} layers skipped")
    if "a" in results and "check" in results:
        n = min(len(results["a"]["tokens"]), len(results["check"]["tokens"]))
        report["greedy_equal"] = results["a"]["tokens"][:n] == results["check"]["tokens"][:n]
        log(f"greedy tokens of (a) equal the all-resident run: {report['greedy_equal']}")
    save()
    problem = chart(report, out_dir / "bench.png")
    if problem:
        log(problem)
    return report


def _kv_line(r: dict) -> str:
    """A KV-memory scenario's figures on one line (long contexts, one long sequence, prefix reuse)."""
    if r["label"] == "prefix":
        return (f"(prefix) first token with a cached {r['prefix_tokens']}-token prefix and {r['new_tokens']} new tokens "
                f"{r['first_token_reused_s']:.3f} s, a {r['new_tokens']}-token prompt {r['first_token_short_s']:.3f} s "
                f"({r['reused_over_short']:.2f}x), cold {r['first_token_cold_s']:.3f} s; "
                f"prefix hit tokens {r['prefix_hit_tokens']}")
    s = (f"({r['label']}) {r['sequences']} x {r['prompt_tokens']}-token prompts: {r['completed']}/{r['sequences']} "
         f"completed in {r['total_s']:.1f} s; decode {r['tokens_per_s']:.3f} tok/s, {r['pass_s'] * 1e3:.1f} ms/pass")
    if r.get("limit_tokens_per_s"):
        s += f"; limit for the plan in force {r['limit_tokens_per_s']:.3f} tok/s ({100 * r['ratio_to_limit']:.1f}%)"
    s += (f"; {len(r['demoted_layers'])} layers demoted for the KV cache, "
          f"{format_bytes(r['streamed_bytes_per_pass'])} of layers over the link per pass, KV "
          f"{format_bytes(r['kv_bytes_in_vram'])} in VRAM (none over the link)")
    return s


def _line(r: dict) -> str:
    s = f"({r['label']}) {r['tokens_per_s']:.3f} tok/s, {r['pass_s'] * 1e3:.1f} ms/pass"
    if r.get("streamed_bytes_per_pass") == 0 and r["label"] not in ("d", "check"):  # those are all resident
        s += "; nothing streamed (every layer resident)"
    if r.get("skipped_layers"):
        s += (f"; {len(r['skipped_layers'])} layers skipped ({layer_ranges(r['skipped_layers'])}), "
              f"{format_bytes(r['skipped_bytes_per_pass'])} per pass never read nor copied")
    if r.get("cpu_bytes_per_pass"):
        tiers = r.get("plan_tiers", {})
        s += (f"; cpu tier {tiers.get(CPU, '?')} layers ({format_bytes(r['cpu_bytes_per_pass'])} a pass on the host) "
              f"beside {tiers.get(RAM, 0) + tiers.get(STORAGE, 0)} streamed ({format_bytes(r['streamed_bytes_per_pass'])})")
        if r.get("cpu_tier"):
            s += f", host {r['cpu_tier']['busy_gbps']:.1f} GB/s while busy"
    if r.get("host_rates"):
        h = r["host_rates"]
        s += (f"; sized by link {h['link_gbps']:.1f} GB/s, cores {h['cpu_gbps']:.1f} alone"
              + (f" / {h['cpu_beside_link_gbps']:.1f} beside the link" if h.get("cpu_beside_link_gbps") else "")
              + f": {h['predicted_pass_s'] * 1e3:.0f} ms a pass predicted")
    if r.get("limit_tokens_per_s"):
        s += f"; limit {r['limit_tokens_per_s']:.3f} tok/s ({100 * r['ratio_to_limit']:.1f}%)"
        if r.get("cpu_bytes_per_pass"):
            s += " (link + host read bandwidth)"
    if r.get("share_of_copy_bw") is not None:
        s += f"; weights {r['weight_gbps']:.0f} GB/s = {100 * r['share_of_copy_bw']:.1f}% of copy bandwidth"
    for name, st in r.get("stages", {}).items():
        s += (f"\n    {name:8s} busy {100 * st['busy_share']:5.1f}%  starved {100 * st['starved_share']:5.1f}%  "
              f"blocked {100 * st['blocked_share']:5.1f}%  {st['busy_gbps']:.2f} GB/s busy")
    if r.get("stages"):
        s += f"\n    (over {next(iter(r['stages'].values())).get('n_passes', '?')} decode passes) bottleneck: {r['bottleneck']}"
    if r.get("status_bottleneck"):
        s += f"; ntxctl status names: {r['status_bottleneck']}"
    return s
