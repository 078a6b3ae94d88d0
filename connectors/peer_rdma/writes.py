"""Writes, in two placements.

* ``local`` (default): the page is copied into this node's own segment, then its directory
  entry is published (put-if-absent) to the key's owner and ``directory_replicas`` successors.
* ``owner``: the key's data owner reserves a block (``Alloc``), the writer writes the page
  into it one-sidedly, and the owner verifies the checksum of the landed bytes before it
  publishes the slot (``Commit``). A node that lends nothing always writes this way; an
  owner that is full or unreachable makes the writer keep the page itself (a spill).
"""

from __future__ import annotations

import time
from typing import Any

from kvconnect.connectors.base import Page, page_nbytes
from kvconnect.connectors.buffers import gather_into
from kvconnect.connectors.peer_rdma.directory import HOLDER, SEQ
from kvconnect.connectors.peer_rdma.membership import Member
from kvconnect.connectors.peer_rdma.rpc import RpcError
from kvconnect.connectors.peer_rdma.segment import checksum_at, checksum_page


class Writer:
    """The node's writes and deletes (no state of its own: the segment, the directory
    shards and the holders keep it)."""

    def __init__(self, node):  # the PeerNode this is part of
        self.node = node

    def put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        t0 = time.perf_counter()
        if self.node.config.placement == "owner" or not self.node.config.global_segment_size:
            out = self._put_owner(keys, pages)  # a node that lends nothing writes to the owners
        else:
            out = self._put_local(list(range(len(keys))), keys, pages)
        sizes = [page_nbytes(p) for p in pages]
        self.node.count(write_requests=len(keys), write_failures=len(keys) - sum(out),
                        bytes_written=sum(s for s, o in zip(sizes, out) if o))
        self.node.timed("put", t0)
        return out

    def _put_local(self, idx: list[int], keys: list[str], pages: list[Page]) -> list[bool]:
        out = [False] * len(idx)
        new = []
        for j, i in enumerate(idx):
            slot, fresh = self.node.segment.write(keys[i], pages[i])
            if slot is None:
                continue
            out[j] = True
            if fresh:
                new.append((j, keys[i], slot))
                self.node.holder.write_through(keys[i], slot)
        self.node.announcer.flush()
        # a page this batch stored may already have been evicted by a later one of it
        new = [(j, k, sl) for j, k, sl in new if self.node.segment.holds(k, sl.seq)]
        if new:
            self.node.count(writes_stored=len(new))
            published = self.node.announcer.publish([(k, s) for _, k, s in new])
            dup = [(k, s) for (j, k, s), ok in zip(new, published) if ok is False]
            for k, s in dup:  # another node already holds this key: keep theirs (idempotent put)
                self.node.segment.remove(k, s.seq)
                if self.node.disk is not None:
                    self.node.disk.remove(k)
            self.node.announcer.tombstone([(k, s.seq) for k, s in dup])  # where a replica took ours
        return out

    def _put_owner(self, keys: list[str], pages: list[Page]) -> list[bool]:
        view = self.node.view
        out = [False] * len(keys)
        mine, per_owner = [], {}
        for i, k in enumerate(keys):
            o = self.node.data_owner(k, view)
            if o == self.node.node_id:
                mine.append(i)
            elif o is not None:
                per_owner.setdefault(o, []).append(i)
        if mine:
            for i, ok in zip(mine, self._put_local(mine, keys, pages)):
                out[i] = ok
        if per_owner:
            deadline = time.monotonic() + self.node.config.timeout
            jobs = [self.node.io.submit(self._write_to, view.members[o], idx, keys, pages, out, deadline)
                    for o, idx in per_owner.items()]
            for j in jobs:
                j.result()
            # an owner that was full (blocks reserved by in-flight writes) or unreachable: keep
            # the page in this node's own segment instead; readers find it through the directory
            spill = [i for idx in per_owner.values() for i in idx if not out[i]]
            if spill and self.node.config.global_segment_size:
                self.node.count(write_spills=len(spill))
                for i, ok in zip(spill, self._put_local(spill, keys, pages)):
                    out[i] = ok
        return out

    def _write_to(self, member: Member, idx: list[int], keys, pages, out: list[bool], deadline: float) -> None:
        sizes = [page_nbytes(pages[i]) for i in idx]
        try:
            # Alloc and Commit publish directory entries themselves (nested calls): twice the time
            grants = self.node.clients.call(member.node_id, "Alloc", [[keys[i], n] for i, n in zip(idx, sizes)],
                                       min(2 * self.node.config.rpc_timeout, max(0.01, deadline - time.monotonic())))
        except RpcError:
            self.node.count(rpc_failures=1)
            return
        todo = []
        for i, n, g in zip(idx, sizes, grants):
            if g is True:
                out[i] = True
            elif g:
                todo.append((i, n, g[0], g[1]))
        if not todo:
            return
        reg = self.node.transport.page_registered
        commits = []
        direct, bounced = [], []
        for t in todo:
            (direct if reg(pages[t[0]]) else bounced).append(t)
        if direct:
            local, remote, lengths = [], [], []
            for i, n, tok, off in direct:
                r = member.seg_base + off
                for a, sz in pages[i]:
                    local.append(a)
                    remote.append(r)
                    lengths.append(sz)
                    r += sz
            # the checksums are computed while the engine moves the bytes
            t0 = time.monotonic()
            try:
                bid = self.node.transport.write_async(member.te_name, local, remote, lengths)
            except Exception:  # noqa: BLE001 - a data-plane error is a failed write
                bid = 0
            sums = [checksum_page(pages[i]) for i, n, tok, off in direct] if bid else []
            rc = self.node.transport.wait(bid) if bid else -1
            if rc != 0:
                self.node.count(**{"write_timeouts" if time.monotonic() - t0 >= self.node.config.transfer_timeout * 0.9
                              else "write_transfer_failures": 1})
            commits += [[tok, sums[j] if rc == 0 else None] for j, (i, n, tok, off) in enumerate(direct)]
        if bounced:
            cap = self.node.staging.arena_bytes
            bounce = self.node.staging.acquire(cap, deadline)
            if bounce is None:
                bounced = []
            try:
                start = 0
                while start < len(bounced):
                    chunk, used = [], 0
                    while start < len(bounced) and used + bounced[start][1] <= cap:
                        chunk.append((bounced[start], used))
                        used += bounced[start][1]
                        start += 1
                    if not chunk:
                        commits.append([bounced[start][2], None])
                        start += 1
                        continue
                    for (i, n, tok, off), o in chunk:
                        gather_into(pages[i], bounce + o)
                    ok = self.node.transfer(member, [bounce + o for _, o in chunk],
                                        [member.seg_base + t[3] for t, _ in chunk], [t[1] for t, _ in chunk],
                                        write=True)
                    commits += [[t[2], checksum_at(bounce + o, t[1]) if ok else None] for t, o in chunk]
            finally:
                if bounce is not None:
                    self.node.staging.release(bounce)
        try:
            results = self.node.clients.call(member.node_id, "Commit", commits,
                                        min(2 * self.node.config.rpc_timeout, max(0.01, deadline - time.monotonic())))
        except RpcError:
            self.node.count(rpc_failures=1)
            return
        by_tok = {c[0]: r for c, r in zip(commits, results)}
        for i, n, tok, off in todo:
            out[i] = bool(by_tok.get(tok))

    def delete(self, keys: list[str]) -> list[bool]:
        """Remove keys here, on their directory owners, and on the holders the owners named.

        Every removed slot is tombstoned on its owners before this returns (here for this
        node's own slots, by the holder's ``Free`` for the others'), so a publication of it
        still in flight (re-homing from a snapshot taken before the delete) is refused where
        it lands: once ``delete`` returned True, the page is gone from every owner."""
        view = self.node.view
        deadline = time.monotonic() + self.node.config.timeout
        out = [False] * len(keys)
        mine = []
        for i, k in enumerate(keys):
            slot = self.node.segment.remove(k)
            if slot is not None:
                out[i] = True
                mine.append((k, slot.seq))
            if self.node.disk is not None:
                self.node.disk.remove(k)
        self.node.reader.forget(keys)
        self.node.announcer.tombstone(mine)
        per: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            for t in self.node.dir_owners(k, view):
                per.setdefault(t, []).append(i)
        # the call's whole deadline, not one control call's: an owner that answers late under
        # load would otherwise keep the entry, and the deleted key would still be found
        answers: dict[str, Any] = self.node.clients.fan_out(
            {t: [keys[i] for i in idx] for t, idx in per.items() if t != self.node.node_id}, "DirDelete",
            max(0.01, deadline - time.monotonic()))
        if self.node.node_id in per:
            answers[self.node.node_id] = self.node.directory.delete([keys[i] for i in per[self.node.node_id]])
        frees: dict[str, dict[str, list]] = {}
        for t, idx in per.items():
            ans = answers.get(t)
            if isinstance(ans, RpcError) or ans is None:
                continue
            for i, e in zip(idx, ans):
                if e is not None:
                    out[i] = True
                    if e[HOLDER] != self.node.node_id:
                        frees.setdefault(e[HOLDER], {})[keys[i]] = [keys[i], e[SEQ]]
        if frees:
            # Free tombstones the slots on their owners (nested calls): twice the time
            self.node.clients.fan_out({h: list(v.values()) for h, v in frees.items() if h in view.members}, "Free",
                                      min(2 * self.node.config.rpc_timeout, max(0.01, deadline - time.monotonic())))
        return out
