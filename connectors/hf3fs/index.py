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
lock is held, so the journal order is the state order; ``replay_*`` methods rebuild state
from it. Keys are ``bytes`` without ``b"\\n"`` (the wire format joins keys with newlines).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Iterable, Sequence

# reserve() statuses
NEW = 0  # reserved for the caller: write the page, then confirm or release it
EXISTS = 1  # already stored (confirmed): nothing to write
INFLIGHT = 2  # another writer holds a live reservation for this key
NOSPACE = 3  # no page can be freed now (all reserved or leased to readers)

# put() statuses
PUT_LOST = 0  # the slot is not (any more) this writer's lease: the key is not stored
PUT_OK = 1  # stored (or already stored by this very put: a retried call)
PUT_DUP = 2  # the key is stored or in flight elsewhere; the slot stays leased to the writer

FREE, RESERVED, CONFIRMED = 0, 1, 2

log = logging.getLogger("kvconnect.hf3fs.index")

MAX_PAGES = 1 << 27
"""Pages one namespace (data file) may have: the index keeps ~40 bytes per page from the
start (5 GiB at this bound), so a file_size typo must not become an allocation."""
INDEX_BYTES_PER_PAGE = 29
"""Of those, allocated when the namespace is created: state 1, generation 8, crc 4, read lease 8,
write lease 8 (the key map grows with the pages stored)."""

DEFAULT_READ_LEASE_S = 2.0
DEFAULT_WRITE_LEASE_S = 30.0


def _each(fn, *iterables) -> None:
    """``fn`` over the items, in a C loop (no per-item bytecode): the hot paths' setters."""
    deque(map(fn, *iterables), maxlen=0)


class IndexError_(ValueError):
    """A namespace/geometry error (unknown namespace, page-size conflict)."""


@dataclass
class NamespaceInfo:
    name: str
    num_pages: int
    page_bytes: int
    read_lease_s: float
    write_lease_s: float


class Namespace:
    """State of one data file. Guarded by the owning ``PageIndex``'s lock."""

    __slots__ = ("name", "num_pages", "page_bytes", "index", "state", "gen", "crc",
                 "read_until", "lease_end", "free", "fresh_next", "pending", "evictions", "expired", "next_sweep",
                 "evicted", "leased", "gen_top")

    def __init__(self, name: str, num_pages: int, page_bytes: int):
        self.name = name
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.index: OrderedDict[bytes, int] = OrderedDict()  # confirmed key -> slot, LRU first
        self.state = bytearray(num_pages)
        self.gen = array("q", bytes(8 * num_pages))
        self.crc = array("I", bytes(4 * num_pages))
        self.read_until = array("d", bytes(8 * num_pages))
        self.free: deque[int] = deque()  # slots freed since start (FREE, maybe still leased)
        self.fresh_next = 0  # slots >= fresh_next were never handed out
        self.pending: dict[bytes, tuple[int, int]] = {}  # key -> (slot, gen) of a live reservation
        self.lease_end = array("d", bytes(8 * num_pages))  # a reserved slot's write deadline
        self.evictions = 0
        self.expired = 0
        self.next_sweep = 0.0  # when to look for expired reservations next
        self.evicted: list[bytes] = []  # keys evicted by the reserve call in progress (journal)
        self.leased: dict[int, int] = {}  # slot -> generation, leased to a writer without a key yet
        self.gen_top = 0  # the highest generation handed out: a lease's slots all get the next one

    def rebuild_free(self) -> None:
        st = self.state
        self.free = deque(i for i in range(self.fresh_next) if st[i] == FREE)


Journal = Callable[..., None]


