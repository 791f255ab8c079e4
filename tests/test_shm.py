"""ShmSegment: cross-process sharing, alignment, exclusivity, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from ntx.shared.align import PAGE_BYTES
from ntx.shared.errors import NtxError
from ntx.shared.shm import SHM_DIR, ShmSegment, list_segments, shm_free_bytes, unlink_all


@pytest.fixture
def prefix():
    """A prefix no other test (or concurrent run) uses; everything under it is swept after."""
    p = f"ntx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
    yield p
    unlink_all(p)


def test_create_in_parent_write_in_child_read_back(prefix):
    name = prefix + "hslot-0"
    seg = ShmSegment.create(name, 3 * PAGE_BYTES + 5)
    try:
        child = (
            "import numpy as np\n"
            "from ntx.shared.shm import ShmSegment\n"
            f"seg = ShmSegment.open({name!r})\n"
            "a = seg.array()\n"
            "a[:] = np.arange(a.size, dtype=np.uint64).astype(np.uint8)\n"
            "del a\n"
            "seg.close()\n"
        )
        subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
        a = seg.array()
        assert np.array_equal(a, np.arange(a.size, dtype=np.uint64).astype(np.uint8))
        del a
        # The child opened and exited: the segment must still be there (no resource tracker).
        assert name in list_segments(prefix)
    finally:
        seg.close()
        seg.unlink()


def test_size_rounded_and_address_page_aligned(prefix):
    with ShmSegment.create(prefix + "a", 1) as seg:
        assert seg.nbytes == PAGE_BYTES
        assert seg.address % PAGE_BYTES == 0
        assert seg.array().ctypes.data == seg.address
        assert os.stat(os.path.join(SHM_DIR, seg.name)).st_mode & 0o777 == 0o600
        with ShmSegment.open(seg.name) as other:
            assert other.nbytes == seg.nbytes
            assert other.address % PAGE_BYTES == 0


def test_views_share_memory_between_mappings(prefix):
    with ShmSegment.create(prefix + "a", 1 << 16) as seg, ShmSegment.open(prefix + "a") as other:
        seg.array(np.float32, offset=64, count=4)[:] = [1, 2, 3, 4]
        assert other.array(np.float32, offset=64, count=4).tolist() == [1, 2, 3, 4]
        assert bytes(other.buf[64:68]) == np.float32(1).tobytes()


def test_exclusive_create_names_the_segment(prefix):
    with ShmSegment.create(prefix + "dup", 4096):
        with pytest.raises(NtxError, match=prefix + "dup"):
            ShmSegment.create(prefix + "dup", 4096)


def test_open_missing(prefix):
    with pytest.raises(NtxError, match="does not exist"):
        ShmSegment.open(prefix + "missing")


@pytest.mark.parametrize("bad", ["", "/lead", "a/b", "..", "x" * 300])
def test_bad_names_refused(bad):
    with pytest.raises(NtxError):
        ShmSegment.create(bad, 4096)


@pytest.mark.parametrize("size", [0, -1])
def test_bad_size_refused(prefix, size):
    with pytest.raises(NtxError, match="size"):
        ShmSegment.create(prefix + "s", size)
    assert list_segments(prefix) == []


def test_too_large_refused_early(prefix):
    with pytest.raises(NtxError, match="not enough shared memory"):
        ShmSegment.create(prefix + "huge", shm_free_bytes() + (1 << 30), reserve=True)
    assert list_segments(prefix) == []


def test_reserve_allocates(prefix):
    with ShmSegment.create(prefix + "r", 1 << 20, reserve=True) as seg:
        st = os.stat(seg.path)
        assert st.st_blocks * 512 >= 1 << 20


def test_close_twice_and_close_with_live_view(prefix):
    seg = ShmSegment.create(prefix + "v", 4096)
    view = seg.array()
    view[:4] = [1, 2, 3, 4]
    assert seg.close() is False  # a view is alive: not unmapped under it
    assert seg.closed
    assert view[:4].tolist() == [1, 2, 3, 4]  # still valid memory
    assert seg.close() is True
    with pytest.raises(NtxError, match="closed"):
        seg.array()
    del view
    seg2 = ShmSegment.open(prefix + "v")
    assert seg2.close() is True
    seg2.unlink()
    assert seg2.unlink() is False


def test_array_bounds(prefix):
    with ShmSegment.create(prefix + "b", 4096) as seg:
        assert seg.array(np.uint32).size == 1024
        assert seg.array(np.uint8, offset=4000).size == 96
        with pytest.raises(NtxError):
            seg.array(np.uint8, offset=4097)
        with pytest.raises(NtxError):
            seg.array(np.uint32, offset=8, count=1023)


def test_unlink_all_leaves_nothing(prefix):
    segs = [ShmSegment.create(f"{prefix}hslot-{i}", 8192) for i in range(3)]
    other_prefix = prefix.rstrip("-") + "x-"
    keep = ShmSegment.create(other_prefix + "keep", 4096)  # shares a stem, not the prefix
    try:
        assert list_segments(prefix) == [f"{prefix}hslot-{i}" for i in range(3)]
        assert unlink_all(prefix) == 3
        assert list_segments(prefix) == []
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
        assert list_segments(other_prefix) == [other_prefix + "keep"]
        # Mappings stay usable after unlink; the memory goes when they close.
        segs[0].array()[:2] = [7, 8]
        assert segs[0].array()[:2].tolist() == [7, 8]
    finally:
        for s in segs:
            s.close()
        keep.close()
        unlink_all(other_prefix)


def test_empty_prefix_refused():
    with pytest.raises(NtxError):
        unlink_all("")


def test_segment_survives_interpreter_exit_with_live_views(prefix):
    """A process that exits while holding views must exit cleanly (no BufferError noise)."""
    name = prefix + "exit"
    child = (
        "from ntx.shared.shm import ShmSegment\n"
        f"seg = ShmSegment.create({name!r}, 1 << 20)\n"
        "v = seg.array()\n"
        "v[:] = 1\n"
        "seg.close()\n"
    )
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    with ShmSegment.open(name) as seg:
        assert int(seg.array().sum()) == 1 << 20
