"""Measurements of the machine the benchmarks compare with, importable anywhere (cupy on call).

``device_copy_gbps``: the device-to-device copy bandwidth, the reference every GPU benchmark
compares with. A kernel or a decode step that reads weights cannot beat the device's own copy
(DRAM read and write), so ``ntxctl bench`` (ctl/bench.py), scripts/bench_decode.py,
scripts/bench_kernels.py, scripts/profile_pass.py and dev/cuda's sweeps report their GB/s beside
this figure, measured in the same run by this one function. It lives here, not in the cuda
backend's package, so that ctl reaches no cuda internals.

``pinned_link_gbps`` / ``link_gbps_apart`` and ``host_layer_gbps``: the two roads a layer that
does not fit the GPU can take (streamed over the link, or computed by the host's cores: the cpu
tier), measured at start so that the planner splits the layers between them (``plan_for``).
"""

from __future__ import annotations

__all__ = ["device_copy_gbps", "gpu_layers_gbps", "host_layer_gbps", "host_read_gbps", "layer_kinds", "link_gbps_apart",
           "mixed_gbps", "pinned_link_gbps", "probe_layers", "roads_together"]


def device_copy_gbps(nbytes: int = 1 << 30, iters: int = 10) -> float:
    """GB/s (1e9 bytes, read + written) of ``iters`` copies of ``nbytes`` between two buffers
    of the current device, timed with CUDA events after one untimed copy."""
    import cupy as cp

    src = cp.ones(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    cp.copyto(dst, src)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        cp.copyto(dst, src)
    stop.record()
    stop.synchronize()
    elapsed_s = cp.cuda.get_elapsed_time(start, stop) / 1e3
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes * iters / elapsed_s / 1e9


def pinned_link_gbps(nbytes: int = 256 << 20, iters: int = 3) -> float:
    """GB/s of the host-to-device link as a streamed layer crosses it: the best of ``iters``
    copies of ``nbytes`` from pinned host memory to the device, after one untimed copy."""
    import time

    import cupy as cp

    dev = cp.empty(nbytes, dtype=cp.uint8)
    pinned = cp.cuda.alloc_pinned_memory(nbytes)
    stream = cp.cuda.Stream(non_blocking=True)
    best_s = float("inf")
    for i in range(iters + 1):
        t0 = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, pinned.ptr, nbytes, 1, stream.ptr)
        stream.synchronize()
        if i:
            best_s = min(best_s, time.perf_counter() - t0)
    return nbytes / best_s / 1e9


