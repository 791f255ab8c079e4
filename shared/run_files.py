"""The run folder's folders made private, its files opened without following links.

Why: the run folder (``/tmp/ntx-<uid>`` unless ``NTX_RUN_DIR`` says otherwise) sits in a place
everyone can write to. A folder someone else made there first, or a link someone planted among
its logs, would have an instance (perhaps run by root) append its log lines or write its state
wherever that someone chose. So every folder from the run root down is created 0700 and refused
unless it is a real folder owned by this user (a too-open mode of its own is tightened), and
every file is opened with ``O_NOFOLLOW`` and refused unless it is a regular file of this user;
new files are 0600. A refusal is one ``NtxError`` line naming the path.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

from ntx.shared.config import run_root
from ntx.shared.errors import NtxError


def private_dir(path: Path) -> Path:
    """Create ``path`` (under the run root) and the folders between, each 0700 and ours."""
    root = run_root()
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
    folders = [root]
    for part in Path(path).relative_to(root).parts:
        folders.append(folders[-1] / part)
    for folder in folders:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(folder)
        _check_own(folder, st, stat.S_ISDIR, "folder")
        if st.st_mode & 0o077:  # ours, but open to others: whatever they may have planted is refused below
            os.chmod(folder, 0o700)
    return Path(path)


def _check_own(path: Path | str, st: os.stat_result, is_kind, kind: str) -> None:
    """Refuse what is not a ``kind`` (by ``is_kind`` of the mode) owned by this user."""
    if stat.S_ISLNK(st.st_mode):
        raise NtxError(f"{path} is a symbolic link; refusing to follow it (remove it; someone may have planted it)")
    if not is_kind(st.st_mode):
        raise NtxError(f"{path} is not a {kind}; remove it")
    if st.st_uid != os.getuid():
        raise NtxError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); remove it "
                       f"or choose another run folder with NTX_RUN_DIR")


def open_private(path: Path | str, mode: str = "a") -> io.IOBase:
    """Open a run-folder file for writing without following a link: ``"a"``/``"ab"`` append,
    ``"w"``/``"wb"`` replace the content; text modes are line-buffered."""
    append = mode.startswith("a")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a planted FIFO must not block
    try:
        fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NtxError(f"{path} is a symbolic link; refusing to follow it (remove it; someone may have planted it)") from None
        raise NtxError(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        _check_own(path, st, stat.S_ISREG, "regular file")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
        if not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    binary = "b" in mode
    return os.fdopen(fd, ("a" if append else "w") + ("b" if binary else ""), buffering=-1 if binary else 1)


def write_private(path: Path | str, text: str) -> None:
    """Replace a run-folder file's content with ``text`` (not following a link)."""
    with open_private(path, "w") as f:
        f.write(text)


def hand_over_secret(path: Path | str, secret: str) -> None:
    """Leave ``secret`` in a new run-folder file (0600) for one other process to take
    (``take_secret``): a secret in the environment is readable in ``/proc/PID/environ`` of every
    process that inherits it, and a file only until the taker reads it."""
    Path(path).unlink(missing_ok=True)  # a leftover (or a planted link) of an earlier run
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise NtxError(f"cannot write {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def take_secret(path: Path | str) -> str:
    """The secret ``hand_over_secret`` left at ``path``, the file deleted once read; NtxError if
    it is not a private regular file of this user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise NtxError(f"cannot read the secret in {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        _check_own(path, st, stat.S_ISREG, "regular file")
        if st.st_mode & 0o077:
            raise NtxError(f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); refusing its secret")
        with os.fdopen(os.dup(fd), "r") as f:
            return f.read()
    finally:
        os.close(fd)
        Path(path).unlink(missing_ok=True)
