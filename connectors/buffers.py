"""Moving bytes between ``(address, nbytes)`` segments and Python buffers.

``ctypes.memmove`` releases the GIL, so copies on several threads run in parallel.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import hashlib
import os
import threading
import zlib
from typing import Any, Callable, Sequence

from kvconnect.connectors.base import Page, Segment, page_nbytes

memmove = ctypes.memmove


def buffer_address(buf: bytearray | memoryview | "ctypes.Array") -> int:
    """Address of a writable buffer's first byte (bytearray, ctypes array, writable memoryview)."""
    if isinstance(buf, ctypes.Array):
        return ctypes.addressof(buf)
    mv = memoryview(buf)
    if mv.readonly:
        raise ValueError("buffer_address needs a writable buffer")
    if mv.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def bytes_address(data: bytes) -> int:
    """Address of an immutable ``bytes`` object's data (valid while ``data`` is alive)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


def gather(page: Page) -> bytearray:
    """Copy a page's segments into one new bytearray (one memcpy per segment)."""
    out = bytearray(page_nbytes(page))
    if out:
        gather_into(page, buffer_address(out))
    return out


def gather_into(page: Page, dst: int) -> int:
    """Copy a page's segments to ``dst`` back to back; returns bytes copied."""
    off = 0
    for addr, n in page:
        memmove(dst + off, addr, n)
        off += n
    return off


def scatter(src: int, page: Page) -> int:
    """Copy contiguous bytes at ``src`` into a page's segments; returns bytes copied."""
    off = 0
    for addr, n in page:
        memmove(addr, src + off, n)
        off += n
    return off


# One core's memcpy moves ~3-10 GiB/s, and the pages of one prefix are GiBs: big batches of
# copies are spread over a few threads (memmove releases the GIL).
COPY_THREADS_ENV = "KVCONNECT_COPY_THREADS"
_PARALLEL_MIN_BYTES = 8 << 20   # below this, handing work to threads costs more than it saves
_CHUNK_BYTES = 4 << 20          # large segments are split so threads get even shares
_copy_pool: cf.ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def copy_threads() -> int:
    """Threads used by :func:`copy_many`: ``$KVCONNECT_COPY_THREADS``, else min(8, cores)."""
    raw = os.environ.get(COPY_THREADS_ENV, "")
    if raw.strip():
        try:
            return max(1, int(raw))
        except ValueError:
            raise ValueError(f"{COPY_THREADS_ENV} must be an integer, got {raw!r}") from None
    return max(1, min(8, os.cpu_count() or 1))


def _pool() -> cf.ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = cf.ThreadPoolExecutor(max(1, copy_threads() - 1), thread_name_prefix="kvc-copy")
        return _copy_pool


