"""POSIX shared-memory segments for the layer staging slots.

Why our own instead of ``multiprocessing.shared_memory``: its resource tracker registers every
segment a process *opens* and unlinks (or warns about) it when that process exits, so a reader
daemon that merely attaches to the supervisor's slots would tear them down, or spam warnings,
on exit. Here ownership is explicit: whoever calls :meth:`ShmSegment.create` decides when to
:meth:`ShmSegment.unlink`, and the supervisor sweeps leftovers after a crash with
:func:`unlink_all` over the instance's name prefix.

A segment is a file in ``/dev/shm`` (tmpfs) mapped with ``mmap``. Mappings start on a page
boundary, which is what O_DIRECT reads into the slot and ``cudaHostRegister`` need.

Views and ``close()``: :meth:`ShmSegment.array` hands out numpy views that point into the
mapping. ``mmap.close()`` refuses (BufferError) while such views exist, because unmapping would
leave them dangling. :meth:`ShmSegment.close` therefore never unmaps under a live view: if views
remain it drops the segment's own reference and the mapping is released by the garbage
collector when the last view goes (numpy keeps the mmap object alive as the views' base). Holders
should still drop their views before closing, so that the memory is returned at a known time.
Nothing here needs a ``__del__``: an mmap object unmaps itself when collected, also at
interpreter exit.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any

import numpy as np

from ntx.shared.align import PAGE_BYTES, round_up
from ntx.shared.errors import NtxError

SHM_DIR = "/dev/shm"
"""Where Linux exposes POSIX shared memory (``shm_open`` names map to files here)."""

_GIB = float(1 << 30)


def _check_name(name: str) -> str:
    """Refuse names that would escape /dev/shm or that shm_open would not accept."""
    if not isinstance(name, str) or not name:
        raise NtxError(f"shared memory name must be a non-empty string, got {name!r}")
    if "/" in name or "\0" in name or name in (".", ".."):
        raise NtxError(f"shared memory name {name!r} must not contain '/' (give it without a leading slash)")
    if len(name.encode()) > 255:
        raise NtxError(f"shared memory name {name[:40]!r}... is longer than 255 bytes")
    return name


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, _check_name(name))


def shm_free_bytes() -> int:
    """Bytes still free in /dev/shm (tmpfs size limit minus what segments already use)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _not_enough(nbytes: int) -> NtxError:
    return NtxError(
        f"not enough shared memory for {nbytes / _GIB:.2f} GiB in {SHM_DIR} "
        f"(free {shm_free_bytes() / _GIB:.2f} GiB)"
    )


