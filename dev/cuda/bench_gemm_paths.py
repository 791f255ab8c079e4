"""Which path is fastest for T <= 64 rows of x against one quantized matrix: the tensor-core
matmul (``lab.mm``, weights read once; the K-quants staged or direct), the int8 tensor-core
matmul (``lab.mmq``, the K-quants), or matvec (f32, the int8-activation dp4a variant and the
two-plane i16 one) in chunks of 8 rows (weights read ceil(T/8) times)? It decides
``mm_min_rows``, ``mmq_min_rows``, ``mm_launch`` and ``mmq_launch`` of the device's entry in
daemons/compute/cuda/tuning.py. (Dequantize + cuBLAS, the path beyond
64 rows, is not a candidate: cupy cannot capture cuBLAS calls in a graph.) Each path is timed as
a CUDA graph of 20 calls (no Python launch overhead) cycling over up to 8 copies of the matrix,
so small matrices are not read from L2.

--sweep-mv times the matvec alone (its quantize-x launch included), as "i16" (x read from
global memory by every CTA) and "i16s" (x staged in shared memory once per CTA, CTAs looping over
row groups), and with --mv-variants also the f32 matvec's cuts "v1" and "v2", at every launch
configuration (rows per CTA, warps per CTA, pieces per trip) = MV_SWEEP for each B of --ts up
to 8 (default 1..8), printing weight bytes per second beside the device's copy bandwidth and
the best configuration per (type, shape, B) beside the device table's own (tuning.py
i16_launch): the figures behind the H200's i16_launch.

    python3 dev/cuda/bench_gemm_paths.py [--shapes 8b|70b] [--types Q4_K,Q6_K,Q8_0] [--ts 1,2,4,8,16,32,64] [--paths mm,mmq,matvec_i16] [--out gemm_paths.json]
    python3 dev/cuda/bench_gemm_paths.py --sweep-mv [--shapes 8b] [--types Q4_K,Q6_K] [--mv-variants i16,v2] [--out mv_sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "scripts")]
import lab  # noqa: E402  (dev/cuda)
from synth_gguf import make_blocks  # noqa: E402  (scripts/synth_gguf)

from ntx.daemons.compute.cuda import fixed_point, gemm, matvec, runtime, tuning  # noqa: E402
from ntx.daemons.compute.cuda.memory import mm_cut  # noqa: E402
from ntx.daemons.compute.cuda.mm import mmq_supported  # noqa: E402
from ntx.daemons.compute.cuda.tuning import MAX_MATVEC_B, MAX_MM_ROWS  # noqa: E402
from ntx.daemons.compute.probes import device_copy_gbps  # noqa: E402
from ntx.shared.quant_types import quant_type, tensor_nbytes  # noqa: E402

CTX = runtime.standalone()

SHAPES = {"70b": [(28672, 8192), (8192, 8192), (8192, 28672), (1024, 8192)],  # ffn up, q/o, down, k/v
          "8b": [(14336, 4096), (4096, 4096), (4096, 14336), (1024, 4096)]}
ITERS = 20
# an 8B layer's matrices per shape of SHAPES["8b"]: gate and up, q and o, down, k and v
LAYER_COUNTS_8B = {(14336, 4096): 2, (4096, 4096): 2, (4096, 14336): 1, (1024, 4096): 2}


def fx_layer_summary(rows: list[dict], mmq_min_rows: int) -> list[dict]:
    """Per type and row count, an 8B layer's products (LAYER_COUNTS_8B, every matrix of that
    type) on the default's paths (the i16 matvec below mmq_min_rows rows, mmq from there) beside
    the fixed-point sums' (below: per matrix the fastest of fx_mvq, fx_mv and fx_mvs; from there fx_mmq):
    what the mode's third form would add to a pass's products, before anything else of the pass
    is counted."""
    out = []
    for (tname, T) in dict.fromkeys((r["type"], r["T"]) for r in rows):
        mine = {tuple(r["shape"]): r for r in rows if r["type"] == tname and r["T"] == T}
        small = T < mmq_min_rows
        base, fx_keys = ("matvec_i16_ms", ("fx_mvq_ms", "fx_mv_ms", "fx_mvs_ms")) if small else ("mmq_ms", ("fx_mmq_ms",))
        if set(mine) != set(LAYER_COUNTS_8B):
            continue
        fx_ms = {s: [r[k] for k in fx_keys if r.get(k) is not None] for s, r in mine.items()}
        if any(mine[s].get(base) is None or not fx_ms[s] for s in mine):
            continue
        default = sum(n * mine[s][base] for s, n in LAYER_COUNTS_8B.items())
        fx = sum(n * min(fx_ms[s]) for s, n in LAYER_COUNTS_8B.items())
        fx_name = "/".join(k[:-3] for k in fx_keys)
        out.append({"type": tname, "T": T, "default_path": base[:-3], "fx_path": fx_name,
                    "layer_default_ms": round(default, 4), "layer_fx_ms": round(fx, 4),
                    "cost_pct": round(100 * (fx / default - 1), 1)})
        print(f"fixed point, an 8B layer's {tname} products at {T} rows: {fx_name} {fx:.4f} ms against "
              f"{base[:-3]} {default:.4f} ms ({100 * (fx / default - 1):+.1f}%)", flush=True)
    return out
# (rows per CTA, warps per CTA, pieces per trip) of the i16 matvec sweep
MV_SWEEP = [(nr, nw, u) for nr in tuning.MV_ROWS_PER_CTA for nw in (2, 4, 8) for u in tuning.MV_UNROLLS]
# --mv-variants: the matvec variants --sweep-mv may time (fx: production's fixed-point matvec,
# fixed_point.fx_matvec_pieces, the K-quants only)
MV_VARIANTS = ("i16", "i16s", "v1", "v2", "dp4a", "fx")


def _time_ms(fn, stream) -> float | None:
    """Mean time of one of ITERS calls replayed as one CUDA graph (None when the path fails)."""
    try:
        with stream:
            fn(0)  # eager first: compiles, makes workspaces
            stream.synchronize()
            stream.begin_capture()
            try:
                for i in range(ITERS):
                    fn(i)
            finally:
                g = stream.end_capture()
            g.launch(stream)
            stream.synchronize()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            g.launch(stream)
            b.record(stream)
            b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) / ITERS
    except Exception as e:  # a path that cannot run this shape (or be captured) is reported, not fatal
        print(f"  path failed: {type(e).__name__}: {e}", flush=True)
        return None


def try_run(name: str, run):
    """``run()``'s output (one eager launch, synchronized), or None where it raises (reported,
    not fatal): a variant's first run before it is checked and timed."""
    try:
        got = run()
        cp.cuda.Device().synchronize()
        return got
    except Exception as e:  # noqa: BLE001 (a variant that fails is reported, not fatal)
        print(f"  {name}: failed: {type(e).__name__}: {e}", flush=True)
        return None