def link_gbps_apart(timeout_s: float = 60.0) -> float:
    """``pinned_link_gbps`` measured in a child process, so that the CUDA context it needs (and
    its device memory) is gone before the pipeline starts. Raises RuntimeError with the child's
    last line when it fails."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from ntx.daemons.compute.probes import pinned_link_gbps; "
                          "print(pinned_link_gbps())"], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["no output"])[-1])
    return float(out.stdout.strip().splitlines()[-1])


def _packed_products(index, layers) -> list:
    """Each matrix of ``layers`` packed as the cpu tier holds it, with a one-row input and an
    output: (packed, x, out, file bytes)."""
    import numpy as np

    from ntx.daemons.compute import cpu_kernels
    from ntx.shared.layer_bytes import read_layer

    cpu_kernels.set_threads(spare=cpu_kernels.TIER_SPARE_CORES)  # as the tier runs (host_tier.py)
    products = []
    for layer in layers:
        info = index.layers[layer]
        buf = read_layer(info)
        for name, t in info.tensors.items():
            if len(t.shape) != 2:
                continue
            off = info.image_offset(name)
            n, k = t.shape
            w = cpu_kernels.pack(buf[off: off + t.nbytes], t.ggml_type, n, k)
            x = cpu_kernels.QuantizedActivations(np.ones((1, k), dtype=np.float32))
            products.append((w, x, np.empty((1, n), dtype=np.float32), t.nbytes))
    for w, x, out, _ in products:
        cpu_kernels.matmul(w, x, out)  # compiled and warm before any timing
    return products


def layer_kinds(index, layers) -> dict[tuple, list[int]]:
    """``layers`` grouped by the types of their matrices, in order: a Q4_K_M model has layers
    whose attn_v and ffn_down are Q6_K (llama.cpp gives half of a 70B's more bits) and layers
    without, and the host's cores compute a Q6_K byte at about half a Q4_K byte's speed."""
    kinds: dict[tuple, list[int]] = {}
    for i in layers:
        kind = tuple(sorted((name, int(t.ggml_type)) for name, t in index.layers[i].tensors.items() if len(t.shape) == 2))
        kinds.setdefault(kind, []).append(i)
    return kinds


def probe_layers(index, candidates, count: int = 3) -> list[int]:
    """``count`` of ``candidates`` to time the cores on, at least one of each kind
    (``layer_kinds``; the commonest kinds when there are more than ``count``), the rest by the
    kinds' shares, each kind's spread over its layers. Three layers that all lacked the 70B's
    Q6_K matrices made the cores look 1.6x faster than they ran on the tier's mix (H200 host,
    2026-12-05: 82.5 GB/s measured beside the link, 47.8-57.4 in the pipeline)."""
    from ntx.shared.plan import spread_pick

    kinds = sorted(layer_kinds(index, candidates).values(), key=len, reverse=True)[:count]
    if not kinds:
        return []
    n = [1] * len(kinds)
    total = sum(len(k) for k in kinds)
    for _ in range(count - len(kinds)):  # the rest to the kind furthest below its share
        j = max(range(len(kinds)), key=lambda j: len(kinds[j]) / total - n[j] / sum(n))
        n[j] += 1
    return sorted(i for k, m in zip(kinds, n) for i in spread_pick(k, m))


def mixed_gbps(gbps_by_kind: dict[tuple, float], bytes_by_kind: dict[tuple, int]) -> float:
    """The speed at which the cores compute a mix of kinds: each kind's bytes at its own speed,
    one after the other (bytes over the sum of their times)."""
    return sum(bytes_by_kind.values()) / sum(b / gbps_by_kind[k] for k, b in bytes_by_kind.items())


def _products_gbps(products, min_time_s: float) -> float:
    """File bytes per second of running ``products`` in turn over at least ``min_time_s``."""
    import time

    from ntx.daemons.compute import cpu_kernels

    nbytes, reps, t0 = sum(p[3] for p in products), 0, time.perf_counter()
    while True:
        for w, x, out, _ in products:
            cpu_kernels.matmul(w, x, out)
        reps += 1
        elapsed_s = time.perf_counter() - t0
        if elapsed_s >= min_time_s:
            return nbytes * reps / elapsed_s / 1e9


def host_layer_gbps(index, layer: int, min_time_s: float = 0.3) -> float:
    """File bytes of layer ``layer``'s matrices that the host's cores compute per second in a
    one-row pass, with the cpu kernels on every thread they use (``NTX_CPU_THREADS``): the cpu
    tier's speed at decode (``shared/plan.py``'s ``HostRates``). Each matrix is packed as the
    tier holds it and timed over at least ``min_time_s`` after one untimed product."""
    return _products_gbps(_packed_products(index, [layer]), min_time_s)


def gpu_layers_gbps(index, layers, min_time_s: float = 0.2) -> float:
    """File bytes of ``layers``' matrices that the GPU multiplies per second by one row (the
    matrix products of a decode step at batch 1, each launched on its own, in turn): the GPU's
    share of a pass's chain when the cpu tier computes the other layers (``HostRates.gpu_gbps``)."""
    import time

    import cupy as cp

    from ntx.daemons.compute.cuda import gemm, runtime
    from ntx.shared.layer_bytes import read_layer

    ctx = runtime.standalone()
    products = []
    for layer in layers:
        info = index.layers[layer]
        dev = cp.asarray(read_layer(info))
        for name, t in info.tensors.items():
            if len(t.shape) == 2:
                off = info.image_offset(name)
                w = gemm.weight(dev[off: off + t.nbytes], t.ggml_type, t.shape[0], t.shape[1])
                products.append((w, cp.ones((1, t.shape[1]), dtype=cp.float32), t.nbytes))
    for w, x, _ in products:  # compiled and warm before any timing
        gemm.gemm(ctx, w, x)
    cp.cuda.Device().synchronize()
    nbytes, reps, t0 = sum(p[2] for p in products), 0, time.perf_counter()
    while True:
        for w, x, _ in products:
            gemm.gemm(ctx, w, x)
        cp.cuda.Device().synchronize()
        reps += 1
        elapsed_s = time.perf_counter() - t0
        if elapsed_s >= min_time_s:
            return nbytes * reps / elapsed_s / 1e9


