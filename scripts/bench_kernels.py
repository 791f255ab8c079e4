#!/usr/bin/env python3
"""Benchmark the CUDA kernels against the device's measured copy bandwidth.

Measures in one run: device-to-device copy bandwidth (copy_bandwidth.device_copy_gbps, bytes
read + written per second), then matvec bandwidth (weight bytes per second) for the Llama-3-8B
shapes per type at B = 1 and B = 8 for both variants, f32 ("v1"/"v2") and int8-activation "dp4a" (its time includes
the quantize-x launch), sweeping launch configurations (--quick: a few), plus a few other kernels. Each timing replays a
CUDA graph of back-to-back launches that cycle over enough copies of the weights (>= 512 MiB) that
the 50 MB L2 cannot serve them, timed with CUDA events. Prints a table with % of copy bandwidth
and writes JSON. The figures behind each launch choice are kept in daemons/compute/cuda/tuning.py.

    python scripts/bench_kernels.py [--out bench.json] [--quick]
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

from ntx.daemons.compute.cuda import tuning
from ntx.daemons.compute.cuda.copy_bandwidth import device_copy_gbps
from ntx.shared.quant_types import QUANT_TYPES, quant_type

TYPES = ["Q4_K", "Q6_K", "Q8_0", "F16"]
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]
# (rows per CTA, warps per CTA, pieces per lane per trip)
SWEEP = [(nr, nw, u) for nr in (1, 2, 4) for u in (1, 2) for nw in (4, 8)]
QUICK_SWEEP = [(1, 4, 2), (2, 4, 2), (4, 4, 1)]
QUICK_SWEEP_DP4A = [(1, 4, 1), (4, 4, 1), (2, 8, 1), (2, 4, 2)]


def _k():
    from ntx.daemons.compute.cuda import kernels as K
    return K


def precompile_specs():
    """The modules that the default launches of every device entry in tuning.py and this
    benchmark's sweeps need, as (file, name expressions) of kernels._module."""
    K = _k()
    tunings = list(tuning.TUNINGS.values())
    mv_default = {(nr, u) for t in tunings for nr, _, u in t.all_mv_launches()}
    mvq_default = {(nr, u) for t in tunings for nr, _, u in t.all_mvq_launches()}
    sweep = {(c[0], c[2]) for c in SWEEP}
    benched = {QT[t] for t in TYPES}
    specs = []
    for q in QUANT_TYPES.values():
        for cut in q.cuts:
            cfgs = mv_default | (sweep if q.qtype in benched else set())
            for nr, u in sorted(cfgs):
                specs.append(("quant.cu", K._mv_names(q.qtype, cut, nr, u)))
            specs.append(("quant.cu", K._deq_names(q.qtype, cut)))
        # dp4a variant: defaults for every type it exists for, the sweep for the benchmarked ones
        if q.dp4a:
            cfgs = mvq_default | ({(c[0], c[2]) for c in SWEEP + QUICK_SWEEP_DP4A} if q.qtype in benched else set())
            for nr, u in sorted(cfgs):
                specs.append(("quant.cu", K._mvq_names(q.qtype, nr, u)))
            for nr, u in sorted(mvq_default):
                specs.append(("quant.cu", K._mvq2_names(q.qtype, nr, u)))
        for cut, _, _ in q.mm_cuts:  # the tensor-core matmul
            specs.append(("quant.cu", K._mm_names(q.qtype, cut)))
        if q.mm_staged:
            specs.append(("quant.cu", K._mms_names(q.qtype)))
            for mt in tuning.MMQ_TILES_PER_WARP:  # the int8 tensor-core matmul
                specs.append(("quant.cu", K._mmq_names(q.qtype, mt)))
    specs.append(("quant.cu", ()))  # quantize_x_kernel, mm_split_x_kernel
    specs.append(("ops.cu", ()))
    for g in (1, 3, 4, 8):
        for hd in (64, 128):
            specs.append(("ops.cu", K._attn_names(g, hd)))
    return list(dict.fromkeys(specs))


def _compile_spec(spec):
    K = _k()
    t0 = time.perf_counter()
    K._module(spec[0], spec[1])
    return time.perf_counter() - t0


def precompile(jobs: int) -> None:
    import multiprocessing as mp
    specs = precompile_specs()
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(jobs) as pool:
        times = pool.map(_compile_spec, specs, chunksize=1)
    print(f"precompiled {len(specs)} modules in {time.perf_counter() - t0:.1f} s "
          f"(sum of compile times {sum(times):.1f} s, max {max(times):.1f} s)")