def bit_check(name: str, run, want) -> str:
    """"same" where ``run()`` (one eager launch, returning its output) gives ``want``'s bits,
    "DIFFERENT" where not, "failed" where it raises (``try_run``): a variant's check before it
    is timed (bench_fx_variants.py, bench_mmqx.py)."""
    got = try_run(name, run)
    if got is None:
        return "failed"
    return "same" if bool(cp.array_equal(got.view(cp.uint32), want.view(cp.uint32))) else "DIFFERENT"


def interleaved_medians(paths: dict, rounds: int, stream) -> dict[str, float | None]:
    """Each path's median ``_time_ms`` over ``rounds`` rounds that time every path in turn (so
    a drift of the clocks or of the host spreads over all of them), rounded to 0.1 us; None for
    a path that failed every time."""
    import statistics

    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for k, fn in paths.items():
            ms = _time_ms(fn, stream)
            if ms is not None:
                times[k].append(ms)
    return {k: round(statistics.median(tl), 4) if tl else None for k, tl in times.items()}


def _weight_copies(qt: int, n_rows: int, n_cols: int, rng) -> tuple[list, int]:
    """Up to 8 device copies of a random [n_rows, n_cols] matrix of qt (Weights), enough to
    cycle through >= 256 MB (L2-cold), and its bytes."""
    nbytes = tensor_nbytes(qt, (n_rows, n_cols))
    n_copies = max(1, -(-(256 << 20) // nbytes))
    nblocks = n_rows * n_cols // quant_type(qt).block_elems
    return [gemm.weight(cp.asarray(make_blocks(qt, nblocks, 0.02, rng).reshape(-1)), qt, n_rows, n_cols)
            for _ in range(min(n_copies, 8))], nbytes


def sweep_mv(args, stream, copy_gbps: float, rng) -> list[dict]:
    """The matvec variants of --mv-variants (default i16, i16s; v1, v2: the f32 matvec's cuts) at
    every MV_SWEEP configuration for each B (<= 8) of --ts: one row per (type, shape, B) with
    each (variant, configuration)'s ms and GB/s (weight bytes / time), keyed "i16_2_4_1" /
    "v2_8_4_1", the best, and the device table's choice (i16)."""
    from gguf import GGMLQuantizationType as QT

    table = runtime.tuning()
    variants = args.mv_variants.split(",")
    unknown = set(variants) - set(MV_VARIANTS)
    if unknown:
        raise SystemExit(f"--mv-variants: unknown {sorted(unknown)}; choose from {', '.join(MV_VARIANTS)}")
    bs = [b for b in (int(t) for t in args.ts.split(",")) if 1 <= b <= MAX_MATVEC_B] if args.ts_given else \
        list(range(1, MAX_MATVEC_B + 1))
    configs = [tuple(int(v) for v in c.split(",")) for c in args.mv_configs.replace("/", " ").split()] \
        if args.mv_configs else MV_SWEEP
    rows = []
    for tname in args.types.split(","):
        qt = int(QT[tname])
        if not quant_type(qt).dp4a:
            print(f"{tname}: no i16 matvec, skipped", flush=True)
            continue
        for n_rows, n_cols in SHAPES[args.shapes]:
            ws, nbytes = _weight_copies(qt, n_rows, n_cols, rng)
            for B in bs:
                x = cp.asarray(rng.standard_normal((B, n_cols), dtype=np.float32))
                out = cp.empty((B, n_rows), dtype=cp.float32)
                default = tuple(table.i16(QT(qt), B))
                cfgs = {}
                for variant in variants:
                    if variant == "v2" and "v2" not in quant_type(qt).cuts:
                        continue
                    if variant == "fx" and not mmq_supported(qt, n_cols):
                        continue
                    for cfg in configs:
                        if variant == "fx":
                            fn = lambda i, c=cfg: fixed_point.fx_matvec_pieces(CTX, ws[i % len(ws)], x, out=out, launch=c)
                        else:
                            fn = lambda i, c=cfg, v=variant: lab.matvec(CTX, ws[i % len(ws)], x, out=out, variant=v, config=c)
                        ms = _time_ms(fn, stream)
                        cfgs["_".join(map(str, (variant, *cfg)))] = None if ms is None else {
                            "ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 1)}
                timed = {k: v for k, v in cfgs.items() if v is not None}
                best = min(timed, key=lambda k: timed[k]["ms"]) if timed else None
                dkey = "_".join(map(str, ("i16", *default)))
                row = {"type": tname, "shape": [n_rows, n_cols], "B": B, "weight_bytes": nbytes,
                       "copy_gbps": round(copy_gbps, 1), "default": list(default), "best": best, "configs": cfgs}
                rows.append(row)
                d, b = cfgs.get(dkey), timed.get(best) if best else None
                dtxt = f"{d['gbps']:6.0f} GB/s ({100 * d['gbps'] / copy_gbps:4.1f}%)" if d else "   n/a"
                btxt = f"{b['gbps']:6.0f} GB/s ({100 * b['gbps'] / copy_gbps:4.1f}%) {best}" if b else "n/a"
                print(f"{tname} {n_rows}x{n_cols} B={B}: table {dkey} {dtxt}  best {btxt}  "
                      f"(copy {copy_gbps:.0f} GB/s)", flush=True)
                for variant in variants:
                    print(f"   {variant:4s} " + "  ".join(f"{k.split('_', 1)[1]} {v['gbps']:.0f}" for k, v in timed.items()
                                                      if k.split("_", 1)[0] == variant), flush=True)
            ws.clear()
            cp.get_default_memory_pool().free_all_blocks()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--ts", default=None, help="rows of x (default 1,2,3,4,8,9,16,24,32,48,64; --sweep-mv: 1..8)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep-mm", action="store_true",
                    help="time the tensor-core matmuls (mm, mmq: those --paths keeps) at every (WR, WK, KS[, MT])")
    ap.add_argument("--paths", default=None,
                    help="comma-separated paths to time (matvec_f32, matvec_dp4a, matvec_i16, mm, mm_direct, mmq, mvq2_rows, "
                         "mvq2_rows_nt1, mvq2_rows_split, fx_mvq, fx_mv, fx_mvs, fx_mmq); default all")
    ap.add_argument("--sweep-mv", action="store_true",
                    help="time only the matvec (--mv-variants) at every (rows per CTA, warps, pieces per trip), B <= 8")
    ap.add_argument("--mv-configs", default=None,
                    help="--sweep-mv's configurations, 'NR,NW,U/NR,NW,U/...' (default: every one of MV_SWEEP)")
    ap.add_argument("--mv-variants", default="i16,i16s",
                    help=f"--sweep-mv's variants, comma-separated from {','.join(MV_VARIANTS)} (v1, v2: f32 matvec cuts)")
    args = ap.parse_args()
    args.ts_given = args.ts is not None
    if args.ts is None:
        args.ts = "1,2,3,4,8,9,16,24,32,48,64"
    from gguf import GGMLQuantizationType as QT

    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    copy_gbps = device_copy_gbps()
    print(f"device-to-device copy {copy_gbps:.0f} GB/s (read + write)", flush=True)
    if args.sweep_mv:
        rows = sweep_mv(args, stream, copy_gbps, rng)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"copy_gbps": round(copy_gbps, 1), "mode": "sweep-mv", "rows": rows}, f, indent=1)
        return
    rows = []
    for tname in args.types.split(","):
        qt = int(QT[tname])
        for n_rows, n_cols in SHAPES[args.shapes]:
            ws, nbytes = _weight_copies(qt, n_rows, n_cols, rng)  # cycle through >= 256 MB: L2-cold
            for T in [int(t) for t in args.ts.split(",")]:
                x = cp.asarray(rng.standard_normal((T, n_cols), dtype=np.float32))
                out = cp.empty((T, n_rows), dtype=cp.float32)

                def chunked(i, variant="f32"):
                    w = ws[i % len(ws)]
                    for a in range(0, T, MAX_MATVEC_B):
                        b = min(a + MAX_MATVEC_B, T)
                        lab.matvec(CTX, w, x[a:b], out=out[a:b], variant=variant)

                paths = {"matvec_f32": chunked}
                if quant_type(qt).dp4a:
                    paths.update(matvec_dp4a=lambda i: chunked(i, "dp4a"), matvec_i16=lambda i: chunked(i, "i16"))
                if mm_cut(quant_type(qt), n_cols) is not None and T <= MAX_MM_ROWS:
                    paths["mm"] = lambda i: lab.mm(CTX, ws[i % len(ws)], x, out=out)
                    if quant_type(qt).mm_staged:
                        paths["mm_direct"] = lambda i: lab.mm(CTX, ws[i % len(ws)], x, out=out, staged=False)
                if mmq_supported(qt, n_cols) and T <= MAX_MM_ROWS:
                    paths["mmq"] = lambda i: lab.mmq(CTX, ws[i % len(ws)], x, out=out)
                if quant_type(qt).dp4a:  # the i16 matvec's bits at any rows (batch-invariant candidate)
                    # production's matvec_rows (the batch-invariant mode's rows form), at 2 and 1 tiles a warp
                    paths["mvq2_rows"] = lambda i: matvec.matvec_rows(CTX, ws[i % len(ws)], x, out=out, nt=2)
                    paths["mvq2_rows_nt1"] = lambda i: matvec.matvec_rows(CTX, ws[i % len(ws)], x, out=out, nt=1)
                    # the lab's K split of it over 8 warps a CTA (rows_split.cu): the same bits
                    paths["mvq2_rows_split"] = lambda i: lab.matvec_rows_split(CTX, ws[i % len(ws)], x, out=out)
                if mmq_supported(qt, n_cols) and T <= MAX_MM_ROWS:  # fixed-point sums (fixed_point.py): one set of bits
                    if T <= MAX_MATVEC_B:
                        paths["fx_mvq"] = lambda i: fixed_point.fx_matvec_pieces(CTX, ws[i % len(ws)], x, out=out)
                        paths["fx_mv"] = lambda i: fixed_point.fx_matvec_direct(CTX, ws[i % len(ws)], x, out=out)
                        paths["fx_mvs"] = lambda i: fixed_point.fx_matvec_staged(CTX, ws[i % len(ws)], x, out=out)
                    paths["fx_mmq"] = lambda i: fixed_point.fx_mmq(CTX, ws[i % len(ws)], x, out=out)
                if args.paths:
                    keep = set(args.paths.split(","))
                    paths = {k: v for k, v in paths.items() if k in keep}
                if args.sweep_mm and "mm" in paths:
                    for wr in (1, 2, 4, 8):
                        for wk in (1, 2, 4, 8):
                            for ks in (1, 2, 4, 8):
                                if wr * wk <= 8 and 16 * wr >= T // 2:
                                    paths[f"mm_{wr}_{wk}_{ks}"] = (lambda c: lambda i: lab.mm(
                                        CTX, ws[i % len(ws)], x, out=out, config=c))((wr, wk, ks))
                if args.sweep_mm and "mmq" in paths:
                    for wr, wk, ks, mt in itertools.product((1, 2), (2, 4, 8), (1, 2, 4), (1, 2)):
                        if wr * wk <= 8:
                            paths[f"mmq_{wr}_{wk}_{ks}_{mt}"] = (lambda c: lambda i: lab.mmq(
                                CTX, ws[i % len(ws)], x, out=out, config=c))((wr, wk, ks, mt))
                row = {"type": tname, "shape": [n_rows, n_cols], "T": T, "weight_bytes": nbytes}
                for name, fn in paths.items():
                    ms = _time_ms(fn, stream)
                    row[f"{name}_ms"] = None if ms is None else round(ms, 4)
                    row[f"{name}_gbps"] = None if ms is None else round(nbytes / ms / 1e6, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
            ws.clear()
            cp.get_default_memory_pool().free_all_blocks()
    for key, f in sorted(runtime._functions.items(), key=str):  # registers, spills: what bounds occupancy
        print(f"kernel {key[1:]}: {f.num_regs} registers, {f.local_size_bytes} B local (spills), "
              f"{f.shared_size_bytes} B static shared", flush=True)
    summary = fx_layer_summary(rows, runtime.tuning().mmq_min_rows) if args.shapes == "8b" else []
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_gbps": round(copy_gbps, 1), "rows": rows, "fx_layer_summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