def _copy_until_told(model_path: str = "", layers: str = "", nbytes: int = 256 << 20, iters: int = 3) -> None:
    """roads_together's child: prints ``alone GBPS`` (``pinned_link_gbps``) and, given a model
    and its layers (\"3,9\"), ``gpu GBPS`` (``gpu_layers_gbps``); waits for a line on stdin,
    prints ``copying`` and copies pinned host memory to the device until the next line, then
    prints ``beside GBPS``, the link's speed over that stretch."""
    import select
    import sys
    import time

    import cupy as cp

    print(f"alone {pinned_link_gbps(nbytes, iters)}", flush=True)
    if model_path:
        from ntx.shared.gguf_index import open_model

        gpu = gpu_layers_gbps(open_model(model_path), [int(i) for i in layers.split(",")])
        cp.get_default_memory_pool().free_all_blocks()
        print(f"gpu {gpu}", flush=True)
    sys.stdin.readline()
    dev = cp.empty(nbytes, dtype=cp.uint8)
    pinned = cp.cuda.alloc_pinned_memory(nbytes)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.runtime.memcpyAsync(dev.data.ptr, pinned.ptr, nbytes, 1, stream.ptr)
    stream.synchronize()
    print("copying", flush=True)
    copied, t0 = 0, time.perf_counter()
    while not select.select([sys.stdin], [], [], 0)[0]:
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, pinned.ptr, nbytes, 1, stream.ptr)
        stream.synchronize()
        copied += nbytes
    print(f"beside {copied / (time.perf_counter() - t0) / 1e9}", flush=True)


def roads_together(index, layers, min_time_s: float = 0.5, timeout_s: float = 120.0,
                   mix_of: list[int] | None = None) -> dict[str, float]:
    """The two roads of a layer that does not fit the GPU, each alone and each while the other
    runs, and the GPU's speed on the same layers (``gpu``: ``gpu_layers_gbps``, the part of a
    pass's chain the cores wait for): ``link`` / ``link_beside_cpu`` (pinned host memory to the device, in a child process so
    that no CUDA context outlives the probe) and ``cpu`` / ``cpu_beside_link`` (the file bytes of
    ``layers``' matrices the host's cores compute per second in one-row products, packed as the
    cpu tier holds them, taken in turn so that several layers exceed the caches as in a pass).
    The cores are timed on each kind of layer apart (``layer_kinds``) and their speed is that of
    the kinds' mix in ``mix_of`` (default: ``layers``; ``mixed_gbps``), the layers the tier may
    take. Why together: in the pipeline the cores computed the 70B's tier at ~32 GB/s against 44.5
    alone (H200 host), more than the memory's bandwidth left them explained. Raises RuntimeError
    with the child's last line when the child fails."""
    import subprocess
    import sys
    import threading

    child = subprocess.Popen([sys.executable, "-c", "import sys; from ntx.daemons.compute.probes import _copy_until_told; "
                              "_copy_until_told(*sys.argv[1:])", str(index.paths[0]), ",".join(map(str, layers))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killer = threading.Timer(timeout_s, child.kill)
    killer.start()

    def expect(word: str) -> str:
        line = child.stdout.readline().strip()
        if not line.startswith(word):
            child.kill()
            err = child.stderr.read().strip().splitlines() or [line or "no output"]
            raise RuntimeError(f"the link probe: {err[-1]}")
        return line.partition(" ")[2]

    kinds = layer_kinds(index, layers)
    mix = {kind: sum(index.layers[i].image_bytes for i in group)
           for kind, group in layer_kinds(index, mix_of if mix_of is not None else layers).items() if kind in kinds}
    def cores_gbps() -> float:  # each kind timed apart, their mix's speed
        return mixed_gbps({k: _products_gbps(p, min_time_s) for k, p in products.items()}, mix)

    try:
        # while the child makes its CUDA context
        products = {kind: _packed_products(index, group) for kind, group in kinds.items() if kind in mix}
        link = float(expect("alone"))
        gpu = float(expect("gpu"))
        cpu = cores_gbps()
        child.stdin.write("go\n")
        child.stdin.flush()
        expect("copying")
        cpu_beside = cores_gbps()
        child.stdin.write("stop\n")
        child.stdin.flush()
        link_beside = float(expect("beside"))
        child.wait()
    finally:
        killer.cancel()
        if child.poll() is None:
            child.kill()
            child.wait()
    return {"link": link, "link_beside_cpu": link_beside, "cpu": cpu, "cpu_beside_link": cpu_beside, "gpu": gpu}


def host_read_gbps(nbytes: int, repeats: int, threads: int) -> float:
    """GB/s (1e9 bytes read) of summing an ``nbytes`` float64 array, split into one slice per
    thread (numpy releases the GIL in the sum), best of ``repeats`` after one untimed pass. What
    a decode step that reads every weight once could at best reach on this host."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(nbytes // 8, dtype=np.float64)
    parts = np.array_split(a, threads)
    best_s = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        for _ in range(repeats):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best_s = min(best_s, time.perf_counter() - t)
    return a.nbytes / best_s / 1e9
