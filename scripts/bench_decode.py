"""Decode speed of fully resident models on the cuda backend, against the device's copy bandwidth.

For each model: load every layer into VRAM, prefill a short prompt, then decode greedily and
time (a) the model's passes alone (``LlamaModel.forward`` on one token with a greedy pick a row,
as the engine asks: the head's top-1 on the device, only the picks copied back; what the kernels
and graphs cost) and (b) whole engine steps (sampling and bookkeeping included), with the next pass
queued while the host takes the current one (``EngineCore.run_ahead``, the default) and without.
The weight-read bandwidth is (bytes of every layer + the output head) per token × tokens/s,
compared with the device-to-device copy bandwidth measured in the same run (bytes read + written
/ time).

    python scripts/bench_decode.py MODEL.gguf [MODEL2.gguf ...] [--tokens 128] [--batch 1 8] [--out bench.json]
                                   [--kernels "" batch-invariant=on]

--kernels: the kernel switches (``--kernels`` of ntxctl start) of each run, every model timed
under each in turn, in one process on one device; with more than one, each later setting's pass
time is also given relative to the first's (e.g. the batch-invariant mode's cost).

--fx-mvq-launch NR,WARPS,U: the batch-invariant mode's fixed-point matvec (fixed_point.py
fx_matvec_pieces) takes this launch (rows a CTA, warps a CTA, pieces a lane a trip) for every
K-quant at 1 and 2 rows, in place of the device table's fx_mvq_launch, for the whole run: what a
launch gives a whole pass, beside what dev/cuda/bench_gemm_paths.py --sweep-mv times of the
product alone (its bits are the same at every launch).

--rounds R (with two or more --kernels): one engine per setting, all loaded at once, and the
model passes of each batch size timed in R rounds that take every setting in turn (--tokens passes
a setting a round, over the same positions each round), so the settings share the device's
warm-up and drift. Each later setting's cost is the median over the rounds of its pass time
against the first setting's in the same round, with the spread (lowest and highest round): a
pass-cost difference of a few percent is inside the spread of runs timed one after the other.
Engine steps are not timed in this mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import cupy as cp

from ntx.ctl.local import build_local_engine
from ntx.daemons.compute.backend import Pick
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.probes import device_copy_gbps
from ntx.shared.config import EngineOptions
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.messages import EngineRequest
from ntx.shared.sampling_fields import SamplingParams


def bench_model(path: str, tokens: int, batches: list[int], kernels: str = "") -> dict:
    t0 = time.monotonic()
    eng = build_local_engine(path, backend="cuda", options=EngineOptions(max_batch=max(batches), ctx=tokens + 64,
                                                                         kernels=kernels))
    res = {**report_head(path, eng, kernels), "load_s": round(time.monotonic() - t0, 2), "batches": {}}
    bytes_per_pass = res["weight_bytes_per_pass"]
    prompt = list(range(100, 108))
    for B in batches:
        # model passes alone: B sequences decoding one token each, graph-captured after the first
        timer = PassTimer(eng, B, tokens)
        pass_s = timer.time(tokens)
        timer.close()
        # whole engine: B requests decoding together, passes queued one ahead of the host
        # (EngineCore.run_ahead, the default on the GPU) and, for comparison, one at a time
        engine_tps = {ahead: engine_tokens_per_s(eng, B, prompt, tokens, ahead) for ahead in (True, False)}
        res["batches"][B] = {
            "pass_ms": round(pass_s * 1e3, 3),
            "model_tokens_per_s": round(B / pass_s, 1),
            "model_weight_gbps": round(bytes_per_pass / pass_s / 1e9, 1),
            "engine_tokens_per_s": round(engine_tps[True], 1),
            "engine_weight_gbps": round(bytes_per_pass * engine_tps[True] / B / 1e9, 1),
            "engine_serial_tokens_per_s": round(engine_tps[False], 1),
        }
    del eng
    cp.get_default_memory_pool().free_all_blocks()
    return res


def report_head(path: str, eng, kernels: str) -> dict:
    """A model's report fields before any timing: its file, type, layers, kernel switches, and
    the weight bytes a pass reads (every layer and the output head)."""
    idx = eng.core.model.index
    head = idx.globals.get("output", idx.globals["token_embd"])
    return {"model": os.path.basename(path), "type": idx.file_type, "layers": idx.hparams.n_layers,
            "kernels": KernelOptions.parse(kernels).describe(),
            "weight_bytes_per_pass": idx.layer_bytes_total + head.nbytes}


class PassTimer:
    """Times ``eng``'s model passes at batch B over the same positions each call: B sequences
    prefilled once, then each ``time(n)`` decodes n tokens from the position after the warm-up.
    Each pass picks every row's top token on the device, as the engine's greedy decode does: a pass
    without picks copies all of its logits to the host ([B, V] f32: 33 MB at 64 rows of a
    128256-token vocabulary), which took 25 of a 64-row pass's 39 ms on an H100's host and hid
    most of a kernel change's cost there."""

    def __init__(self, eng, B: int, tokens: int) -> None:
        self.m, self.B = eng.core.model, B
        self.picks = [Pick(1)] * B
        prompt = list(range(100, 108))
        for s in range(B):
            self.m.backend.alloc_sequence(2000 + s, tokens + 64)
            self.m.forward(StepBatch([SeqChunk(2000 + s, 0, tuple(prompt))]), [Pick(1)])
        self.start = len(prompt)
        self.time(3)  # capture the graphs before any timing

    def _chunks(self, pos: int) -> StepBatch:
        return StepBatch([SeqChunk(2000 + s, pos, (5 + s,)) for s in range(self.B)])

    def time(self, n: int) -> float:
        """Seconds a pass, over n passes from the first decode position."""
        self.m.backend.sync()
        t = time.perf_counter()
        for i in range(n):
            self.m.forward(self._chunks(self.start + i), self.picks)
        self.m.backend.sync()
        return (time.perf_counter() - t) / n

    def close(self) -> None:
        for s in range(self.B):
            self.m.backend.free_sequence(2000 + s)


