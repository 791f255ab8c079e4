#!/usr/bin/env python3
"""Benchmark the production CUDA kernels against the device's measured copy bandwidth.

Measures in one run: device-to-device copy bandwidth (probes.device_copy_gbps, bytes read +
written per second), then the matvec production takes (the i16 product for the block-quantized
types, its quantize-x launch included; the f32 one for F16) as weight bytes per second for the
Llama-3-8B shapes per type at B = 1 and B = 8, at the device table's launch, plus attention,
rope, dequantization, the cuBLAS path and sampling. Each timing replays a CUDA graph of
back-to-back launches that cycle over enough copies of the weights (>= 512 MiB) that the 50 MB
L2 cannot serve them, timed with CUDA events. Prints a table with % of copy bandwidth and writes
JSON. The variants and launch configurations behind the table are swept by
dev/cuda/bench_gemm_paths.py; the measurements are in docs/PERFORMANCE.md, "Kernel tuning".

    python scripts/bench_kernels.py [--out bench.json]
    python scripts/bench_kernels.py --attention [--out attn.json]   # decode attention and rope only
    python scripts/bench_kernels.py --precompile --jobs 16   # fill cupy's kernel cache in parallel
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.cuda import instances
from ntx.daemons.compute.probes import device_copy_gbps
from ntx.shared.quant_types import quant_type, row_nbytes

TYPES = ["Q4_K", "Q6_K", "Q8_0", "F16"]
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]


def _rt():
    """The kernel families, the KV pages and a standalone KernelContext (cupy imported on call)."""
    from ntx.daemons.compute.cuda import attention, dequant, gemm, matvec, norm_rope_kv, runtime, selection
    from ntx.daemons.compute.cuda.kv_pages import KvPages

    return dict(A=attention, DQ=dequant, G=gemm, MV=matvec, N=norm_rope_kv, S=selection, rt=runtime, KvPages=KvPages,
                CTX=runtime.standalone())


def precompile_specs():
    """Every module production compiles (instances.production, every device entry), as
    (source, name expressions) of runtime.module."""
    return [(source, names) for source, modules in instances.production().items() for names in modules]


def _compile_spec(spec):
    from ntx.daemons.compute.cuda import runtime

    t0 = time.perf_counter()
    runtime.module(spec[0], spec[1])
    return time.perf_counter() - t0


def precompile(jobs: int) -> None:
    import multiprocessing as mp
    specs = precompile_specs()
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(jobs) as pool:
        times = pool.map(_compile_spec, specs, chunksize=1)
    print(f"precompiled {len(specs)} modules in {time.perf_counter() - t0:.1f} s "
          f"(sum of compile times {sum(times):.1f} s, max {max(times):.1f} s)")


def random_raw(cp, qt, n_rows, n_cols, rng):
    """Random valid GGUF bytes built on the device (random bytes, finite f16 scale fields)."""
    rb = row_nbytes(qt, n_cols)
    if qt == QT.F16:
        return (cp.random.standard_normal((n_rows, n_cols), dtype=cp.float32) * 0.5).astype(cp.float16).view(cp.uint8).reshape(-1)
    ts = GGML_QUANT_SIZES[qt][1]
    nb = n_rows * rb // ts
    blocks = cp.random.randint(0, 256, size=(nb, ts), dtype=cp.int32).astype(cp.uint8)
    fields = {QT.Q4_K: (0, 2), QT.Q6_K: (208,), QT.Q8_0: (0,)}[qt]
    for off in fields:
        sc = (cp.random.uniform(0.002, 0.05, size=nb, dtype=cp.float32)).astype(cp.float16)
        blocks[:, off:off + 2] = sc.view(cp.uint8).reshape(nb, 2)
    return blocks.reshape(-1)


def time_graph(cp, launch_fns, reps: int) -> float:
    """Seconds per launch of a CUDA graph made of launch_fns (each enqueues one kernel)."""
    cp.cuda.Device().synchronize()  # inputs were written on the legacy stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for f in launch_fns[:2]:
            f(s)
        s.synchronize()
        s.begin_capture()
        for f in launch_fns:
            f(s)
        g = s.end_capture()
        g.launch(stream=s)
        s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(reps):
            g.launch(stream=s)
        e1.record(s)
        e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) / 1e3 / (reps * len(launch_fns))


def bench_matvec(cp, R):
    """The matvec production takes per type, shape and B (its launch from the device's table;
    the i16 product's time includes its quantize-x launch)."""
    rng = np.random.default_rng(0)
    results = []
    for tname in TYPES:
        qt = QT[tname]
        for (n_rows, n_cols) in SHAPES:
            raw0 = random_raw(cp, qt, n_rows, n_cols, rng)
            nbytes = raw0.size
            copies = max(2, min(256, -(-(512 << 20) // nbytes)))
            big = cp.empty(copies * nbytes, dtype=cp.uint8)
            for c in range(copies):
                big[c * nbytes:(c + 1) * nbytes] = raw0
            views = [R["G"].weight(big[c * nbytes:(c + 1) * nbytes], qt, n_rows, n_cols) for c in range(copies)]
            for B in (1, 8):
                x = cp.random.standard_normal((B, n_cols), dtype=cp.float32)
                out = cp.empty((B, n_rows), dtype=cp.float32)
                fns = [(lambda s, v=v: R["MV"].matvec(R["CTX"], v, x, out=out, stream=s)) for v in views]
                reps = max(3, int(0.02 / max(1e-6, nbytes / 3e12) / copies))
                t = time_graph(cp, fns, min(reps, 200))
                product = "i16" if quant_type(qt).dp4a else "f32"
                launch = R["rt"].tuning().i16(qt, B) if product == "i16" else R["rt"].tuning().mv(qt, B)
                results.append({"type": tname, "n_rows": n_rows, "n_cols": n_cols, "B": B, "bytes": nbytes,
                                "copies": copies, "product": product, "config": list(launch), "us": t * 1e6,
                                "gbps": nbytes / t / 1e9})
                print(f"  {tname:5s} {n_rows:6d}x{n_cols:<6d} B={B}  {product} {list(launch)}: {nbytes / t / 1e9:6.0f} GB/s",
                      flush=True)
            del big, views
    return results


def kv_pages(R, n_rows, n_kv, max_ctx, hd, rng, random=True):
    """One layer of KV pages for ``n_rows`` sequences of ``max_ctx`` positions, every page at a
    random place of the pool (as sequences that grew side by side hold them), keys and values
    random f16 (``random``) or zero."""
    shape = (1, n_rows, n_kv, max_ctx, hd)
    if random:
        ck = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
        cv = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    else:
        ck = cv = np.zeros(shape, dtype=np.float16)
    return R["KvPages"].from_dense(ck, cv, rng)


def bench_attention(cp, R):
    """Decode attention and rope, 8B-shaped (32 heads, n_kv 8, G 4, hd 128), over KV pages of
    4096 positions per sequence (the splits sized for it, as the engine runs): 1 and 8 sequences
    at 64, 512 and 4096 cached keys, a causal 512-token prefill; rope of q and k in one launch
    for 1 and 512 tokens."""
    res = {}
    n_kv, G, hd, max_ctx = 8, 4, 128, 4096
    rng = np.random.default_rng(0)
    for T in (1, 8):
        kv = kv_pages(R, T, n_kv, max_ctx, hd, rng)
        q = cp.random.standard_normal((T, n_kv * G, hd), dtype=cp.float32)
        slots = cp.arange(T, dtype=cp.int32)
        S = R["A"].attention_splits(T, n_kv, max_ctx)
        ws = R["A"].attention_workspace(T, n_kv * G, hd, S)
        out = cp.empty_like(q)
        for L in (64, 512, max_ctx):
            lens = cp.full(T, L, dtype=cp.int32)
            t = time_graph(cp, [lambda s: R["A"].attention(R["CTX"], q, kv, 0, slots, lens, out=out, n_splits=S,
                                                           workspace=ws, stream=s)] * 20, 20)
            kvb = 2 * T * n_kv * L * hd * 2
            res[f"attention_decode_T{T}_L{L}"] = {"us": t * 1e6, "kv_gbps": kvb / t / 1e9, "n_splits": S}
            print(f"  attention decode T={T} L={L} (cache {max_ctx}): {t * 1e6:.1f} us, KV read {kvb / t / 1e9:.0f} GB/s "
                  f"(splits {S})")
        del kv
    # prefill attention: 512 queries, causal, after 0 cached
    T = 512
    kv = kv_pages(R, 1, n_kv, 4096, hd, rng, random=False)
    q = cp.random.standard_normal((T, n_kv * G, hd), dtype=cp.float32)
    slots = cp.zeros(T, dtype=cp.int32)
    lens = cp.arange(1, T + 1, dtype=cp.int32)
    out = cp.empty_like(q)
    S = R["A"].attention_splits(T, n_kv, 4096)
    ws = R["A"].attention_workspace(T, n_kv * G, hd, S)
    t = time_graph(cp, [lambda s: R["A"].attention(R["CTX"], q, kv, 0, slots, lens, out=out, n_splits=S, workspace=ws,
                                                   stream=s)] * 5, 5)
    flops = 4 * n_kv * G * hd * (T * (T + 1) / 2)
    res["attention_prefill_T512"] = {"us": t * 1e6, "tflops": flops / t / 1e12}
    print(f"  attention prefill T=512 causal: {t * 1e6:.1f} us ({flops / t / 1e12:.2f} TFLOP/s)")
    for T in (1, 512):
        q = cp.random.standard_normal((T, n_kv * G, hd), dtype=cp.float32)
        k = cp.random.standard_normal((T, n_kv, hd), dtype=cp.float32)
        pos = cp.arange(T, dtype=cp.int32)
        ff = cp.random.uniform(1.0, 8.0, hd // 2, dtype=cp.float32)
        t = time_graph(cp, [lambda s: R["N"].rope_qk_inplace(R["CTX"], q, k, pos, hd, 500000.0, ff, stream=s)] * 20, 20)
        res[f"rope_qk_T{T}"] = {"us": t * 1e6}
        print(f"  rope q+k T={T} (32 + 8 heads, hd {hd}): {t * 1e6:.1f} us")
    return res


def bench_other(cp, R):
    res = bench_attention(cp, R)
    # dequantize Q4_K 14336x4096 to f16, and gemm T=512
    qt = QT.Q4_K
    raw = random_raw(cp, qt, 14336, 4096, np.random.default_rng(1))
    wq = R["G"].weight(raw, qt, 14336, 4096)
    w16 = cp.empty((14336, 4096), dtype=cp.float16)
    t = time_graph(cp, [lambda s: R["DQ"].dequantize_f16(R["CTX"], wq, out=w16, stream=s)] * 10, 10)
    res["dequantize_f16_Q4_K_14336x4096"] = {"us": t * 1e6, "gbps_rw": (raw.size + w16.nbytes) / t / 1e9}
    print(f"  dequantize_f16 Q4_K 14336x4096: {t * 1e6:.1f} us ({(raw.size + w16.nbytes) / t / 1e9:.0f} GB/s read+write)")
    x = cp.random.standard_normal((512, 4096), dtype=cp.float32)
    outg = cp.empty((512, 14336), dtype=cp.float32)
    R["G"].gemm(R["CTX"], wq, x, out=outg)
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(10):
        R["G"].gemm(R["CTX"], wq, x, out=outg)
    e1.record()
    e1.synchronize()
    t = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 10
    res["gemm_Q4_K_T512_14336x4096"] = {"us": t * 1e6, "tflops": 2 * 512 * 14336 * 4096 / t / 1e12}
    print(f"  gemm Q4_K T=512 14336x4096 (dequant + cuBLAS f16): {t * 1e6:.1f} us ({2 * 512 * 14336 * 4096 / t / 1e12:.1f} TFLOP/s)")
    # sampling on a 128256 vocabulary
    for B in (1, 8):
        lg = cp.random.standard_normal((B, 128256), dtype=cp.float32)
        ids = cp.empty(B, dtype=cp.int32)
        t = time_graph(cp, [lambda s: R["S"].argmax(R["CTX"], lg, out=ids, stream=s)] * 20, 20)
        res[f"argmax_B{B}"] = {"us": t * 1e6}
        v = cp.empty((B, 64), dtype=cp.float32)
        i = cp.empty((B, 64), dtype=cp.int32)
        t2 = time_graph(cp, [lambda s: R["S"].topk(R["CTX"], lg, 64, values=v, ids=i, stream=s)] * 20, 20)
        res[f"topk64_B{B}"] = {"us": t2 * 1e6}
        print(f"  sampling V=128256 B={B}: argmax {t * 1e6:.1f} us, top-64 {t2 * 1e6:.1f} us")
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench.json"))
    ap.add_argument("--quick", action="store_true", help="accepted for scripts/device_check.sh; the run is one size")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--attention", action="store_true", help="only decode attention and rope (bench_attention)")
    a = ap.parse_args()
    if a.precompile:
        precompile(a.jobs)
        return 0
    import cupy as cp
    R = _rt()
    props = cp.cuda.runtime.getDeviceProperties(0)
    dev = {"name": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
           "sms": props["multiProcessorCount"], "l2_bytes": props["l2CacheSize"],
           "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion()}
    print("device:", dev)
    copy_bw = device_copy_gbps() * 1e9
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    t0 = time.perf_counter()
    if a.attention:
        res = {"device": dev, "copy_gbps": copy_bw / 1e9, "attention": bench_attention(cp, R),
               "seconds": time.perf_counter() - t0}
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.out)
        return 0
    mv = bench_matvec(cp, R)
    other = bench_other(cp, R)
    copy_bw2 = device_copy_gbps() * 1e9
    print(f"device-to-device copy again: {copy_bw2 / 1e9:.0f} GB/s")
    print()
    print(f"matvec, weight bytes / time, vs copy bandwidth {copy_bw / 1e9:.0f} GB/s (graph replay, L2-cold); "
          "i16 times include its quantize-x launch")
    print(f"{'type':5s} {'shape':>12s} {'B':>2s} {'MB':>6s} | {'product':>7s} {'config':>10s} {'GB/s':>6s} {'%':>5s}")
    for r in mv:
        print(f"{r['type']:5s} {r['n_rows']:>5d}x{r['n_cols']:<6d} {r['B']:>2d} {r['bytes'] / 1e6:6.1f} | "
              f"{r['product']:>7s} {str(r['config']):>10s} {r['gbps']:6.0f} {100 * r['gbps'] * 1e9 / copy_bw:5.1f}")
    res = {"device": dev, "copy_gbps": copy_bw / 1e9, "copy_gbps_end": copy_bw2 / 1e9, "matvec": mv, "other": other,
           "seconds": time.perf_counter() - t0}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
