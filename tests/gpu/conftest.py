"""GPU tests: skipped, with the reason, where cupy or an NVIDIA GPU is absent.

Run them on the GPU machine with scripts/device_check.sh (it also runs the kernel benchmark)."""

from __future__ import annotations

import pytest


def _gpu_unavailable() -> str | None:
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install
        return f"cupy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no usable CUDA device ({type(e).__name__}: {e})"
    if n < 1:
        return "no CUDA device"
    return None


_REASON = _gpu_unavailable()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU tests need cupy and an NVIDIA GPU: {_REASON}")
    for item in items:
        if "gpu" in item.keywords or "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)