def _run_moves(moves: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, n in moves:
        memmove(dst, src, n)


def copy_many(moves: Sequence[tuple[int, int, int]]) -> None:
    """Do every ``(dst, src, nbytes)`` memmove; large totals are split over several threads.

    Returns when all bytes are copied (the calling thread does one share itself)."""
    total = sum(n for _, _, n in moves)
    threads = copy_threads()
    if threads == 1 or total < _PARALLEL_MIN_BYTES:
        _run_moves(moves)
        return
    share = -(-total // threads)
    groups: list[list[tuple[int, int, int]]] = [[]]
    filled = 0
    for dst, src, n in moves:
        off = 0
        while off < n:
            take = min(n - off, _CHUNK_BYTES, share - filled)
            groups[-1].append((dst + off, src + off, take))
            off += take
            filled += take
            if filled >= share:
                groups.append([])
                filled = 0
    run_shares(_pool(), _run_moves, [g for g in groups if g])


def run_shares(pool: cf.Executor, fn: Callable[[Any], Any], shares: Sequence[Any]) -> list:
    """``[fn(share) for share in shares]``: every share but the first on ``pool``, the first on
    the calling thread, then each one waited for. Results in share order."""
    futures = [pool.submit(fn, share) for share in shares[1:]]
    out = [fn(shares[0])] if shares else []
    out.extend(f.result() for f in futures)
    return out


def map_spread(fn: Callable[[Any], Any], items: Sequence[Any], total_bytes: int) -> list:
    """``[fn(x) for x in items]``, the items shared out over the copy threads when they cover
    ``total_bytes`` >= 8 MiB (``fn`` must release the GIL, as memmove and xxhash do); the calling
    thread does one share itself. Results in item order."""
    threads = min(copy_threads(), len(items))
    if threads <= 1 or total_bytes < _PARALLEL_MIN_BYTES:
        return [fn(x) for x in items]
    share = -(-len(items) // threads)
    groups = [items[i:i + share] for i in range(0, len(items), share)]
    return [y for part in run_shares(_pool(), lambda g: [fn(x) for x in g], groups) for y in part]


def scatter_many(srcs: Sequence[int], pages: Sequence[Page]) -> None:
    """:func:`scatter` of ``srcs[i]`` into ``pages[i]`` for every i, in parallel."""
    moves = []
    for src, page in zip(srcs, pages):
        off = 0
        for addr, n in page:
            moves.append((addr, src + off, n))
            off += n
    copy_many(moves)


def gather_many(pages: Sequence[Page], dsts: Sequence[int]) -> None:
    """:func:`gather_into` of ``pages[i]`` to ``dsts[i]`` for every i, in parallel."""
    moves = []
    for page, dst in zip(pages, dsts):
        off = 0
        for addr, n in page:
            moves.append((dst + off, addr, n))
            off += n
    copy_many(moves)


def page_view(page: Page) -> list[memoryview]:
    """Writable memoryviews over a page's segments (for preadv / pwritev)."""
    return [memoryview((ctypes.c_char * n).from_address(addr)).cast("B") for addr, n in page]


def page_checksum(page: Page) -> int:
    """CRC32 over a page's bytes (no copy)."""
    crc = 0
    for mv in page_view(page):
        crc = zlib.crc32(mv, crc)
    return crc


def page_digest(page: Page) -> bytes:
    """BLAKE2b-128 over a page's bytes (tests and demos: stronger than CRC)."""
    h = hashlib.blake2b(digest_size=16)
    for mv in page_view(page):
        h.update(mv)
    return h.digest()


def split_page(address: int, sizes: Sequence[int]) -> list[Segment]:
    """Consecutive segments of the given sizes starting at ``address``."""
    segs, off = [], 0
    for n in sizes:
        segs.append((address + off, n))
        off += n
    return segs


class HostBuffer:
    """An owned, page-addressable block of host memory (tests, demo, benchmarks).

    Pages are ``page_bytes`` long and split into ``segments`` equal segments placed in
    separate halves of the buffer when ``interleave`` is False (like SGLang's K and V
    buffers), so multi-segment pages are really non-contiguous.
    """

    def __init__(self, num_pages: int, page_bytes: int, segments: int = 1):
        if page_bytes % segments:
            raise ValueError("page_bytes must be a multiple of segments")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.segments = segments
        self.seg_bytes = page_bytes // segments
        self.raw = bytearray(num_pages * page_bytes)
        self.address = buffer_address(self.raw) if self.raw else 0

    def page(self, i: int) -> list[Segment]:
        if not 0 <= i < self.num_pages:
            raise IndexError(i)
        region = self.num_pages * self.seg_bytes
        return [(self.address + s * region + i * self.seg_bytes, self.seg_bytes) for s in range(self.segments)]

    def fill(self, i: int, data: bytes) -> None:
        if len(data) != self.page_bytes:
            raise ValueError("data must be exactly one page")
        scatter(bytes_address(data), self.page(i))

    def read(self, i: int) -> bytes:
        return bytes(gather(self.page(i)))

    def zero(self, i: int) -> None:
        for addr, n in self.page(i):
            ctypes.memset(addr, 0, n)
