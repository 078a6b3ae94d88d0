"""kvconnect.connectors.buffers: the parallel copy path moves exactly the requested bytes."""

import ctypes
import os

import pytest

from kvconnect.connectors import buffers
from kvconnect.connectors.buffers import HostBuffer, copy_many, gather_many, scatter_many


def _random_buffer(num_pages: int, page_bytes: int, segments: int) -> HostBuffer:
    b = HostBuffer(num_pages, page_bytes, segments)
    for i in range(num_pages):
        b.fill(i, os.urandom(page_bytes))
    return b


@pytest.mark.parametrize("threads", ["1", "3", "8"])
def test_scatter_and_gather_many_roundtrip_bytes(monkeypatch, threads):
    monkeypatch.setenv(buffers.COPY_THREADS_ENV, threads)
    # 24 pages x 1.5 MiB in 3 non-contiguous segments: 36 MiB, above the parallel threshold,
    # and segments of 512 KiB next to a 9 MiB move that gets split into chunks
    src = _random_buffer(24, 3 * 512 * 1024, 3)
    staging = [bytearray(src.page_bytes) for _ in range(24)]
    gather_many([src.page(i) for i in range(24)], [buffers.buffer_address(s) for s in staging])
    for i in range(24):
        assert bytes(staging[i]) == src.read(i)
    dst = HostBuffer(24, src.page_bytes, 3)
    scatter_many([buffers.buffer_address(s) for s in staging], [dst.page(i) for i in range(24)])
    for i in range(24):
        assert dst.read(i) == src.read(i)

    big_src = bytearray(os.urandom(9 << 20))
    big_dst = bytearray(len(big_src) + 2)
    copy_many([(buffers.buffer_address(big_dst) + 1, buffers.buffer_address(big_src), len(big_src))])
    assert big_dst[0] == 0 and big_dst[-1] == 0  # nothing written outside the range
    assert bytes(big_dst[1:-1]) == bytes(big_src)


def test_copy_threads_env_is_validated(monkeypatch):
    monkeypatch.setenv(buffers.COPY_THREADS_ENV, "four")
    with pytest.raises(ValueError, match="KVCONNECT_COPY_THREADS"):
        buffers.copy_threads()
    monkeypatch.setenv(buffers.COPY_THREADS_ENV, "0")
    assert buffers.copy_threads() == 1


def test_map_spread_keeps_order_and_shares_a_large_batch_out(monkeypatch):
    import threading

    import xxhash

    from kvconnect.connectors.buffers import map_spread
    from kvconnect.connectors.peer_rdma.segment import checksum_page, checksum_pages

    monkeypatch.setenv(buffers.COPY_THREADS_ENV, "4")
    monkeypatch.setattr(buffers, "_copy_pool", None)
    seen: set = set()

    def tagged(x):
        seen.add(threading.get_ident())
        return x * 2

    assert map_spread(tagged, list(range(40)), 64 << 20) == [x * 2 for x in range(40)]
    assert len(seen) > 1                                      # shared out over the copy threads
    seen.clear()
    assert map_spread(tagged, list(range(40)), 1 << 20) == [x * 2 for x in range(40)]
    assert seen == {threading.get_ident()}                    # a small batch stays on the caller
    # page checksums, spread or not, are each page's own xxh3 over its segments in order
    bufs = [bytearray(os.urandom(3 << 20)) for _ in range(8)]
    pages = [[(ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b)), 1 << 20),
              (ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b)) + (1 << 20), 2 << 20)] for b in bufs]
    assert checksum_pages(pages) == [checksum_page(p) for p in pages] == [xxhash.xxh3_64_intdigest(bytes(b))
                                                                          for b in bufs]
