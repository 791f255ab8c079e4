"""Storage I/O for the reader: one layer's byte span of a model file into a staging slot.

Why O_DIRECT: a streamed layer is read once per pass and never again soon, so the page cache
only costs a copy and evicts what else is cached; with O_DIRECT the device DMAs straight into
the slot (pinned shared memory). The price is alignment: file offset, length and destination
address must be multiples of the logical block size (``ntx.shared.align.DIRECT_ALIGN_BYTES``,
4096, which covers 512- and 4096-byte devices), and we read the aligned superset of the span; the
caller gets back ``head``, where the span's first byte landed in the slot. ``read_span`` puts a
layer's span where the image layout (``gguf_index.Span``) says it goes.

Why several reads in flight: one synchronous 8 MiB request at a time leaves an NVMe drive
mostly idle; a handful of threads each doing ``os.preadv`` (which releases the GIL) keeps
``queue_depth`` requests queued without io_uring or any per-page Python work.

Modes: ``direct`` (O_DIRECT, the product), ``buffered`` (same threads, through the page cache:
for file systems that refuse O_DIRECT, such as tmpfs), ``mmap`` (map the file and copy: the
naive baseline the others are measured against). ``auto`` tries direct, both at open and with a
first real read, and falls back to buffered, saying why in ``fallback_reason``.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import mmap
import os
import re
import stat

import numpy as np

from ntx.shared.align import DIRECT_ALIGN_BYTES, aligned_empty, round_up
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import Span

MODES = ("auto", "direct", "buffered", "mmap")

_REFUSAL_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP)


class ReadError(NtxError):
    """A read that failed or came back short; names the file, the span and what arrived."""

    def __init__(self, path: object, offset: int, nbytes: int, message: str, got_bytes: int | None = None) -> None:
        self.path = str(path)
        self.offset = offset
        self.nbytes = nbytes
        self.got_bytes = got_bytes
        super().__init__(f"{self.path}: {message}")


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the file system holding ``path`` (e.g. 'ext4', 'tmpfs'), from /proc/mounts.

    Only used to say *why* O_DIRECT was refused; 'unknown' when it cannot be told.
    """
    try:
        real = os.path.realpath(path)
        best_mount, best_type = "", "unknown"
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best_mount):
                    best_mount, best_type = mount, fields[2]
        return best_type
    except OSError:
        return "unknown"


