"""The cpu backend computes the same bits whatever vector width the host's CPU prefers.

The norm's and attention's float sums are fast-math, and LLVM vectorizes them at the width the
target prefers (256-bit on its Intel targets, 512-bit on AMD Zen 4), so two hosts used to give
two greedy texts (dev/cpu/vector_width.py; docs/PERFORMANCE.md, "The CPU's figures depend on
the vector width the host compiles for"). ``cpu_kernels._pin_vector_width`` compiles for 256-bit
vectors everywhere. Each build here runs in its own process with its own numba cache, compiled
as Zen 4 with this host's features (so it runs here, whatever this host is): pinned, it must give
this host's bits; with the pin taken off (``-prefer-256-bit``) on an AVX-512 host it must not,
which shows the check can fail.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

numba = pytest.importorskip("numba")
llvm = pytest.importorskip("llvmlite.binding")

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths")

# The norm (with its int8 rounding) and attention over a few pages, on fixed inputs; their
# outputs' bytes go to argv[1].
CHILD = r"""
import sys
import numpy as np
from ntx.daemons.compute import cpu_ops

rng = np.random.default_rng(7)
T, D = 4, 576
x = (rng.standard_normal((T, D)) * 3).astype(np.float32)
delta = rng.standard_normal((T, D)).astype(np.float32)
w = rng.standard_normal(D).astype(np.float32)
h = np.empty_like(x)
xq = np.empty((T, D), np.int8)
xd = np.empty((T, D // 32), np.float32)
xs = np.empty_like(xd)
cpu_ops.add_norm_quantize(x, delta, True, w, 1e-5, h, xq, xd, xs)

H, HKV, HD, PAGE, PAGES, n, start = 9, 3, 64, 16, 4, 5, 40
keys = rng.standard_normal((1, 1, PAGES, HKV, PAGE, HD)).astype(np.float32)
values = rng.standard_normal((1, 1, PAGES, HKV, PAGE, HD)).astype(np.float32)
q = rng.standard_normal((n, H * HD)).astype(np.float32)
out = np.empty_like(q)
cpu_ops.attention(q, out, keys, values, 0, np.arange(PAGES, dtype=np.int32), PAGES, start,
                  np.zeros((1, 1), np.bool_), False, H, HKV, HD, np.float32(HD ** -0.5))
with open(sys.argv[1], "wb") as f:
    for a in (h, xq, xd, out):
        f.write(a.tobytes())
"""


def _bits(tmp_path, name: str, cpu_name: str | None = None, features: str | None = None) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / f"cache-{name}")
    if cpu_name:
        env["NUMBA_CPU_NAME"] = cpu_name
    if features is not None:
        env["NUMBA_CPU_FEATURES"] = features
    out = tmp_path / f"{name}.bin"
    r = subprocess.run([sys.executable, "-c", CHILD, str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out.read_bytes()


def test_zen4s_build_gives_this_hosts_bits_and_without_the_pin_it_would_not(tmp_path):
    host_features = llvm.get_host_cpu_features()
    flat = host_features.flatten()
    here = _bits(tmp_path, "host")
    assert _bits(tmp_path, "znver4-pinned", "znver4", flat) == here
    if host_features.get("avx512f"):
        # the same build preferring 512-bit vectors, as Zen 4 does by itself: other bits
        unpinned = _bits(tmp_path, "znver4-512", "znver4", flat + ",-prefer-256-bit")
        assert len(unpinned) == len(here) and unpinned != here
        h = np.frombuffer(here[: 4 * 576 * 4], np.float32)
        u = np.frombuffer(unpinned[: 4 * 576 * 4], np.float32)
        assert np.allclose(h, u, rtol=1e-5, atol=1e-5)  # the last bits only
