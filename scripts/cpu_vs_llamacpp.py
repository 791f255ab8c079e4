"""ntx's CPU backend beside llama.cpp's CPU build: decode speed on the same GGUF, same thread count.

The goal it checks (docs/PERFORMANCE.md, CPU): ntx's CPU backend at least 0.8x llama.cpp's CPU
build on the same machine and file, at batch 1. In one run, interleaved round by round (ntx,
llama.cpp, ntx, llama.cpp, ...) so that whatever else the machine does hits both:

- ntx: the engine ``ntxctl generate --local`` runs (``ntx.ctl.local``), built once in this process
  on the cpu backend; each round decodes ``--tokens`` tokens greedily after a short prompt, and
  only those decode steps are timed (loading, warm-up and the prompt's pass are not). End of
  generation tokens are ignored, as llama-bench does, so every round decodes the same count. With
  ``--pp N``, a separate N-token prompt's one pass is timed too (prompt processing).
- llama.cpp: ``llama-bench -m MODEL -t THREADS -n TOKENS -p PP -r 1 -o json`` per round (its own
  warm-up run is untimed), the tok/s it reports. It is built by scripts/build_llama_cpp.sh from
  the source vendored in llama-cpp-python 0.3.36; where it is not built, that half is skipped and
  the line says how to build it.
- with ``--pipeline``, also ntx through a real pipeline: ``ntxctl start --backend cpu`` in a run
  folder of its own on a free port, each round one greedy request through the client, the
  ``decode_tokens_per_s`` of its ``done`` reply (end of generation ends it there).

The thread count (``--threads``, default every core this process may use) goes to llama-bench as
``-t`` and to ntx as ``NTX_CPU_THREADS`` (and to the BLAS libraries' own variables where the user
has not set them, ``ntx.daemons.compute.threads``), set before numpy loads.

The limit beside the figures, measured in the same run: the host's memory read bandwidth (numpy
sums over a 1 GiB array split among the threads, best of ``--bw-repeats``), and the bytes each
decoded token must read (every layer's weights plus the output head), so each engine's tok/s
is also shown as GB/s of weights read and as a share of that bandwidth.

    python scripts/cpu_vs_llamacpp.py [--model M.gguf] [--threads N] [--tokens 64] [--pp 64]
        [--rounds 5] [--pipeline] [--llama-bench PATH] [--llama-args='-ngl 0'] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GOAL_RATIO = 0.8  # ntx's decode tok/s over llama.cpp's, at least
GIB = 1 << 30
BUSY_LOAD = 0.5  # load average beyond the cores the threads leave free: the report warns
# SmolLM2 continues this greedily for more than 64 tokens (the README's "The capital of France is"
# ends after 29), so a pipeline's request, which stops at end of generation, decodes as many as the rest
DECODE_PROMPT = "Once upon a time, in a small village by the sea,"
PP_TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill, and "
           "the miller counts the sacks of flour he will carry to the market in the morning. ")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=None, help="GGUF file (default: the default model, pulled on first use)")
    ap.add_argument("--threads", "-t", type=int, default=None,
                    help="threads for both engines (default: every core this process may use)")
    ap.add_argument("--tokens", "-n", type=int, default=64, help="tokens decoded per round (default 64)")
    ap.add_argument("--pp", type=int, default=0, help="also time one pass over a prompt of this many tokens (0: no)")
    ap.add_argument("--rounds", "-r", type=int, default=5, help="interleaved rounds, one sample per engine each")
    ap.add_argument("--llama-bench", default=None,
                    help="llama-bench binary (default: scripts/build_llama_cpp.sh's CPU build in the ntx cache)")
    ap.add_argument("--llama-args", default="",
                    help="more llama-bench options, one string split as a shell would: --llama-args='-ngl 0' "
                         "(a CUDA build on the host's cores)")
    ap.add_argument("--no-llama", action="store_true", help="measure ntx alone")
    ap.add_argument("--pipeline", action="store_true",
                    help="also ntx through a real pipeline (ntxctl start --backend cpu)")
    ap.add_argument("--bw-mib", type=int, default=1024, help="the read bandwidth probe's array, MiB (default 1024)")
    ap.add_argument("--bw-repeats", type=int, default=5, help="read bandwidth: best of this many sums (default 5)")
    ap.add_argument("--json", dest="json_out", default=None, help="write the results here as JSON")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, each checked: a bad one exits with one line naming it and the fix."""
    ap = build_parser()
    args = ap.parse_args(argv)
    usable = len(os.sched_getaffinity(0))
    if args.threads is None:
        args.threads = usable
    for name, low in (("threads", 1), ("tokens", 1), ("pp", 0), ("rounds", 1), ("bw_mib", 1), ("bw_repeats", 1)):
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {low}")
    if args.model is not None and not os.path.isfile(args.model):
        ap.error(f"--model {args.model}: no such file (give a GGUF file, or leave --model out for the default model)")
    try:
        args.llama_args = shlex.split(args.llama_args)
    except ValueError as e:
        ap.error(f"--llama-args {args.llama_args!r}: {e}")
    if args.llama_bench is not None and args.no_llama:
        ap.error("--llama-bench and --no-llama contradict each other: give one")
    if args.llama_bench is not None and not (os.path.isfile(args.llama_bench) and os.access(args.llama_bench, os.X_OK)):
        ap.error(f"--llama-bench {args.llama_bench}: no such executable (scripts/build_llama_cpp.sh --print-bin says "
                 "where the build puts it)")
    return args


