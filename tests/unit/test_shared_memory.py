"""The same-host shared segments both memory-lending stores use (``connectors/shared_memory``):
a holder's file and registry entry, a reader's mapping, address translation, and what happens
to entries that cannot be used. Real files in a temporary directory under /dev/shm; the holder
and the reader are two objects of this process, each with its own mapping of the file."""

import ctypes
import json
import mmap
import os
import tempfile
from pathlib import Path

import pytest

from kvconnect.connectors import shared_memory
from kvconnect.connectors.shared_memory import SameHostSegments, SharedSegmentFile, netns_id

SIZE = 1 << 20


@pytest.fixture
def shm_dir():
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="kvc-shm-unit-", dir=root)
    yield Path(d)
    for p in Path(d).iterdir():
        p.unlink()
    os.rmdir(d)


@pytest.fixture
def holder(shm_dir):
    """A holder: the file, its own MAP_SHARED mapping, published at a Transfer Engine endpoint."""
    f = SharedSegmentFile(str(shm_dir), SIZE, "unit")
    fd = os.open(f.path, os.O_RDWR)
    mem = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED)
    os.close(fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    f.publish("127.0.0.1:15000", base)
    yield f, mem, base
    f.close()
    # mem stays mapped: ctypes' from_buffer export keeps it open, the process unmaps it at exit


def test_a_reader_copies_the_holders_bytes_at_the_holders_addresses(shm_dir, holder):
    f, mem, base = holder
    assert oct(os.stat(f.path).st_mode & 0o777) == "0o600" and oct(shm_dir.stat().st_mode & 0o777) == "0o700"
    mem[4096:4096 + 11] = b"page-bytes!"
    reader = SameHostSegments(str(shm_dir), "unit")
    assert reader.present() and reader.mapped == 0
    src = reader.source("127.0.0.1:15000", base + 4096, 11)
    assert src is not None and reader.mapped == 1
    assert ctypes.string_at(src, 11) == b"page-bytes!"
    mem[4096:4096 + 11] = b"overwritten"  # one file: the reader sees the holder's writes
    assert ctypes.string_at(src, 11) == b"overwritten"
    # outside the published range, or another endpoint: not ours to copy
    assert reader.source("127.0.0.1:15000", base + SIZE - 4, 8) is None
    assert reader.source("127.0.0.1:15000", base - 8, 8) is None
    assert reader.source("127.0.0.1:15001", base + 4096, 11) is None
    reader.close()
    assert reader.mapped == 0


def test_an_entry_that_cannot_be_mapped_is_not_retried_until_the_next_listing(shm_dir, holder, monkeypatch):
    f, _, base = holder
    entry = shm_dir / f"{netns_id()}-127.0.0.1_15000.json"
    rec = json.loads(entry.read_text())
    entry.write_text(json.dumps({**rec, "path": str(shm_dir / "missing.mem")}))
    reads = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or real(self, *a, **k))
    now = [1000.0]
    monkeypatch.setattr(shared_memory.time, "monotonic", lambda: now[0])
    reader = SameHostSegments(str(shm_dir), "unit")
    assert reader.present()
    for _ in range(50):  # a reader asks once per page
        assert reader.source("127.0.0.1:15000", base, 64) is None
    assert len(reads) == 1
    entry.write_text(json.dumps(rec))  # the entry is right again
    assert reader.source("127.0.0.1:15000", base, 64) is None  # still within the listing period
    now[0] += shared_memory._LIST_EVERY_S
    assert reader.source("127.0.0.1:15000", base, 64) is not None
    reader.close()


def test_a_dead_holders_entry_is_not_used_and_the_next_holder_sweeps_it(shm_dir, holder, caplog):
    f, _, base = holder
    entry = shm_dir / f"{netns_id()}-127.0.0.1_15000.json"
    rec = json.loads(entry.read_text())
    entry.write_text(json.dumps({**rec, "start": rec["start"] + 1}))  # a pid now held by another process
    reader = SameHostSegments(str(shm_dir), "unit")
    assert reader.present() and reader.source("127.0.0.1:15000", base, 64) is None and reader.mapped == 0
    with caplog.at_level("INFO", logger="kvconnect.shared_memory"):
        other = SharedSegmentFile(str(shm_dir), 4096, "unit")
    assert not entry.exists() and not Path(f.path).exists()
    assert "removed the shared segment of dead holder" in caplog.text
    other.close()
    assert list(shm_dir.iterdir()) == []


def test_too_little_shared_memory_is_a_clear_error_and_leaves_nothing(shm_dir):
    free = os.statvfs(shm_dir).f_bavail * os.statvfs(shm_dir).f_frsize
    with pytest.raises(OSError, match=r"has \d+ bytes free, the shared segment needs \d+.*--shm-size"):
        SharedSegmentFile(str(shm_dir), free + (1 << 30), "unit")
    assert list(shm_dir.iterdir()) == []



@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_users_directory_is_a_clear_error(shm_dir, holder):
    """A second user's holder on the same directory fails at start, saying what to do (the
    directory is 0700: neither side could use the other's segments). The other user: this
    process with its effective ids switched to nobody's for the call."""
    os.setegid(65534)
    os.seteuid(65534)
    try:
        with pytest.raises(PermissionError, match="give each user its own shared_segment_dir"):
            SharedSegmentFile(str(shm_dir), 4096, "unit")
    finally:
        os.seteuid(0)
        os.setegid(0)
    assert len(list(shm_dir.glob("segment-*.mem"))) == 1  # the first holder's, untouched
