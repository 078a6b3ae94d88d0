"""peer_rdma's same-host copy: copy and xxh3-64 in one pass, chunk by chunk.

The published checksum is the one-shot xxh3-64 of a whole page; the fused pass feeds each
chunk it copied into a streaming hasher. The two must agree for every page shape, and the
digest must be of the bytes that landed in the caller's page, so a source rewritten while
it is copied can never pass as the page (a miss, never torn bytes)."""

import ctypes
import os
import pytest
import xxhash

from kvconnect.connectors import buffers
from kvconnect.connectors.buffers import HostBuffer, buffer_address
from kvconnect.connectors.peer_rdma import segment
from kvconnect.connectors.peer_rdma.reads import Reader
from kvconnect.connectors.peer_rdma.segment import checksum_page, checksum_pages, copy_checksum_pages
from kvconnect.connectors.testing.conformance import race


@pytest.mark.parametrize("threads", ["1", "4"])
@pytest.mark.parametrize("chunk", [4096, 1000, 64 << 10, 512 << 10, 1 << 20, 4 << 20])
def test_fused_digest_equals_the_one_shot_digest_and_the_bytes_are_copied(monkeypatch, threads, chunk):
    monkeypatch.setenv(buffers.COPY_THREADS_ENV, threads)
    monkeypatch.setattr(buffers, "_copy_pool", None)
    # 12 pages of 1.5 MiB + 3 bytes in 3 uneven, non-contiguous segments: 18 MiB, spread
    # over the threads; segment ends that are not chunk multiples
    sizes = [(512 << 10) + 1, (768 << 10) + 2, 256 << 10]
    pb = sum(sizes)
    srcs = [bytes(os.urandom(pb)) for _ in range(12)]
    raw = [bytearray(pb + 64) for _ in range(12)]
    pages = []
    for r in raw:  # the segments of a page lie apart, in reverse order
        base = buffer_address(r)
        pages.append([(base + 32 + sizes[2] + sizes[1], sizes[0]), (base + 32 + sizes[2], sizes[1]),
                      (base + 32, sizes[2])])
    sums = copy_checksum_pages([buffers.bytes_address(s) for s in srcs], pages, chunk)
    assert sums == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    for s, p, r in zip(srcs, pages, raw):
        assert b"".join(ctypes.string_at(a, n) for a, n in p) == s
        assert r[:32] == bytes(32) and r[32 + pb:] == bytes(32)  # nothing written outside the page
        assert checksum_page(p) == xxhash.xxh3_64_intdigest(s)


def test_reads_take_one_pass_of_1_mib_steps_by_default_and_every_step_gives_the_published_digest(monkeypatch):
    """Same-host reads copy and hash in one pass, 1 MiB per step, unless told otherwise; the
    digest of a page is the same whatever the step, the default's included, and equals the two
    passes' (``checksum_pages`` of the landed bytes), so changing the step never turns a hit
    into a miss."""
    monkeypatch.setenv(buffers.COPY_THREADS_ENV, "2")
    monkeypatch.setattr(buffers, "_copy_pool", None)
    assert Reader.fused_same_host and Reader.fused_chunk_bytes == segment.HASH_CHUNK == 1 << 20
    n, pb = 3, (3 << 20) + 5  # not a multiple of any step
    own = [os.urandom(pb) for _ in range(n)]
    src = HostBuffer(n, pb)
    for i in range(n):
        src.fill(i, own[i])
    published = [xxhash.xxh3_64_intdigest(b) for b in own]
    for chunk in (None, 64 << 10, 256 << 10, 1 << 20, 4 << 20):
        dst = HostBuffer(n, pb)
        srcs, pages = [src.address + i * pb for i in range(n)], [dst.page(i) for i in range(n)]
        sums = copy_checksum_pages(srcs, pages) if chunk is None else copy_checksum_pages(srcs, pages, chunk)
        assert sums == published == checksum_pages(pages), chunk
        assert [dst.read(i) for i in range(n)] == own


def test_a_page_rewritten_during_the_copy_is_a_miss_never_torn(monkeypatch):
    """A writer keeps rewriting the source pages (another key's bytes over them, then the
    page's own again, chunk by chunk) while they are copied: every page whose digest is the
    published checksum holds exactly the page's bytes, the digest is always that of the
    bytes in the caller's page, and some reads did see a torn page (counted as misses)."""
    monkeypatch.setenv(buffers.COPY_THREADS_ENV, "2")
    monkeypatch.setattr(buffers, "_copy_pool", None)
    n, pb = 4, 2 << 20
    own = [os.urandom(pb) for _ in range(n)]
    other = os.urandom(pb)
    published = [xxhash.xxh3_64_intdigest(b) for b in own]
    src = HostBuffer(n, pb)
    for i in range(n):
        src.fill(i, own[i])
    dst = HostBuffer(n, pb)
    other_at = buffers.bytes_address(other)
    seen = {"hits": 0, "misses": 0}

    def rewrite(stop):
        k = 0
        while not stop.is_set():
            i, off = k % n, (k * 48 << 10) % pb
            step = min(96 << 10, pb - off)
            ctypes.memmove(src.address + i * pb + off, other_at + off, step)  # slot reused...
            ctypes.memmove(src.address + i * pb + off, buffers.bytes_address(own[i]) + off, step)  # ...and back
            k += 1

    def read(stop):
        while not stop.is_set():
            sums = copy_checksum_pages([src.address + i * pb for i in range(n)], [dst.page(i) for i in range(n)],
                                       64 << 10)
            for i, got in enumerate(sums):
                landed = dst.read(i)
                assert got == xxhash.xxh3_64_intdigest(landed)  # the digest is of the caller's bytes
                assert (got == published[i]) == (landed == own[i])
                seen["hits" if got == published[i] else "misses"] += 1

    assert race([rewrite, read], seconds=2) == []
    misses = seen["misses"]
    assert misses > 0, "the writer never raced a copy: the test proved nothing"


def test_a_chunk_that_changed_under_the_copy_and_back_is_a_miss(monkeypatch):
    """The writer's worst timing, made deterministic: the source of one chunk holds another
    key's bytes while that chunk is copied and the page's own again by the time it is hashed.
    The digest is of what landed in the caller's page, so that page is a miss; the others hit."""
    monkeypatch.setenv(buffers.COPY_THREADS_ENV, "1")
    n, pb = 3, 1 << 20
    own = [os.urandom(pb) for _ in range(n)]
    src = HostBuffer(n, pb)
    for i in range(n):
        src.fill(i, own[i])
    dst = HostBuffer(n, pb)
    target = src.address + pb + 5 * (64 << 10)  # page 1, its sixth chunk
    copy = segment.memmove

    def racing_memmove(to, frm, nbytes):
        if frm == target:
            saved = ctypes.string_at(frm, nbytes)
            ctypes.memset(frm, 0x5A, nbytes)          # rewritten while copied ...
            copy(to, frm, nbytes)
            ctypes.memmove(frm, saved, nbytes)        # ... and back before the hash
            return to
        return copy(to, frm, nbytes)

    monkeypatch.setattr(segment, "memmove", racing_memmove)
    sums = copy_checksum_pages([src.address + i * pb for i in range(n)], [dst.page(i) for i in range(n)], 64 << 10)
    published = [xxhash.xxh3_64_intdigest(b) for b in own]
    assert [s == p for s, p in zip(sums, published)] == [True, False, True]
    assert sums[1] == xxhash.xxh3_64_intdigest(dst.read(1)) and dst.read(1) != own[1]