class ShmSegment:
    """One named POSIX shared-memory segment, mapped read-write into this process.

    Make one with :meth:`create` (the owner) or :meth:`open` (everyone else); both return a
    mapped segment. ``nbytes`` is the mapped size, i.e. the requested size rounded up to the
    page size. Use as a context manager to close (not unlink) on exit.
    """

    def __init__(self, name: str, mm: mmap.mmap, nbytes: int) -> None:
        # Private: use create() or open().
        self._name = name
        self._mmap: mmap.mmap | None = mm
        self._nbytes = nbytes
        # The base address, taken through a short-lived numpy view so that no buffer export
        # stays behind to block close(). It stays valid for as long as the mapping lives.
        probe = np.frombuffer(mm, dtype=np.uint8, count=1)
        self._address = int(probe.ctypes.data)
        del probe

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, name: str, nbytes: int, *, reserve: bool = False) -> "ShmSegment":
        """Create a new segment of at least ``nbytes`` (rounded up to the page size).

        An existing segment of that name is refused rather than reused: a leftover from a
        crashed run must be swept (:func:`unlink_all`) on purpose, never silently shared.

        The file is sparse: tmpfs only spends memory on pages that are touched, and a touch that
        finds /dev/shm full kills the process with SIGBUS. ``reserve=True`` allocates every page
        now (``posix_fallocate``) so that a too-small /dev/shm fails here, with a message,
        instead. Either way a request larger than the free space is refused up front.
        """
        path = _path(name)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise NtxError(f"shared memory segment {name!r}: size must be a positive integer, got {nbytes!r}")
        size_bytes = round_up(nbytes, PAGE_BYTES)
        if size_bytes > shm_free_bytes():
            raise _not_enough(size_bytes)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise NtxError(f"shared memory segment {name!r} already exists ({path}); "
                           f"another instance is running or a previous one crashed") from None
        except OSError as e:
            raise NtxError(f"cannot create shared memory segment {path}: {e.strerror}") from None
        try:
            try:
                os.ftruncate(fd, size_bytes)
                if reserve:
                    os.posix_fallocate(fd, 0, size_bytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise _not_enough(size_bytes) from None
                raise NtxError(f"cannot size shared memory segment {path} to {size_bytes} bytes: {e.strerror}") from None
            mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)  # the mapping holds its own reference to the file
        return cls(name, mm, size_bytes)

    @classmethod
    def open(cls, name: str) -> "ShmSegment":
        """Map an existing segment (made by another process); its size is the file's size."""
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NtxError(f"shared memory segment {name!r} does not exist ({path})") from None
        except OSError as e:
            raise NtxError(f"cannot open shared memory segment {path}: {e.strerror}") from None
        try:
            size_bytes = os.fstat(fd).st_size
            if size_bytes <= 0:
                raise NtxError(f"shared memory segment {name!r} is empty (its creator has not sized it yet?)")
            mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, size_bytes)

    # ---------------------------------------------------------------- access

    @property
    def name(self) -> str:
        """The segment's name, without the leading slash."""
        return self._name

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self._name)

    @property
    def nbytes(self) -> int:
        """Mapped size in bytes (the requested size rounded up to the page size)."""
        return self._nbytes

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def buf(self) -> mmap.mmap:
        """The mmap object itself; slicing or exporting it counts as a view for close()."""
        if self._mmap is None:
            raise NtxError(f"shared memory segment {self._name!r} is closed")
        return self._mmap

    @property
    def address(self) -> int:
        """Base address of this process's mapping (page-aligned); valid until the mapping goes."""
        if self._mmap is None:
            raise NtxError(f"shared memory segment {self._name!r} is closed")
        return self._address

    def array(self, dtype: Any = np.uint8, offset: int = 0, count: int = -1) -> np.ndarray:
        """A 1-D numpy view (no copy) of ``count`` items of ``dtype`` starting at byte ``offset``.

        ``count=-1`` means as many whole items as fit after ``offset``. The view keeps the
        mapping alive; drop it before :meth:`close` so that the memory goes back promptly.
        """
        mm = self.buf
        dt = np.dtype(dtype)
        if offset < 0 or offset > self._nbytes:
            raise NtxError(f"shared memory segment {self._name!r}: offset {offset} outside 0..{self._nbytes}")
        if count < 0:
            count = (self._nbytes - offset) // dt.itemsize
        elif offset + count * dt.itemsize > self._nbytes:
            raise NtxError(
                f"shared memory segment {self._name!r}: {count} x {dt} at offset {offset} "
                f"needs {offset + count * dt.itemsize} bytes, segment has {self._nbytes}"
            )
        return np.frombuffer(mm, dtype=dt, count=count, offset=offset)

    # ---------------------------------------------------------------- teardown

    def close(self) -> bool:
        """Release this process's handle on the mapping; safe to call twice.

        Returns True when the memory was unmapped now, False when numpy views (or other
        buffer exports) still point into it: then the mapping is left to the garbage collector,
        which unmaps it when the last view is dropped. It never unmaps under a live view.
        """
        mm, self._mmap = self._mmap, None
        if mm is None:
            return True
        try:
            mm.close()
        except BufferError:
            return False  # views hold `mm` alive; it unmaps itself when they go
        return True

    def unlink(self) -> bool:
        """Remove the name from /dev/shm (mappings stay valid until closed); True if it existed."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True

    def __enter__(self) -> "ShmSegment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else f"0x{self._address:x}"
        return f"ShmSegment({self._name!r}, nbytes={self._nbytes}, {state})"


def list_segments(prefix: str) -> list[str]:
    """Names (without slash) of the segments in /dev/shm that start with ``prefix``, sorted."""
    if not isinstance(prefix, str) or not prefix or "/" in prefix:
        raise NtxError(f"shared memory prefix must be a non-empty name without '/', got {prefix!r}")
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def unlink_all(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix``; return how many went.

    For the supervisor after a stop or a crash. An empty prefix is refused, so that a bug
    cannot sweep other programs' segments.
    """
    removed = 0
    for name in list_segments(prefix):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue  # someone else swept it meanwhile
        removed += 1
    return removed