def random_raw(cp, K, qt, n_rows, n_cols, rng):
    """Random valid GGUF bytes built on the device (random bytes, finite f16 scale fields)."""
    rb = K.row_bytes(qt, n_cols)
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


def bench_matvec(cp, K, quick: bool):
    """Both variants per shape and B: f32 ("v1"/"v2", the default config and a sweep) and "dp4a"
    (int8 activations; its time includes the quantize-x kernel that each call launches)."""
    rng = np.random.default_rng(0)
    results = []
    sweep = SWEEP if not quick else QUICK_SWEEP
    sweep_q = SWEEP if not quick else QUICK_SWEEP_DP4A
    for tname in TYPES:
        qt = QT[tname]
        has_dp4a = quant_type(qt).dp4a
        for (n_rows, n_cols) in SHAPES:
            raw0 = random_raw(cp, K, qt, n_rows, n_cols, rng)
            nbytes = raw0.size
            copies = max(2, min(256, -(-(512 << 20) // nbytes)))
            big = cp.empty(copies * nbytes, dtype=cp.uint8)
            for c in range(copies):
                big[c * nbytes:(c + 1) * nbytes] = raw0
            views = [big[c * nbytes:(c + 1) * nbytes] for c in range(copies)]
            for B in (1, 8):
                x = cp.random.standard_normal((B, n_cols), dtype=cp.float32)
                out = cp.empty((B, n_rows), dtype=cp.float32)
                ref = K.matvec(views[0], qt, n_rows, n_cols, x, variant="v1").copy()
                default_cfg = K._tuning().mv(qt, B)
                has_v2 = "v2" in quant_type(qt).cuts
                runs = [("v1", default_cfg)] + [(("v2" if has_v2 else "v1"), c) for c in sweep]
                if has_v2:
                    runs.insert(1, ("v2", default_cfg))
                if has_dp4a:
                    ref_q = K.matvec(views[0], qt, n_rows, n_cols, x, variant="dp4a").copy()
                    qcfg = K._tuning().mvq(qt, B)
                    runs += [("dp4a", qcfg)] + [("dp4a", c) for c in sweep_q]
                runs = list(dict.fromkeys(runs))
                rows = []
                cp.cuda.Device().synchronize()
                for var, cfg in runs:
                    out.fill(cp.nan)
                    K.matvec(views[0], qt, n_rows, n_cols, x, out=out, config=cfg, variant=var)
                    err = float(cp.linalg.norm(out - ref) / cp.linalg.norm(ref))
                    # a config must give its variant's own result (dp4a: ~5e-3 from x's int8 rounding vs f32)
                    err_own = err if var != "dp4a" else float(cp.linalg.norm(out - ref_q) / cp.linalg.norm(ref_q))
                    fns = [(lambda s, v=v, cfg=cfg, var=var: K.matvec(v, qt, n_rows, n_cols, x, out=out, stream=s,
                                                                      config=cfg, variant=var)) for v in views]
                    reps = max(3, int(0.02 / max(1e-6, nbytes / 3e12) / copies))
                    t = time_graph(cp, fns, min(reps, 200))
                    rows.append({"variant": var, "config": list(cfg), "us": t * 1e6, "gbps": nbytes / t / 1e9,
                                 "relerr_vs_v1": err, "relerr_vs_own_default": err_own})
                bad = [r for r in rows if not r["relerr_vs_own_default"] < 1e-5]
                if bad:
                    print("  MISMATCH:", [(r["variant"], r["config"], r["relerr_vs_own_default"]) for r in bad])
                none = {"variant": "-", "config": [], "us": 0, "gbps": 0}
                f32_ok = [r for r in rows if r["variant"] != "dp4a" and r not in bad]
                q_ok = [r for r in rows if r["variant"] == "dp4a" and r not in bad]
                best_f32 = max(f32_ok, key=lambda r: r["gbps"]) if f32_ok else none
                best_q = max(q_ok, key=lambda r: r["gbps"]) if q_ok else none
                dflt = rows[0]
                dflt_q = next((r for r in rows if r["variant"] == "dp4a"), none)
                results.append({"type": tname, "n_rows": n_rows, "n_cols": n_cols, "B": B, "bytes": nbytes,
                                "copies": copies, "default": dflt, "best": best_f32, "dp4a_default": dflt_q,
                                "dp4a_best": best_q, "all": rows})
                print(f"  {tname:5s} {n_rows:6d}x{n_cols:<6d} B={B}  f32: v1-default {dflt['gbps']:6.0f} best {best_f32['gbps']:6.0f} GB/s "
                      f"{best_f32['variant']} {best_f32['config']}  dp4a: default {dflt_q['gbps']:6.0f} best {best_q['gbps']:6.0f} GB/s "
                      f"{best_q['config']} (vs f32 {dflt_q.get('relerr_vs_v1', 0):.1e})", flush=True)
            del big, views
    return results


def bench_attention(cp, K):
    """Decode attention and rope, 8B-shaped (32 heads, n_kv 8, G 4, hd 128), in a KV cache of
    4096 positions (the splits sized for it, as the engine runs): 1 and 8 sequences at 64, 512
    and 4096 cached keys, a causal 512-token prefill; rope of q and k in one launch for 1 and 512
    tokens."""
    res = {}
    n_kv, G, hd, max_ctx = 8, 4, 128, 4096
    for T in (1, 8):
        ck, cv = K.alloc_kv_cache(T, n_kv, max_ctx, hd)
        ck[...] = cp.random.standard_normal(ck.shape, dtype=cp.float32).astype(cp.float16)
        cv[...] = cp.random.standard_normal(cv.shape, dtype=cp.float32).astype(cp.float16)
        q = cp.random.standard_normal((T, n_kv * G, hd), dtype=cp.float32)
        slots = cp.arange(T, dtype=cp.int32)
        S = K.attention_splits(T, n_kv, max_ctx)
        ws = K.attention_workspace(T, n_kv * G, hd, S)
        out = cp.empty_like(q)
        for L in (64, 512, max_ctx):
            lens = cp.full(T, L, dtype=cp.int32)
            t = time_graph(cp, [lambda s: K.attention(q, ck, cv, slots, lens, out=out, n_splits=S, workspace=ws,
                                                      stream=s)] * 20, 20)
            kvb = 2 * T * n_kv * L * hd * 2
            res[f"attention_decode_T{T}_L{L}"] = {"us": t * 1e6, "kv_gbps": kvb / t / 1e9, "n_splits": S}
            print(f"  attention decode T={T} L={L} (cache {max_ctx}): {t * 1e6:.1f} us, KV read {kvb / t / 1e9:.0f} GB/s "
                  f"(splits {S})")
        del ck, cv
    # prefill attention: 512 queries, causal, after 0 cached
    T = 512
    ck, cv = K.alloc_kv_cache(1, n_kv, 4096, hd)
    q = cp.random.standard_normal((T, n_kv * G, hd), dtype=cp.float32)
    slots = cp.zeros(T, dtype=cp.int32)
    lens = cp.arange(1, T + 1, dtype=cp.int32)
    out = cp.empty_like(q)
    S = K.attention_splits(T, n_kv, 4096)
    ws = K.attention_workspace(T, n_kv * G, hd, S)
    t = time_graph(cp, [lambda s: K.attention(q, ck, cv, slots, lens, out=out, n_splits=S, workspace=ws, stream=s)] * 5, 5)
    flops = 4 * n_kv * G * hd * (T * (T + 1) / 2)
    res["attention_prefill_T512"] = {"us": t * 1e6, "tflops": flops / t / 1e12}
    print(f"  attention prefill T=512 causal: {t * 1e6:.1f} us ({flops / t / 1e12:.2f} TFLOP/s)")
    for T in (1, 512):
        q = cp.random.standard_normal((T, n_kv * G, hd), dtype=cp.float32)
        k = cp.random.standard_normal((T, n_kv, hd), dtype=cp.float32)
        pos = cp.arange(T, dtype=cp.int32)
        ff = cp.random.uniform(1.0, 8.0, hd // 2, dtype=cp.float32)
        t = time_graph(cp, [lambda s: K.rope_qk_inplace(q, k, pos, hd, 500000.0, ff, stream=s)] * 20, 20)
        res[f"rope_qk_T{T}"] = {"us": t * 1e6}
        print(f"  rope q+k T={T} (32 + 8 heads, hd {hd}): {t * 1e6:.1f} us")
    return res


def bench_other(cp, K):
    res = bench_attention(cp, K)
    # dequantize Q4_K 14336x4096 to f16, and gemm T=512
    qt = QT.Q4_K
    raw = random_raw(cp, K, qt, 14336, 4096, np.random.default_rng(1))
    w16 = cp.empty((14336, 4096), dtype=cp.float16)
    t = time_graph(cp, [lambda s: K.dequantize_f16(raw, qt, 14336, 4096, out=w16, stream=s)] * 10, 10)
    res["dequantize_f16_Q4_K_14336x4096"] = {"us": t * 1e6, "gbps_rw": (raw.size + w16.nbytes) / t / 1e9}
    print(f"  dequantize_f16 Q4_K 14336x4096: {t * 1e6:.1f} us ({(raw.size + w16.nbytes) / t / 1e9:.0f} GB/s read+write)")
    x = cp.random.standard_normal((512, 4096), dtype=cp.float32)
    outg = cp.empty((512, 14336), dtype=cp.float32)
    K.gemm(raw, qt, 14336, 4096, x, out=outg)
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(10):
        K.gemm(raw, qt, 14336, 4096, x, out=outg)
    e1.record()
    e1.synchronize()
    t = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 10
    res["gemm_Q4_K_T512_14336x4096"] = {"us": t * 1e6, "tflops": 2 * 512 * 14336 * 4096 / t / 1e12}
    print(f"  gemm Q4_K T=512 14336x4096 (dequant + cuBLAS f16): {t * 1e6:.1f} us ({2 * 512 * 14336 * 4096 / t / 1e12:.1f} TFLOP/s)")
    # sampling on a 128256 vocabulary
    for B in (1, 8):
        lg = cp.random.standard_normal((B, 128256), dtype=cp.float32)
        ids = cp.empty(B, dtype=cp.int32)
        t = time_graph(cp, [lambda s: K.argmax(lg, out=ids, stream=s)] * 20, 20)
        res[f"argmax_B{B}"] = {"us": t * 1e6}
        v = cp.empty((B, 64), dtype=cp.float32)
        i = cp.empty((B, 64), dtype=cp.int32)
        t2 = time_graph(cp, [lambda s: K.topk(lg, 64, values=v, ids=i, stream=s)] * 20, 20)
        res[f"topk64_B{B}"] = {"us": t2 * 1e6}
        print(f"  sampling V=128256 B={B}: argmax {t * 1e6:.1f} us, top-64 {t2 * 1e6:.1f} us")
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--attention", action="store_true", help="only decode attention and rope (bench_attention)")
    a = ap.parse_args()
    if a.precompile:
        precompile(a.jobs)
        return 0
    import cupy as cp
    K = _k()
    props = cp.cuda.runtime.getDeviceProperties(0)
    dev = {"name": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
           "sms": props["multiProcessorCount"], "l2_bytes": props["l2CacheSize"],
           "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion()}
    print("device:", dev)
    copy_bw = device_copy_gbps() * 1e9
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    t0 = time.perf_counter()
    if a.attention:
        res = {"device": dev, "copy_gbps": copy_bw / 1e9, "attention": bench_attention(cp, K),
               "seconds": time.perf_counter() - t0}
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.out)
        return 0
    mv = bench_matvec(cp, K, a.quick)
    other = bench_other(cp, K)
    copy_bw2 = device_copy_gbps() * 1e9
    print(f"device-to-device copy again: {copy_bw2 / 1e9:.0f} GB/s")
    print()
    print(f"matvec, weight bytes / time, vs copy bandwidth {copy_bw / 1e9:.0f} GB/s (graph replay, L2-cold); "
          "dp4a times include its quantize-x launch")
    print(f"{'type':5s} {'shape':>12s} {'B':>2s} {'MB':>6s} | {'f32 dflt':>8s} {'%':>5s} {'f32 best':>8s} {'%':>5s} "
          f"{'cfg':>10s} | {'dp4a dflt':>9s} {'%':>5s} {'dp4a best':>9s} {'%':>5s} {'cfg':>10s}")
    pc = lambda g: 100 * g * 1e9 / copy_bw  # noqa: E731
    for r in mv:
        d, b, qd, qb = r["default"], r["best"], r["dp4a_default"], r["dp4a_best"]
        qtxt = (f"{qd['gbps']:9.0f} {pc(qd['gbps']):5.1f} {qb['gbps']:9.0f} {pc(qb['gbps']):5.1f} {str(qb['config']):>10s}"
                if qb["gbps"] else f"{'n/a':>9s} {'':5s} {'n/a':>9s} {'':5s} {'':>10s}")
        print(f"{r['type']:5s} {r['n_rows']:>5d}x{r['n_cols']:<6d} {r['B']:>2d} {r['bytes'] / 1e6:6.1f} | {d['gbps']:8.0f} "
              f"{pc(d['gbps']):5.1f} {b['gbps']:8.0f} {pc(b['gbps']):5.1f} {b['variant'] + str(b['config']):>10s} | {qtxt}")
    res = {"device": dev, "copy_gbps": copy_bw / 1e9, "copy_gbps_end": copy_bw2 / 1e9, "matvec": mv, "other": other,
           "seconds": time.perf_counter() - t0}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
