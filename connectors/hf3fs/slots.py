"""One namespace of the HF3FS page index: the state of one data file's slots, and which
slot a writer gets next (never used, freed, or the least recently used key's, evicted).

Guarded by the owning ``PageIndex``'s lock; see ``kvconnect.connectors.hf3fs.index`` for
the rules (read leases, reservations, write leases) the index keeps with it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque

FREE, RESERVED, CONFIRMED = 0, 1, 2


def each(fn, *iterables) -> None:
    """``fn`` over the items, in a C loop (no per-item bytecode): the hot paths' setters."""
    deque(map(fn, *iterables), maxlen=0)


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

    # ------------------------------------------------------------------ placement and eviction
    def alloc_many(self, m: int, now: float, evict: bool = True) -> list[int]:
        """Up to ``m`` slots: never-used ones first, then freed ones, then LRU evictions."""
        out: list[int] = []
        take = min(m, self.num_pages - self.fresh_next)
        if take > 0:
            out.extend(range(self.fresh_next, self.fresh_next + take))
            self.fresh_next += take
        while len(out) < m:
            s = self.alloc(now, evict)
            if s < 0:
                break
            out.append(s)
        return out

    def alloc(self, now: float, evict: bool = True) -> int:
        """A free slot not under a read lease, evicting the LRU key if needed (and allowed); -1 if none."""
        if self.fresh_next < self.num_pages:
            s = self.fresh_next
            self.fresh_next += 1
            return s
        ru = self.read_until
        free = self.free
        for _ in range(min(len(free), 8)):
            s = free.popleft()
            if ru[s] <= now:
                return s
            free.append(s)
        if not evict:
            return -1
        # Evict the least recently used confirmed key whose page no reader holds.
        index = self.index
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
        self.state[s] = FREE
        self.evictions += 1
        self.evicted.append(victim)
        return s
