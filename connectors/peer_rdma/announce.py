"""What a node tells the directory: its new pages (put-if-absent on their owners) and the
pages it no longer holds in memory (evicted: dropped, or demoted to its disk tier).

Evictions happen under the segment's lock, so they are only queued there; the outbox is
flushed by a thread of its own, and by a write that evicted before it returns (so
``exists`` never reports a page this node already dropped). Keys no owner accepted yet are
kept for the re-homing rounds to publish again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from kvconnect.connectors.peer_rdma.rpc import RpcError
from kvconnect.connectors.peer_rdma.segment import Slot

log = logging.getLogger("kvconnect.connectors.peer_rdma.node")


class Announcer:
    """The node's outbox to the directory owners, and its publications."""

    def __init__(self, node):  # the PeerNode this is part of
        self.node = node
        self._outbox: deque[tuple[str, str, list]] = deque()  # (op, key, payload): evictions to announce
        self._outbox_event = threading.Event()
        self._announce_lock = threading.Lock()
        self._lock = threading.Lock()
        self.unpublished: set[str] = set()  # held keys no directory owner accepted yet

    def take_unpublished(self) -> set[str]:
        with self._lock:
            keys, self.unpublished = self.unpublished, set()
        return keys

    def retry_later(self, keys: set[str]) -> None:
        with self._lock:
            self.unpublished |= keys

    def dropped(self, items: list[tuple[str, Slot]]) -> None:
        """Slots this node dropped (a clear): a drop per slot generation leaves a tombstone
        on the owners that refuses a re-publish taken from an older snapshot."""
        for key, slot in items:
            self._outbox.append(("drop", key, [key, self.node.node_id, slot.seq]))
        self.flush()

    def tombstone(self, items: list[tuple[str, int]], also: tuple = ()) -> None:
        """Slots (key, seq) this node no longer holds (deleted, freed, or gone while a
        publication of them was in flight), dropped now from their owners in the current
        view and in the views ``also`` (a publication's): each owner forgets the entry and
        keeps a tombstone that refuses a re-publish of that slot arriving later, so a
        publication racing the removal cannot bring the page back. Returns when every
        owner answered (or the control call's deadline passed)."""
        if not items:
            return
        me = self.node.node_id
        per: dict[str, dict[tuple[str, int], list]] = {}
        for view in (self.node.view, *also):
            for key, seq in items:
                for t in self.node.dir_owners(key, view):
                    per.setdefault(t, {})[(key, seq)] = [key, me, seq]
        local = per.pop(me, None)
        if local:
            self.node.directory.drop(list(local.values()))
        if per:
            self.node.clients.fan_out({t: list(b.values()) for t, b in per.items()}, "DirDrop")

    def unpublish_gone(self, sent: list[tuple[str, int]], view) -> None:
        """After a publication in ``view``: tombstone the slots among ``sent`` (key, seq)
        that were removed meanwhile (their removal's own tombstones may have gone to the
        owners of a newer view, or arrived before this publication did)."""
        holds = self.node.segment.holds
        self.tombstone([(k, q) for k, q in sent if not holds(k, q)], also=(view,))

    def wake(self) -> None:
        self._outbox_event.set()

    def publish(self, items: list[tuple[str, Slot]]) -> list:
        """Put-if-absent entries on their owners. Per item: True (published), False (another
        live holder already has the key: the primary owner's word wins), None (no owner answered)."""
        view = self.node.view
        per_target: dict[str, list[int]] = {}
        primary = []
        for i, (key, _) in enumerate(items):
            ol = self.node.dir_owners(key, view)
            primary.append(ol[0])
            for t in ol:
                per_target.setdefault(t, []).append(i)
        wire = [[key, self.node.entry(slot)] for key, slot in items]
        remote = {t: [[wire[i] for i in idx], True] for t, idx in per_target.items() if t != self.node.node_id}
        answers: dict[str, Any] = self.node.clients.fan_out(remote, "DirPut") if remote else {}
        if self.node.node_id in per_target:
            answers[self.node.node_id] = self.node.directory.put([[wire[i] for i in per_target[self.node.node_id]], True])
        result: list[bool | None] = [None] * len(items)
        decided = [False] * len(items)
        for t, idx in per_target.items():
            ans = answers.get(t)
            if isinstance(ans, RpcError) or ans is None:
                self.node.count(rpc_failures=1)
                continue
            for i, ok in zip(idx, ans):
                if t == primary[i]:
                    result[i], decided[i] = bool(ok), True
                elif not decided[i]:
                    result[i] = bool(ok) or bool(result[i])
        self.unpublish_gone([(key, slot.seq) for key, slot in items], view)
        failed = [items[i][0] for i, r in enumerate(result) if r is None]
        if failed:
            self.node.count(publish_failures=len(failed))
            with self._lock:
                self.unpublished.update(failed)
            self.node.rehoming.wake()  # retried by the next re-home round
        return result

    def evicted(self, key: str, slot: Slot) -> None:
        # under the segment lock: only queue work
        if self.node.disk is not None and self.node.disk.contains(key) is not None:
            self._outbox.append(("demote", key, self.node.entry(slot, resident=False)))
        else:
            self._outbox.append(("drop", key, [key, self.node.node_id, slot.seq]))
        self._outbox_event.set()

    def disk_evicted(self, key: str) -> None:
        if self.node.segment.lookup(key, touch=False) is None:
            self._outbox.append(("drop", key, [key, self.node.node_id, None]))
            self._outbox_event.set()

    def loop(self) -> None:
        while not self.node.closed:
            self._outbox_event.wait(0.5)
            self._outbox_event.clear()
            if not self._outbox:
                continue
            time.sleep(0.01)  # let a burst of evictions batch up
            self.flush()

    def flush(self) -> None:
        """Tell the owners about evictions now (a write that evicted returns after this,
        so ``exists`` never reports a page this node already dropped). Serialised: a caller
        also waits for an announcement the background thread has in flight."""
        with self._announce_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        while self._outbox:
            items = []
            while self._outbox and len(items) < 4096:
                try:
                    items.append(self._outbox.popleft())
                except IndexError:
                    break
            try:
                self._announce(items)
            except Exception:  # noqa: BLE001
                log.exception("announcing evictions failed")

    def _announce(self, items: list) -> None:
        view = self.node.view
        drops: dict[str, list] = {}
        puts: dict[str, list] = {}
        for op, key, payload in items:
            for t in self.node.dir_owners(key, view):
                (drops if op == "drop" else puts).setdefault(t, []).append(
                    payload if op == "drop" else [key, payload])
        for t, batch in drops.items():
            if t == self.node.node_id:
                self.node.directory.drop(batch)
        for t, batch in puts.items():
            if t == self.node.node_id:
                self.node.directory.put([batch, False])
        remote_d = {t: b for t, b in drops.items() if t != self.node.node_id}
        remote_p = {t: [b, False] for t, b in puts.items() if t != self.node.node_id}
        if remote_d:
            self.node.clients.fan_out(remote_d, "DirDrop")
        if remote_p:
            self.node.clients.fan_out(remote_p, "DirPut")