class PageIndex:
    """Thread-safe, batched page index over many namespaces.

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

    # ------------------------------------------------------------------ allocation
    def _alloc(self, sp: Namespace, now: float, evict: bool = True) -> int:
        """A free slot not under a read lease, evicting the LRU key if needed (and allowed); -1 if none."""
        if sp.fresh_next < sp.num_pages:
            s = sp.fresh_next
            sp.fresh_next += 1
            return s
        ru = sp.read_until
        free = sp.free
        for _ in range(min(len(free), 8)):
            s = free.popleft()
            if ru[s] <= now:
                return s
            free.append(s)
        if not evict:
            return -1
        # Evict the least recently used confirmed key whose page no reader holds.
        index = sp.index
        victim = None
        for scanned, (k, s) in enumerate(index.items()):
            if ru[s] <= now:
                victim = k
                break
            if scanned >= 64:
                break
        if victim is None:
            return -1
        s = index.pop(victim)
        sp.state[s] = FREE
        sp.evictions += 1
        sp.evicted.append(victim)
        return s

    def _expire(self, sp: Namespace, now: float) -> None:
        le = sp.lease_end
        gone = [(s, g) for s, g in sp.leased.items() if le[s] <= now]
        if gone:
            self._unlease(sp, [s for s, _ in gone], [g for _, g in gone])
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

    # ------------------------------------------------------------------ writers
    def _alloc_many(self, sp: Namespace, m: int, now: float, evict: bool = True) -> list[int]:
        """Up to ``m`` slots: never-used ones first, then freed ones, then LRU evictions."""
        out: list[int] = []
        take = min(m, sp.num_pages - sp.fresh_next)
        if take > 0:
            out.extend(range(sp.fresh_next, sp.fresh_next + take))
            sp.fresh_next += take
        while len(out) < m:
            s = self._alloc(sp, now, evict)
            if s < 0:
                break
            out.append(s)
        return out

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

    # ------------------------------------------------------------------ write leases
    def lease(self, ns: str, need: int, extra: int = 0,
              give_back: tuple[Sequence[int], Sequence[int]] = ((), ())) -> tuple[list[int], list[int]]:
        """Lease up to ``need + extra`` free slots for writes to come (``extra`` at most
        ``num_pages // 16``: no writer hoards a small file). Never evicts: a writer whose
        lease comes back short of ``need`` reserves instead, which evicts only for keys
        that are not stored yet. ``give_back`` (slots, gens) returns slots of the
        caller's earlier leases first. Returns (slots, generations); each slot is the
        caller's for ``write_lease_s``."""
        with self.lock:
            sp = self._space(ns)
            if give_back[0]:
                self._unlease_owned(sp, give_back[0], give_back[1])
            now = self.clock()
            self._sweep(sp, now)
            got = self._alloc_many(sp, need + min(extra, sp.num_pages // 16), now, evict=False)
            # one generation for the whole grant, above every one handed out before: still a
            # new generation for each slot, and uniform values store as slices when the
            # slots are a run (a file filling up)
            g = sp.gen_top = sp.gen_top + 1
            k = len(got)
            deadline = now + self.write_lease_s
            lo = min(got) if got else 0
            if got and max(got) - lo + 1 == k:
                sp.gen[lo:lo + k] = array("q", (g,)) * k
                sp.state[lo:lo + k] = bytes((RESERVED,)) * k
                sp.lease_end[lo:lo + k] = array("d", (deadline,)) * k
                sp.crc[lo:lo + k] = array("I", bytes(4 * k))
            else:
                _each(sp.crc.__setitem__, got, repeat(0))  # a put without checksums skips them
                _each(sp.gen.__setitem__, got, repeat(g))
                _each(sp.state.__setitem__, got, repeat(RESERVED))
                _each(sp.lease_end.__setitem__, got, repeat(deadline))
            sp.leased.update(dict.fromkeys(got, g))
            gens = [g] * k
            if got and self.journal is not None:
                self.journal.record("lease", ns, slots=got, gens=gens)
        return got, gens

    def _unlease(self, sp: Namespace, slots: list[int], gens: list[int]) -> None:
        """Free leased slots (known to be leased with these generations). Lock held."""
        leased, state, free = sp.leased, sp.state, sp.free
        for s in slots:
            del leased[s]
            state[s] = FREE
        free.extend(slots)
        if self.journal is not None:
            self.journal.record("unlease", sp.name, slots=slots, gens=gens)

    def _unlease_owned(self, sp: Namespace, slots: Sequence[int], gens: Sequence[int]) -> bytes:
        """Free those of (slots, gens) that are leased as named; one ok byte per item."""
        leased = sp.leased
        ok = bytearray(len(slots))
        mine: dict[int, int] = {}
        for i, (s, g) in enumerate(zip(slots, gens)):
            if leased.get(s) == g and s not in mine:
                mine[s] = g
                ok[i] = 1
        if mine:
            self._unlease(sp, list(mine), list(mine.values()))
        return bytes(ok)

    def unlease(self, ns: str, slots: Sequence[int], gens: Sequence[int]) -> bytes:
        """Return leased slots unused (a writer closing). One ok byte per slot."""
        with self.lock:
            sp = self.spaces.get(ns)
            if sp is None:
                return bytes(len(slots))
            return self._unlease_owned(sp, slots, gens)

    def put(self, ns: str, keys: Sequence[bytes], slots: Sequence[int], gens: Sequence[int],
            crcs: Sequence[int], wire: bytes | None = None) -> bytes:
        """Store each key at a slot of the caller's lease (its page already written there).
        Returns a ``PUT_*`` status per item (see the module docstring). ``wire``: the items
        as the journal lays them out (i64 slots, i64 gens, u32 crcs, keys joined), if the
        caller has them so."""
        n = len(keys)
        with self.lock:
            sp = self._space(ns)
            index, pending, leased, state, crc = sp.index, sp.pending, sp.leased, sp.state, sp.crc
            gens = list(gens)
            if list(map(leased.get, slots)) == gens and index.keys().isdisjoint(keys) \
                    and (not pending or pending.keys().isdisjoint(keys)) \
                    and len(set(keys)) == n and len(set(slots)) == n:
                # the common case, at C speed: new keys, each on a slot of the caller's lease
                _each(leased.__delitem__, slots)
                _each(state.__setitem__, slots, repeat(CONFIRMED))
                if any(crcs):  # leased slots hold crc 0 already
                    _each(crc.__setitem__, slots, crcs)
                index.update(zip(keys, slots))
                if self.journal is not None:
                    self.journal.record("put", ns, keys=keys, slots=slots, gens=gens, crcs=crcs, wire=wire)
                return bytes((PUT_OK,)) * n
            out = bytearray(n)
            gen = sp.gen
            done = []
            for i in range(n):
                k, s, g = keys[i], slots[i], gens[i]
                if leased.get(s) != g:
                    if index.get(k) == s and gen[s] == g:
                        out[i] = PUT_OK  # stored by an earlier attempt of this call
                    continue
                if k in index or k in pending:
                    out[i] = PUT_DUP
                    continue
                del leased[s]
                state[s] = CONFIRMED
                crc[s] = crcs[i]
                index[k] = s
                out[i] = PUT_OK
                done.append(i)
            if done and self.journal is not None:
                self.journal.record("put", ns, keys=[keys[i] for i in done], slots=[slots[i] for i in done],
                                    gens=[gens[i] for i in done], crcs=[crcs[i] for i in done])
        return bytes(out)

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
            got = self._alloc_many(sp, len(want), now)
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
                _each(index.move_to_end, keys)
                _each(ru.__setitem__, found, repeat(until))
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

    # ------------------------------------------------------------------ recovery
    def replay(self, kind: str, ns: str, fields: dict, now: float) -> None:
        """Apply one journal record (no journaling; called before serving)."""
        if kind == "init":
            if ns not in self.spaces:
                self.spaces[ns] = Namespace(ns, fields["num_pages"], fields["page_bytes"])
            return
        sp = self.spaces.get(ns)
        if sp is None:
            return
        if kind == "reserve":
            deadline = now + self.write_lease_s
            st, gen, pending = sp.state, sp.gen, sp.pending
            # Evictions and expiries before this record were journaled (delete / release);
            # a pending entry left on a slot reused here is dropped in finish_recovery.
            le = sp.lease_end
            for k, s, g in zip(fields["keys"], fields["slots"], fields["gens"]):
                gen[s] = g
                st[s] = RESERVED
                le[s] = deadline
                pending[k] = (s, g)
            if fields["slots"]:
                top = max(fields["slots"]) + 1
                if top > sp.fresh_next:
                    sp.fresh_next = top
        elif kind == "confirm":
            st, crc, index, pending = sp.state, sp.crc, sp.index, sp.pending
            pop = pending.pop
            for k, s, g, c in zip(fields["keys"], fields["slots"], fields["gens"], fields["crcs"]):
                p = pop(k, None)
                if p != (s, g):
                    if p is not None:
                        pending[k] = p
                    continue
                st[s] = CONFIRMED
                crc[s] = c
                index[k] = s
        elif kind == "release":
            for k, s, g in zip(fields["keys"], fields["slots"], fields["gens"]):
                p = sp.pending.get(k)
                if p is not None and p[0] == s and p[1] == g:
                    del sp.pending[k]
                    sp.state[s] = FREE
        elif kind == "lease":
            st, gen, leased, crc = sp.state, sp.gen, sp.leased, sp.crc
            for s, g in zip(fields["slots"], fields["gens"]):
                crc[s] = 0
                gen[s] = g
                st[s] = RESERVED
                leased[s] = g
            if fields["slots"]:
                sp.fresh_next = max(sp.fresh_next, max(fields["slots"]) + 1)
        elif kind == "unlease":
            for s, g in zip(fields["slots"], fields["gens"]):
                if sp.leased.get(s) == g:
                    del sp.leased[s]
                    sp.state[s] = FREE
        elif kind == "put":
            st, crc, index, leased = sp.state, sp.crc, sp.index, sp.leased
            for k, s, g, c in zip(fields["keys"], fields["slots"], fields["gens"], fields["crcs"]):
                if leased.get(s) == g:
                    del leased[s]
                    st[s] = CONFIRMED
                    crc[s] = c
                    index[k] = s
        elif kind == "delete":
            for k in fields["keys"]:
                s = sp.index.pop(k, None)
                if s is not None:
                    sp.state[s] = FREE
        elif kind == "clear":
            for s in sp.index.values():
                sp.state[s] = FREE
            sp.index.clear()
        else:
            raise ValueError(f"unknown journal record {kind!r}")

    def finish_recovery(self, now: float) -> None:
        """After loading: rebuild free lists and lease every used slot for one read lease.

        Readers that got a slot from the previous incarnation may still be reading it; no
        slot that ever held data is reused before their lease would have run out.
        """
        until = now + self.read_lease_s
        for sp in self.spaces.values():
            st, gen = sp.state, sp.gen
            sp.gen_top = max(sp.gen_top, max(gen, default=0))
            sp.pending = {k: v for k, v in sp.pending.items() if st[v[0]] == RESERVED and gen[v[0]] == v[1]}
            sp.leased = {s: g for s, g in sp.leased.items() if st[s] == RESERVED and gen[s] == g}
            owned = {v[0] for v in sp.pending.values()}.union(sp.leased)
            s = st.find(RESERVED)
            while 0 <= s:  # a reserved slot nobody owns any more is free
                if s not in owned:
                    st[s] = FREE
                s = st.find(RESERVED, s + 1)
            sp.rebuild_free()
            used = sp.fresh_next
            sp.read_until = array("d", [until]) * used + array("d", bytes(8 * (sp.num_pages - used)))
            # a writer alive across the restart may still be writing its reserved or leased slots
            for s, _ in sp.pending.values():
                sp.lease_end[s] = now + self.write_lease_s
            for s in sp.leased:
                sp.lease_end[s] = now + self.write_lease_s

    def iter_spaces(self) -> Iterable[Namespace]:
        return list(self.spaces.values())
