"""Re-homing: directory entries follow the membership.

When the view changes, every holder publishes its pages to the owners that joined their
owner sets (a restarted member lost its shard: it counts as new), and retries the pages no
owner accepted yet; owners forget entries of holders that stayed away and, once the view
settled, entries they no longer own. A round publishes from a snapshot of the slots: a slot
removed meanwhile (deleted, evicted) is dropped again from the owners it was sent to once
the round's calls are answered, and its removal's tombstones refuse it where it arrives late.
"""

from __future__ import annotations

import logging
import threading
import time

from kvconnect.connectors.peer_rdma.directory import SEQ
from kvconnect.connectors.peer_rdma.membership import View
from kvconnect.connectors.peer_rdma.placement import owners
from kvconnect.connectors.peer_rdma.rpc import RpcError

log = logging.getLogger("kvconnect.connectors.peer_rdma.node")


class Rehoming:
    """The node's re-homing rounds (a thread of their own) and its view of who left."""

    def __init__(self, node):  # the PeerNode this is part of
        self.node = node
        self._event = threading.Event()
        self._gone: dict[str, float] = {}  # member -> when it left the view
        self._swept_version = 0

    def wake(self) -> None:
        self._event.set()

    def on_view_change(self, old: View, new: View) -> None:
        # Entries of a holder that left stay but are invisible (readers and DirGet check that
        # the holder is live): a member dropped by a false suspicion comes back with its
        # entries intact. They are purged once it stays away (or restarts) - see _sweep.
        now = time.monotonic()
        for m, rec in old.members.items():
            if m not in new.members or new.members[m].incarnation != rec.incarnation:
                self._gone.setdefault(m, now)
                self.node.clients.forget(m)
        for m in new.members:
            self._gone.pop(m, None)
        self._event.set()

    def loop(self) -> None:
        published_view: View | None = None
        while not self.node.closed:
            woke = self._event.wait(1.0)
            if self.node.closed:
                return
            try:
                if woke:
                    self._event.clear()
                    time.sleep(0.05)
                    view = self.node.view
                    self.rehome(published_view, view)
                    published_view = view
                elif self.node.announcer.unpublished:
                    self.rehome(self.node.view, self.node.view)
                self.sweep()
            except Exception:  # noqa: BLE001
                log.exception("re-homing directory entries failed")

    def rehome(self, old: View | None, new: View, held: list | None = None) -> None:
        """Publish every held page to the owners that joined its owner set since ``old``
        (and retry the pages no owner accepted yet). ``held``: the slots to publish, (key,
        slot) pairs (default: a snapshot of the segment taken now)."""
        held = self.node.segment.items() if held is None else held
        n = 1 + self.node.config.directory_replicas
        new_ids = new.ids
        old_ids = old.ids if old else []
        # a member that restarted lost its directory shard: it counts as a new owner
        restarted = {m for m in old_ids if m in new.members and
                     old.members[m].incarnation != new.members[m].incarnation}
        by_target: dict[str, list] = {}
        if old is not new:
            for key, slot in held:
                now_owners = owners(key, new_ids, n)
                before = set(owners(key, old_ids, n)) - restarted if old_ids else set()
                for t in now_owners:
                    if t not in before or old is None or t == self.node.node_id:
                        by_target.setdefault(t, []).append([key, self.node.entry(slot)])
        retry = self.node.announcer.take_unpublished()
        for key in retry:
            slot = self.node.segment.lookup(key, touch=False)
            if slot is not None:
                for t in owners(key, new_ids, n):
                    by_target.setdefault(t, []).append([key, self.node.entry(slot)])
        local = by_target.pop(self.node.node_id, None)
        if local:
            self.node.directory.put([local, True])
        failed: set[str] = set()
        for t, batch in by_target.items():
            for i in range(0, len(batch), 4096):
                try:
                    self.node.clients.call(t, "DirPut", [batch[i:i + 4096], True])
                except RpcError:
                    self.node.count(rpc_failures=1)
                    if t in self.node.view.members:  # still an owner: try again next round
                        failed.update(k for k, _ in batch[i:])
                    break
        if failed:
            self.node.announcer.retry_later(failed)
        sent = {(k, e[SEQ]) for b in (*by_target.values(), local or []) for k, e in b}
        self.node.announcer.unpublish_gone(list(sent), new)
        if by_target:
            self.node.count(directory_republishes=sum(len(b) for b in by_target.values()))

    def sweep(self) -> None:
        """Purge entries of holders gone (or restarted) for 3 TTLs, and, once the view has
        been stable long enough for every node to agree on it, entries this node no longer
        owns (their holders have published them to the new owners)."""
        now = time.monotonic()
        config = self.node.config
        purge = [h for h, t in list(self._gone.items()) if now - t > 3 * config.member_ttl]
        for h in purge:
            self._gone.pop(h, None)
        view = self.node.view
        self.node.directory.purge_holders(purge, view)
        settle = config.member_ttl + 2 * config.heartbeat_interval + 1
        if self._swept_version == view.version or now - view.changed_at < settle:
            return
        self._swept_version = view.version
        self.node.directory.drop_unowned(view.ids, 1 + config.directory_replicas)
