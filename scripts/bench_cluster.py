#!/usr/bin/env python3
"""Throughput of ntx replicas under Ray Serve: the same saturating load against one instance
behind its own gateway (``ntxctl start --http``), and against clusters of 1, 2, ... replicas
(``ntxctl cluster up``, a local Ray head). Prints one line per setup and writes JSON.

The load: ``--concurrency`` clients, each sending non-streamed chat requests with a prompt of
its own (no shared prefix: the router balances by load) and ``--max-tokens`` tokens, until
``--requests`` have been answered. Throughput is generated tokens over the wall time of the
load; latency is per request, as the client sees it. Then ``--light-requests`` one at a time
(``--light-max-tokens`` each): the latency a request pays on an idle setup. The 1-replica
cluster against the single gateway is the Ray path's overhead (its added latency per request,
idle and loaded, and its throughput); N replicas against 1 is the scaling.

    python scripts/bench_cluster.py --replicas 1,2 --concurrency 16 --requests 96 --max-tokens 32

Everything runs in a run folder of its own (a temporary one unless --run-dir), on free ports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def load(base: str, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    """Run the load against ``base`` (http://HOST:PORT); tokens/s and latency figures."""
    latencies_s: list[float] = []
    tokens = [0]
    errors: list[str] = []
    next_i = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    i = next_i[0]
                    if i >= n_requests:
                        return
                    next_i[0] += 1
                body = {"messages": [{"role": "user", "content": f"Client {c}, request {i}: describe a city."}],
                        "max_tokens": max_tokens, "temperature": 0}
                t0 = time.monotonic()
                r = http.post(f"{base}/v1/chat/completions", json=body)
                dt = time.monotonic() - t0
                with lock:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                        continue
                    latencies_s.append(dt)
                    tokens[0] += r.json()["usage"]["completion_tokens"]

    # one request first: the first request of an instance pays for things once
    httpx.post(f"{base}/v1/chat/completions", timeout=600,
               json={"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.monotonic() - t0
    lat = sorted(latencies_s)
    return {"requests": len(lat), "errors": errors[:5], "n_errors": len(errors), "tokens": tokens[0],
            "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens[0] / wall_s, 2),
            "latency_mean_s": round(statistics.mean(lat), 4) if lat else None,
            "latency_p50_s": round(lat[len(lat) // 2], 4) if lat else None,
            "latency_p95_s": round(lat[int(len(lat) * 0.95)], 4) if lat else None}


def ntxctl(*args: str, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "ntx.ctl.cli", *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ntxctl {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or local model name (default: SmolLM2-135M)")
    ap.add_argument("--backend", default="cpu", help="cpu or cuda")
    ap.add_argument("--replicas", default="1,2", help="cluster sizes to measure, e.g. 1,2,4")
    ap.add_argument("--concurrency", type=int, default=16, help="clients at once")
    ap.add_argument("--requests", type=int, default=96, help="requests per setup")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--light-requests", type=int, default=20, help="requests one at a time, after the load")
    ap.add_argument("--light-max-tokens", type=int, default=8, help="tokens per request of those")
    ap.add_argument("--instance-args", default="", help="more ntxctl start options for every instance")
    ap.add_argument("--no-single", action="store_true", help="skip the single gateway")
    ap.add_argument("--run-dir", default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--out", default="bench-cluster.json", help="where the JSON goes")
    args = ap.parse_args()

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="ntx-bench-cluster-")
    env = {**os.environ, "NTX_RUN_DIR": run_dir}
    model = args.model
    if model is None:
        from ntx.ctl.models import ensure_default_model

        model = str(ensure_default_model())
    extra = args.instance_args.split()
    results: dict = {"model": os.path.basename(model), "backend": args.backend, "concurrency": args.concurrency,
                     "requests": args.requests, "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "setups": {}}

    def measure(name: str, base: str) -> None:
        r = load(base, args.concurrency, args.requests, args.max_tokens)
        r["light"] = load(base, 1, args.light_requests, args.light_max_tokens)
        results["setups"][name] = r
        print(f"{name:12s} {r['tokens_per_s']:8.1f} tok/s  {r['requests']} requests ({r['n_errors']} errors) in "
              f"{r['wall_s']:.1f} s; latency mean {r['latency_mean_s']} s, p50 {r['latency_p50_s']} s, "
              f"p95 {r['latency_p95_s']} s; one at a time: {1000 * r['light']['latency_mean_s']:.1f} ms mean, "
              f"{1000 * r['light']['latency_p50_s']:.1f} ms p50", flush=True)

    if not args.no_single:
        http = f"127.0.0.1:{free_port()}"
        ntxctl("start", "--model", model, "--name", "bench-single", "--backend", args.backend,
               "--listen", f"tcp://127.0.0.1:{free_port()}", "--http", http, *extra, env=env)
        try:
            measure("single", f"http://{http}")
        finally:
            ntxctl("stop", "--name", "bench-single", "--force", env=env)
    for n in (int(x) for x in args.replicas.split(",")):
        http = f"127.0.0.1:{free_port()}"
        ntxctl("cluster", "up", "--model", model, "--replicas", str(n), "--backend", args.backend, "--name",
               "bench-cluster", "--http", http, *(["--instance-args", args.instance_args] if extra else []), env=env)
        try:
            measure(f"cluster x{n}", f"http://{http}")
        finally:
            ntxctl("cluster", "down", "--name", "bench-cluster", env=env)
    setups = results["setups"]
    if "cluster x1" in setups:
        one = setups["cluster x1"]["tokens_per_s"]
        for name, r in setups.items():
            if name.startswith("cluster x") and name != "cluster x1":
                r["scaling_vs_x1"] = round(r["tokens_per_s"] / one, 3)
                print(f"{name} / cluster x1: {r['scaling_vs_x1']:.2f}x")
        if "single" in setups:
            s, c = setups["single"], setups["cluster x1"]
            over = results["ray_overhead"] = {
                "throughput_loss": round(1 - c["tokens_per_s"] / s["tokens_per_s"], 4),
                "latency_added_loaded_mean_s": round(c["latency_mean_s"] - s["latency_mean_s"], 4),
                "latency_added_idle_p50_s": round(c["light"]["latency_p50_s"] - s["light"]["latency_p50_s"], 4)}
            print(f"Ray path vs single gateway (1 replica): throughput {100 * over['throughput_loss']:+.1f}% lost; "
                  f"latency added {1000 * over['latency_added_idle_p50_s']:+.1f} ms a request idle (p50), "
                  f"{1000 * over['latency_added_loaded_mean_s']:+.1f} ms loaded (mean)")
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
