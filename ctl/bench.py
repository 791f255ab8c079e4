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
    different tiers), when it fits.

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
from pathlib import Path
from typing import Any

import numpy as np

from ntx.ctl import instance
from ntx.ctl.client import Client
from ntx.daemons.compute.backend import plan_for
from ntx.daemons.compute.model import FileLayerStream
from ntx.shared.config import InstanceConfig, format_bytes
from ntx.shared.gguf_index import ModelIndex, open_model
from ntx.shared.plan import RAM, STORAGE, VRAM
from ntx.shared.stats import bottleneck, combine, summarize

GB = 1e9
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

    from ntx.daemons.compute.cuda.copy_bandwidth import device_copy_gbps
    from ntx.shared.shm import ShmSegment

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
    buf = aligned_empty(max(index.layers[i].slot_bytes for i in layers))  # one slot, as the reader fills
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


def _generate_concurrently(listen: str, batch: int, tokens: int) -> tuple[float, int, list[list[int]]]:
    """``batch`` greedy requests at once; returns (decode seconds, tokens generated, tokens of each)."""
    results: list[list[int]] = [None] * batch  # type: ignore[list-item]
    firsts: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        with Client(listen, event_timeout_s=600) as c:
            toks = []
            for ev in c.generate(PROMPT, raw=True, temperature=0.0, max_tokens=tokens):
                if ev["type"] == "token":
                    if not toks:
                        with lock:
                            firsts.append(time.perf_counter())
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


def run_pipeline(label: str, cfg: InstanceConfig, index: ModelIndex, tokens: int, batch: int, log) -> dict[str, Any]:
    plan = plan_for(index, cfg)
    log(f"({label}) plan: " + "; ".join(plan.describe()[:3]))
    t0 = time.perf_counter()
    instance.start(cfg, plan)
    start_s = time.perf_counter() - t0
    try:
        _generate_concurrently(cfg.listen, batch, 2)  # warm-up: kernels compiled, decode graph captured
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
        "label": label, "plan_tiers": {t: len(plan.layers_on(t)) for t in (VRAM, RAM, STORAGE)},
        "streamed_bytes_per_pass": plan.streamed_bytes_per_pass, "ram_bytes_per_pass": plan.ram_layer_bytes,
        "storage_bytes_per_pass": plan.storage_layer_bytes, "start_s": round(start_s, 2),
        "tokens_per_s": n / decode_s if decode_s > 0 else 0.0, "pass_s": decode_s / passes if passes else 0.0,
        "stages": stages, "stages_whole_window": _stage_delta(before, after),
        "bottleneck": bottleneck({k: {"recent": v} for k, v in stages.items()}),
        "status_bottleneck": after.get("bottleneck"), "status": after, "tokens": toks[0],
    }


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


