"""kvconnect.connectors.buffers: the parallel copy path moves exactly the requested bytes."""

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
