"""dev/cuda's tests: the lab module and the repository's tests package importable, and the GPU
tests' skip (tests/gpu/conftest.py) where there is no GPU and cupy."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parents[1]), str(_HERE.parents[1] / "scripts")]

from tests.gpu.conftest import pytest_collection_modifyitems  # noqa: E402,F401  (skips without a GPU)
