"""GGUF encoding and file writing: metadata pairs, tensor infos, padding, gguf-split sets.

A file is written directly as GGUF v3: header, metadata pairs, tensor infos, padding to the
alignment, then each tensor's data (padded), with large sequential writes.

Split sets follow ``gguf-split``: ``NAME-00001-of-0000N.gguf`` …; every shard is a full GGUF with
``split.no`` (u16, 0-based), ``split.count`` (u16) and ``split.tensors.count`` (i32, the total);
only the first shard carries the model's other metadata. ``split_gguf`` cuts an existing file
into such a set, reading its header through ``gguf_index.read_header``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
from gguf import GGUFValueType as VT

from ntx.shared.align import round_up
from ntx.shared.errors import ConfigError, NtxError
from ntx.shared.gguf_index import DEFAULT_ALIGNMENT, GGUF_MAGIC, HeaderTensor, read_header

GGUF_VERSION = 3  # the version this writer writes

_SCALAR_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h",
               VT.UINT32: "<I", VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?",
               VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


def _str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: VT, value) -> bytes:
    if vtype == VT.STRING:
        return _str(value)
    return struct.pack(_SCALAR_FMT[vtype], value)


def encode_kv(key: str, vtype: VT, value, subtype: VT | None = None) -> bytes:
    """One GGUF key/value pair as bytes (arrays: ``vtype=ARRAY`` and ``subtype``)."""
    out = [_str(key), struct.pack("<I", vtype)]
    if vtype == VT.ARRAY:
        assert subtype is not None
        out.append(struct.pack("<IQ", subtype, len(value)))
        if subtype == VT.STRING:
            out.extend(_str(v) for v in value)
        else:
            fmt = _SCALAR_FMT[subtype]
            out.append(np.asarray(value, dtype=np.dtype(fmt)).tobytes())
    else:
        out.append(_value(vtype, value))
    return b"".join(out)


@dataclass
class TensorEntry:
    """One tensor to write: its info record and a function that writes its data."""

    name: str
    shape: tuple[int, ...]  # GGUF order (ne)
    qtype: int
    nbytes: int
    write: Callable[[int], None]   # writes exactly nbytes to the file descriptor


def write_all(fd: int, views: Sequence) -> None:
    """Write every buffer in ``views`` to ``fd`` in order, resuming after partial writes."""
    views = [memoryview(v).cast("B") for v in views if len(v)]
    while views:
        batch = views[:512]
        n = os.writev(fd, batch) if len(batch) > 1 else os.write(fd, batch[0])
        while n:
            head = views[0]
            if n >= len(head):
                n -= len(head)
                views.pop(0)
            else:
                views[0] = head[n:]
                n = 0


def write_gguf(path: pathlib.Path, kvs: Sequence[bytes], entries: Sequence[TensorEntry], *,
               version: int = GGUF_VERSION, magic: bytes = GGUF_MAGIC,
               alignment: int = DEFAULT_ALIGNMENT,
               advance: Callable[[int], None] = lambda n: None) -> int:
    """Write one GGUF file; returns its size. Each entry's writer gets the file descriptor; one
    that only seeks ahead (``hole_writer``) leaves its data as a hole of a sparse file."""
    head = [magic, struct.pack("<IQQ", version, len(entries), len(kvs)), *kvs]
    off = 0
    for e in entries:
        head.append(_str(e.name) + struct.pack(f"<I{len(e.shape)}Q", len(e.shape), *e.shape)
                    + struct.pack("<IQ", e.qtype, off))
        off += round_up(e.nbytes, alignment)
    meta = b"".join(head)
    meta += b"\0" * (-len(meta) % alignment)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        write_all(fd, [meta])
        for e in entries:
            start = os.lseek(fd, 0, os.SEEK_CUR)
            e.write(fd)
            n = os.lseek(fd, 0, os.SEEK_CUR) - start
            if n != e.nbytes:  # pragma: no cover - a generator bug
                raise AssertionError(f"{e.name}: wrote {n} bytes, expected {e.nbytes}")
            pad = -n % alignment
            if pad:
                write_all(fd, [b"\0" * pad])
            advance(n + pad)
        end = os.lseek(fd, 0, os.SEEK_CUR)
        os.ftruncate(fd, end)  # a no-op unless the last tensor is a hole
        return end
    finally:
        os.close(fd)


def hole_writer(nbytes: int) -> Callable[[int], None]:
    """A tensor writer that writes nothing: ``nbytes`` of hole that read as zeros and take no
    disk space (a model-sized file whose header alone is real)."""
    return lambda fd: os.lseek(fd, nbytes, os.SEEK_CUR)


def raw_key(raw: bytes) -> str:
    """The key of an encoded pair (as ``encode_kv`` or ``HeaderKV.raw`` hold it)."""
    (n,) = struct.unpack_from("<Q", raw, 0)
    return raw[8:8 + n].decode("utf-8", errors="replace")


def split_names(base: pathlib.Path, n: int) -> list[pathlib.Path]:
    """gguf-split's shard names for ``base``: NAME-0000i-of-0000N.gguf."""
    stem = base.name[:-5] if base.name.endswith(".gguf") else base.name
    return [base.with_name(f"{stem}-{i + 1:05d}-of-{n:05d}.gguf") for i in range(n)]


