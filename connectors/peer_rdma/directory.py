"""The directory: this node's shard of "which holder has key k" (a peer pool has no master).

Each key's entry ``[holder, incarnation, offset, length, seq, checksum, resident]`` lives on
the key's owner and ``directory_replicas`` successors (rendezvous hashing over live members).
An entry whose holder left the view (or restarted: another incarnation) is kept but
invisible, so a member dropped by a false suspicion comes back with its entries intact;
``purge_holders`` forgets them once the holder stays away. A holder's drop of a slot (a
clear, an eviction, a delete's ``Free``) and a delete's removal of an entry leave a tombstone
per (holder, slot generation), so a re-publish taken from an older snapshot (re-homing after
a view change) cannot bring the slot back, whichever arrives first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvconnect.connectors.peer_rdma.membership import Member, View
from kvconnect.connectors.peer_rdma.placement import owners

# directory entry fields (a list on the wire)
HOLDER, INC, OFF, LEN, SEQ, CSUM, RESIDENT = range(7)
HOLDER_GONE = 0
"""What ``DirGet`` answers for a key whose entry names a holder no longer in the view: the page
was stored and is lost with its holder, which a reader counts as ``unavailable``, not as a
page never stored (``not_found``)."""


def live_holder(entry: list, view: View) -> Member | None:
    """The member an entry names, if it is in the view with the same incarnation."""
    m = view.members.get(entry[HOLDER])
    return m if m is not None and m.incarnation == entry[INC] else None


class DirectoryShard:
    """Entries of the keys this node owns (or replicates); the ``Dir*`` RPC handlers."""

    def __init__(self, node):  # the PeerNode this is part of
        self.node = node
        self._dir: dict[str, list] = {}
        self._dir_by_holder: dict[str, set[str]] = {}  # holder -> keys: drop a departed holder at once
        self._tombs: OrderedDict[tuple[str, int], None] = OrderedDict()  # dropped (holder, seq)
        self._dlock = threading.Lock()

    def __len__(self) -> int:
        return len(self._dir)

    def set(self, key: str, entry: list, if_absent: bool, view: View) -> bool:
        with self._dlock:
            if (entry[HOLDER], entry[SEQ]) in self._tombs:
                return False  # its holder already dropped this very slot (a re-publish raced it)
            cur = self._dir.get(key)
            if cur is not None and if_absent and cur[HOLDER] != entry[HOLDER] and \
                    live_holder(cur, view) is not None:
                return False
            if cur is not None and cur[HOLDER] == entry[HOLDER] and cur[INC] > entry[INC]:
                return False
            if cur is not None and cur[HOLDER] != entry[HOLDER]:
                self._dir_by_holder.get(cur[HOLDER], set()).discard(key)
            self._dir[key] = entry
            self._dir_by_holder.setdefault(entry[HOLDER], set()).add(key)
            return True

    def pop(self, key: str, holder: str | None = None, seq: int | None = None) -> list | None:
        with self._dlock:
            cur = self._dir.get(key)
            if cur is None or (holder is not None and cur[HOLDER] != holder) or \
                    (seq is not None and cur[SEQ] != seq):
                return None
            del self._dir[key]
            self._dir_by_holder.get(cur[HOLDER], set()).discard(key)
            return cur

    def put(self, req: list) -> list:
        items, if_absent = req
        view = self.node.view
        return [self.set(k, e, if_absent, view) for k, e in items]

    def get(self, keys: list) -> list:
        view = self.node.view
        out = []
        with self._dlock:
            for k in keys:
                e = self._dir.get(k)
                out.append(None if e is None else e if live_holder(e, view) is not None else HOLDER_GONE)
        return out

    def _bury(self, slots: list[tuple[str, int]]) -> None:
        """Tombstones for (holder, seq) pairs (_dlock held)."""
        for h, s in slots:
            self._tombs[(h, s)] = None
        while len(self._tombs) > 262144:  # slot generations are never reused: old ones are moot
            self._tombs.popitem(last=False)

    def drop(self, items: list) -> list:
        if any(s is not None for _, _, s in items):
            with self._dlock:
                self._bury([(h, s) for _, h, s in items if s is not None])
        return [self.pop(k, h, s) is not None for k, h, s in items]

    def delete(self, keys: list) -> list:
        """Remove the entries of ``keys`` (a delete), each leaving a tombstone for its slot."""
        out = [self.pop(k) for k in keys]
        with self._dlock:
            self._bury([(e[HOLDER], e[SEQ]) for e in out if e is not None])
        return out

    def clear(self, prefix: str = "") -> None:
        """Forget the entries of keys starting with ``prefix`` (every entry for "")."""
        with self._dlock:
            for key in [k for k in self._dir if k.startswith(prefix)]:
                entry = self._dir.pop(key)
                self._dir_by_holder.get(entry[HOLDER], set()).discard(key)

    def purge_holders(self, holders: list[str], view: View) -> None:
        """Forget the entries of holders that stayed away (or restarted)."""
        with self._dlock:
            for h in holders:
                for k in self._dir_by_holder.pop(h, set()):
                    e = self._dir.get(k)
                    if e is not None and e[HOLDER] == h and live_holder(e, view) is None:
                        del self._dir[k]

    def drop_unowned(self, ids: list[str], replicas: int) -> None:
        """Forget the entries this node no longer owns in a view of members ``ids``."""
        me = self.node.node_id
        with self._dlock:
            for k in [k for k in self._dir if me not in owners(k, ids, replicas)]:
                e = self._dir.pop(k)
                self._dir_by_holder.get(e[HOLDER], set()).discard(k)
