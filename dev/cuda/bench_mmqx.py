"""mmqx_kernel (mmq.cu: mmq with x staged in shared memory once per CTA of WR warps) and its
fixed form (fixed_point.cu fx_mmqx_kernel) against mmq_kernel and fx_mmq_kernel at the device's
mmq launch, at each launch of --configs (WR warps side by side, NS stages) and each split-K count
KS that gives every CTA at least two block columns; and production's own pick (``mm.mmq``,
``fixed_point.fx_mmq``: tuning.py mmqx_launch) as "prod" and "fx_prod". How tuning.py's
MMQX_WARPS, MMQX_STAGES and mmqx_min_ctas were chosen.

Checks first: the fixed form (FX) must give fx_mmq's bits exactly (its block values are
fx_mmq's, its sums integers: any split gives the same row); the default form is mmq's arithmetic
in another split, so its largest difference from mmq is reported against the output's scale.
Then times every path as CUDA graphs of 20 calls over L2-cold copies of the matrix
(bench_gemm_paths' timer), interleaved, the median of --rounds; per (type, shape, rows) the best
launch of each form, against mmq.

--fx-mmq-configs WRxWKxKS,...: also fx_mmq_kernel itself at those launches ("fxmmq_1x4x2"), its
bits checked against its own at mmq's launch (the fixed form may take any launch: its sums are
exact), for the matrices mmqx does not serve (4096 and 1024 rows of the 8B at 64 rows).
--configs "" skips mmqx.

    python3 dev/cuda/bench_mmqx.py [--types Q4_K,Q6_K] [--ts 16,32,64] [--configs 4x2,4x3,8x2,8x3]
        [--fx-mmq-configs 1x2x1,1x4x2] [--rounds 2] [--out mmqx.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parents[1] / "scripts")]
from bench_gemm_paths import SHAPES, _weight_copies, bit_check, interleaved_medians, try_run  # noqa: E402

from ntx.daemons.compute.cuda import fixed_point as fx  # noqa: E402
from ntx.daemons.compute.cuda import instances, runtime  # noqa: E402
from ntx.daemons.compute.cuda import mm as tc  # noqa: E402
from ntx.shared.kernel_options import KernelOptions  # noqa: E402
from ntx.shared.quant_types import quant_type  # noqa: E402

CTX = runtime.standalone()
FX_CTX = runtime.standalone(KernelOptions.parse("batch-invariant=on,invariant-fixed=on"))  # the fixed form's table
SMEM_MAX = 227 * 1024  # an H100/H200 CTA's dynamic shared memory at most


def smem_bytes(q, nt: int, wr: int, ns: int, fx_sums: bool) -> int:
    """mmqx_kernel's dynamic shared memory: NS stages, or the epilogue's sums."""
    return tc.mmqx_smem_bytes(q, nt, wr, ns, 8 if fx_sums else 4)


def kernel_name(qt: int, nt: int, wr: int, ns: int, fx_form: bool) -> str:
    return f"{'fx_mmqx_kernel' if fx_form else 'mmqx_kernel'}<{qt},{nt},{wr},{ns}>"


def all_names(types: list[int], nts: list[int], configs: list[tuple[int, int]], fx_form: bool) -> tuple[str, ...]:
    return tuple(kernel_name(qt, nt, wr, ns, fx_form) for qt in types for nt in nts for wr, ns in configs)


def split_k_scratch(ks: int, B: int, n_rows: int, tiles: int):
    """(partials [ks, B, n_rows] of 8 bytes, enough for either form; tile counters), or null
    pointers without split-K."""
    if ks == 1:
        return np.uint64(0), np.uint64(0)
    return CTX.scratch("bench partials", ks * B * n_rows * 8), CTX.scratch("bench counters", tiles * 4, zero=True)


def mmq_kernel(w, planes, out, B: int) -> None:
    """mmq_kernel at the device's mmq launch (what mm.mmq ran before mmqx)."""
    q = quant_type(w.qtype)
    wr, wk, ks = CTX.tuning().mmq_launch(B, w.n_rows, w.n_cols // 256 * 8)
    nt, tiles = -(-B // 8), -(-w.n_rows // (16 * wr))
    names = instances.mmq_names(int(w.qtype))
    part, counts = split_k_scratch(ks, B, w.n_rows, tiles)
    xq, xd = planes
    fx._launch_staged(CTX, runtime.function("mmq.cu", names[nt - 1], names), (tiles, ks), wr * wk,
                      tc.staged_smem_bytes(q, wr * wk, nt),
                      (w.data, xq, xd, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                       np.int64(w.row_bytes), np.int32(B), np.int32(wr)))


def launch(names, w, planes, out, B: int, wr: int, ns: int, ks: int, fx_form: bool) -> None:
    q = quant_type(w.qtype)
    nt = -(-B // 8)
    name = kernel_name(int(w.qtype), nt, wr, ns, fx_form)
    kern = runtime.function("fixed_point.cu" if fx_form else "mmq.cu", name, names[fx_form])
    smem = smem_bytes(q, nt, wr, ns, fx_form)
    if smem > runtime.DEFAULT_SMEM_LIMIT - 1024 and kern.max_dynamic_shared_size_bytes < smem:
        kern.max_dynamic_shared_size_bytes = smem  # (the kernel's static 4 bytes count too)
    tiles = -(-w.n_rows // (16 * wr))
    part, counts = split_k_scratch(ks, B, w.n_rows, tiles)
    xq, xd = planes
    fx._launch_staged(CTX, kern, (tiles, ks), wr, smem,
                      (w.data, xq, xd, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                       np.int64(w.row_bytes), np.int32(B), np.int32(wr)))


def main() -> None:
    from gguf import GGMLQuantizationType as QT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--ts", default="16,32,64", help="rows of x")
    ap.add_argument("--configs", default="4x2,4x3,8x2,8x3", help="WRxNS launches")
    ap.add_argument("--ks", default="1,2,4,8", help="split-K counts tried (each CTA keeps >= 2 block columns)")
    ap.add_argument("--fx-mmq-configs", default="", help="WRxWKxKS launches of fx_mmq_kernel also timed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    types = [int(QT[t]) for t in args.types.split(",")]
    ts = [int(t) for t in args.ts.split(",")]
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
    fx_configs = [tuple(int(v) for v in c.split("x")) for c in args.fx_mmq_configs.split(",") if c]
    nts = sorted({-(-t // 8) for t in ts})
    names = (all_names(types, nts, configs, False), all_names(types, nts, configs, True))
    print(f"compiling {len(names[0]) + len(names[1])} instantiations ...", flush=True)
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    rows, mismatches = [], 0
    for qt in types:
        q = quant_type(qt)
        for n_rows, n_cols in SHAPES[args.shapes]:
            ws, nbytes = _weight_copies(qt, n_rows, n_cols, rng)
            nb = n_cols // 256
            for T in ts:
                nt = -(-T // 8)
                x = cp.asarray(rng.standard_normal((T, n_cols), dtype=np.float32))
                outs = [cp.empty((T, n_rows), dtype=cp.float32) for _ in ws]
                mplanes = tuple(p.copy() for p in tc.mmq_quantize(CTX, x))
                fplanes = tuple(p.copy() for p in fx.fx_quantize(CTX, x))
                mmq_cfg = CTX.tuning().mmq_launch(T, n_rows, n_cols // 256 * 8)
                want_fx = fx.fx_mmq(CTX, ws[0], x, planes=fplanes, config=mmq_cfg).copy()
                want = cp.empty((T, n_rows), dtype=cp.float32)
                mmq_kernel(ws[0], mplanes, want, T)
                scale = float(cp.abs(want).max())
                paths = {"mmq": lambda i: mmq_kernel(ws[i % len(ws)], mplanes, outs[i % len(ws)], T),
                         "fx_mmq": lambda i: fx.fx_mmq(CTX, ws[i % len(ws)], x, out=outs[i % len(ws)],
                                                       planes=fplanes, config=mmq_cfg),
                         "prod": lambda i: tc.mmq(CTX, ws[i % len(ws)], x, out=outs[i % len(ws)], planes=mplanes)}
                paths["fx_prod"] = lambda i: fx.fx_mmq(FX_CTX, ws[i % len(ws)], x, out=outs[i % len(ws)],
                                                       planes=fplanes)
                row_checks = {"fx_prod": bit_check(
                    "fx_prod", lambda: fx.fx_mmq(FX_CTX, ws[0], x, planes=fplanes).copy(), want_fx)}
                mismatches += row_checks["fx_prod"] != "same"
                row = {"type": q.name, "shape": [n_rows, n_cols], "T": T, "weight_bytes": nbytes, "checks": row_checks}
                for cfg in fx_configs:
                    wr, wk, ks = cfg
                    if nb // (wk * ks) < 1:  # a warp without a block column
                        continue
                    key = "fxmmq_{}x{}x{}".format(*cfg)
                    verdict = row["checks"][key] = bit_check(
                        key, lambda: fx.fx_mmq(CTX, ws[0], x, planes=fplanes, config=cfg).copy(), want_fx)
                    if verdict == "failed":
                        continue
                    mismatches += verdict != "same"
                    paths[key] = (lambda c: lambda i: fx.fx_mmq(CTX, ws[i % len(ws)], x, out=outs[i % len(ws)],
                                                                planes=fplanes, config=c))(cfg)
                for wr, ns in configs:
                    for fx_form in (False, True):
                        if smem_bytes(q, nt, wr, ns, fx_form) > SMEM_MAX:
                            continue
                        for ks in (int(k) for k in args.ks.split(",")):
                            if nb // ks < 2 and ks > 1:
                                continue
                            key = f"{'fx' if fx_form else 'mmqx'}_{wr}x{ns}_ks{ks}"
                            got = cp.full_like(want, cp.nan)
                            pl = fplanes if fx_form else mplanes
                            run = lambda: launch(names, ws[0], pl, got, T, wr, ns, ks, fx_form) or got  # noqa: E731
                            if fx_form:
                                verdict = row["checks"][key] = bit_check(key, run, want_fx)
                                if verdict == "failed":
                                    continue
                                mismatches += verdict != "same"
                            elif try_run(key, run) is None:
                                row["checks"][key] = "failed"
                                continue
                            else:
                                rel = float(cp.abs(got - want).max()) / max(scale, 1e-30)
                                row["checks"][key] = f"{rel:.2e}"
                                mismatches += not (rel < 1e-4)
                            paths[key] = (lambda a: lambda i: launch(names, ws[i % len(ws)], a[0],
                                                                     outs[i % len(ws)], T, *a[1:]))(
                                (pl, wr, ns, ks, fx_form))
                for k, ms in interleaved_medians(paths, args.rounds, stream).items():
                    row[f"{k}_ms"] = ms
                base = row["mmq_ms"]
                best = {}
                for form in ("mmqx", "fx", "fxmmq"):
                    cand = [(row[f"{k}_ms"], k) for k in paths if k.startswith(form + "_") and row.get(f"{k}_ms")]
                    if cand:
                        best[form] = min(cand)
                row["best"] = {f: k for f, (_, k) in best.items()}
                line = f"{q.name} {n_rows}x{n_cols} T={T:2d}: mmq {base:.4f} fx_mmq {row['fx_mmq_ms']:.4f} " \
                       f"({row['fx_mmq_ms'] / base:.2f}x)  prod {row['prod_ms'] / base:.2f}x fx_prod " \
                       f"{row['fx_prod_ms'] / base:.2f}x"
                for f, (ms, k) in best.items():
                    line += f"  best {k} {ms:.4f} ({ms / base:.2f}x)"
                bad = {k: v for k, v in row["checks"].items() if v in ("DIFFERENT", "failed")
                       or (k.startswith("mmqx") and v not in ("DIFFERENT", "failed") and float(v) >= 1e-4)}
                print(line + (f"  CHECKS {bad}" if bad else ""), flush=True)
                rows.append(row)
    print(f"checks: {'fixed form gives fx_mmq bits, default within 1e-4 of mmq' if not mismatches else f'{mismatches} FAILED'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "rounds": args.rounds, "configs": args.configs}, indent=1))


if __name__ == "__main__":
    main()
