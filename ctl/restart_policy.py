"""When the supervisor restarts a failed pipeline, and when it stops it instead.

Two rules, kept out of the supervisor's loop so that they can be tested without processes:

- **Back-off.** A pipeline that keeps failing is restarted later each time (``RestartPolicy``):
  the n-th restart within the window waits ``first_delay_s * 2**(n-1)``, at most
  ``max_delay_s``, and more than ``max_restarts`` failures in ``window_s`` stop the instance. A
  crash loop then costs seconds of waiting, not a CPU spinning on model loads.
- **The model's files.** Every daemon opens the model again at each restart and the plan was
  made from the file as it was at ``ntxctl start``. A file truncated, rewritten or replaced under
  a running pipeline would fail every request (``layer_unavailable``) or send a daemon into a
  crash loop, so the supervisor compares the files' size, mtime, inode and device with their
  stamps from start (``ModelFiles``), every ``FILE_CHECK_INTERVAL_S`` and before each restart,
  and stops with the change as its reason.
- **Liveness.** A ready daemon that sends no ``Stats`` for ``STALL_REPORT_S`` is reported
  stalled; for ``--stall-timeout`` it is killed and the pipeline restarted (the back-off above).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ntx.shared.gguf_index import model_file_paths

FILE_CHECK_INTERVAL_S = 1.0
# A ready daemon that sent no Stats (every STATS_INTERVAL_S = 0.5 s) for this long is reported
# stalled: with the gateway's status poll (1 s), /health shows it within 5 s of its last word.
STALL_REPORT_S = 3.0


@dataclass(frozen=True)
class FileStamp:
    """What identifies one file's content cheaply: one ``stat``, no read."""

    size_bytes: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: str) -> FileStamp | None:
        """The file's stamp now; None when it is gone."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


class ModelFiles:
    """The files a pipeline reads its model (and draft model) from, stamped when it started."""

    def __init__(self, *models: str | None) -> None:
        paths = [p for model in models if model for p in model_file_paths(model)]
        self.stamps: dict[str, FileStamp | None] = {p: FileStamp.of(p) for p in paths}

    def change(self) -> str | None:
        """A line saying how the first changed file changed since the start, or None."""
        for path, was in self.stamps.items():
            now = FileStamp.of(path)
            if now == was:
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
            else:
                how = "was rewritten (its modification time changed)"
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
