"""Write-behind: an engine's page writes staged in a bounded buffer, stored on a background thread.

An engine that writes through to L3 (SGLang HiCache ``write_through``) keeps each page's host
memory until the store call returns. When the store's medium writes slower than the engine
produces pages (a local disk under the HF3FS POSIX client, a congested network), those host
pages pile up, the host pool runs out, and the engine itself waits: serving becomes slower
than with no L3 at all. With write-behind the engine's call only copies its pages into a
staging buffer of a fixed size and returns; a background thread stores them. When the buffer
is full, the pages that do not fit are refused at once (the engine sees a failed write and
frees them): a cache that cannot keep up stores fewer pages, it never slows the engine.

Pages refused or whose store write failed count as ``shed`` / ``failed``; a page is readable
once its background write has been confirmed by the store (until then it is a miss).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import threading
import time
from typing import Callable, Optional, Sequence

from kvconnect.connectors.base import Capability, Page, PageStore

log = logging.getLogger("kvconnect.engines")


class WriteBehind:
    """A staging buffer of ``budget_bytes // page_nbytes`` page slots and one writer thread."""

    def __init__(self, store: PageStore, budget_bytes: int, page_nbytes: int, *, name: str = "kv",
                 put_from: Optional[Callable[[list, list], list]] = None):
        """``put_from``: how a staged batch is stored (default ``store.put_from``; the HiCache
        adapter passes one that also publishes KV events)."""
        if page_nbytes <= 0:
            raise ValueError(f"write-behind: page size must be > 0, got {page_nbytes}")
        slots = budget_bytes // page_nbytes
        if slots < 1:
            raise ValueError(f"write-behind: {budget_bytes} bytes hold no {page_nbytes}-byte page")
        self.store, self.page_nbytes, self.name = store, page_nbytes, name
        self._put_from = put_from or store.put_from
        self.slots = slots
        self._buf = mmap.mmap(-1, slots * page_nbytes)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        if store.supports(Capability.NEEDS_REGISTERED_MEMORY):
            store.register_memory(self._base, slots * page_nbytes)
        self._free = list(range(slots - 1, -1, -1))
        self._queue: collections.deque = collections.deque()
        self._busy = 0                       # batches taken by the writer, not yet done
        self._copying = 0                    # submit calls copying into the buffer right now
        self._cond = threading.Condition()
        self._stopping = False
        self.counts = {"staged": 0, "written": 0, "failed": 0, "shed": 0}
        self._last_shed_log = 0.0
        self._thread = threading.Thread(target=self._run, name=f"kvconnect-write-behind-{name}", daemon=True)
        self._thread.start()
        log.info("kvconnect: write-behind for %s pages: %d slots of %d bytes (%.1f GiB)", name, slots,
                 page_nbytes, slots * page_nbytes / (1 << 30))

    def submit(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Copy the pages into free slots and queue their write; True per page staged, False per
        page refused (no free slot, or not ``page_nbytes`` long). Staged pages form a prefix."""
        with self._cond:
            if self._stopping:
                return [False] * len(keys)
            take = min(len(keys), len(self._free))
            slots = [self._free.pop() for _ in range(take)]
            self._copying += 1               # close() waits for this copy before unmapping
        memmove, pb = ctypes.memmove, self.page_nbytes
        staged_slots: list[int] = []
        try:
            for slot, page in zip(slots, pages):
                if sum(n for _, n in page) != pb:
                    break                    # another pool's page size: never staged
                dst = self._base + slot * pb
                for addr, n in page:
                    memmove(dst, addr, n)    # ctypes releases the GIL while it copies
                    dst += n
                staged_slots.append(slot)
        finally:
            k = len(staged_slots)
            with self._cond:                 # one step: the writer never sees no copy and no batch
                self._copying -= 1
                self._free.extend(slots[k:])
                if k:
                    self._queue.append((list(keys[:k]), staged_slots))
                    self.counts["staged"] += k
                self.counts["shed"] += len(keys) - k
                self._cond.notify_all()
        if k < len(keys):
            self._note_shed(len(keys) - k)
        return [True] * k + [False] * (len(keys) - k)

    def _note_shed(self, n: int) -> None:
        now = time.monotonic()
        if now - self._last_shed_log >= 30.0:
            self._last_shed_log = now
            log.warning("kvconnect: write-behind buffer of %s pages full (%d slots): %d page(s) not stored; the "
                        "store writes slower than the engine produces pages (%d shed so far)",
                        self.name, self.slots, n, self.counts["shed"])

    def _run(self) -> None:
        pb = self.page_nbytes
        while True:
            with self._cond:
                while not self._queue and not (self._stopping and not self._copying):
                    self._cond.wait()
                if not self._queue:
                    return                   # stopping, and no copy left that could queue a batch
                keys, slots = self._queue.popleft()
                self._busy += 1
            try:
                ok = self._put_from(keys, [[(self._base + s * pb, pb)] for s in slots])
            except Exception as e:  # noqa: BLE001 - the writer thread never dies
                log.error("kvconnect: write-behind store write of %d page(s) failed: %s", len(keys), e)
                ok = [False] * len(keys)
            with self._cond:
                done = sum(1 for o in ok if o)
                self.counts["written"] += done
                self.counts["failed"] += len(keys) - done
                self._free.extend(slots)
                self._busy -= 1
                self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return sum(len(k) for k, _ in self._queue) + self._busy

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every staged page was written (or failed); False if ``timeout_s`` passed first."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is staged (at most ``timeout_s``), then stop the writer. Pages still queued
        after that are dropped (counted as shed); the buffer is released once the writer stopped."""
        flushed = self.flush(timeout_s)
        end = time.monotonic() + timeout_s
        with self._cond:
            self._stopping = True            # no new copies; a copy under way still queues its batch
            while self._copying and time.monotonic() < end:
                self._cond.wait(max(0.0, end - time.monotonic()))
            if not flushed:
                dropped = sum(len(k) for k, _ in self._queue)
                self.counts["shed"] += dropped
                self._queue.clear()
                log.warning("kvconnect: write-behind closed with %d page(s) unwritten", dropped)
            self._cond.notify_all()          # the writer drains what is queued, then exits
        self._thread.join(timeout_s)
        if not self._thread.is_alive() and not self._copying:
            try:
                self._buf.close()
            except BufferError:
                pass                         # a ctypes view still points into it: left to the GC

    def stats(self) -> dict:
        with self._cond:
            return {**self.counts, "slots": self.slots, "pending": sum(len(k) for k, _ in self._queue) + self._busy}
