#!/usr/bin/env python3
"""Throughput of ntx replicas under Ray Serve: the same saturating load against one instance
behind its own gateway (``ntxctl start --http``), and against clusters of 1, 2, ... replicas
(``ntxctl cluster up``, a local Ray head). Prints one line per setup and writes JSON.

The load: ``--concurrency`` clients, each sending non-streamed chat requests with a prompt of
its own (no shared prefix: the router balances by load) and ``--max-tokens`` tokens, until
``--requests`` have been answered. Throughput is generated tokens over the wall time of the
load; latency is per request, as the client sees it. Then ``--light-requests`` one at a time
(``--light-max-tokens`` each): the latency a request pays on an idle setup; for a cluster also
that many pairs alternating with the single gateway, which stays up (idle) beside the clusters
(``paired_light``). The 1-replica cluster against the single gateway is the Ray path's overhead
(its added latency per idle request, from the pairs; loaded; and its throughput); N replicas
against 1 is the scaling.

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


def paired_light(single: str, cluster: str, n_pairs: int, max_tokens: int) -> dict:
    """One request at a time, alternately to the single gateway and to the cluster (``n_pairs``
    each, in the same minutes): the latency the cluster adds to an idle request, as the median of
    the pairs' differences. Apart, the two setups' idle figures were measured minutes apart and
    moved by more than that (single rounds on the 2-core VM swing by tens of ms)."""
    body = {"messages": [{"role": "user", "content": "Name a city."}], "max_tokens": max_tokens, "temperature": 0}
    times: dict[str, list[float]] = {"single": [], "cluster": []}
    with httpx.Client(timeout=600) as http:
        for i in range(n_pairs):
            order = (("single", single), ("cluster", cluster)) if i % 2 == 0 else (("cluster", cluster), ("single", single))
            for label, base in order:
                t0 = time.monotonic()
                r = http.post(f"{base}/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise SystemExit(f"{label}: {r.status_code} {r.text[:200]}")
                times[label].append(time.monotonic() - t0)
    diffs = sorted(c - s for s, c in zip(times["single"], times["cluster"]))
    return {"pairs": n_pairs, "max_tokens": max_tokens,
            "single_p50_s": round(statistics.median(times["single"]), 4),
            "cluster_p50_s": round(statistics.median(times["cluster"]), 4),
            "added_median_s": round(statistics.median(diffs), 4)}


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
    ap.add_argument("--also-ray-replies", action="store_true", help="also a 1-replica cluster on Ray's roads "
                    "(`cluster up --replies-through-ray --serve-proxy`): HTTP through Serve's proxy and every reply "
                    "through Ray, what the direct ingress and the direct replies replace")
    ap.add_argument("--concurrency-per-replica", type=int, default=0, help="clients per replica for the clusters' "
                    "load (0: --concurrency for every setup): a load that saturates each replica as --concurrency "
                    "saturates the single instance")
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

    def measure(name: str, base: str, replicas: int = 0) -> None:
        clients = args.concurrency_per_replica * replicas if replicas and args.concurrency_per_replica else \
            args.concurrency
        r = load(base, clients, args.requests, args.max_tokens)
        r["concurrency"] = clients
        r["light"] = load(base, 1, args.light_requests, args.light_max_tokens)
        results["setups"][name] = r
        print(f"{name:12s} {r['tokens_per_s']:8.1f} tok/s  {r['requests']} requests ({r['n_errors']} errors) in "
              f"{r['wall_s']:.1f} s; latency mean {r['latency_mean_s']} s, p50 {r['latency_p50_s']} s, "
              f"p95 {r['latency_p95_s']} s; one at a time: {1000 * r['light']['latency_mean_s']:.1f} ms mean, "
              f"{1000 * r['light']['latency_p50_s']:.1f} ms p50", flush=True)

    single = None
    try:
        if not args.no_single:  # kept up (idle) beside the clusters: their idle latency is paired with its
            http = f"127.0.0.1:{free_port()}"
            ntxctl("start", "--model", model, "--name", "bench-single", "--backend", args.backend,
                   "--listen", f"tcp://127.0.0.1:{free_port()}", "--http", http, *extra, env=env)
            single = f"http://{http}"
            measure("single", single)
        sizes = [(int(x), False) for x in args.replicas.split(",")] + ([(1, True)] if args.also_ray_replies else [])
        for n, through_ray in sizes:
            http = f"127.0.0.1:{free_port()}"
            ntxctl("cluster", "up", "--model", model, "--replicas", str(n), "--backend", args.backend, "--name",
                   "bench-cluster", "--http", http, *(["--instance-args", args.instance_args] if extra else []),
                   *(["--replies-through-ray", "--serve-proxy"] if through_ray else []), env=env)
            label = f"cluster x{n}" + (" via Ray" if through_ray else "")
            try:
                measure(label, f"http://{http}", n)
                if single is not None:
                    p = results["setups"][label]["paired_light"] = paired_light(
                        single, f"http://{http}", args.light_requests, args.light_max_tokens)
                    print(f"{label:12s} one at a time, alternating with the single gateway ({p['pairs']} pairs): "
                          f"{1000 * p['cluster_p50_s']:.1f} ms against {1000 * p['single_p50_s']:.1f} ms p50; "
                          f"added {1000 * p['added_median_s']:+.1f} ms (median of the pairs)", flush=True)
            finally:
                ntxctl("cluster", "down", "--name", "bench-cluster", env=env)
    finally:
        if single is not None:
            ntxctl("stop", "--name", "bench-single", "--force", env=env)
    setups = results["setups"]
    if "cluster x1" in setups:
        one = setups["cluster x1"]["tokens_per_s"]
        for name, r in setups.items():
            if name.startswith("cluster x") and name not in ("cluster x1", "cluster x1 via Ray"):
                r["scaling_vs_x1"] = round(r["tokens_per_s"] / one, 3)
                print(f"{name} / cluster x1: {r['scaling_vs_x1']:.2f}x")
    for label, key in (("cluster x1", "ray_overhead"), ("cluster x1 via Ray", "ray_overhead_proxy_and_replies_through_ray")):
        if "single" in setups and label in setups:
            s, c = setups["single"], setups[label]
            over = results[key] = {
                "throughput_loss": round(1 - c["tokens_per_s"] / s["tokens_per_s"], 4),
                "latency_added_loaded_mean_s": round(c["latency_mean_s"] - s["latency_mean_s"], 4),
                "latency_added_idle_s": c["paired_light"]["added_median_s"]}
            print(f"{label} vs single gateway: throughput {100 * over['throughput_loss']:+.1f}% lost; "
                  f"latency added {1000 * over['latency_added_idle_s']:+.1f} ms a request idle (median of the "
                  f"pairs), {1000 * over['latency_added_loaded_mean_s']:+.1f} ms loaded (mean)")
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
