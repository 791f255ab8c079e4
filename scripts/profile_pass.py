"""Where one pass's time goes: each backend operation's share, on the GPU's own clock.

A decode pass (B rows of one token each, ``DECODE_CACHED_TOKENS`` positions already in every
row's KV cache) and a prefill pass (one prompt of ``--prompt`` tokens) of a fully resident model
on the cuda backend, each broken down by operation (the ``Backend`` methods the Llama block is
written in, a matrix product named by its weight: ``matmul ffn_down Q6_K [4096x14336]``),
summed over the layers: calls, µs, share of the pass, and GB/s of weight bytes for the products.

How the times are taken, with no profiler: the model runs the pass eagerly through
``ProfiledBackend``, which records a CUDA event on the pass stream after each operation. Before
the pass, a kernel that spins for ``--spin-ms`` holds the GPU, so Python queues the whole pass
(kernels and events) while the GPU waits; the GPU then runs it back to back, and the time
between two consecutive events is that operation's kernels alone, free of launch overhead.
Each operation is checked: if the GPU had already passed the event before it when the event
after it was queued, the GPU may have idled inside its interval waiting for Python, and the
report counts such *exposed* operations (raise ``--spin-ms``). A stream's launch queue holds
about a thousand commands; past that, queuing waits for the GPU, and the same check says
whether the GPU ever caught up.

The same pass as the engine runs it (``LlamaModel.forward``, after warm-up: a replayed CUDA
graph where the backend captures the pass, a decode of few rows; eagerly otherwise; the head
picks on the device and copies the picks) is timed on the wall clock beside the sum of the
kernels: the difference is what the kernels alone do not explain (launch gaps, graph overhead,
the host copy of the picks), printed as ``graph pass X ms vs sum of kernels Y ms``.

    python scripts/profile_pass.py MODEL.gguf [--batch 1 8] [--prompt 512] [--reps 20] [--out prof.json]

Medians over ``--reps`` passes. ``--kernels`` sets the cuda backend's kernel switches
(``KernelOptions``, e.g. ``pdl=off``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from ntx.daemons.compute.backend import PendingPicks, Pick, make_backend
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.model import LlamaModel
from ntx.shared.config import EngineOptions
from ntx.shared.gguf_index import open_model
from ntx.shared.kernel_options import KernelOptions

DECODE_CACHED_TOKENS = 64  # positions every decoding row already has in its KV cache
WARMUP_PASSES = 3  # the engine's first decode pass compiles, the second captures, the third replays

# One operation of one recorded pass: (label, µs on the GPU, weight bytes it read).
Sample = tuple[str, float, int]

# A kernel that holds the GPU for ``ns`` nanoseconds of its global timer (one thread).
SPIN_SOURCE = r"""
extern "C" __global__ void ntx_profile_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


# ------------------------------------------------------------------------------ the profile
def aggregate(reps: list[list[Sample]]) -> dict[str, Any]:
    """The profile of ``reps`` recordings of one pass: per operation label (summed over its
    calls in a pass) the median over reps, its share of the sum of those medians
    (``kernels_ms``), µs per call and, where it read weights, GB/s; the same rolled up by kind
    (a label's first word). Every rep must have recorded the same operations in the same order."""
    if not reps or not reps[0]:
        raise ValueError("no recorded operations to aggregate")
    order = [label for label, _, _ in reps[0]]
    for rep in reps[1:]:
        if [label for label, _, _ in rep] != order:
            raise ValueError("the recorded passes ran different operations")
    calls: dict[str, int] = {}
    weight_bytes: dict[str, int] = {}
    for label, _, nbytes in reps[0]:
        calls[label] = calls.get(label, 0) + 1
        weight_bytes[label] = weight_bytes.get(label, 0) + nbytes
    per_rep_us: dict[str, list[float]] = {label: [] for label in calls}
    for rep in reps:
        totals = dict.fromkeys(calls, 0.0)
        for label, us, _ in rep:
            totals[label] += us
        for label, us in totals.items():
            per_rep_us[label].append(us)
    median_us = {label: statistics.median(v) for label, v in per_rep_us.items()}
    kernels_us = sum(median_us.values())
    share = (lambda us: us / kernels_us) if kernels_us > 0 else (lambda us: 0.0)
    ops = []
    for label in sorted(calls, key=lambda lb: (-median_us[lb], lb)):
        us = median_us[label]
        gbps = weight_bytes[label] / us / 1e3 if weight_bytes[label] and us > 0 else None
        ops.append({"op": label, "kind": label.split()[0], "calls": calls[label], "total_us": round(us, 2),
                    "per_call_us": round(us / calls[label], 2), "share": round(share(us), 4),
                    "weight_gbps": round(gbps, 1) if gbps is not None else None})
    by_kind: dict[str, dict[str, Any]] = {}
    for op in ops:
        k = by_kind.setdefault(op["kind"], {"kind": op["kind"], "calls": 0, "total_us": 0.0})
        k["calls"] += op["calls"]
        k["total_us"] += median_us[op["op"]]
    kinds = sorted(by_kind.values(), key=lambda k: -k["total_us"])
    for k in kinds:
        k["share"] = round(share(k["total_us"]), 4)
        k["total_us"] = round(k["total_us"], 2)
    total_bytes = sum(weight_bytes.values())
    return {"kernels_ms": round(kernels_us / 1e3, 4), "reps": len(reps), "ops_per_pass": len(order),
            "weight_bytes": total_bytes,
            "weight_gbps": round(total_bytes / kernels_us / 1e3, 1) if kernels_us > 0 else None,
            "ops": ops, "by_kind": kinds}


