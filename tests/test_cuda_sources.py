"""The CUDA side's cupy-free parts: the sources NVRTC compiles.

These run without a GPU (and without cupy): scripts/compile_check.py depends on them, and a
stale header in cupy's cache would only show on the GPU machine otherwise.
"""

from __future__ import annotations

import pytest

from ntx.daemons.compute.cuda import sources


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
