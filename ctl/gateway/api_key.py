"""The gateway's API key: from a file the supervisor writes in the run folder (read once and
deleted, so the key is in no environment, no process' arguments and no file for longer than the
gateway's start), or, where the gateway is started by hand, from ``NTX_API_KEY``.

The file must be a regular file of this user that no one else may read (mode 0600), opened
without following a link: a key that others could have read or written is refused in one line.
"""

from __future__ import annotations

import os

from ntx.shared.errors import NtxError
from ntx.shared.run_files import take_secret

API_KEY_ENV = "NTX_API_KEY"
MAX_KEY_BYTES = 4096


def read_key_file(path: str) -> str:
    """The key held in ``path`` (surrounding white space stripped); the file is deleted
    (``take_secret``'s checks: a private regular file of this user). A ValueError names what is
    wrong and the fix."""
    try:
        key = take_secret(path)
    except NtxError as e:
        raise ValueError(f"--api-key-file {e}") from None
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"--api-key-file {path}: longer than {MAX_KEY_BYTES} bytes; it should hold the key alone")
    text = key.strip()
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
