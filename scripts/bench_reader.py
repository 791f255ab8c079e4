#!/usr/bin/env python3
"""Measure SpanReader throughput: direct at several queue depths, buffered and mmap.

Writes a test file (default 1 GiB) in the given folder, then reads it span by span (layer-sized
spans at unaligned offsets) into a POSIX shared-memory slot, as the reader daemon does.

No root needed: direct mode bypasses the page cache by itself; for the buffered and mmap
"cold" rows the file's cached pages are dropped with posix_fadvise(DONTNEED), which works for
clean pages of one's own file. The "warm" rows read again right after, from the page cache.
On a VM the host may cache the virtual disk, so even "direct" can beat the physical device.

    /tmp/venv/bin/python scripts/bench_reader.py --dir /var/tmp --size-gib 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from ntx.daemons.reader.io import SpanReader, filesystem_type
from ntx.shared.shm import ShmSegment, unlink_all

_GIB = 1 << 30
_MIB = 1 << 20


def write_test_file(path: str, size_bytes: int) -> None:
    """Random-looking bytes (a 64 MiB random block repeated), flushed to the device."""
    block = np.random.default_rng(0).bytes(64 * _MIB)
    with open(path, "wb") as f:
        left = size_bytes
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: str) -> None:
    """Evict the file's clean pages from the page cache (no root needed for one's own file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pass_over_file(reader: SpanReader, size_bytes: int, span_bytes: int, slot: np.ndarray) -> tuple[int, float]:
    """Read the whole file as consecutive spans starting at an unaligned offset; (bytes, seconds)."""
    offsets = range(123, size_bytes, span_bytes)
    total_bytes = 0
    t0 = time.perf_counter()
    for off in offsets:
        n = min(span_bytes, size_bytes - off)
        reader.read_into(off, n, slot)
        total_bytes += n
    return total_bytes, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="folder for the test file (a real file system)")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--span-mib", type=int, default=256, help="bytes per read_into call (a layer)")
    ap.add_argument("--chunk-mib", type=int, default=8, help="bytes per request in flight")
    ap.add_argument("--repeat", type=int, default=3, help="passes per row; the median is shown")
    ap.add_argument("--keep", action="store_true", help="keep the test file (reused when its size matches)")
    args = ap.parse_args()

    size_bytes = int(args.size_gib * _GIB)
    span_bytes = args.span_mib * _MIB
    path = os.path.join(args.dir, f"ntx-bench-reader-{size_bytes}.bin")
    if not (os.path.exists(path) and os.path.getsize(path) == size_bytes):
        print(f"writing {size_bytes / _GIB:.2f} GiB test file {path} ...", flush=True)
        t0 = time.perf_counter()
        write_test_file(path, size_bytes)
        print(f"  written at {size_bytes / (time.perf_counter() - t0) / 1e9:.2f} GB/s (incl. fsync)")
    print(f"file system: {filesystem_type(path)}; span {args.span_mib} MiB, chunk {args.chunk_mib} MiB, "
          f"median of {args.repeat} passes; GB = 1e9 bytes")

    seg_prefix = f"ntx-bench-{os.getpid()}-"
    seg = ShmSegment.create(seg_prefix + "hslot-0", SpanReader.slot_bytes_needed(span_bytes))
    slot = seg.array()
    slot[:] = 0  # fault the slot in once so page faults are not billed to the first row
    rows: list[tuple[str, float]] = []

    def run(label: str, mode: str, queue_depth: int, cold: bool) -> None:
        rates = []
        for _ in range(args.repeat):
            if cold:
                drop_cache(path)
            with SpanReader(path, mode=mode, chunk_bytes=args.chunk_mib * _MIB, queue_depth=queue_depth) as r:
                if r.mode_in_use != mode:
                    print(f"  {label}: got {r.mode_in_use} ({r.fallback_reason})")
                nbytes, secs = pass_over_file(r, size_bytes, span_bytes, slot)
            rates.append(nbytes / secs / 1e9)
        rate = statistics.median(rates)
        rows.append((label, rate))
        print(f"  {label:<28} {rate:6.2f} GB/s   (passes: {', '.join(f'{x:.2f}' for x in rates)})", flush=True)

    try:
        for qd in (1, 2, 4, 8):
            run(f"direct  qd={qd}", "direct", qd, cold=False)
        run("buffered qd=4  cold cache", "buffered", 4, cold=True)
        run("buffered qd=4  warm cache", "buffered", 4, cold=False)
        run("buffered qd=1  warm cache", "buffered", 1, cold=False)
        run("mmap           cold cache", "mmap", 1, cold=True)
        run("mmap           warm cache", "mmap", 1, cold=False)
    finally:
        del slot
        seg.close()
        unlink_all(seg_prefix)
        if not args.keep:
            os.unlink(path)
    print("note: buffered and mmap figures depend on the page cache (cold = evicted with "
          "posix_fadvise DONTNEED before each pass, warm = read from RAM); direct bypasses it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