class SpanReader:
    """Reads byte spans of one file into caller-provided buffers (staging slots).

    Not meant to be shared between threads calling :meth:`read_into` at the same time: the
    reader daemon has one loop per file. ``read_into`` returns only after every read it issued
    has finished, so the slot is never written after it returns.
    """

    mode_in_use: str
    fallback_reason: str | None

    def __init__(
        self,
        path: str | os.PathLike,
        mode: str = "auto",
        chunk_bytes: int = 8 << 20,
        queue_depth: int = 4,
    ) -> None:
        self.path = os.fspath(path)
        if mode not in MODES:
            raise NtxError(f"read mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise NtxError(f"chunk size must be a positive number of bytes, got {chunk_bytes!r}")
        if not isinstance(queue_depth, int) or queue_depth < 1:
            raise NtxError(f"queue depth must be >= 1, got {queue_depth!r}")
        self.requested_mode = mode
        self.chunk_bytes = round_up(chunk_bytes, DIRECT_ALIGN_BYTES)
        self.queue_depth = queue_depth
        self.fallback_reason = None
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self._pool: cf.ThreadPoolExecutor | None = None

        if mode in ("auto", "direct"):
            refusal = self._open_direct()
            if refusal is None:
                self.mode_in_use = "direct"
            elif mode == "direct":
                raise NtxError(f"{self.path}: {refusal}; use read mode 'auto' or 'buffered' for this file")
            else:
                self.fallback_reason = f"{refusal}; using buffered reads"
                self._fd = self._open(0)
                self.mode_in_use = "buffered"
        else:
            self._fd = self._open(0)
            self.mode_in_use = mode

        if self.mode_in_use == "buffered":
            try:  # a hint only: larger read-ahead for the page-cache path
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass
        if self.mode_in_use != "mmap" and queue_depth > 1:
            self._pool = cf.ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="ntx-read")

    # ---------------------------------------------------------------- opening

    def _open(self, extra_flags: int) -> int:
        """Open read-only; NtxError for the user's problems (missing file, a directory, ...)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | extra_flags)
        except OSError as e:
            if extra_flags and e.errno in _REFUSAL_ERRNOS:
                raise  # O_DIRECT refused: the caller decides
            raise NtxError(f"{self.path}: cannot open: {e.strerror}") from None
        st_mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(st_mode) or stat.S_ISBLK(st_mode)):
            os.close(fd)
            raise NtxError(f"{self.path}: not a regular file")
        return fd

    def _open_direct(self) -> str | None:
        """Open with O_DIRECT and prove it with one aligned read; return why not, or None.

        tmpfs refuses at open (EINVAL); some file systems (and FUSE mounts) accept the flag and
        refuse the first read instead, so both are tried before direct is chosen.
        """
        fs = filesystem_type(self.path)
        try:
            fd = self._open(os.O_DIRECT)
        except OSError as e:
            return f"O_DIRECT refused by {fs} ({self.path}): {errno.errorcode.get(e.errno, e.errno)}"
        probe = aligned_empty(DIRECT_ALIGN_BYTES)
        try:
            os.preadv(fd, [memoryview(probe)], 0)
        except OSError as e:
            os.close(fd)
            if e.errno in _REFUSAL_ERRNOS:
                return f"O_DIRECT reads refused by {fs} ({self.path}): {errno.errorcode.get(e.errno, e.errno)}"
            raise ReadError(self.path, 0, DIRECT_ALIGN_BYTES, f"first read failed: {e.strerror}") from None
        self._fd = fd
        return None

    # ---------------------------------------------------------------- reading

    @staticmethod
    def slot_bytes_needed(nbytes: int) -> int:
        """Destination size that suffices for a span of ``nbytes`` at any offset, in any mode."""
        return round_up(nbytes + 2 * DIRECT_ALIGN_BYTES, DIRECT_ALIGN_BYTES)

    @property
    def file_bytes(self) -> int:
        """The file's current size."""
        return os.fstat(self._require_fd()).st_size

    def _require_fd(self) -> int:
        if self._fd is None:
            raise NtxError(f"{self.path}: reader is closed")
        return self._fd

    def read_into(self, offset: int, nbytes: int, dest: np.ndarray) -> int:
        """Read file bytes [offset, offset+nbytes) into ``dest``; return ``head``.

        ``head`` is the index in ``dest`` where byte ``offset`` landed: 0 for buffered and
        mmap, ``offset % DIRECT_ALIGN_BYTES`` for direct (which reads the aligned superset of the
        span). ``dest`` must be a writable, contiguous 1-D uint8 array; for direct its base must
        be DIRECT_ALIGN_BYTES-aligned (ShmSegment and :func:`aligned_empty` buffers are). Size it with
        :meth:`slot_bytes_needed` to be safe in every mode.
        """
        fd = self._require_fd()
        if not isinstance(offset, int) or not isinstance(nbytes, int) or offset < 0 or nbytes < 0:
            raise NtxError(f"{self.path}: span must have offset >= 0 and nbytes >= 0, got {offset!r}, {nbytes!r}")
        if not isinstance(dest, np.ndarray) or dest.dtype != np.uint8 or dest.ndim != 1:
            raise NtxError("read destination must be a 1-D numpy uint8 array")
        if not dest.flags.c_contiguous or not dest.flags.writeable:
            raise NtxError("read destination must be contiguous and writable")

        direct = self.mode_in_use == "direct"
        if direct:
            start = offset - offset % DIRECT_ALIGN_BYTES
            end = round_up(offset + nbytes, DIRECT_ALIGN_BYTES)
        else:
            start, end = offset, offset + nbytes
        span_bytes = end - start
        if dest.size < span_bytes:
            raise NtxError(
                f"read destination holds {dest.size} bytes, span of {nbytes} at offset {offset} "
                f"needs {span_bytes} in {self.mode_in_use} mode (size slots with slot_bytes_needed)"
            )
        if direct and dest.ctypes.data % DIRECT_ALIGN_BYTES:
            raise NtxError(
                f"read destination at 0x{dest.ctypes.data:x} is not {DIRECT_ALIGN_BYTES}-byte aligned "
                f"as O_DIRECT needs (use a ShmSegment or aligned_empty)"
            )
        head = offset - start
        if nbytes == 0:
            return head
        if self.mode_in_use == "mmap":
            self._read_mmap(fd, offset, nbytes, dest)
            return head

        mv = memoryview(dest)
        chunks = [(start + i, i, min(self.chunk_bytes, span_bytes - i)) for i in range(0, span_bytes, self.chunk_bytes)]
        if self._pool is None or len(chunks) == 1:
            outcomes: list[int | BaseException] = []
            for file_off, dest_off, length in chunks:
                try:
                    outcomes.append(self._read_chunk(fd, file_off, mv[dest_off:dest_off + length], direct))
                except BaseException as e:  # noqa: BLE001 - re-raised below with context
                    outcomes.append(e)
                    break
        else:
            futures = [self._pool.submit(self._read_chunk, fd, fo, mv[do:do + ln], direct) for fo, do, ln in chunks]
            cf.wait(futures)  # every read must be done before the slot is handed on, even on error
            outcomes = [f.exception() or f.result() for f in futures]
        del mv

        request_end = offset + nbytes
        for (file_off, _dest_off, length), outcome in zip(chunks, outcomes):
            if isinstance(outcome, BaseException):
                raise outcome
            needed_end = min(file_off + length, request_end)
            if file_off + outcome < needed_end:
                got_bytes = max(0, file_off + outcome - offset)
                raise ReadError(
                    self.path, offset, nbytes,
                    f"short read: got {got_bytes} of {nbytes} bytes at offset {offset} "
                    f"(file is {self._size_or_unknown(fd)} bytes)",
                    got_bytes=got_bytes,
                )
        return head

    def read_span(self, span: Span, slot: np.ndarray) -> None:
        """Read a layer's ``span`` (of this file) into its place in the layer-image buffer ``slot``.

        Direct mode reads the aligned superset into the span's aligned region; the other modes
        read the bytes alone to where the image layout puts them. Either way every byte lands at
        ``span.bytes_in(slot)``.
        """
        if self.mode_in_use == "direct":
            head = self.read_into(span.offset, span.nbytes, span.region_in(slot))
            assert head == span.head, (head, span.head)  # one alignment for the layout and the read
        else:
            self.read_into(span.offset, span.nbytes, span.bytes_in(slot))

    def _read_chunk(self, fd: int, file_off: int, buf: memoryview, direct: bool) -> int:
        """Fill ``buf`` from ``file_off``; return bytes read (fewer only at end of file)."""
        want = len(buf)
        got = 0
        while got < want:
            try:
                n = os.preadv(fd, [buf[got:]], file_off + got)
            except OSError as e:
                raise ReadError(
                    self.path, file_off + got, want - got,
                    f"read of {want - got} bytes at offset {file_off + got} failed: "
                    f"{errno.errorcode.get(e.errno, e.errno)} ({e.strerror})",
                ) from None
            if n == 0:
                break  # end of file
            got += n
            if direct and n % DIRECT_ALIGN_BYTES:
                break  # O_DIRECT stops short only at end of file; a retry would be unaligned
        return got

    def _read_mmap(self, fd: int, offset: int, nbytes: int, dest: np.ndarray) -> None:
        """The naive baseline: map the file and let numpy copy (page faults do the I/O)."""
        size_bytes = os.fstat(fd).st_size
        if offset + nbytes > size_bytes:  # touching a mapped page past EOF would SIGBUS
            got_bytes = max(0, size_bytes - offset)
            raise ReadError(
                self.path, offset, nbytes,
                f"short read: got {got_bytes} of {nbytes} bytes at offset {offset} (file is {size_bytes} bytes)",
                got_bytes=got_bytes,
            )
        if self._mm is None or len(self._mm) < offset + nbytes:
            if self._mm is not None:
                self._mm.close()
            self._mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        src = np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=offset)
        try:
            np.copyto(dest[:nbytes], src)
        except OSError as e:
            raise ReadError(self.path, offset, nbytes, f"read failed: {e.strerror}") from None
        finally:
            del src

    @staticmethod
    def _size_or_unknown(fd: int) -> int | str:
        try:
            return os.fstat(fd).st_size
        except OSError:
            return "unknown"

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Stop the threads, unmap, close the file; safe to call twice."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view escaped; the mapping goes when it does
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "SpanReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SpanReader({self.path!r}, mode={self.mode_in_use!r}, queue_depth={self.queue_depth})"