def format_profile(title: str, prof: dict[str, Any]) -> str:
    """The profile as a text table: a header (the pass as the engine runs it against the sum
    of the kernels), one row per operation, largest first, and the roll-up by kind."""
    kernels_ms = prof["kernels_ms"]
    lines = [f"== {title}: medians of {prof['reps']} passes"]
    engine_ms = prof.get("engine_pass_ms")
    if engine_ms is not None:
        gap_ms = engine_ms - kernels_ms
        lines.append(f"{prof['engine_pass']} pass {engine_ms:.3f} ms vs sum of kernels {kernels_ms:.3f} ms: "
                     f"{gap_ms:+.3f} ms ({gap_ms / engine_ms:+.1%} of the pass) launch gaps, graph overhead, host copies")
    else:
        lines.append(f"sum of kernels {kernels_ms:.3f} ms")
    if prof.get("weight_gbps") is not None:
        lines.append(f"weights read at {prof['weight_gbps']:.0f} GB/s over the kernels' time")
    if prof.get("exposed_ops"):
        lines.append(f"WARNING: in some pass the GPU caught up with Python in {prof['exposed_ops']} of "
                     f"{prof['ops_per_pass']} operations: their times may include idle time (raise --spin-ms)")
    lines.append(f"{'share':>7} {'total µs':>10} {'calls':>6} {'µs/call':>9} {'GB/s':>7}  operation")
    for op in prof["ops"]:
        gbps = f"{op['weight_gbps']:.0f}" if op["weight_gbps"] is not None else "-"
        lines.append(f"{op['share']:7.1%} {op['total_us']:10.1f} {op['calls']:6d} {op['per_call_us']:9.2f} "
                     f"{gbps:>7}  {op['op']}")
    lines.append("by kind: " + ", ".join(f"{k['kind']} {k['share']:.1%}" for k in prof["by_kind"]))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ recording
def matrix_labels(model: LlamaModel) -> dict[int, tuple[str, int, int, int]]:
    """Each resident weight matrix the backend made (by object identity, as ``matmul`` gets
    it) -> (its operation label, its bytes, its GGUF type, its columns): ``matmul attn_q Q4_K
    [4096x4096]``."""
    labels = {}
    for i, weights in model.resident.items():
        for name, t in model.index.layers[i].tensors.items():
            if len(t.shape) == 2:
                labels[id(weights[name])] = (f"matmul {name} {t.type_name} [{t.shape[0]}x{t.shape[1]}]", t.nbytes,
                                             int(t.ggml_type), int(t.shape[1]))
    return labels