def set_thread_env(threads: int) -> dict[str, str]:
    """``NTX_CPU_THREADS`` and the BLAS libraries' thread variables for this process (before numpy
    loads: they are read once, at load); returns what they now hold."""
    from ntx.daemons.compute.threads import BLAS_THREAD_VARS, bound_blas_threads

    os.environ["NTX_CPU_THREADS"] = str(threads)
    bound_blas_threads(os.environ)
    return {var: os.environ[var] for var in ("NTX_CPU_THREADS", *BLAS_THREAD_VARS)}


# ---------------------------------------------------------------------------------------------
# The machine and the model


def host_info() -> dict[str, Any]:
    """Cores this process may use, the CPU's model name and the memory, from /proc."""
    cpu = platform.processor() or platform.machine()
    mem_bytes = None
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_bytes = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "cpu_count": os.cpu_count(), "mem_bytes": mem_bytes, "load_avg_1m_before": os.getloadavg()[0]}


def bytes_per_token(index) -> int:
    """Weight bytes one decode step reads: every layer, and the output head (the embedding matrix
    when the head is tied to it). The embedding row of the input token is left out (kilobytes)."""
    head = index.globals.get("output", index.globals["token_embd"])
    return index.layer_bytes_total + head.nbytes


def default_llama_bench() -> pathlib.Path:
    """Where scripts/build_llama_cpp.sh puts the CPU build's llama-bench."""
    from ntx.ctl.models import cache_dir

    return cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "build-cpu" / "bin" / "llama-bench"


def find_llama_bench(given: str | None) -> tuple[str | None, str | None]:
    """(the binary, None), or (None, why the llama.cpp half is skipped, with the fix). A binary
    given by ``--llama-bench`` was checked by ``parse_args``."""
    if given:
        return given, None
    path = default_llama_bench()
    if path.is_file() and os.access(path, os.X_OK):
        return str(path), None
    return None, (f"llama-bench is not built ({path} is missing): run scripts/build_llama_cpp.sh "
                  "(about 13 minutes on 2 cores), or pass --llama-bench PATH")


# ---------------------------------------------------------------------------------------------
# The engines


