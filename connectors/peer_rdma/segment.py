"""The memory a node lends to the pool: one mmap'd segment, an allocator, LRU slots.

Every stored page is a *slot*: a block of the segment plus its generation ``seq`` (unique
per allocation, never reused) and the xxh3-64 ``checksum`` of its bytes. The slot table is
the seqlock: a writer copies into a block that no index entry points at and publishes the
slot (new ``seq``) only after the copy and checksum; eviction or deletion removes the slot
before its block can be handed to another writer. A local reader copies, then checks that
the key still maps to the same ``seq``; a remote reader checks the checksum of the bytes it
received against the one published with ``seq``. Either way a reused block is a miss.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import xxhash

from kvconnect.connectors.base import Page, page_nbytes
from kvconnect.connectors.buffers import gather_into, map_spread, memmove, page_view, scatter_many

ALIGN = 256


# Bytes copied and hashed per step of a fused copy: the chunk is hashed while it is still in this
# core's cache, so memory is read from DRAM once. 1 MiB was the fastest step measured against
# two passes on a 16-core H100 node (figures at ``Reader.fused_same_host``; smaller steps make
# more calls per page). A page's digest is the same for any step.
HASH_CHUNK = 1 << 20


def _hash_page(page: Page, src: int | None = None, chunk: int = HASH_CHUNK) -> int:
    """xxh3-64 over a page's segments in order; with ``src``, each chunk of the page is first
    copied from ``src`` (the page's bytes back to back) and hashed right after, while hot.
    The streaming digest equals the one-shot digest of the same bytes; ``update`` releases
    the GIL, so pages on several threads hash in parallel."""
    h = xxhash.xxh3_64()
    off = 0
    for (addr, n), mv in zip(page, page_view(page)):
        if src is None:
            h.update(mv)
        else:
            for o in range(0, n, chunk):
                c = min(chunk, n - o)
                memmove(addr + o, src + off + o, c)
                h.update(mv[o:o + c])
        off += n
    return h.intdigest()


def checksum_page(page: Page) -> int:
    """xxh3-64 over a page's segments in order (= over the same bytes back to back)."""
    return _hash_page(page)


def checksum_pages(pages: list[Page]) -> list[int]:
    """:func:`checksum_page` of each page; a prefix's worth is hashed on the copy threads (xxhash
    releases the GIL). Hashed one by one on the caller, a 1 GiB prefix's same-host get took 131 ms
    in a serving run where Mooncake's shared segment, which copies without hashing, took 41 ms."""
    return map_spread(checksum_page, pages, sum(page_nbytes(p) for p in pages))


def copy_checksum_pages(srcs: list[int], pages: list[Page], chunk: int = HASH_CHUNK) -> list[int]:
    """Copies ``srcs[i]`` (contiguous bytes) into ``pages[i]`` and returns the xxh3-64 of the
    bytes that landed in each page, in one pass: copy a chunk, hash it while it is in cache.
    Pages are shared out over the copy threads. A page's digest is of the caller's bytes, so a
    source rewritten during the copy cannot pass as the published checksum."""
    return map_spread(lambda sp: _hash_page(sp[1], sp[0], chunk), list(zip(srcs, pages)),
                      sum(page_nbytes(p) for p in pages))


def checksum_at(address: int, nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B"))


@dataclass(frozen=True)
class Slot:
    offset: int
    length: int
    seq: int
    checksum: int


class Allocator:
    """First-fit over exact-size free lists, with coalescing and a bump pointer.

    KV pages of one pool all have one size, so the exact-size list serves nearly every
    allocation in O(1); mixed sizes fall back to splitting a larger free block.
    """

    def __init__(self, size: int):
        self.size = size
        self.top = 0  # never-allocated tail starts here
        self.free_by_start: dict[int, int] = {}
        self.free_by_end: dict[int, int] = {}
        self.free_by_size: dict[int, set[int]] = {}
        self.used = 0

    @staticmethod
    def rounded(n: int) -> int:
        return (n + ALIGN - 1) // ALIGN * ALIGN

    def alloc(self, n: int) -> int | None:
        n = self.rounded(n)
        starts = self.free_by_size.get(n)
        if starts:
            start = starts.pop()
            self._unlink(start, n, from_size=False)
            self.used += n
            return start
        if self.top + n <= self.size:
            start = self.top
            self.top += n
            self.used += n
            return start
        for size in sorted(self.free_by_size):
            if size > n and self.free_by_size[size]:
                start = next(iter(self.free_by_size[size]))
                self._unlink(start, size)
                self._link(start + n, size - n)
                self.used += n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        n = self.rounded(n)
        self.used -= n
        end = start + n
        nxt = self.free_by_start.get(end)
        if nxt is not None:
            self._unlink(end, nxt)
            end += nxt
        prev = self.free_by_end.get(start)
        if prev is not None:
            self._unlink(prev, start - prev)
            start = prev
        if end == self.top:
            self.top = start
        else:
            self._link(start, end - start)

    def _link(self, start: int, n: int) -> None:
        self.free_by_start[start] = n
        self.free_by_end[start + n] = start
        self.free_by_size.setdefault(n, set()).add(start)

    def _unlink(self, start: int, n: int, from_size: bool = True) -> None:
        del self.free_by_start[start]
        del self.free_by_end[start + n]
        if from_size:
            s = self.free_by_size[n]
            s.discard(start)
            if not s:
                del self.free_by_size[n]
        elif not self.free_by_size.get(n):
            self.free_by_size.pop(n, None)


class Segment:
    """A node's lent memory: slots by key in LRU order.

    ``on_evict(key, slot)`` is called (under the lock; keep it cheap) for every slot that
    capacity pressure pushed out, so the node can unpublish or demote it to disk.
    """

    def __init__(self, size: int, on_evict: Callable[[str, Slot], None] | None = None, populate: bool = True,
                 path: str = ""):
        """``path``: a file of at least ``size`` bytes (in shared memory) to map ``MAP_SHARED``
        instead of anonymous memory, so same-host processes can map it too."""
        self.size = size
        flags = mmap.MAP_SHARED if path else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate:
            # Fault the lent memory in now: a remote write into never-touched pages pays a page
            # fault (and zeroing) per 4 KiB on the receiving node, several times the transfer
            # itself. RDMA registration pins it anyway.
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        if path:
            fd = os.open(path, os.O_RDWR)
            try:
                self._mem = mmap.mmap(fd, max(size, mmap.PAGESIZE), flags=flags,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        else:
            self._mem = mmap.mmap(-1, max(size, mmap.PAGESIZE), flags=flags)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        self._alloc = Allocator(size)
        self._slots: OrderedDict[str, Slot] = OrderedDict()
        self._lock = threading.Lock()
        # slot generations start at the clock, so a restarted node (same id, new segment)
        # never reuses one: owners' tombstones name (holder, seq)
        self._seq = time.time_ns()
        self.evictions = 0
        self.on_evict = on_evict

    # -- reads --------------------------------------------------------------------
    def lookup(self, key: str, touch: bool = True) -> Slot | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and touch:
                self._slots.move_to_end(key)
            return slot

    def lookup_many(self, keys: list[str]) -> list[Slot | None]:
        """``lookup`` for a batch under one lock acquisition (touches the hits)."""
        with self._lock:
            slots = self._slots
            out = [slots.get(k) for k in keys]
            for k, s in zip(keys, out):
                if s is not None:
                    slots.move_to_end(k)
            return out

    def holds(self, key: str, seq: int) -> bool:
        return (s := self._slots.get(key)) is not None and s.seq == seq

    def read_into(self, key: str, page: Page, slot: Slot | None = None) -> bool:
        """Local read with the seqlock check: True only for this key's untorn bytes."""
        return self.read_many([key], [page], [slot or self.lookup(key)])[0]

    def read_many(self, keys: list[str], pages: list[Page], slots: list[Slot | None]) -> list[bool]:
        """Local reads of a batch, copies spread over threads (a prefix is GiBs: one core's
        memcpy is far too slow); each page is True only if its key still maps to the slot's
        ``seq`` after the copy (seqlock), so an eviction racing the copy is a miss."""
        ok = [s is not None and s.length == sum(n for _, n in p) for s, p in zip(slots, pages)]
        scatter_many([self.base + s.offset for s, o in zip(slots, ok) if o],  # type: ignore[union-attr]
                     [p for p, o in zip(pages, ok) if o])
        return [o and self.holds(k, s.seq) for k, s, o in zip(keys, slots, ok)]  # type: ignore[union-attr]

    # -- writes -------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int | None:
        """A block for a page being written (invisible until ``commit``); evicts LRU slots."""
        if self._alloc.rounded(nbytes) > self.size:
            return None
        with self._lock:
            while True:
                off = self._alloc.alloc(nbytes)
                if off is not None:
                    return off
                if not self._slots:
                    return None
                key, slot = self._slots.popitem(last=False)
                self._alloc.free(slot.offset, slot.length)
                self.evictions += 1
                if self.on_evict:
                    self.on_evict(key, slot)

    def release(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._alloc.free(offset, nbytes)

    def commit(self, key: str, offset: int, nbytes: int, checksum: int) -> Slot | None:
        """Publish a reserved block under ``key``; None (block released) if the key is held."""
        with self._lock:
            if key in self._slots:
                self._alloc.free(offset, nbytes)
                return None
            self._seq += 1
            slot = Slot(offset, nbytes, self._seq, checksum)
            self._slots[key] = slot
            return slot

    def write(self, key: str, page: Page) -> tuple[Slot | None, bool]:
        """Copy a caller page in: (slot, new). An existing key returns (its slot, False)."""
        cur = self.lookup(key)
        if cur is not None:
            return cur, False
        n = sum(sz for _, sz in page)
        off = self.reserve(n)
        if off is None:
            return None, False
        gather_into(page, self.base + off)
        slot = self.commit(key, off, n, checksum_at(self.base + off, n))
        if slot is None:
            return self.lookup(key), False
        return slot, True

    def remove(self, key: str, seq: int | None = None) -> Slot | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or (seq is not None and slot.seq != seq):
                return None
            del self._slots[key]
            self._alloc.free(slot.offset, slot.length)
            return slot

    def clear(self, prefix: str = "") -> list[tuple[str, Slot]]:
        """Drop every slot (of keys starting with ``prefix``); returns them. Blocks reserved
        and not committed stay allocated: a one-sided write into one may be in flight (or
        land late), so it must not be handed out again."""
        with self._lock:
            items = [(k, s) for k, s in self._slots.items() if k.startswith(prefix)]
            for key, slot in items:
                self._alloc.free(slot.offset, slot.length)
                del self._slots[key]
            return items

    def items(self) -> list[tuple[str, Slot]]:
        with self._lock:
            return list(self._slots.items())

    @property
    def keys(self) -> int:
        return len(self._slots)

    @property
    def bytes_used(self) -> int:
        return self._alloc.used

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
        try:
            self._mem.close()
        except BufferError:  # a ctypes view still alive: the mapping goes with the object
            pass
