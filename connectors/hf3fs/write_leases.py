"""Write leases of the HF3FS page index (the one-call write path; see
``kvconnect.connectors.hf3fs.index``): free slots handed to a writer ahead of its writes,
each a fresh generation with no key yet, then mapped to keys by ``put``; unused ones come
back with ``unlease`` or when the lease expires.

Part of a ``PageIndex``: its lock, clock, journal and namespaces are the index's.
"""

from __future__ import annotations

from array import array
from itertools import repeat
from typing import Sequence

from kvconnect.connectors.hf3fs.slots import CONFIRMED, FREE, RESERVED, Namespace, each

# put() statuses
PUT_LOST = 0  # the slot is not (any more) this writer's lease: the key is not stored
PUT_OK = 1  # stored (or already stored by this very put: a retried call)
PUT_DUP = 2  # the key is stored or in flight elsewhere; the slot stays leased to the writer


class WriteLeases:
    """``lease`` / ``put`` / ``unlease`` of a ``PageIndex``, and the freeing of leased slots."""

    def __init__(self, index):  # the PageIndex this is part of
        self.index = index

    def lease(self, ns: str, need: int, extra: int = 0,
              give_back: tuple[Sequence[int], Sequence[int]] = ((), ())) -> tuple[list[int], list[int]]:
        """Lease up to ``need + extra`` free slots for writes to come (``extra`` at most
        ``num_pages // 16``: no writer hoards a small file). Never evicts: a writer whose
        lease comes back short of ``need`` reserves instead, which evicts only for keys
        that are not stored yet. ``give_back`` (slots, gens) returns slots of the
        caller's earlier leases first. Returns (slots, generations); each slot is the
        caller's for ``write_lease_s``."""
        ix = self.index
        with ix.lock:
            sp = ix._space(ns)
            if give_back[0]:
                self._unlease_owned(sp, give_back[0], give_back[1])
            now = ix.clock()
            ix._sweep(sp, now)
            got = sp.alloc_many(need + min(extra, sp.num_pages // 16), now, evict=False)
            # one generation for the whole grant, above every one handed out before: still a
            # new generation for each slot, and uniform values store as slices when the
            # slots are a run (a file filling up)
            g = sp.gen_top = sp.gen_top + 1
            k = len(got)
            deadline = now + ix.write_lease_s
            lo = min(got) if got else 0
            if got and max(got) - lo + 1 == k:
                sp.gen[lo:lo + k] = array("q", (g,)) * k
                sp.state[lo:lo + k] = bytes((RESERVED,)) * k
                sp.lease_end[lo:lo + k] = array("d", (deadline,)) * k
                sp.crc[lo:lo + k] = array("I", bytes(4 * k))
            else:
                each(sp.crc.__setitem__, got, repeat(0))  # a put without checksums skips them
                each(sp.gen.__setitem__, got, repeat(g))
                each(sp.state.__setitem__, got, repeat(RESERVED))
                each(sp.lease_end.__setitem__, got, repeat(deadline))
            sp.leased.update(dict.fromkeys(got, g))
            gens = [g] * k
            if got and ix.journal is not None:
                ix.journal.record("lease", ns, slots=got, gens=gens)
        return got, gens

    def release(self, sp: Namespace, slots: list[int], gens: list[int]) -> None:
        """Free leased slots (known to be leased with these generations): a writer's give-back,
        or an expired lease. Lock held."""
        ix = self.index
        leased, state, free = sp.leased, sp.state, sp.free
        for s in slots:
            del leased[s]
            state[s] = FREE
        free.extend(slots)
        if ix.journal is not None:
            ix.journal.record("unlease", sp.name, slots=slots, gens=gens)

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
            self.release(sp, list(mine), list(mine.values()))
        return bytes(ok)

    def unlease(self, ns: str, slots: Sequence[int], gens: Sequence[int]) -> bytes:
        """Return leased slots unused (a writer closing). One ok byte per slot."""
        ix = self.index
        with ix.lock:
            sp = ix.spaces.get(ns)
            if sp is None:
                return bytes(len(slots))
            return self._unlease_owned(sp, slots, gens)

    def put(self, ns: str, keys: Sequence[bytes], slots: Sequence[int], gens: Sequence[int],
            crcs: Sequence[int], wire: bytes | None = None) -> bytes:
        """Store each key at a slot of the caller's lease (its page already written there).
        Returns a ``PUT_*`` status per item (see ``kvconnect.connectors.hf3fs.index``). ``wire``: the items
        as the journal lays them out (i64 slots, i64 gens, u32 crcs, keys joined), if the
        caller has them so."""
        ix = self.index
        n = len(keys)
        with ix.lock:
            sp = ix._space(ns)
            index, pending, leased, state, crc = sp.index, sp.pending, sp.leased, sp.state, sp.crc
            gens = list(gens)
            if list(map(leased.get, slots)) == gens and index.keys().isdisjoint(keys) \
                    and (not pending or pending.keys().isdisjoint(keys)) \
                    and len(set(keys)) == n and len(set(slots)) == n:
                # the common case, at C speed: new keys, each on a slot of the caller's lease
                each(leased.__delitem__, slots)
                each(state.__setitem__, slots, repeat(CONFIRMED))
                if any(crcs):  # leased slots hold crc 0 already
                    each(crc.__setitem__, slots, crcs)
                index.update(zip(keys, slots))
                if ix.journal is not None:
                    ix.journal.record("put", ns, keys=keys, slots=slots, gens=gens, crcs=crcs, wire=wire)
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
            if done and ix.journal is not None:
                ix.journal.record("put", ns, keys=[keys[i] for i in done], slots=[slots[i] for i in done],
                                    gens=[gens[i] for i in done], crcs=[crcs[i] for i in done])
        return bytes(out)
