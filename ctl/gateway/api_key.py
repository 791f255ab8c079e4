"""The gateway's API key: from a file the supervisor writes in the run folder (read once and
deleted, so the key is in no environment, no process' arguments and no file for longer than the
gateway's start), or, where the gateway is started by hand, from ``NTX_API_KEY``.

The file must be a regular file of this user that no one else may read (mode 0600), opened
without following a link: a key that others could have read or written is refused in one line.
"""

from __future__ import annotations

import os
import stat

API_KEY_ENV = "NTX_API_KEY"
MAX_KEY_BYTES = 4096


def read_key_file(path: str) -> str:
    """The key held in ``path`` (surrounding white space stripped); the file is deleted. A
    ValueError names what is wrong and the fix."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: cannot open it ({e.strerror}); give a file of this user, "
                         "mode 0600, holding the key") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--api-key-file {path}: not a regular file")
        if st.st_uid != os.getuid():
            raise ValueError(f"--api-key-file {path}: belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
        if st.st_mode & 0o077:
            raise ValueError(f"--api-key-file {path}: others may read or write it (mode {stat.S_IMODE(st.st_mode):o}); "
                             "make it 0600")
        key = os.read(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    os.unlink(path)
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"--api-key-file {path}: longer than {MAX_KEY_BYTES} bytes; it should hold the key alone")
    text = key.decode("utf-8", errors="replace").strip()
    if not text:
        raise ValueError(f"--api-key-file {path}: empty; it should hold the key")
    return text


def api_key(key_file: str | None) -> str | None:
    """The key from ``key_file`` if given, else from the environment (then removed from this
    process' environment); None for no key."""
    if key_file:
        os.environ.pop(API_KEY_ENV, None)
        return read_key_file(key_file)
    return os.environ.pop(API_KEY_ENV, None) or None