class NtxDecode:
    """ntx's in-process engine (what ``ntxctl generate --local`` runs), built once; each
    ``round()`` times ``tokens`` greedy decode steps after a short prompt, and with ``pp`` one
    prompt pass of ``pp`` tokens, as two requests of their own."""

    label = "ntx cpu (in-process)"

    def __init__(self, model: str, tokens: int, pp: int) -> None:
        from ntx.ctl.local import build_local_engine
        from ntx.shared.config import EngineOptions
        from ntx.shared.gguf_index import open_model

        self.tokens = tokens
        self.ctx = min(open_model(model).hparams.n_ctx_train, max(pp, 32) + tokens + 8)  # positions a request may use
        t = time.perf_counter()
        self.engine = build_local_engine(model, backend="cpu", options=EngineOptions(max_batch=1, ctx=self.ctx))
        self.load_s = time.perf_counter() - t
        # llama-bench decodes its count whatever comes out; so does each round here
        self.engine.core.stop_token_ids = frozenset()
        self.decode_prompt = self.engine.tokenizer.encode(DECODE_PROMPT)[:16]
        text_ids = self.engine.tokenizer.encode(PP_TEXT)
        self.pp_prompt = [text_ids[i % len(text_ids)] for i in range(pp)]
        self._n = 0

    def _request(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Run one greedy request to its end; the wall time of each of its passes, in order."""
        from ntx.shared.messages import EngineRequest
        from ntx.shared.sampling_fields import SamplingParams

        self._n += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.engine.submit(EngineRequest(f"bench-{self._n}", prompt, params))
        times_s = []
        while self.engine.has_work:
            t = time.perf_counter()
            replies = self.engine.step()
            times_s.append(time.perf_counter() - t)
            for r in replies:
                if r["type"] == "error":
                    raise RuntimeError(f"ntx request failed: {r.get('code')}: {r.get('message')}")
        return times_s

    def round(self) -> dict[str, float]:
        out = {}
        if self.pp_prompt:
            out["pp_tps"] = len(self.pp_prompt) / self._request(self.pp_prompt, 1)[0]
        steps_s = self._request(self.decode_prompt, self.tokens + 1)
        decode_s = steps_s[1:]  # the first pass is the prompt's (and gives the first token)
        if len(decode_s) != self.tokens:
            raise RuntimeError(f"ntx decoded {len(decode_s)} tokens, not {self.tokens}")
        out["tg_tps"] = self.tokens / sum(decode_s)
        return out


class LlamaBench:
    """llama.cpp's CPU build: one ``llama-bench -r 1`` run per round, its reported tok/s."""

    label = "llama.cpp cpu (llama-bench)"

    def __init__(self, binary: str, model: str, threads: int, tokens: int, pp: int, extra: list[str]) -> None:
        self.cmd = [binary, "-m", model, "-t", str(threads), "-n", str(tokens), "-p", str(pp), "-r", "1", "-o", "json",
                    *extra]
        self.info: dict[str, Any] = {}

    def round(self) -> dict[str, float]:
        r = subprocess.run(self.cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{' '.join(self.cmd)} failed (exit {r.returncode}): {' / '.join(tail)}")
        out = {}
        for test in json.loads(r.stdout):
            key = "tg_tps" if test["n_gen"] > 0 else "pp_tps"
            out[key] = float(test["avg_ts"])
            self.info = {k: test.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends",
                                                    "model_type", "model_size", "n_threads", "type_k")}
        return out


class NtxPipeline:
    """ntx through a real pipeline: ``ntxctl start --backend cpu`` in a run folder of its own on a
    free port; each round one greedy request with the in-process rounds' prompt, its
    ``decode_tokens_per_s`` (the engine's own timing of its decode passes, as the client receives
    it; an end of generation token ends the request there: ``completion_tokens`` says where).
    Stopped by ``close()``."""

    label = "ntx cpu (pipeline)"

    def __init__(self, model: str, tokens: int, ctx: int, prompt: list[int]) -> None:
        import socket

        from ntx.ctl.client import Client

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.tokens = tokens
        self.prompt = prompt
        self.run_dir = tempfile.mkdtemp(prefix="ntx-cmp-")
        self.env = dict(os.environ, NTX_RUN_DIR=self.run_dir)
        self.name = "cpu-vs-llamacpp"
        self.listen = f"tcp://127.0.0.1:{port}"
        t = time.perf_counter()
        self._ntxctl("start", "--model", model, "--backend", "cpu", "--name", self.name, "--listen", self.listen,
                     "--max-batch", "1", "--ctx", str(ctx))
        self.load_s = time.perf_counter() - t
        self.client = Client(self.listen, event_timeout_s=600.0)

    def _ntxctl(self, *args: str) -> None:
        r = subprocess.run([sys.executable, "-m", "ntx.ctl.cli", *args], capture_output=True, text=True,
                           env=self.env, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"ntxctl {args[0]} failed: {(r.stderr or r.stdout).strip()}")

    def round(self) -> dict[str, float]:
        done = self.client.complete(tokens=self.prompt, temperature=0.0, max_tokens=self.tokens + 1)
        return {"tg_tps": float(done["timings"]["decode_tokens_per_s"]),
                "completion_tokens": done["usage"]["completion_tokens"]}

    def close(self) -> None:
        self.client.close()
        try:
            self._ntxctl("stop", "--name", self.name)
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Figures and the report


def summary(samples: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(samples), "std": statistics.stdev(samples) if len(samples) > 1 else 0.0,
            "n": len(samples), "samples": [round(s, 3) for s in samples]}


def render_report(res: dict[str, Any]) -> str:
    """The table: each engine's decode (and prompt) tok/s, its GB/s of weights against the host's
    read bandwidth, ntx's ratio to llama.cpp and the goal."""
    h = res["host"]
    bw = res["host_read_gbps"]
    bpt = res["model"]["bytes_per_token"]
    threads = f"{res['threads']} thread{'s' * (res['threads'] > 1)}"
    pp_head = f" {'pp' + str(res['pp']) + ' tok/s':>18s}" if res["pp"] else ""
    lines = [
        f"host: {h['cpu']}, {h['cores']} usable cores of {h['cpu_count']}, "
        f"{(h['mem_bytes'] or 0) / GIB:.1f} GiB; threads {res['threads']} for both engines; load average (1 min) "
        f"{h['load_avg_1m_before']:.2f} before, {h['load_avg_1m_after']:.2f} after",
        f"limit: memory read {bw:.1f} GB/s (numpy sum, {threads}, best of {res['bw_repeats']} before "
        f"the rounds and {res['bw_repeats']} after); "
        f"{bpt / 1e6:.1f} MB of weights per token -> at most {bw * 1e9 / bpt:.1f} tok/s",
        f"model: {res['model']['path']} ({res['model']['type']}, {res['model']['layers']} layers); "
        f"{res['tokens']} tokens decoded per round, {res['rounds']} rounds interleaved",
        "",
        f"{'engine':30s} {'decode tok/s':>18s} {'GB/s':>6s} {'of bw':>6s}{pp_head}",
    ]
    for e in res["engines"]:
        if "tg_tps" not in e:
            lines.append(f"{e['label']:30s} skipped: {e['skipped']}")
            continue
        tg = e["tg_tps"]
        gbps = tg["mean"] * bpt / 1e9
        row = f"{e['label']:30s} {tg['mean']:9.1f} ± {tg['std']:6.1f} {gbps:6.2f} {100 * gbps / bw:5.1f}%"
        if "pp_tps" in e:
            row += f" {e['pp_tps']['mean']:9.1f} ± {e['pp_tps']['std']:6.1f}"
        lines.append(row)
    load = max(h["load_avg_1m_before"], h["load_avg_1m_after"])
    if load + res["threads"] - h["cores"] > BUSY_LOAD:
        lines += ["", f"warning: the machine is busy: load average up to {load:.1f} on {h['cores']} cores, "
                  f"with {threads} wanted here; other work takes these threads' cores, and thread pools that spin (llama.cpp's, "
                  "OpenBLAS's) lose most of their speed then: these figures are not the machine's"]
    if res.get("ratio") is not None:
        verdict = "met" if res["ratio"] >= GOAL_RATIO else "not met"
        lines += ["", f"ntx / llama.cpp decode: {res['ratio']:.2f}x (goal: at least {GOAL_RATIO}x: {verdict}); "
                  f"round by round {', '.join(f'{r:.2f}' for r in res['round_ratios'])} "
                  f"(median {statistics.median(res['round_ratios']):.2f})"]
        if res.get("pp_ratio") is not None:
            lines.append(f"ntx / llama.cpp prompt ({res['pp']} tokens): {res['pp_ratio']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    thread_env = set_thread_env(args.threads)  # before anything loads numpy

    from ntx.ctl.models import ensure_default_model
    from ntx.shared.gguf_index import open_model

    model = os.path.abspath(args.model) if args.model else str(ensure_default_model())
    index = open_model(model)
    binary, llama_skipped = (None, "--no-llama") if args.no_llama else find_llama_bench(args.llama_bench)
    if llama_skipped and not args.no_llama:
        print(f"cpu_vs_llamacpp: llama.cpp half skipped: {llama_skipped}", file=sys.stderr, flush=True)

    res: dict[str, Any] = {
        "host": host_info(), "threads": args.threads, "thread_env": thread_env, "tokens": args.tokens,
        "pp": args.pp, "rounds": args.rounds, "bw_repeats": args.bw_repeats,
        "model": {"path": model, "type": index.file_type, "layers": index.hparams.n_layers,
                  "bytes_per_token": bytes_per_token(index)},
    }
    print(f"measuring the memory read bandwidth ({args.bw_mib} MiB, {args.threads} thread{'s' * (args.threads > 1)})",
          file=sys.stderr, flush=True)
    from ntx.daemons.compute.probes import host_read_gbps

    bw_gbps = [host_read_gbps(args.bw_mib << 20, args.bw_repeats, args.threads)]

    print("loading ntx's engine", file=sys.stderr, flush=True)
    engines: list[Any] = [NtxDecode(model, args.tokens, args.pp)]
    if binary:
        engines.append(LlamaBench(binary, model, args.threads, args.tokens, args.pp, args.llama_args))
    pipeline = None
    try:
        if args.pipeline:
            print("starting an ntx pipeline (--backend cpu)", file=sys.stderr, flush=True)
            pipeline = NtxPipeline(model, args.tokens, engines[0].ctx, engines[0].decode_prompt)
            engines.append(pipeline)
        samples: list[dict[str, list[float]]] = [{} for _ in engines]
        for r in range(args.rounds):
            for e, got in zip(engines, samples):
                for k, v in e.round().items():
                    got.setdefault(k, []).append(v)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{e.label} {got['tg_tps'][-1]:.1f}" for e, got in zip(engines, samples)) + " tok/s",
                file=sys.stderr, flush=True)
    finally:
        if pipeline is not None:
            pipeline.close()
    res["host"]["load_avg_1m_after"] = os.getloadavg()[0]
    bw_gbps.append(host_read_gbps(args.bw_mib << 20, args.bw_repeats, args.threads))
    res["host_read_gbps_probes"] = bw_gbps  # before and after the rounds
    res["host_read_gbps"] = max(bw_gbps)

    res["engines"] = []
    for e, got in zip(engines, samples):
        entry = {"label": e.label, **{k: summary(v) for k, v in got.items()}}
        if isinstance(e, LlamaBench):
            entry["command"] = " ".join(e.cmd)
            entry["llama_bench"] = e.info
        else:
            entry["load_s"] = round(e.load_s, 2)
        entry["tg_gbps"] = entry["tg_tps"]["mean"] * res["model"]["bytes_per_token"] / 1e9
        res["engines"].append(entry)
    if llama_skipped:
        res["engines"].append({"label": LlamaBench.label, "skipped": llama_skipped})
    ntx, llama = res["engines"][0], next((e for e in res["engines"] if e["label"] == LlamaBench.label), None)
    res["ratio"] = res["pp_ratio"] = None
    if llama is not None and "tg_tps" in llama:
        res["ratio"] = ntx["tg_tps"]["mean"] / llama["tg_tps"]["mean"]
        # each round's two runs came one after the other: their ratio is the least exposed to drift
        res["round_ratios"] = [a / b for a, b in zip(ntx["tg_tps"]["samples"], llama["tg_tps"]["samples"])]
        if "pp_tps" in ntx and "pp_tps" in llama:
            res["pp_ratio"] = ntx["pp_tps"]["mean"] / llama["pp_tps"]["mean"]
    res["goal_ratio"] = GOAL_RATIO
    print(render_report(res), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:  # an engine failed: its own line, not a traceback
        print(f"cpu_vs_llamacpp: error: {e}", file=sys.stderr)
        sys.exit(1)
