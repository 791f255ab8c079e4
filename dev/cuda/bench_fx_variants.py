"""Variants of fixed-point mmq (fixed_point.cu fx_mmq_kernel) against production's fx_mmq and
mmq_kernel: each variant is a folder holding its own fixed_point.cu (and mmq.cu or other headers,
found there before daemons/compute/cuda), compiled and launched exactly as ``fixed_point.fx_mmq``
launches production's. Checks first that every variant gives production's bits (the fixed form's
promise), then times all of them in interleaved rounds as CUDA graphs of 20 calls cycling over
copies of the matrix (L2-cold; bench_gemm_paths' timer): the median of --rounds. Where the
device's table sends the matrix to mmqx (``mmq_choice``: "mmqx" in the line, "production_kernel"
in the JSON), "mmq" and "fx_mmq" are mmqx_kernel and fx_mmqx_kernel, and "fx_mmq_kernel" is
production's fx_mmq_kernel at the variants' launch: the one to weigh a variant against there.

    python3 dev/cuda/bench_fx_variants.py NAME=DIR [NAME=DIR ...] [--ts 8,32,64] [--types Q4_K,Q6_K]
        [--shapes 8b] [--rounds 3] [--out fx_variants.json]

Another revision's kernel as a variant: ``mkdir -p /tmp/r && git archive REV daemons/compute/cuda |
tar x -C /tmp/r``, then ``old=/tmp/r/daemons/compute/cuda`` (its bits must be production's too:
a variant that changes the fixed form's values is reported DIFFERENT, and only timed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "scripts")]
from bench_gemm_paths import SHAPES, _weight_copies, bit_check, interleaved_medians  # noqa: E402

from ntx.daemons.compute.cuda import fixed_point as fx  # noqa: E402
from ntx.daemons.compute.cuda import instances, runtime  # noqa: E402
from ntx.daemons.compute.cuda import mm as tc  # noqa: E402
from ntx.shared.quant_types import quant_type  # noqa: E402

CTX = runtime.standalone()


def variant_fx_mmq(source: Path, w, x, out, planes) -> None:
    """fixed_point.fx_mmq's launch with the kernel compiled from ``source``; a variant that keeps
    more in shared memory names its bytes a thread per tile of 8 x rows in a file
    ``smem_bytes_per_thread_tile`` beside it (added past production's): one number for every
    type, or ``TYPE:BYTES`` entries (e.g. ``Q4_K:32 Q5_K:32``; a type not named adds none)."""
    q = quant_type(w.qtype)
    B = x.shape[0]
    wr, wk, ks = CTX.tuning().mmq_launch(B, w.n_rows, w.n_cols // 256 * 8)
    tiles, nt = -(-w.n_rows // (16 * wr)), -(-B // 8)
    name = instances.fx_mmq_names(w.qtype)[nt - 1]
    xq, xd = planes
    part, counts = fx._split_k(CTX, ks, B, w.n_rows, tiles)
    fx._launch_staged(CTX, runtime.function(source, name, (name,)), (tiles, ks), wr * wk,
                      fx.fx_mmq_smem_bytes(q, wr * wk, nt) + 32 * wr * wk * nt * _extra_smem(source, q.name),
                      (w.data, xq, xd, out, part, counts, np.int32(w.n_rows), np.int32(w.n_cols),
                       np.int64(w.row_bytes), np.int32(B), np.int32(wr)))


def _extra_smem(source: Path, type_name: str) -> int:
    f = source.parent / "smem_bytes_per_thread_tile"
    if not f.is_file():
        return 0
    entries = f.read_text().split()
    if len(entries) == 1 and ":" not in entries[0]:
        return int(entries[0])
    return dict((k, int(v)) for k, v in (e.split(":") for e in entries)).get(type_name, 0)


def main() -> None:
    from gguf import GGMLQuantizationType as QT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="NAME=DIR: a folder with the variant's fixed_point.cu")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--ts", default="8,32,64", help="rows of x")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = {}
    for v in args.variants:
        name, _, d = v.partition("=")
        src = Path(d).resolve() / "fixed_point.cu"
        if not src.is_file():
            raise SystemExit(f"{v}: no fixed_point.cu in {d}")
        variants[name] = src
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    rows, mismatches = [], 0
    for tname in args.types.split(","):
        qt = int(QT[tname])
        for n_rows, n_cols in SHAPES[args.shapes]:
            ws, nbytes = _weight_copies(qt, n_rows, n_cols, rng)
            for T in (int(t) for t in args.ts.split(",")):
                x = cp.asarray(rng.standard_normal((T, n_cols), dtype=np.float32))
                outs = [cp.empty((T, n_rows), dtype=cp.float32) for _ in ws]
                mplanes = tc.mmq_quantize(CTX, x)
                mplanes = (mplanes[0].copy(), mplanes[1].copy())
                fplanes = fx.fx_quantize(CTX, x)
                fplanes = (fplanes[0].copy(), fplanes[1].copy())
                want = fx.fx_mmq(CTX, ws[0], x, planes=fplanes).copy()
                paths = {"mmq": lambda i: tc.mmq(CTX, ws[i % len(ws)], x, out=outs[i % len(ws)], planes=mplanes),
                         "fx_mmq": lambda i: fx.fx_mmq(CTX, ws[i % len(ws)], x, out=outs[i % len(ws)], planes=fplanes)}
                row = {"type": tname, "shape": [n_rows, n_cols], "T": T, "weight_bytes": nbytes, "bits": {}}
                if CTX.tuning().mmq_choice(qt, T, n_rows, n_cols // 256).staged_x:
                    # production takes mmqx_kernel / fx_mmqx_kernel here, the variants fx_mmq_kernel:
                    # production's fx_mmq_kernel at the variants' launch too, the like-for-like figure
                    row["production_kernel"] = "mmqx"
                    launch = CTX.tuning().mmq_launch(T, n_rows, n_cols // 256 * 8)
                    paths["fx_mmq_kernel"] = lambda i: fx.fx_mmq(CTX, ws[i % len(ws)], x, out=outs[i % len(ws)],
                                                                 planes=fplanes, config=launch)
                for name, src in variants.items():
                    got = cp.empty_like(want)
                    verdict = row["bits"][name] = bit_check(
                        name, lambda: variant_fx_mmq(src, ws[0], x, got, fplanes) or got, want)
                    if verdict == "failed":
                        continue
                    mismatches += verdict != "same"
                    paths[name] = (lambda s: lambda i: variant_fx_mmq(s, ws[i % len(ws)], x, outs[i % len(ws)],
                                                                     fplanes))(src)
                for k, ms in interleaved_medians(paths, args.rounds, stream).items():
                    row[f"{k}_ms"] = ms
                base = row["mmq_ms"]
                line = f"{tname} {n_rows}x{n_cols} T={T:2d}: mmq{'x' if row.get('production_kernel') else ''} {base:.4f}"
                for k in paths:
                    if k != "mmq" and row.get(f"{k}_ms") is not None:
                        line += f"  {k} {row[f'{k}_ms']:.4f} ({row[f'{k}_ms'] / base:.2f}x)"
                print(line + ("" if all(b == "same" for b in row["bits"].values()) else f"  bits {row['bits']}"),
                      flush=True)
                rows.append(row)
    print(f"bits: {'every variant gives fx_mmq bits' if not mismatches else f'{mismatches} MISMATCHES'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "rounds": args.rounds}, indent=1))


if __name__ == "__main__":
    main()