class ProfiledBackend:
    """A backend that runs every operation of a pass through ``inner`` and tells ``recorder``
    after each one (``recorder.begin()`` once the pass's inputs are queued, then
    ``recorder.mark(label, weight_bytes)``). Everything else goes to ``inner`` unchanged, except
    that nothing is captured: the pass runs eagerly, operation by operation.

    The head runs as the cuda backend's ``pick_launch`` runs it on the device, in two parts: final
    norm and head matvec (``inner._logits_dev``), then ``topk`` of the largest k asked; the picks
    are not copied to the host (the profiled pass's result is not used): no rows come back.
    ``topk`` is the device selection function (``CudaBackend.topk``); ``fused_attention`` tells
    whether the backend runs a pass's attention and W_o product as one operation."""

    def __init__(self, inner: Any, recorder: Any, model: LlamaModel, topk: Callable,
                 fused_attention: Callable[[int, Any], bool]) -> None:
        self.inner = inner
        self.recorder = recorder
        self.topk = topk
        self.fused_attention = fused_attention  # (rows, W_o's Weight): CudaBackend.attention_fuses
        self.matrices = matrix_labels(model)
        g = model.index.globals
        head = g.get("output", g["token_embd"])
        self.head_label = f"head rmsnorm+matvec {head.type_name} [{head.shape[0]}x{head.shape[1]}]"
        self.head_bytes = head.nbytes
        self.captured_by_engine = False  # whether the engine would replay a graph for the last pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _timed(self, label: str, weight_bytes: int, op: Callable, *args) -> Any:
        out = op(*args)
        self.recorder.mark(label, weight_bytes)
        return out

    def begin_pass(self, batch: StepBatch) -> Any:
        ws = self.inner.begin_pass(batch)
        self.captured_by_engine = ws.capturable
        self.recorder.begin()
        return ws

    def run_captured(self, key, ws, run: Callable[[], None]) -> None:
        run()

    def embed(self, ws):
        return self._timed("embed", 0, self.inner.embed, ws)

    def rms_norm(self, x, w, out):
        return self._timed("rms_norm", 0, self.inner.rms_norm, x, w, out)

    def add_rms_norm(self, x, delta, w, out):
        return self._timed("add_rms_norm", 0, self.inner.add_rms_norm, x, delta, w, out)

    def matmul(self, w, x, out):
        label, nbytes = self.matrices[id(w)][:2]
        return self._timed(label, nbytes, self.inner.matmul, w, x, out)

    def matmuls(self, x, products) -> None:
        """The products of one x as the backend runs them (x quantized once): one timed
        operation, labelled with every matrix."""
        labels = [self.matrices[id(w)][:2] for w, _ in products]
        label = "matmul " + " + ".join(lbl.removeprefix("matmul ") for lbl, _ in labels)
        self._timed(label, sum(n for _, n in labels), self.inner.matmuls, x, products)

    def norm_matmuls(self, x, w, h, products, delta=None) -> None:
        """The norm and the products of its output as the backend runs them (the i16 planes made
        in the norm's kernel): one timed operation."""
        labels = [self.matrices[id(m)][:2] for m, _ in products]
        norm = "rms_norm" if delta is None else "add_rms_norm"
        label = "matmul " + " + ".join(lbl.removeprefix("matmul ") for lbl, _ in labels) + f" with its {norm}"
        self._timed(label, sum(n for _, n in labels), self.inner.norm_matmuls, x, w, h, products, delta)

    def swiglu_matmul_add(self, gate, up, act, w, out, tmp):
        label, nbytes = self.matrices[id(w)][:2]
        return self._timed(label + " with its swiglu + add", nbytes, self.inner.swiglu_matmul_add, gate, up, act,
                           w, out, tmp)

    def qkv_bias_pairs(self, q, k, v, biases, ws) -> None:  # a Qwen2 layer's
        self._timed("qkv bias+pairs", 0, self.inner.qkv_bias_pairs, q, k, v, biases, ws)

    def rope_kv_write(self, layer_idx, q, k, v, ws) -> None:
        self._timed("rope+kv_write", 0, self.inner.rope_kv_write, layer_idx, q, k, v, ws)

    def attention(self, layer_idx, q, ws, out):
        return self._timed("attention", 0, self.inner.attention, layer_idx, q, ws, out)

    def attention_matmul(self, layer_idx, q, ws, attn, w, out):
        """One timed operation where the backend fuses the two (``fused_attention``), else the
        attention and the product apart, as the backend then runs them: a prefill's attention
        is a large share of its pass, and stays visible."""
        label, nbytes = self.matrices[id(w)][:2]
        if not self.fused_attention(ws.T, w):
            self.attention(layer_idx, q, ws, out=attn)
            return self.matmul(w, attn, out=out)
        return self._timed(label + " with its attention", nbytes, self.inner.attention_matmul, layer_idx, q, ws,
                           attn, w, out)

    def swiglu(self, gate, up, out):
        return self._timed("swiglu", 0, self.inner.swiglu, gate, up, out)

    def add(self, x, y, out):
        return self._timed("add", 0, self.inner.add, x, y, out)

    def pick_launch(self, ws, picks: list[Pick]) -> PendingPicks:
        logits = self._timed(self.head_label, self.head_bytes, self.inner._logits_dev, ws)  # [N, V]
        k = max(p.k for p in picks)
        if k > 0:
            self._timed("topk", 0, self.topk, logits, min(k, logits.shape[1]))
        return PendingPicks([])  # nothing comes back: the profiled pass's result is not used


