"""When the supervisor restarts a failed pipeline, and when it stops it instead.

Two rules, kept out of the supervisor's loop so that they can be tested without processes:

- **Back-off.** A pipeline that keeps failing is restarted later each time (``RestartPolicy``):
  the n-th restart within the window waits ``first_delay_s * 2**(n-1)``, at most
  ``max_delay_s``, and more than ``max_restarts`` failures in ``window_s`` stop the instance. A
  crash loop then costs seconds of waiting, not a CPU spinning on model loads.
- **The model's files.** Every daemon opens the model again at each restart and the plan was
  made from the file as it was at ``ntxctl start``. A file truncated, rewritten or replaced under
  a running pipeline would fail every request (``layer_unavailable``) or send a daemon into a
  crash loop, so the supervisor compares the files' size, mtime, inode, device and a digest of
  ``SAMPLE_BLOCKS`` blocks spread over the file (a rewrite in place that restored the mtime
  keeps the rest) with their stamps from start (``ModelFiles``), every ``FILE_CHECK_INTERVAL_S``
  and before each restart, and stops with the change as its reason.
- **Liveness.** A ready daemon that sends no ``Stats`` for ``STALL_REPORT_S`` is reported
  stalled; for ``--stall-timeout`` it is killed and the pipeline restarted (the back-off above).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from ntx.shared.gguf_index import model_file_paths

FILE_CHECK_INTERVAL_S = 1.0
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 16, 4096  # 64 KiB read per file and check, from the page cache mostly
STAMP_TRIES = 3  # reads of a file's blocks before its stamp goes without a digest (it kept changing)
# A ready daemon that sent no Stats (every STATS_INTERVAL_S = 0.5 s) for this long is reported
# stalled: with the gateway's status poll (1 s), /health shows it within 5 s of its last word.
STALL_REPORT_S = 3.0


@dataclass(frozen=True)
class FileStamp:
    """What identifies one file's content cheaply: one ``stat`` and ``SAMPLE_BLOCKS`` small
    reads (``sample_digest``: empty when they failed, and then not compared)."""

    size_bytes: int
    mtime_ns: int
    inode: int
    device: int
    sample_digest: bytes = b""

    @classmethod
    def of(cls, path: str) -> FileStamp | None:
        """The file's stamp now; None when it is gone.

        The file is stat'ed again after its blocks are read: a file truncated between the first
        ``stat`` and the reads would otherwise give the old size and mtime with the new content's
        digest, and be reported "rewritten with its size and modification time kept" instead of
        truncated. While the file keeps changing under the reads, the stamp has no digest (its
        ``stat`` has already changed, which is enough to tell)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        for _ in range(STAMP_TRIES):
            digest = _sample_digest(path, st.st_size)
            try:
                after = os.stat(path)
            except OSError:
                return None
            if _stat_key(after) == _stat_key(st):
                return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, digest)
            st = after
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def same_as(self, other: FileStamp | None) -> bool:
        if other is None or (self.size_bytes, self.mtime_ns, self.inode, self.device) != (
                other.size_bytes, other.mtime_ns, other.inode, other.device):
            return False
        return not (self.sample_digest and other.sample_digest) or self.sample_digest == other.sample_digest


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def _sample_digest(path: str, size_bytes: int) -> bytes:
    """A digest of ``SAMPLE_BLOCKS`` blocks at fixed places from the file's start to its end;
    empty when it cannot be read."""
    h = hashlib.blake2b(digest_size=16)
    step = max(1, (size_bytes - SAMPLE_BLOCK_BYTES) // max(1, SAMPLE_BLOCKS - 1))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        for offset in sorted({min(i * step, max(0, size_bytes - SAMPLE_BLOCK_BYTES)) for i in range(SAMPLE_BLOCKS)}):
            h.update(os.pread(fd, SAMPLE_BLOCK_BYTES, offset))
    except OSError:
        return b""
    finally:
        os.close(fd)
    return h.digest()


class ModelFiles:
    """The files a pipeline reads its model (and draft model) from, stamped when it started."""

    def __init__(self, *models: str | None) -> None:
        paths = [p for model in models if model for p in model_file_paths(model)]
        self.stamps: dict[str, FileStamp | None] = {p: FileStamp.of(p) for p in paths}

    def change(self) -> str | None:
        """A line saying how the first changed file changed since the start, or None."""
        for path, was in self.stamps.items():
            now = FileStamp.of(path)
            if now == was or (now is not None and now.same_as(was)):
                continue
            if now is None:
                how = "was removed"
            elif was is None:
                how = "appeared"
            elif (now.inode, now.device) != (was.inode, was.device):
                how = "was replaced by another file"
            elif now.size_bytes < was.size_bytes:
                how = f"was truncated from {was.size_bytes} to {now.size_bytes} bytes"
            elif now.size_bytes != was.size_bytes:
                how = f"grew from {was.size_bytes} to {now.size_bytes} bytes"
            elif now.mtime_ns != was.mtime_ns:
                how = "was rewritten (its modification time changed)"
            else:
                how = "was rewritten (its content changed; its size and modification time were kept)"
            return f"model file {path} {how} while the pipeline ran"
        return None


@dataclass
class RestartPolicy:
    """Restart after a failure with exponential back-off; give up after ``max_restarts``
    failures within ``window_s``."""

    max_restarts: int
    window_s: float = 300.0
    first_delay_s: float = 0.25
    max_delay_s: float = 30.0
    failures_s: list[float] = field(default_factory=list)  # monotonic times of recent failures

    def after_failure(self, now_s: float) -> float | None:
        """Record a failure at ``now_s``; the delay before the restart, or None to give up."""
        self.failures_s = [t for t in self.failures_s if now_s - t < self.window_s] + [now_s]
        n = len(self.failures_s)
        if n > self.max_restarts:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2 ** (n - 1))