def run_in_process(label: str, model: str, backend: str, resident: list[int] | None, tokens: int, batch: int,
                   naive: bool) -> dict[str, Any]:
    from ntx.daemons.compute.engine import Request
    from ntx.daemons.compute.factory import build_engine
    from ntx.daemons.compute.sampler import SamplingParams

    index = open_model(model)
    stream = _MmapPageableStream(index) if naive else None
    t0 = time.perf_counter()
    eng = build_engine(index, backend, resident_layers=resident, stream=stream, max_batch=max(batch, 1), max_context=512)
    load_s = time.perf_counter() - t0
    ids = eng.prompt_tokens(prompt=PROMPT, raw=True)
    if not naive:  # compile kernels and capture the decode graphs before timing
        eng.submit(Request(f"{label}-warmup", ids, SamplingParams(temperature=0.0, max_tokens=3)))
        while eng.has_work:
            eng.step()
    for i in range(batch):
        eng.submit(Request(f"{label}{i}", ids, SamplingParams(temperature=0.0, max_tokens=tokens)))
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
    all_sc = report["scenarios"]
    axes[2].bar([s["label"] for s in all_sc], [s["tokens_per_s"] for s in all_sc])
    axes[2].set_yscale("log")
    axes[2].set_title("tokens/s (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def limit_tokens_per_s(s: dict, limits: dict, batch: int) -> float | None:
    """What the link or disk allows: batch / (streamed bytes per pass / bandwidth)."""
    h2d = limits.get("h2d_shm_registered_gbps") or limits.get("host_copy_gbps")
    t = 0.0
    if s.get("storage_bytes_per_pass") and limits.get("disk_read_gbps"):
        t = max(t, s["storage_bytes_per_pass"] / (limits["disk_read_gbps"] * GB))
    if s.get("streamed_bytes_per_pass") and h2d:
        t = max(t, s["streamed_bytes_per_pass"] / (h2d * GB))
    return batch / t if t > 0 else None


def run_bench(
    model: str, *, backend: str, vram_budget: int | None, gpu_layers: int | None, ram_budget: int | None,
    tokens: int, batch: int, scenarios: list[str], resident_model: str | None, out_dir: Path, listen: str, log=print,
) -> dict[str, Any]:
    """Run the chosen scenarios; write bench.json (and bench.png) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    index = open_model(model)
    base = InstanceConfig(model=os.path.abspath(model), name="bench", backend=backend, listen=listen,
                          vram_budget=vram_budget, ram_budget=ram_budget, max_vram_layers=gpu_layers,
                          max_batch=max(batch, 1), max_context=512).validate()
    plan_a = plan_for(index, base)
    log(f"model {index.name}: {index.file_type}, {index.hparams.n_layers} layers, "
        f"{format_bytes(index.layer_bytes_total)} of layers; backend {backend}")
    limits = measure_copy_limits(backend)
    streamed = plan_a.streamed_layers
    limits.update(measure_disk(index, streamed[::-1] or list(range(index.hparams.n_layers))[::-1]))
    log("limits: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in limits.items()))
    report: dict[str, Any] = {"model": model, "backend": backend, "batch": batch, "tokens": tokens,
                              "limits": limits, "scenarios": []}
    if backend == "cuda":
        import cupy as cp

        p = cp.cuda.runtime.getDeviceProperties(0)
        report["device"] = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    results: dict[str, dict] = {}
    for sc in scenarios:
        if sc == "a":
            results["a"] = run_pipeline("a", base, index, tokens, batch, log)
        elif sc == "b":
            cfg_b = InstanceConfig(**{**base.to_dict(), "ram_budget": 0})
            results["b"] = run_pipeline("b", cfg_b, index, tokens, batch, log)
        elif sc == "c":
            results["c"] = run_in_process("c", model, backend, plan_a.layers_on(VRAM), tokens, batch, naive=True)
        elif sc == "d" and resident_model:
            results["d"] = run_in_process("d", resident_model, backend, None, tokens, batch, naive=False)
        elif sc == "check":
            results["check"] = run_in_process("check", model, backend, None, tokens, 1, naive=False)
        else:
            continue
        r = results[sc]
        lim = limit_tokens_per_s(r, limits, batch) if sc in ("a", "b", "c") else None
        r["limit_tokens_per_s"] = lim
        r["ratio_to_limit"] = r["tokens_per_s"] / lim if lim else None
        if sc == "d":
            copy = limits.get("d2d_copy_gbps")
            r["weight_gbps"] = r["weight_bytes_per_pass"] * r["tokens_per_s"] / batch / GB
            r["share_of_copy_bw"] = r["weight_gbps"] / copy if copy else None
        report["scenarios"].append(r)
        log(_line(r))
        (out_dir / "bench.json").write_text(json.dumps(report, indent=2))  # partial results survive a cut-off run
    if "a" in results and "c" in results and results["c"]["tokens_per_s"]:
        report["a_over_c"] = results["a"]["tokens_per_s"] / results["c"]["tokens_per_s"]
        log(f"(a)/(c): {report['a_over_c']:.1f}x")
    if "a" in results and "check" in results:
        n = min(len(results["a"]["tokens"]), len(results["check"]["tokens"]))
        report["greedy_equal"] = results["a"]["tokens"][:n] == results["check"]["tokens"][:n]
        log(f"greedy tokens of (a) equal the all-resident run: {report['greedy_equal']}")
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    problem = chart(report, out_dir / "bench.png")
    if problem:
        log(problem)
    return report


def _line(r: dict) -> str:
    s = f"({r['label']}) {r['tokens_per_s']:.3f} tok/s, {r['pass_s'] * 1e3:.1f} ms/pass"
    if r.get("limit_tokens_per_s"):
        s += f"; limit {r['limit_tokens_per_s']:.3f} tok/s ({100 * r['ratio_to_limit']:.1f}%)"
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