def partition(sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """Cut ``sizes`` (in order) into ``n`` non-empty runs of about equal total."""
    if not 1 <= n <= len(sizes):
        raise ConfigError(f"cannot split {len(sizes)} tensors into {n} shards")
    cum = np.cumsum(np.asarray(sizes, dtype=np.float64))
    total = cum[-1]
    cuts = [0]
    for k in range(1, n):
        i = int(np.searchsorted(cum, total * k / n)) + 1  # first index of the next shard
        i = max(i, cuts[-1] + 1)
        i = min(i, len(sizes) - (n - k))
        cuts.append(i)
    cuts.append(len(sizes))
    return [(cuts[k], cuts[k + 1]) for k in range(n)]


def split_kvs(no: int, count: int, n_tensors: int) -> list[bytes]:
    """The pairs every shard of a split set carries."""
    return [encode_kv("split.no", VT.UINT16, no), encode_kv("split.count", VT.UINT16, count),
            encode_kv("split.tensors.count", VT.INT32, n_tensors)]


@contextlib.contextmanager
def progress_bar(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr (or nothing); yields ``advance(n_bytes)``."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _copy_range(src_fd: int, dst_fd: int, offset: int, n: int, chunk: int = 64 << 20) -> None:
    """Copy ``n`` bytes at ``offset`` of ``src_fd`` to ``dst_fd``'s position (copy_file_range
    where the kernel has it, pread/write otherwise)."""
    left = n
    off = offset
    while left:
        m = min(chunk, left)
        try:
            done = os.copy_file_range(src_fd, dst_fd, m, off)
        except (AttributeError, OSError):
            done = 0
        if done <= 0:
            data = os.pread(src_fd, m, off)
            if not data:
                raise NtxError(f"unexpected end of file while copying tensor data at {off}")
            write_all(dst_fd, [data])
            done = len(data)
        off += done
        left -= done


def split_gguf(src: str | os.PathLike, n_shards: int, *, out: str | os.PathLike | None = None,
               remove_src: bool = False, progress: bool = False) -> list[pathlib.Path]:
    """Split a GGUF into ``n_shards`` files the way llama.cpp's gguf-split does.

    Shards are named ``<out stem>-00001-of-0000N.gguf`` (``out`` defaults to ``src``), tensors
    keep their order and are cut into runs of about equal bytes; the first shard carries all
    metadata, every shard carries ``split.no``/``split.count``/``split.tensors.count``.
    """
    src = pathlib.Path(src)
    header = read_header(src)
    if n_shards < 1:
        raise ConfigError(f"cannot split into {n_shards} shards")
    paths = split_names(pathlib.Path(out) if out is not None else src, n_shards)
    groups = partition([t.nbytes for t in header.tensors], n_shards)
    meta = [kv.raw for kv in header.kvs if not kv.key.startswith("split.")]
    total = sum(t.nbytes for t in header.tensors)
    fd = os.open(src, os.O_RDONLY)
    try:
        with progress_bar(total, f"splitting {src.name}", progress) as advance:
            for i, (p, (a, b)) in enumerate(zip(paths, groups)):
                kvs = (meta if i == 0 else []) + split_kvs(i, n_shards, len(header.tensors))
                if i > 0 and header.alignment != DEFAULT_ALIGNMENT:
                    kvs.append(encode_kv("general.alignment", VT.UINT32, header.alignment))

                def writer(t: HeaderTensor):
                    return lambda out: _copy_range(fd, out, header.data_start + t.rel_offset, t.nbytes)

                entries = [TensorEntry(t.name, t.ne, t.type_id, t.nbytes, writer(t))
                           for t in header.tensors[a:b]]
                write_gguf(p, kvs, entries, version=GGUF_VERSION, alignment=header.alignment,
                           advance=advance)
    except BaseException as e:  # leave no partial set behind
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()
        if isinstance(e, OSError):
            raise NtxError(f"cannot split {src}: {e.strerror or e}") from e
        raise
    finally:
        os.close(fd)
    if remove_src:
        src.unlink()
    return paths

