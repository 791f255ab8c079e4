"""SpanReader: every mode returns the file's bytes; refusals, fallbacks and short reads are clear."""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest

from ntx.daemons.reader.io import ReadError, SpanReader, aligned_empty, filesystem_type
from ntx.shared.align import DIRECT_ALIGN_BYTES
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import open_model
from ntx.shared.layer_bytes import read_layer
from ntx.shared.shm import SHM_DIR, ShmSegment, unlink_all
from tests.synth_models import write_tiny

REPO = Path(__file__).resolve().parent.parent


def _accepts_direct(folder: str) -> str | None:
    """Return None if files in ``folder`` can be read with O_DIRECT, else the reason not."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix="ntx-odirect-probe-") as f:
            f.write(b"\0" * 8192)
            f.flush()
            try:
                fd = os.open(f.name, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                return f"{folder} ({filesystem_type(folder)}): open O_DIRECT: {e.strerror}"
            try:
                os.preadv(fd, [memoryview(aligned_empty(4096))], 0)
            except OSError as e:
                return f"{folder} ({filesystem_type(folder)}): O_DIRECT read: {e.strerror}"
            finally:
                os.close(fd)
    except OSError as e:
        return f"{folder}: {e.strerror}"
    return None


def _find_direct_dir() -> tuple[str | None, list[str]]:
    """The first candidate folder on a real file system that accepts O_DIRECT.

    /tmp is often tmpfs (which refuses O_DIRECT), so /var/tmp and the repo's ignored .cache/ are
    tried too; NTX_TEST_DIRECT_DIR overrides.
    """
    candidates = [os.environ.get("NTX_TEST_DIRECT_DIR"), "/var/tmp", tempfile.gettempdir(), str(REPO / ".cache")]
    reasons = []
    for folder in candidates:
        if not folder:
            continue
        if folder == str(REPO / ".cache"):
            os.makedirs(folder, exist_ok=True)
        why_not = _accepts_direct(folder)
        if why_not is None:
            return folder, reasons
        reasons.append(why_not)
    return None, reasons


@pytest.fixture(scope="module")
def direct_dir():
    folder, reasons = _find_direct_dir()
    if folder is None:
        pytest.skip("no folder accepts O_DIRECT: " + "; ".join(reasons))
    with tempfile.TemporaryDirectory(dir=folder, prefix="ntx-test-io-") as d:
        yield Path(d)


FILE_BYTES = 3 * (1 << 20) + 1234  # unaligned on purpose: the aligned tail runs past EOF


@pytest.fixture(scope="module")
def data_file(direct_dir):
    data = np.frombuffer(np.random.default_rng(7).bytes(FILE_BYTES), dtype=np.uint8)
    path = direct_dir / "model.bin"
    path.write_bytes(data.tobytes())
    return path, data


SPANS = [
    (0, 0),
    (0, FILE_BYTES),
    (1, 4095),
    (4095, 2),
    (4096 * 100, 4096 * 3),
    (12345, 1_000_001),
    (FILE_BYTES - 777, 777),  # touches EOF
    (FILE_BYTES - 1, 1),
    (FILE_BYTES - 70_001, 70_000),  # ends one byte before EOF
    (2 * (1 << 20) - 3, (1 << 20) + 3 + 1234),  # starts unaligned, ends at EOF
]


@pytest.mark.parametrize("mode", ["direct", "buffered", "mmap", "auto"])
@pytest.mark.parametrize("queue_depth", [1, 3])
def test_spans_match_plain_read(data_file, mode, queue_depth):
    path, data = data_file
    with SpanReader(path, mode=mode, chunk_bytes=64 << 10, queue_depth=queue_depth) as r:
        expected_mode = "direct" if mode == "auto" else mode
        assert r.mode_in_use == expected_mode
        assert r.fallback_reason is None
        for offset, nbytes in SPANS:
            dest = aligned_empty(SpanReader.slot_bytes_needed(nbytes))
            dest[:] = 0xAB
            head = r.read_into(offset, nbytes, dest)
            assert head == (offset % DIRECT_ALIGN_BYTES if expected_mode == "direct" else 0)
            got = dest[head:head + nbytes]
            assert np.array_equal(got, data[offset:offset + nbytes]), (mode, offset, nbytes)


def test_read_into_shm_slot(data_file):
    path, data = data_file
    name = f"ntx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-hslot-0"
    nbytes = 1_500_000
    try:
        with ShmSegment.create(name, SpanReader.slot_bytes_needed(nbytes)) as seg, SpanReader(path, "direct") as r:
            slot = seg.array()
            head = r.read_into(777, nbytes, slot)
            assert np.array_equal(slot[head:head + nbytes], data[777:777 + nbytes])
            del slot
    finally:
        unlink_all(name)


@pytest.mark.parametrize("mode", ["direct", "buffered", "mmap"])
def test_read_span_fills_the_image_layout(direct_dir, mode):
    """Every span of every layer lands where the image layout puts it (the same bytes as
    layer_bytes' plain reads), a layer cut between two shards included."""
    folder = direct_dir / f"spans-{mode}"
    folder.mkdir()
    idx = open_model(write_tiny(folder, "set.gguf", split=3, n_layers=4))
    assert any(len(layer.spans) == 2 for layer in idx.layers)
    assert any(s.head for layer in idx.layers for s in layer.spans)  # unaligned spans are covered
    readers = {p: SpanReader(p, mode=mode) for p in idx.paths}
    try:
        for layer in idx.layers:
            slot = aligned_empty(layer.image_bytes)
            slot[:] = 0xAB
            for s in layer.spans:
                readers[s.path].read_span(s, slot)
            want = read_layer(layer)
            for s in layer.spans:
                assert np.array_equal(s.bytes_in(slot), s.bytes_in(want)), (mode, layer.index, s)
    finally:
        for r in readers.values():
            r.close()


def test_slot_bytes_needed_suffices_at_any_offset():
    for nbytes in (0, 1, 4095, 4096, 4097, 8 << 20, (8 << 20) + 1):
        need = SpanReader.slot_bytes_needed(nbytes)
        assert need % DIRECT_ALIGN_BYTES == 0
        for offset in (0, 1, 4095, 4096, 123457):
            start = offset - offset % 4096
            end = -(-(offset + nbytes) // 4096) * 4096
            assert end - start <= need


@pytest.fixture
def shm_file():
    path = Path(SHM_DIR) / f"ntx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.gguf"
    data = np.frombuffer(np.random.default_rng(3).bytes(100_000), dtype=np.uint8)
    path.write_bytes(data.tobytes())
    yield path, data
    path.unlink(missing_ok=True)


def _kernel_refuses_direct_on(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return True
    return False


@pytest.fixture
def tmpfs_refuses_direct(shm_file, monkeypatch):
    """Make O_DIRECT opens on /dev/shm fail with EINVAL, as tmpfs does before Linux 6.6.

    Newer kernels accept O_DIRECT on tmpfs (it is a plain copy there), so the refusal is
    simulated where the kernel no longer produces it; on old kernels this is a no-op.
    """
    path, _ = shm_file
    if _kernel_refuses_direct_on(path):
        return
    real_open = os.open

    def refusing_open(file, flags, *args, **kwargs):
        if flags & os.O_DIRECT and os.fspath(file).startswith(SHM_DIR + "/"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), os.fspath(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)


def test_auto_on_tmpfs_falls_back_to_buffered(shm_file, tmpfs_refuses_direct):
    path, data = shm_file
    with SpanReader(path, mode="auto") as r:
        assert r.mode_in_use == "buffered"
        assert r.fallback_reason == f"O_DIRECT refused by tmpfs ({path}): EINVAL; using buffered reads"
        dest = aligned_empty(SpanReader.slot_bytes_needed(5000))
        assert r.read_into(333, 5000, dest) == 0
        assert np.array_equal(dest[:5000], data[333:5333])


def test_explicit_direct_on_tmpfs_refused(shm_file, tmpfs_refuses_direct):
    path, _ = shm_file
    with pytest.raises(NtxError, match="O_DIRECT refused by tmpfs"):
        SpanReader(path, mode="direct")


def test_direct_on_tmpfs_where_the_kernel_allows_it(shm_file):
    path, data = shm_file
    if _kernel_refuses_direct_on(path):
        pytest.skip("this kernel refuses O_DIRECT on tmpfs (before Linux 6.6)")
    with SpanReader(path, mode="auto", chunk_bytes=16 << 10, queue_depth=2) as r:
        assert r.mode_in_use == "direct" and r.fallback_reason is None
        dest = aligned_empty(SpanReader.slot_bytes_needed(data.size))
        for offset, nbytes in [(0, data.size), (4097, 50_000), (data.size - 10, 10)]:
            head = r.read_into(offset, nbytes, dest)
            assert np.array_equal(dest[head:head + nbytes], data[offset:offset + nbytes])


@pytest.mark.parametrize("mode", ["auto", "direct"])
def test_refusal_at_first_read(data_file, monkeypatch, mode):
    """Some file systems accept O_DIRECT at open and refuse the first read: auto must notice."""
    path, data = data_file
    real_preadv = os.preadv
    calls = []

    def refuse_first(fd, buffers, offset, *args):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", refuse_first)
    if mode == "direct":
        with pytest.raises(NtxError, match="O_DIRECT reads refused by"):
            SpanReader(path, mode="direct")
        return
    with SpanReader(path, mode="auto") as r:
        assert r.mode_in_use == "buffered"
        assert "O_DIRECT reads refused" in r.fallback_reason and "EINVAL" in r.fallback_reason
        dest = aligned_empty(SpanReader.slot_bytes_needed(1000))
        assert r.read_into(5, 1000, dest) == 0
        assert np.array_equal(dest[:1000], data[5:1005])


@pytest.mark.parametrize("mode", ["direct", "buffered", "mmap"])
@pytest.mark.parametrize("queue_depth", [1, 4])
def test_short_read_after_truncate(direct_dir, mode, queue_depth):
    path = direct_dir / f"trunc-{mode}-{queue_depth}.bin"
    path.write_bytes(os.urandom(3 << 20))
    with SpanReader(path, mode=mode, chunk_bytes=256 << 10, queue_depth=queue_depth) as r:
        dest = aligned_empty(SpanReader.slot_bytes_needed(1 << 20))
        r.read_into(1 << 20, 1 << 20, dest)  # fine while the file is whole
        os.truncate(path, (1 << 20) + 100)
        with pytest.raises(ReadError, match="short read") as info:
            r.read_into(1 << 20, 1 << 20, dest)
        err = info.value
        assert str(path) in str(err)
        assert err.offset == 1 << 20 and err.nbytes == 1 << 20
        assert err.got_bytes == 100
        assert "\n" not in str(err)


def test_os_error_becomes_read_error(data_file, direct_dir):
    path, _ = data_file
    r = SpanReader(path, mode="buffered", queue_depth=1)
    write_only = os.open(direct_dir / "wo.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    real_fd, r._fd = r._fd, write_only  # preadv on a write-only fd fails with EBADF
    try:
        with pytest.raises(ReadError, match="EBADF") as info:
            r.read_into(0, 4096, aligned_empty(8192))
        assert str(path) in str(info.value)
    finally:
        r._fd = real_fd
        os.close(write_only)
        r.close()


@pytest.mark.parametrize("mode", ["direct", "buffered", "mmap"])
def test_too_small_dest_refused(data_file, mode):
    path, _ = data_file
    with SpanReader(path, mode=mode) as r:
        with pytest.raises(NtxError, match="needs"):
            r.read_into(100, 10_000, aligned_empty(9_000))
        if mode == "direct":  # 10_000 bytes at offset 100 need 12_288 aligned bytes
            with pytest.raises(NtxError, match="12288"):
                r.read_into(100, 10_000, aligned_empty(10_000))


def test_bad_dest_refused(data_file):
    path, _ = data_file
    with SpanReader(path, mode="direct") as r:
        buf = aligned_empty(3 * 4096)
        with pytest.raises(NtxError, match="aligned"):
            r.read_into(0, 4096, buf[1:4096 + 1 + 4096])
        with pytest.raises(NtxError, match="uint8"):
            r.read_into(0, 4096, buf.view(np.uint32))
        with pytest.raises(NtxError, match="uint8"):
            r.read_into(0, 4096, b"\0" * 8192)
        with pytest.raises(NtxError, match="contiguous"):
            r.read_into(0, 16, buf[::2])
        with pytest.raises(NtxError, match="offset"):
            r.read_into(-1, 16, buf)


def test_bad_arguments_and_missing_file(data_file, direct_dir):
    path, _ = data_file
    with pytest.raises(NtxError, match="read mode"):
        SpanReader(path, mode="fast")
    with pytest.raises(NtxError, match="queue depth"):
        SpanReader(path, queue_depth=0)
    with pytest.raises(NtxError, match="cannot open"):
        SpanReader(direct_dir / "nope.gguf")
    with pytest.raises(NtxError, match="not a regular file"):
        SpanReader(direct_dir, mode="buffered")
    r = SpanReader(path, chunk_bytes=1000)
    assert r.chunk_bytes == 4096
    r.close()
    r.close()
    with pytest.raises(NtxError, match="closed"):
        r.read_into(0, 1, aligned_empty(8192))


def test_aligned_empty():
    for n in (0, 1, 4096, 100_000):
        a = aligned_empty(n)
        assert a.size == n and a.dtype == np.uint8 and a.flags.writeable
        assert a.ctypes.data % 4096 == 0