class EventRecorder:
    """Times the operations of one pass on the GPU: ``begin`` queues the spin kernel and the
    first event on ``stream``, ``mark`` an event after each operation, ``finish`` waits and
    returns the operations' samples. An operation is *exposed* when the event before it had
    already completed by the time its own event was queued: the GPU may then have idled inside
    its interval, waiting for Python."""

    def __init__(self, stream: Any, spin_ms: float) -> None:
        import cupy as cp

        self.cp = cp
        self.stream = stream
        self.spin_ns = np.uint64(int(spin_ms * 1e6))
        self.spin = cp.RawKernel(SPIN_SOURCE, "ntx_profile_spin")
        self.events: list[Any] = []  # reused from pass to pass; [0] follows the spin
        self.labels: list[tuple[str, int]] = []
        self.exposed = 0
        self.t_begin = 0.0
        self.queued_s = 0.0
        with stream:
            self.spin((1,), (1,), (np.uint64(0),))  # compiled and loaded here, outside any pass
        stream.synchronize()

    def _record(self, i: int) -> None:
        """Queue event i of the pass (0: after the spin; i: after operation i)."""
        if i == len(self.events):
            self.events.append(self.cp.cuda.Event())
        self.events[i].record(self.stream)

    def begin(self) -> None:
        self.labels.clear()
        self.exposed = 0
        with self.stream:
            self.spin((1,), (1,), (self.spin_ns,))
        self._record(0)
        self.t_begin = time.perf_counter()

    def mark(self, label: str, weight_bytes: int) -> None:
        self.labels.append((label, weight_bytes))
        n = len(self.labels)
        self._record(n)
        if self.events[n - 1].done:
            self.exposed += 1

    def finish(self) -> list[Sample]:
        """Wait for the pass; its samples in the order run. Sets ``exposed`` and ``queued_s``
        (CPU seconds from the first event to the last, launches included)."""
        self.queued_s = time.perf_counter() - self.t_begin
        n = len(self.labels)
        self.events[n].synchronize()
        elapsed_ms = self.cp.cuda.get_elapsed_time
        return [(label, elapsed_ms(self.events[i], self.events[i + 1]) * 1e3, nbytes)
                for i, (label, nbytes) in enumerate(self.labels)]


# ------------------------------------------------------------------------------ the passes
def engine_pass_ms(model: LlamaModel, batch: StepBatch, picks: list[Pick], reps: int) -> float:
    """Median wall time of ``model.forward(batch, picks)`` as the engine runs it, after
    ``WARMUP_PASSES`` untimed ones (compile, capture)."""
    for _ in range(WARMUP_PASSES):
        model.forward(batch, picks)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        model.forward(batch, picks)  # pick copies its results to the host: the pass is done
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def profile_pass(model: LlamaModel, batch: StepBatch, picks: list[Pick], reps: int, recorder: Any,
                 topk: Callable, fused_attention: Callable[[int, Any], bool]) -> dict[str, Any]:
    """``reps`` passes of ``batch`` recorded by ``recorder`` (``EventRecorder``; after one
    unrecorded pass) and aggregated, beside the same pass as the engine runs it."""
    engine_ms = engine_pass_ms(model, batch, picks, reps)
    inner = model.backend
    profiled = ProfiledBackend(inner, recorder, model, topk, fused_attention)
    recorded, exposed, queued_s = [], 0, []
    model.backend = profiled
    try:
        for rep in range(reps + 1):
            model.forward(batch, picks)
            samples = recorder.finish()
            if rep:  # the first one warms the eager path (the head's sub-batch, the recorder's events)
                recorded.append(samples)
                exposed = max(exposed, recorder.exposed)
                queued_s.append(recorder.queued_s)
    finally:
        model.backend = inner
    prof = aggregate(recorded)
    prof.update(engine_pass="graph" if profiled.captured_by_engine else "eager", engine_pass_ms=round(engine_ms, 4),
                gap_ms=round(engine_ms - prof["kernels_ms"], 4), exposed_ops=exposed,
                queued_ms=round(statistics.median(queued_s) * 1e3, 3))
    return prof


