"""The CUDA side's cupy-free parts: the sources NVRTC compiles and the per-device launch tables.

These run without a GPU (and without cupy): scripts/compile_check.py depends on both, and a
stale header in cupy's cache or a launch table naming a cut a type lacks would only show on the
GPU machine otherwise.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ntx.daemons.compute.cuda import sources, tuning
from ntx.shared.quant_types import QUANT_TYPES


@pytest.mark.parametrize("name", ["ops.cu", "quant.cu"])
def test_kernel_source_inlines_the_common_header(name):
    src = sources.kernel_source(name)
    header = (sources.CUDA_DIR / "common.cuh").read_text()
    assert '#include "common.cuh"' not in src
    assert header.strip() in src  # the cache key (the source text) covers the header
    assert src.count("__device__ __forceinline__ float warp_sum(") == 1
    assert '#line 1 "common.cuh"' in src and f'"{name}"' in src  # errors name the right file


def test_kernel_source_names_a_missing_header(tmp_path, monkeypatch):
    (tmp_path / "k.cu").write_text('#include "nope.cuh"\n')
    monkeypatch.setattr(sources, "CUDA_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="k.cu:1: included header nope.cuh"):
        sources.kernel_source("k.cu")


def test_tuning_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import ntx.daemons.compute.cuda.tuning, ntx.daemons.compute.cuda.sources\n"
            "import ntx.daemons.compute.cuda.copy_bandwidth")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tuning_entries_by_device_name():
    assert tuning.for_device("NVIDIA H200") is tuning.H200
    assert tuning.for_device("Some Other GPU") is tuning.DEFAULT
    for t in tuning.TUNINGS.values():
        for B in range(1, tuning.MAX_MATVEC_B + 1):
            for q in QUANT_TYPES:
                nr, nw, u = t.mv(q, B)
                assert nr in tuning.MV_ROWS_PER_CTA and 1 <= nw <= tuning.MV_MAX_WARPS and u in tuning.MV_UNROLLS
                nr, nw, u = t.mvq(q, B)
                assert nr in tuning.MV_ROWS_PER_CTA and 1 <= nw <= tuning.MV_MAX_WARPS and u in tuning.MV_UNROLLS
        assert all("v2" in QUANT_TYPES[q].cuts for q in t.v2_auto_types)
        assert all(cut in QUANT_TYPES[q].cuts for q, cut in t.deq_cut.items())
        for D in (1, 2048, 4096, 1 << 20):  # rmsnorm_kernel: a multiple of 32 threads, <= 1024
            assert t.rmsnorm_block(D) % 32 == 0 and t.rmsnorm_block(D) <= 1024
