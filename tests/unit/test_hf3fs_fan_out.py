"""How the hf3fs store cuts a batch into worker tasks: every worker busy on a prefix, no task
smaller than MIN_TASK_BYTES, none larger than one usrbio submission (``entries``); and a real
store's batch read on several workers still returns every page's own bytes, in order."""

from __future__ import annotations

import ctypes
import threading

from kvconnect.connectors.hf3fs.page_io import PageIO
from kvconnect.connectors.registry import create_store

MiB = 1 << 20


def _store(tmp_path, numjobs: int, entries: int, page_bytes: int = MiB, pages: int = 64):
    return create_store("hf3fs", {"file_path_prefix": str(tmp_path / "f"), "file_size": page_bytes * pages,
                                  "numjobs": numjobs, "entries": entries, "page_bytes": page_bytes})


def test_a_prefix_is_spread_over_every_worker(tmp_path):
    s = _store(tmp_path, numjobs=16, entries=16)
    try:
        # a 2,048-token Llama-3-8B prefix: 32 pages of 8 MiB; entries 16 alone made two tasks
        assert s.io.chunk_pages(32, 8 * MiB) == 2
        assert s.io.chunk_pages(1024, 8 * MiB) == 16      # never more than one submission
        assert s.io.chunk_pages(32, 64 << 10) == 16       # small pages grouped up to 1 MiB a task
        assert s.io.chunk_pages(3, 64 << 10) == 16
        assert s.io.chunk_pages(1, 8 * MiB) == 1
    finally:
        s.close()
    s = _store(tmp_path / "b", numjobs=2, entries=16)
    try:
        assert s.io.chunk_pages(32, 8 * MiB) == 16
    finally:
        s.close()


def test_spread_reads_and_writes_keep_every_pages_bytes(tmp_path, monkeypatch):
    s = _store(tmp_path, numjobs=8, entries=16)
    threads: set = set()
    read_chunk = PageIO.read_chunk

    def spy(chunk, lane, checks):
        threads.add(threading.get_ident())
        return read_chunk(chunk, lane, checks)

    monkeypatch.setattr(PageIO, "read_chunk", staticmethod(spy))
    n = 32
    src = (ctypes.c_char * (n * MiB))()
    dst = (ctypes.c_char * (n * MiB))()
    for i in range(n):
        ctypes.memset(ctypes.addressof(src) + i * MiB, i + 1, MiB)
    keys = [f"p{i}" for i in range(n)]
    try:
        assert all(s.put_from(keys, [[(ctypes.addressof(src) + i * MiB, MiB)] for i in range(n)]))
        assert all(s.get_into(keys, [[(ctypes.addressof(dst) + i * MiB, MiB)] for i in range(n)]))
    finally:
        s.close()
    assert dst.raw == src.raw
    assert len(threads) > 1  # 32 pages over 8 workers: eight tasks of four pages, on several threads


def test_reads_and_writes_run_on_workers_of_their_own(tmp_path, monkeypatch):
    """A prefetch never waits behind write-through puts' tasks: each side has its own workers."""
    s = _store(tmp_path, numjobs=4, entries=16)
    names: dict = {"read": set(), "write": set()}
    read_chunk, write_chunk = PageIO.read_chunk, PageIO.write_chunk

    def reads(chunk, lane, checks):
        names["read"].add(threading.current_thread().name.rsplit("_", 1)[0])
        return read_chunk(chunk, lane, checks)

    def writes(chunk, lane, *rest):
        names["write"].add(threading.current_thread().name.rsplit("_", 1)[0])
        return write_chunk(chunk, lane, *rest)

    monkeypatch.setattr(PageIO, "read_chunk", staticmethod(reads))
    monkeypatch.setattr(PageIO, "write_chunk", staticmethod(writes))
    n = 16
    buf = (ctypes.c_char * (n * MiB))()
    pages = [[(ctypes.addressof(buf) + i * MiB, MiB)] for i in range(n)]
    keys = [f"k{i}" for i in range(n)]
    try:
        assert all(s.put_from(keys, pages)) and all(s.get_into(keys, pages))
    finally:
        s.close()
    caller = threading.current_thread().name.rsplit("_", 1)[0]
    assert names["read"] == {caller, "hf3fs-read"} and names["write"] == {caller, "hf3fs-write"}