def run(path: str, batches: list[int], prompt_tokens: int, reps: int, spin_ms: float, ctx: int | None,
        kernels: KernelOptions | None = None) -> dict[str, Any]:
    """Load ``path`` fully resident on the cuda backend (``kernels``: its kernel switches) and
    profile a decode pass per batch size and one prefill pass of ``prompt_tokens`` (none when
    0); each pass's table is printed as soon as it is measured."""
    import cupy as cp

    from ntx.daemons.compute.probes import device_copy_gbps

    index = open_model(path)
    hp = index.hparams
    ctx = EngineOptions(ctx=ctx).for_model(hp.n_ctx_train).ctx  # None: the engine's default for this model
    max_ctx = min(max(ctx, prompt_tokens, DECODE_CACHED_TOKENS + 1), hp.n_ctx_train)
    if prompt_tokens > max_ctx or DECODE_CACHED_TOKENS + 1 > max_ctx:
        raise SystemExit(f"error: the model holds {hp.n_ctx_train} positions, the passes need "
                         f"{max(prompt_tokens, DECODE_CACHED_TOKENS + 1)}")
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    report: dict[str, Any] = {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "copy_gbps": round(device_copy_gbps(), 1), "model": os.path.basename(path), "type": index.file_type,
        "layers": hp.n_layers, "max_context": max_ctx, "kernels": (kernels or KernelOptions()).describe(),
        "spin_ms": spin_ms, "passes": {}}
    print(f"device {report['device']}: device-to-device copy {report['copy_gbps']:.0f} GB/s (read + write); "
          f"kernels {report['kernels']}; KV cache of {max_ctx} positions", flush=True)
    backend = make_backend("cuda", index, max_seqs=max(batches, default=1), max_ctx=max_ctx, kernels=kernels)
    model = LlamaModel(index, backend)
    recorder = EventRecorder(backend.stream, spin_ms)
    rng = np.random.default_rng(0)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, hp.n_vocab, n))

    for B in batches:
        seqs = range(1, B + 1)
        for s in seqs:
            backend.alloc_sequence(s, max_ctx)
            model.forward(StepBatch([SeqChunk(s, 0, tokens(DECODE_CACHED_TOKENS))]), [Pick(1)])
        batch = StepBatch([SeqChunk(s, DECODE_CACHED_TOKENS, tokens(1)) for s in seqs])
        prof = profile_pass(model, batch, [Pick(1)] * B, reps, recorder, backend.topk, backend.attention_fuses)
        prof.update(pass_kind="decode", rows=B, cached_tokens=DECODE_CACHED_TOKENS)
        report["passes"][f"decode_b{B}"] = prof
        print_pass(report, prof)
        for s in seqs:
            backend.free_sequence(s)
    if prompt_tokens:
        backend.alloc_sequence(0, max_ctx)
        prefill = StepBatch([SeqChunk(0, 0, tokens(prompt_tokens))])
        prof = profile_pass(model, prefill, [Pick(1)], reps, recorder, backend.topk, backend.attention_fuses)
        prof.update(pass_kind="prefill", rows=prompt_tokens, cached_tokens=0)
        report["passes"][f"prefill_{prompt_tokens}"] = prof
        print_pass(report, prof)
        backend.free_sequence(0)
    return report


def print_pass(report: dict[str, Any], prof: dict[str, Any]) -> None:
    what = (f"decode, batch {prof['rows']} (one token a row, {prof['cached_tokens']} positions cached)"
            if prof["pass_kind"] == "decode" else f"prefill of one {prof['rows']}-token prompt")
    print()
    print(format_profile(f"{report['model']} ({report['type']}, {report['layers']} layers): {what}", prof))
    print(f"(Python queued a recorded pass in {prof['queued_ms']:.1f} ms while the GPU spun {report['spin_ms']:.0f} ms)",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="decode rows, one profile each (default 1)")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens; 0: no prefill pass (default 512)")
    ap.add_argument("--reps", type=int, default=20, help="recorded passes of each kind; medians (default 20)")
    ap.add_argument("--spin-ms", type=float, default=200.0,
                    help="how long the GPU is held while Python queues a pass (default 200)")
    ap.add_argument("--ctx", type=int, default=EngineOptions().ctx,
                    help="positions per sequence the KV cache holds, as the engine's --ctx (default: the engine's for the model)")
    ap.add_argument("--kernels", default="", help="the cuda backend's kernel switches, e.g. pdl=off (KernelOptions)")
    ap.add_argument("--out", default=None, help="write the profile as JSON here")
    args = ap.parse_args()
    if args.reps < 1 or args.prompt < 0 or args.spin_ms <= 0 or any(b < 1 for b in args.batch):
        ap.error("--reps and --batch must be at least 1, --prompt at least 0, --spin-ms positive")
    report = run(args.model, args.batch, args.prompt, args.reps, args.spin_ms, args.ctx, KernelOptions.parse(args.kernels))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