def bench_rounds(path: str, tokens: int, batches: list[int], settings: list[str], rounds: int) -> list[dict]:
    """Every setting's engine loaded at once; per batch size, ``rounds`` rounds of ``tokens``
    passes a setting in turn. Returns one report per setting, each later one with its median
    per-round cost against the first and that cost's lowest and highest round."""
    engines = [build_local_engine(path, backend="cuda", options=EngineOptions(max_batch=max(batches), ctx=tokens + 64,
                                                                              kernels=k)) for k in settings]
    reports = [{**report_head(path, e, k), "rounds": rounds, "batches": {}} for e, k in zip(engines, settings)]
    bytes_per_pass = reports[0]["weight_bytes_per_pass"]
    for B in batches:
        timers = [PassTimer(e, B, tokens) for e in engines]
        per_round = [[t.time(tokens) for t in timers] for _ in range(rounds)]  # [round][setting] s a pass
        for t in timers:
            t.close()
        for i, r in enumerate(reports):
            times = sorted(row[i] for row in per_round)
            pass_s = times[len(times) // 2]
            b = {"pass_ms": round(pass_s * 1e3, 3), "pass_ms_rounds": [round(row[i] * 1e3, 3) for row in per_round],
                 "model_tokens_per_s": round(B / pass_s, 1), "model_weight_gbps": round(bytes_per_pass / pass_s / 1e9, 1)}
            if i > 0:
                costs = sorted(row[i] / row[0] - 1.0 for row in per_round)
                b.update(pass_vs_first=round(costs[len(costs) // 2], 4), pass_vs_first_low=round(costs[0], 4),
                         pass_vs_first_high=round(costs[-1], 4))
            r["batches"][B] = b
    del engines, timers
    cp.get_default_memory_pool().free_all_blocks()
    return reports


def engine_tokens_per_s(eng, B: int, prompt: list[int], tokens: int, run_ahead: bool) -> float:
    """Tokens per second of ``eng`` decoding B greedy requests of ``tokens`` tokens together,
    from the first token on (the first step, the prefill, is not counted)."""
    eng.core.run_ahead = run_ahead
    for s in range(B):
        eng.submit(EngineRequest(f"b{B}-{s}-{run_ahead}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens)))
    n_tok = 0
    t = None
    while eng.has_work:
        evs = eng.step()
        if t is None:  # the first step is the prefill
            t = time.perf_counter()
            continue
        n_tok += sum(1 for e in evs if e["type"] == "token")
    return n_tok / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", nargs="+", default=[""],
                    help='kernel switches of each run, e.g. "" batch-invariant=on (default: the defaults)')
    ap.add_argument("--rounds", type=int, default=1,
                    help="with several --kernels: all loaded at once, passes timed in this many alternating rounds")
    ap.add_argument("--fx-mvq-launch", default=None, metavar="NR,WARPS,U",
                    help="the fixed-point matvec's launch at 1-2 rows for this run (default: the device table's)")
    args = ap.parse_args()
    for text in args.kernels:
        KernelOptions.parse(text)  # a bad switch stops here, before any model loads
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    if args.rounds > 1 and len(args.kernels) < 2:
        ap.error("--rounds alternates --kernels settings: give two or more (e.g. --kernels \"\" batch-invariant=on)")
    if args.fx_mvq_launch:
        try:
            set_fx_mvq_launch(parse_launch(args.fx_mvq_launch))
        except ValueError as e:
            ap.error(f"--fx-mvq-launch {args.fx_mvq_launch}: {e}")
    props = cp.cuda.runtime.getDeviceProperties(0)
    copy_gbps = device_copy_gbps()
    report = {"device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
              "copy_gbps": round(copy_gbps, 1), "models": []}
    print(f"device {report['device']}: device-to-device copy {copy_gbps:.0f} GB/s (read + write)", flush=True)
    for path in args.models:
        if args.rounds > 1:
            for r in bench_rounds(path, args.tokens, args.batch, args.kernels, args.rounds):
                report["models"].append(r)
                print(f"{r['model']}: kernels {r['kernels']}", flush=True)
                print_rounds(r, copy_gbps)
            continue
        first = None
        for kernels in args.kernels:
            r = bench_model(path, args.tokens, args.batch, kernels)
            report["models"].append(r)
            print(f"{r['model']}: kernels {r['kernels']}", flush=True)
            if first is None:
                first = r
            else:  # this setting's pass time against the first setting's, per batch size
                for B, b in r["batches"].items():
                    b["pass_vs_first"] = round(b["pass_ms"] / first["batches"][B]["pass_ms"] - 1.0, 4)
            print_model(r, copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def parse_launch(text: str) -> tuple[int, int, int]:
    """"NR,WARPS,U" -> (NR, WARPS, U), each in the matvec's range (tuning.py)."""
    from ntx.daemons.compute.cuda.tuning import MV_MAX_WARPS, MV_ROWS_PER_CTA, MV_UNROLLS

    try:
        nr, nw, u = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError("give three integers: rows a CTA, warps a CTA, pieces a trip (e.g. 4,2,1)") from None
    if nr not in MV_ROWS_PER_CTA or u not in MV_UNROLLS or not 1 <= nw <= MV_MAX_WARPS:
        raise ValueError(f"rows a CTA in {MV_ROWS_PER_CTA}, 1-{MV_MAX_WARPS} warps, pieces a trip in {MV_UNROLLS}")
    return nr, nw, u


def set_fx_mvq_launch(launch: tuple[int, int, int]) -> None:
    """The device table with ``launch`` as the fixed-point matvec's for Q4_K, Q5_K and Q6_K at 1
    and 2 rows, small matrices too (its fx_mvq_launch; no fx_mvq_small_launch), for the backends
    this process makes from now on."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType as QT

    from ntx.daemons.compute.cuda import runtime

    t = runtime.tuning()
    keys = {(qt, B) for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K) for B in (1, 2)}
    name = f"{t.name} fx_mvq {','.join(map(str, launch))}"
    runtime.set_tuning(replace(t, name=name, fx_mvq_launch={**t.fx_mvq_launch, **{k: launch for k in keys}},
                               fx_mvq_small_launch={}))


def pass_line(r: dict, B, b: dict, copy_gbps: float) -> str:
    """The start of a batch size's printed line: model passes alone, beside the device's copy."""
    return (f"{r['model']:40s} {r['type']:7s} batch {B:2d}: pass {b['pass_ms']:7.3f} ms  "
            f"model {b['model_tokens_per_s']:8.1f} tok/s  {b['model_weight_gbps']:7.1f} GB/s "
            f"({100 * b['model_weight_gbps'] / copy_gbps:4.1f}% of copy)")


def print_rounds(r: dict, copy_gbps: float) -> None:
    for B, b in r["batches"].items():
        cost = (f"  pass {100 * b['pass_vs_first']:+.1f}% vs the first --kernels (median of {r['rounds']} rounds; "
                f"{100 * b['pass_vs_first_low']:+.1f}% to {100 * b['pass_vs_first_high']:+.1f}%)"
                if "pass_vs_first" in b else f"  (median of {r['rounds']} rounds)")
        print(pass_line(r, B, b, copy_gbps) + cost, flush=True)


def print_model(r: dict, copy_gbps: float) -> None:
    for B, b in r["batches"].items():
        cost = f"  pass {100 * b['pass_vs_first']:+.1f}% vs the first --kernels" if "pass_vs_first" in b else ""
        print(pass_line(r, B, b, copy_gbps)
              + f"  engine {b['engine_tokens_per_s']:8.1f} tok/s ({100 * b['engine_weight_gbps'] / copy_gbps:4.1f}%; "
              f"{b['engine_serial_tokens_per_s']:.1f} one pass at a time){cost}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
