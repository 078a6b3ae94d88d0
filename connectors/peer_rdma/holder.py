"""The holder's side of the pool: blocks reserved for one-sided writes into this node's
segment and their commit (the writer's checksum must match the landed bytes), frees,
promotion of pages from the disk tier back into memory, and the disk write-through.

A block whose writer vanished, or whose write failed or timed out, is quarantined before
reuse: a late write into it must land long before anyone else's page does.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from kvconnect.connectors.peer_rdma.segment import Slot, checksum_at


class Holder:
    """Reservations and quarantine of this node's segment; the ``Alloc``/``Commit``/``Free``/``Promote`` handlers."""

    def __init__(self, node):  # the PeerNode this is part of
        self.node = node
        self._reservations: dict[int, tuple[str, int, int, float]] = {}  # token -> key, off, len, deadline
        self._quarantined: deque[tuple[float, int, int]] = deque()  # (release at, offset, length)
        self._rlock = threading.Lock()
        self._next_token = 0

    def alloc(self, items: list) -> list:
        """Reserve blocks for one-sided writes: [token, offset] per key, True if held, None if full."""
        out = []
        now = time.monotonic()
        with self._rlock:  # expire reservations whose writer vanished (its write may still land)
            for tok, (_, off, n, dl) in list(self._reservations.items()):
                if dl < now:
                    del self._reservations[tok]
                    self.quarantine(off, n)
            while self._quarantined and self._quarantined[0][0] < now:
                _, off, n = self._quarantined.popleft()
                self.node.segment.release(off, n)
        held = []
        for key, n in items:
            slot = self.node.segment.lookup(key, touch=False)
            if slot is not None:
                held.append((key, slot))
                out.append(True)
                continue
            off = self.node.segment.reserve(n)
            if off is None:
                out.append(None)
                continue
            with self._rlock:
                self._next_token += 1
                tok = self._next_token
                self._reservations[tok] = (key, off, n, now + 2 * self.node.config.timeout)
            out.append([tok, off])
        if held:  # already here: make sure the directory still says so
            self.node.announcer.publish(held)
        self.node.announcer.flush()
        return out

    def quarantine(self, off: int, n: int) -> None:
        """Hold a block back from reuse until any late write into it is long over (_rlock held)."""
        self._quarantined.append((time.monotonic() + 2 * self.node.config.transfer_timeout + 10, off, n))

    def commit(self, items: list) -> list:
        """Publish written blocks whose bytes hash to the writer's checksum; abort the rest."""
        out, new = [], []
        for tok, checksum in items:
            with self._rlock:
                res = self._reservations.pop(tok, None)
            if res is None:
                out.append(False)
                continue
            key, off, n, _ = res
            if checksum is None or checksum_at(self.node.segment.base + off, n) != checksum:
                with self._rlock:
                    self.quarantine(off, n)  # a write that failed or timed out may still land
                out.append(False)
                continue
            slot = self.node.segment.commit(key, off, n, checksum)
            if slot is not None:
                new.append((key, slot))
                self.write_through(key, slot)
            out.append(True)
        if new:
            published = self.node.announcer.publish(new)
            dup = [(key, slot) for (key, slot), ok in zip(new, published) if ok is False]
            for key, slot in dup:  # another holder won the key: ours is a duplicate
                self.node.segment.remove(key, slot.seq)
            self.node.announcer.tombstone([(key, slot.seq) for key, slot in dup])  # where a replica took it
        return out

    def free(self, items: list) -> list:
        """A delete's last step: remove the slots its owners named, then tombstone them on
        every owner (a re-publish from a snapshot taken before the removal, re-homing after
        a view change, would otherwise bring the page back after the delete returned)."""
        out = []
        for key, seq in items:
            slot = self.node.segment.remove(key, seq)
            if self.node.disk is not None:
                self.node.disk.remove(key)
            out.append(slot is not None)
        self.node.announcer.tombstone([(key, seq) for key, seq in items if seq is not None])
        return out

    def promote(self, keys: list) -> list:
        out, new = [], []
        for key in keys:
            slot = self.node.segment.lookup(key, touch=False)
            if slot is None and self.node.disk is not None:
                slot = self.promote_from_disk(key)
                if slot is not None:
                    new.append((key, slot))
            out.append(self.node.entry(slot) if slot is not None else None)
        if new:
            self.node.announcer.publish(new)
        return out

    def promote_from_disk(self, key: str) -> Slot | None:
        meta = self.node.disk.contains(key) if self.node.disk is not None else None
        if meta is None:
            return None
        n, checksum = meta
        off = self.node.segment.reserve(n)
        if off is None:
            return None
        got = self.node.disk.read_into(key, self.node.segment.base + off, n)
        if got is None or checksum_at(self.node.segment.base + off, n) != checksum:
            self.node.segment.release(off, n)
            return None
        slot = self.node.segment.commit(key, off, n, checksum) or self.node.segment.lookup(key)
        self.node.count(promotes=1)
        return slot

    def write_through(self, key: str, slot: Slot) -> None:
        if self.node.disk is not None:
            import ctypes

            data = ctypes.string_at(self.node.segment.base + slot.offset, slot.length)
            if self.node.segment.holds(key, slot.seq):
                self.node.disk.submit(key, data, slot.checksum)

