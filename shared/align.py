"""Memory and I/O alignment: each fact stated once, and the one ``round_up``.

Two facts that are easy to confuse and must stay distinct:

``PAGE_BYTES``
    The operating system's page size (``sysconf``): what ``mmap`` maps and what a shared-memory
    segment's size is rounded to. 4096 on x86-64 Linux, 16 or 64 KiB on some arm64 kernels.
``DIRECT_ALIGN_BYTES``
    What O_DIRECT asks of file offsets, read lengths and buffer addresses (the device's logical
    block size). 4096 covers both 512e and 4Kn devices. It is the unit of the image layout
    (``gguf_index.Span``): each span of a layer gets a region of whole units, so an O_DIRECT read
    of the aligned superset lands every byte where a buffered read would.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
"""The OS page size: the granule of mmap and of shared-memory segment sizes."""

DIRECT_ALIGN_BYTES = 4096
"""Alignment of file offsets, lengths and buffer addresses for O_DIRECT; the image layout's unit."""


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned, uninitialised uint8 buffer of ``nbytes`` (anonymous mmap), in pages of its
    own: what O_DIRECT reads need (numpy's own allocations are only 16- or 64-byte aligned), and
    what page-locking wants (two such buffers never share a page). The array keeps its mapping
    alive; it is unmapped when the array goes."""
    if nbytes < 0:
        raise ValueError(f"buffer size must be >= 0, got {nbytes}")
    mm = mmap.mmap(-1, max(nbytes, 1))  # mappings start on a page boundary
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)
