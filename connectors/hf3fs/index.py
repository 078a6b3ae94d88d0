"""The HF3FS page index: which key owns which page (slot) of a data file.

One ``PageIndex`` holds many namespaces (SGLang's ``"{rank}:{pool}"``); each namespace
describes one data file of ``num_pages`` slots of ``page_bytes``. The same class is the
in-process index of a single-node store and the state of ``kvconnect hf3fs-meta serve``.

Why it is safe where SGLang's ``mini_3fs_metadata_server`` is not:

* **In-flight reservations are tracked.** ``reserve`` of a key that another writer has
  reserved but not yet confirmed answers ``INFLIGHT`` (the second writer skips the write)
  instead of handing out a second page; a reservation that is never confirmed expires after
  ``write_lease_s`` and its page returns to the free list. Duplicate keys in one batch are
  reserved once.
* **Generations.** Every reservation bumps the slot's generation. ``confirm`` accepts only
  the (slot, generation) it handed out, and readers can ``validate`` the (slot, generation)
  they read after the read: a page reused meanwhile is a miss, never another key's bytes.
* **Read leases.** ``get`` leases the returned slots for ``read_lease_s``; a freed or
  evicted slot is not handed to a writer until its lease ran out, so LRU eviction and
  deletes never reuse a page under a reader. A reader whose read finished within its lease
  skips the ``validate`` round trip; a slower one validates.
* **LRU eviction** happens only when no free page is left, picks the least recently used
  confirmed key whose page is not leased, and never touches reserved pages.
* **Write leases** (the one-call write path): ``lease`` hands a writer free slots ahead of
  time (each a fresh generation, RESERVED, no key yet); the writer writes its pages there
  and ``put`` maps keys to them in one call. A key already stored or in flight is answered
  ``PUT_DUP`` and its slot stays leased to the writer, so two writers of one key never
  double-assign or leak a page; unused slots come back with ``unlease`` or when the lease
  expires after ``write_lease_s`` (a dead writer).

Every state change is described to an optional journal (``kvconnect.connectors.hf3fs.wal``) while the
lock is held, so the journal order is the state order; ``replay`` and ``finish_recovery``
(``index_recovery.py``) rebuild state from it. Keys are ``bytes`` without ``b"\\n"`` (the wire
format joins keys with newlines).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Iterable, Sequence

from kvconnect.connectors.hf3fs import index_recovery
from kvconnect.connectors.hf3fs.slots import CONFIRMED, FREE, RESERVED, Namespace, each
# put() statuses, named here for the index's callers
from kvconnect.connectors.hf3fs.write_leases import PUT_DUP, PUT_LOST, PUT_OK, WriteLeases  # noqa: F401

# reserve() statuses
NEW = 0  # reserved for the caller: write the page, then confirm or release it
EXISTS = 1  # already stored (confirmed): nothing to write
INFLIGHT = 2  # another writer holds a live reservation for this key
NOSPACE = 3  # no page can be freed now (all reserved or leased to readers)

log = logging.getLogger("kvconnect.hf3fs.index")

MAX_PAGES = 1 << 27
"""Pages one namespace (data file) may have: the index keeps ~40 bytes per page from the
start (5 GiB at this bound), so a file_size typo must not become an allocation."""
INDEX_BYTES_PER_PAGE = 29
"""Of those, allocated when the namespace is created: state 1, generation 8, crc 4, read lease 8,
write lease 8 (the key map grows with the pages stored)."""

DEFAULT_READ_LEASE_S = 2.0
DEFAULT_WRITE_LEASE_S = 30.0


class IndexError_(ValueError):
    """A namespace/geometry error (unknown namespace, page-size conflict)."""


@dataclass
class NamespaceInfo:
    name: str
    num_pages: int
    page_bytes: int
    read_lease_s: float
    write_lease_s: float


Journal = Callable[..., None]


class PageIndex:
    """Thread-safe, batched page index over many namespaces.

    The index holds the namespaces, their reservations, readers and removals; the parts,
    all under its one lock: each ``Namespace`` (slots.py) its slots' state and which slot a
    writer gets next (LRU eviction), ``leases`` (write_leases.py) the one-call write path,
    ``index_recovery`` the journal's replay.

    Args:
        read_lease_s: how long a slot returned by ``get`` is kept from reuse.
        write_lease_s: how long a reservation lives without ``confirm``.
        journal: object with ``record(kind, ns, **fields)`` called under the lock for every
            state change (``None``: volatile index).
        clock: monotonic clock (tests).
    """

    def __init__(self, read_lease_s: float = DEFAULT_READ_LEASE_S,
                 write_lease_s: float = DEFAULT_WRITE_LEASE_S, journal=None,
                 clock: Callable[[], float] = time.monotonic):
        self.lock = threading.Lock()
        self.read_lease_s = read_lease_s
        self.write_lease_s = write_lease_s
        self.journal = journal
        self.clock = clock
        self.spaces: dict[str, Namespace] = {}
        # evict_listeners(ns, keys): told under the lock of every LRU eviction (the in-process
        # index's store reports them; they only queue, never call the index)
        self.evict_listeners: tuple = ()
        self.leases = WriteLeases(self)

    # ------------------------------------------------------------------ namespaces
    def initialize(self, ns: str, num_pages: int, page_bytes: int) -> NamespaceInfo:
        """Create ``ns`` (idempotent). ``num_pages == 0``: look up only.

        A namespace keeps the geometry it was created with: a different ``page_bytes`` is
        an error (two engines with different page sizes must not share one file); a
        different ``num_pages`` is answered with the existing one.
        """
        with self.lock:
            space = self.spaces.get(ns)
            if space is None and num_pages > 0:
                if page_bytes <= 0:
                    raise IndexError_(f"namespace {ns!r}: page_bytes must be > 0")
                if num_pages > MAX_PAGES:
                    raise IndexError_(f"namespace {ns!r}: {num_pages} pages; at most {MAX_PAGES} per file "
                                      "(a smaller file_size)")
                space = self.spaces[ns] = Namespace(ns, num_pages, page_bytes)
                # allocated up front (2^27 pages: ~3.6 GiB): say so, an operator sizing file_size sees it
                log.info("page index: namespace %s created, %d pages of %d bytes, %.1f MiB of index memory",
                         ns, num_pages, page_bytes, num_pages * INDEX_BYTES_PER_PAGE / (1 << 20))
                if self.journal is not None:
                    self.journal.record("init", ns, num_pages=num_pages, page_bytes=page_bytes)
            if space is None:
                return NamespaceInfo(ns, 0, 0, self.read_lease_s, self.write_lease_s)
            if num_pages > 0 and page_bytes != space.page_bytes:
                raise IndexError_(
                    f"namespace {ns!r} holds pages of {space.page_bytes} bytes, not {page_bytes}: "
                    "engines sharing a file must use the same page geometry (or another file_path_prefix)")
            return NamespaceInfo(ns, space.num_pages, space.page_bytes, self.read_lease_s, self.write_lease_s)

    def _space(self, ns: str) -> Namespace:
        """The namespace a write-path call names; it must have been initialized."""
        sp = self.spaces.get(ns)
        if sp is None:
            raise IndexError_(f"namespace {ns!r} is not initialized")
        return sp

    # ------------------------------------------------------------------ expiry
    def _expire(self, sp: Namespace, now: float) -> None:
        le = sp.lease_end
        gone = [(s, g) for s, g in sp.leased.items() if le[s] <= now]
        if gone:
            self.leases.release(sp, [s for s, _ in gone], [g for _, g in gone])
            sp.expired += len(gone)
        dead = [(k, v) for k, v in sp.pending.items() if le[v[0]] <= now]
        if not dead:
            return
        for k, (s, g) in dead:
            del sp.pending[k]
            sp.state[s] = FREE
            sp.free.append(s)
        sp.expired += len(dead)
        if self.journal is not None:
            self.journal.record("release", sp.name, keys=[k for k, _ in dead],
                                slots=[v[0] for _, v in dead], gens=[v[1] for _, v in dead])

    def _sweep(self, sp: Namespace, now: float) -> None:
        if (sp.pending or sp.leased) and now >= sp.next_sweep:
            self._expire(sp, now)
            sp.next_sweep = now + 1.0

    def _journal_evicted(self, sp: Namespace) -> None:
        if sp.evicted:
            if self.journal is not None:
                self.journal.record("delete", sp.name, keys=sp.evicted)
            for listener in self.evict_listeners:
                listener(sp.name, sp.evicted)
            sp.evicted = []

    # ------------------------------------------------------------------ write leases (write_leases.py)
    def lease(self, ns: str, need: int, extra: int = 0,
              give_back: tuple[Sequence[int], Sequence[int]] = ((), ())) -> tuple[list[int], list[int]]:
        """Free slots leased for writes to come: ``WriteLeases.lease``."""
        return self.leases.lease(ns, need, extra, give_back)

    def unlease(self, ns: str, slots: Sequence[int], gens: Sequence[int]) -> bytes:
        """Leased slots returned unused: ``WriteLeases.unlease``."""
        return self.leases.unlease(ns, slots, gens)

    def put(self, ns: str, keys: Sequence[bytes], slots: Sequence[int], gens: Sequence[int],
            crcs: Sequence[int], wire: bytes | None = None) -> bytes:
        """Keys stored at slots of the caller's lease: ``WriteLeases.put``."""
        return self.leases.put(ns, keys, slots, gens, crcs, wire)

    # ------------------------------------------------------------------ reservations
    def reserve(self, ns: str, keys: Sequence[bytes]) -> tuple[bytes, list[int], list[int]]:
        """Reserve a page per key. Returns (statuses, slots, generations), one per key."""
        n = len(keys)
        status = bytearray(n)
        slots = [-1] * n
        gens = [0] * n
        with self.lock:
            sp = self._space(ns)
            now = self.clock()
            self._sweep(sp, now)
            index, pending, gen = sp.index, sp.pending, sp.gen
            # C-level lookups first; the per-key Python loop only visits keys that exist,
            # are in flight or repeat (rare on the write path: writers look before they write)
            found = list(map(index.get, keys))
            inflight = list(map(pending.get, keys)) if pending else None
            want: list[int]
            if found.count(None) == n and inflight is None and len(set(keys)) == n:
                want = list(range(n))
            else:
                want = []
                claimed: set = set()
                le = sp.lease_end
                for i, k in enumerate(keys):
                    s = found[i]
                    if s is not None:
                        index.move_to_end(k)
                        status[i] = EXISTS
                        slots[i] = s
                        gens[i] = gen[s]
                        continue
                    p = inflight[i] if inflight is not None else None
                    if p is not None:
                        if le[p[0]] > now:
                            status[i] = INFLIGHT
                            continue
                        # expired reservation of a writer that never confirmed: take it over
                        del pending[k]
                        sp.state[p[0]] = FREE
                        sp.free.append(p[0])
                        sp.expired += 1
                        if self.journal is not None:
                            self.journal.record("release", ns, keys=[k], slots=[p[0]], gens=[p[1]])
                    if k in claimed:  # the same key twice in one batch: one page
                        status[i] = INFLIGHT
                        continue
                    claimed.add(k)
                    want.append(i)
            if not want:
                return bytes(status), slots, gens
            got = sp.alloc_many(len(want), now)
            m = len(got)
            deadline = now + self.write_lease_s
            state, le = sp.state, sp.lease_end
            new_g = [gen[s] + 1 for s in got]
            if new_g:
                sp.gen_top = max(sp.gen_top, max(new_g))
            for s, g in zip(got, new_g):
                gen[s] = g
                state[s] = RESERVED
                le[s] = deadline
            new_k = [keys[i] for i in want[:m]] if m < n or want[-1] != n - 1 else list(keys)
            pending.update(zip(new_k, zip(got, new_g)))
            for i, s, g in zip(want, got, new_g):
                slots[i] = s
                gens[i] = g
            for i in want[m:]:
                status[i] = NOSPACE
            self._journal_evicted(sp)
            if new_k and self.journal is not None:
                self.journal.record("reserve", ns, keys=new_k, slots=got, gens=new_g)
        return bytes(status), slots, gens

    def commit(self, ns: str, keys: Sequence[bytes], slots: Sequence[int], gens: Sequence[int],
               crcs: Sequence[int], confirm: Sequence[int] | bytes) -> bytes:
        """Confirm (``confirm[i]`` true) or release each reservation.

        Confirm makes the key visible; it succeeds only for the caller's live reservation
        (same slot and generation) or when that exact page is already confirmed (a retried
        call). Release returns the page of a failed write. Returns one ok byte per item.
        """
        n = len(keys)
        ok = bytearray(n)
        with self.lock:
            sp = self._space(ns)
            index, pending, gen, state, crc = sp.index, sp.pending, sp.gen, sp.state, sp.crc
            expect = list(zip(slots, gens))
            if list(map(pending.get, keys)) == expect and (confirm == b"\x01" * n or all(confirm)) \
                    and len(set(keys)) == n:
                # the common case, at C speed: every item is its writer's live reservation
                for k in keys:
                    del pending[k]
                for s, c in zip(slots, crcs):
                    state[s] = CONFIRMED
                    crc[s] = c
                index.update(zip(keys, slots))
                if self.journal is not None:
                    self.journal.record("confirm", ns, keys=keys, slots=slots, gens=gens, crcs=crcs)
                return b"\x01" * n
            released = False
            for i in range(n):
                k = keys[i]
                p = pending.get(k)
                if p is None or p != expect[i]:
                    if p is None and confirm[i] and index.get(k) == slots[i] and gen[slots[i]] == gens[i]:
                        ok[i] = 1  # already confirmed (a retried call)
                    continue
                del pending[k]
                s = p[0]
                if confirm[i]:
                    state[s] = CONFIRMED
                    crc[s] = crcs[i]
                    index[k] = s
                else:
                    state[s] = FREE
                    sp.free.append(s)
                    released = True
                ok[i] = 1
            if self.journal is not None:
                for flag, kind in ((1, "confirm"), (0, "release")):
                    if kind == "release" and not released:
                        continue
                    idx = [i for i in range(n) if ok[i] and bool(confirm[i]) == bool(flag)]
                    if idx:
                        f = {"keys": [keys[i] for i in idx], "slots": [slots[i] for i in idx],
                             "gens": [gens[i] for i in idx]}
                        if kind == "confirm":
                            f["crcs"] = [crcs[i] for i in idx]
                        self.journal.record(kind, ns, **f)
        return bytes(ok)

    # ------------------------------------------------------------------ readers
    def get(self, ns: str, keys: Sequence[bytes]) -> tuple[list[int], list[int], list[int]]:
        """(slot, generation, crc) per key, slot -1 for a miss; LRU touch + read lease."""
        n = len(keys)
        slots = [-1] * n
        gens = [0] * n
        crcs = [0] * n
        with self.lock:
            sp = self.spaces.get(ns)
            if sp is None:
                return slots, gens, crcs
            until = self.clock() + self.read_lease_s
            index, gen, crc, ru = sp.index, sp.gen, sp.crc, sp.read_until
            found = list(map(index.get, keys))
            if None not in found:  # all hits (a reader after exists): C loops only
                each(index.move_to_end, keys)
                each(ru.__setitem__, found, repeat(until))
                return found, list(map(gen.__getitem__, found)), list(map(crc.__getitem__, found))
            touch = index.move_to_end
            for i, s in enumerate(found):
                if s is not None:
                    touch(keys[i])
                    ru[s] = until
                    slots[i] = s
                    gens[i] = gen[s]
                    crcs[i] = crc[s]
        return slots, gens, crcs

    def validate(self, ns: str, slots: Sequence[int], gens: Sequence[int]) -> bytes:
        """Whether each (slot, generation) is still the confirmed page it was."""
        with self.lock:
            sp = self.spaces.get(ns)
            if sp is None:
                return bytes(len(slots))
            st, gen, n = sp.state, sp.gen, sp.num_pages
            return bytes(1 if 0 <= s < n and st[s] == CONFIRMED and gen[s] == g else 0
                         for s, g in zip(slots, gens))

    def exists(self, ns: str, keys: Sequence[bytes]) -> bytes:
        with self.lock:
            sp = self.spaces.get(ns)
            if sp is None:
                return bytes(len(keys))
            index = sp.index
            return bytes(map(index.__contains__, keys))

    # ------------------------------------------------------------------ removal
    def delete(self, ns: str, keys: Sequence[bytes]) -> bytes:
        out = bytearray(len(keys))
        with self.lock:
            sp = self.spaces.get(ns)
            if sp is None:
                return bytes(out)
            gone = []
            for i, k in enumerate(keys):
                s = sp.index.pop(k, None)
                if s is not None:
                    sp.state[s] = FREE
                    sp.free.append(s)
                    out[i] = 1
                    gone.append(k)
            if gone and self.journal is not None:
                self.journal.record("delete", ns, keys=gone)
        return bytes(out)

    def clear(self, ns: str, prefix: bytes = b"") -> int:
        """Drop every confirmed key of ``ns`` (live reservations stay reserved); with
        ``prefix``, only the keys that start with it (journaled as a delete of those keys)."""
        if prefix:
            with self.lock:
                sp = self.spaces.get(ns)
                keys = [k for k in sp.index if k.startswith(prefix)] if sp is not None else []
            return sum(self.delete(ns, keys)) if keys else 0
        with self.lock:
            sp = self.spaces.get(ns)
            if sp is None:
                return 0
            n = len(sp.index)
            for s in sp.index.values():
                sp.state[s] = FREE
                sp.free.append(s)
            sp.index.clear()
            if self.journal is not None:
                self.journal.record("clear", ns)
            return n

    def usage(self, ns: str) -> dict:
        with self.lock:
            sp = self.spaces.get(ns)
            if sp is None:
                return {"keys": 0, "num_pages": 0, "page_bytes": 0}
            return {"keys": len(sp.index), "num_pages": sp.num_pages, "page_bytes": sp.page_bytes,
                    "reserved": len(sp.pending), "leased": len(sp.leased), "evictions": sp.evictions,
                    "expired": sp.expired,
                    "free": len(sp.free) + sp.num_pages - sp.fresh_next}

    def spaces_with_prefix(self, prefix: str) -> list[list]:
        """``[name, num_pages, page_bytes]`` of every namespace whose name starts with ``prefix``."""
        with self.lock:
            return [[n, sp.num_pages, sp.page_bytes] for n, sp in self.spaces.items() if n.startswith(prefix)]

    # ------------------------------------------------------------------ recovery (index_recovery.py)
    def replay(self, kind: str, ns: str, fields: dict, now: float) -> None:
        """Apply one journal record (no journaling; called before serving)."""
        index_recovery.replay(self, kind, ns, fields, now)

    def finish_recovery(self, now: float) -> None:
        """After loading: rebuild free lists and lease every used slot for one read lease."""
        index_recovery.finish(self, now)

    def iter_spaces(self) -> Iterable[Namespace]:
        return list(self.spaces.values())
