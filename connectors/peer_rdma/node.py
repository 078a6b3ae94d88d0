"""A peer-pool node: membership, its lent segment, its share of the directory, the data plane.

Write (``placement="local"``, default): the page is copied into this node's own segment,
then its directory entry ``[holder, incarnation, offset, length, seq, checksum, resident]``
is published (put-if-absent) to the key's owner and ``directory_replicas`` successors.
Write (``placement="owner"``): the key's owner reserves a block (``Alloc``), the writer
writes the page into it one-sidedly, and the owner verifies the checksum of the landed
bytes before it publishes the slot (``Commit``).
Read: own pages are a local copy (seqlock-checked); others are located on their owners
(one batched ``DirGet`` per owner) and read one-sidedly, one batch per holder, straight
into the caller's memory when it is registered, through a bounce buffer otherwise. A page
counts as read only when the xxh3-64 of the bytes received equals the published
checksum: an evicted, reused, rewritten or torn slot is a miss, never wrong bytes.
Membership changes re-home directory entries: holders re-publish to their keys' new
owners, owners drop entries of holders that left.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvconnect.connectors.base import Page, page_nbytes
from kvconnect.connectors.buffers import gather_into, scatter
from kvconnect.connectors.peer_rdma.config import PeerRdmaConfig
from kvconnect.connectors.peer_rdma.counters import COUNTERS
from kvconnect.connectors.peer_rdma.membership import Member, Membership, View
from kvconnect.connectors.peer_rdma.placement import owners
from kvconnect.connectors.peer_rdma.rpc import Clients, RpcError, serve
from kvconnect.connectors.peer_rdma.segment import Segment, Slot, checksum_at, checksum_page
from kvconnect.connectors.transfer_engine import EngineClient, StagingMemory

log = logging.getLogger(__name__)

# directory entry fields (a list on the wire)
HOLDER, INC, OFF, LEN, SEQ, CSUM, RESIDENT = range(7)



class Latency:
    """Recent latencies of one operation, for quantiles at scrape time."""

    def __init__(self, keep: int = 2048):
        self.samples: deque[float] = deque(maxlen=keep)
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:  # callers hold the node's counter lock
        self.samples.append(seconds)
        self.count += 1
        self.total += seconds

    def quantiles(self, qs=(0.5, 0.9, 0.99)) -> dict[float, float]:
        data = sorted(self.samples)
        if not data:
            return {q: 0.0 for q in qs}
        return {q: data[min(len(data) - 1, int(q * len(data)))] for q in qs}


def _route_to(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class PeerNode:
    def __init__(self, config: PeerRdmaConfig):
        self.config = c = config
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latency = {op: Latency() for op in ("get", "put", "exists")}
        self._clock = threading.Lock()  # counters
        self._closed = False

        seed_host = c.seeds[0].rpartition(":")[0]
        bind = c.bind_host
        self.hostname = c.local_hostname or (bind if bind not in ("0.0.0.0", "::", "") else _route_to(seed_host))

        # directory shard: key -> entry, and holder -> keys (to drop a departed holder at once)
        self._dir: dict[str, list] = {}
        self._dir_by_holder: dict[str, set[str]] = {}
        self._tombs: OrderedDict[tuple[str, int], None] = OrderedDict()  # dropped (holder, seq)
        self._dlock = threading.Lock()
        self._reservations: dict[int, tuple[str, int, int, float]] = {}  # token -> key, off, len, deadline
        self._quarantined: deque[tuple[float, int, int]] = deque()  # (release at, offset, length)
        self._rlock = threading.Lock()
        self._next_token = 0
        self._loc_cache: OrderedDict[str, tuple[list, float]] = OrderedDict()
        self._lclock = threading.Lock()
        self._outbox: deque[tuple[str, str, list]] = deque()  # (op, key, payload): evictions to announce
        self._outbox_event = threading.Event()
        self._announce_lock = threading.Lock()
        self._rehome_event = threading.Event()
        self._gone: dict[str, float] = {}  # member -> when it left the view
        self._swept_version = 0
        self._last_view: View | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="peer-io")

        self.segment = Segment(c.global_segment_size, on_evict=self._on_evict, populate=c.populate_segment)
        self.transport = EngineClient(self.hostname, c.protocol, c.devices, user="peer_rdma", extra="peer",
                                      transfer_timeout_s=c.transfer_timeout)
        # Registered chunks that remote pages are read through (and unregistered pages
        # written from), made on first use; kept for the life of the process, retired ones
        # too: a transfer given up on may still land in one.
        chunk = max(1 << 20, min(64 << 20, c.bounce_buffer_size))
        self.staging = StagingMemory(max(1, c.bounce_buffer_size // chunk) * chunk, register=self.transport.register,
                                     arena_bytes=chunk, populate=True)
        if c.global_segment_size:
            self.transport.register(self.segment.base, c.global_segment_size)
        self.disk = None
        self._unpublished: set[str] = set()  # held keys no directory owner accepted yet
        self.clients = Clients(c.token, c.rpc_timeout)
        handlers = {
            "Heartbeat": lambda r: self.membership.handle_heartbeat(r),
            "Leave": lambda r: self.membership.handle_leave(r),
            "DirPut": self._h_dir_put, "DirGet": self._h_dir_get, "DirDrop": self._h_dir_drop,
            "DirDelete": self._h_dir_delete, "Alloc": self._h_alloc, "Commit": self._h_commit,
            "Free": self._h_free, "Promote": self._h_promote, "Clear": self._h_clear, "Stats": self._h_stats,
        }
        port = c.control_port
        self.server = None
        if port == -1:
            seed_port = int(c.seeds[0].rpartition(":")[2])
            try:
                self.server, self.port = serve(handlers, bind, seed_port, c.token)
            except (OSError, RuntimeError):
                port = 0
        if self.server is None:
            self.server, self.port = serve(handlers, bind, max(port, 0), c.token)
        self.node_id = f"{self.hostname}:{self.port}"
        self.incarnation = time.time_ns()
        if c.disk_path:
            import os

            from kvconnect.connectors.peer_rdma.disk import DiskTier

            self.disk = DiskTier(os.path.join(c.disk_path, self.node_id.replace(":", "_")), c.disk_size,
                                 on_evict=self._on_disk_evict)
        self.me = Member(self.node_id, self.incarnation, self.transport.name, self.segment.base,
                         c.global_segment_size)
        self.membership = Membership(self.me, c.seeds, self.clients, interval=c.heartbeat_interval,
                                     ttl=c.member_ttl, on_change=self._on_view_change)
        self.clients.on_reply = self.membership.touch
        self._threads = [threading.Thread(target=self._outbox_loop, name="peer-outbox", daemon=True),
                         threading.Thread(target=self._rehome_loop, name="peer-rehome", daemon=True)]
        for t in self._threads:
            t.start()
        joined = self.membership.join(c.join_timeout)
        self.membership.start()
        log.info("peer node up: node=%s te=%s segment=%d bytes members=%d%s", self.node_id, self.transport.name,
                 c.global_segment_size, len(self.membership.view.members),
                 "" if joined else " (no seed answered yet; retrying in the background)")

    # ------------------------------------------------------------------ helpers
    def count(self, **kw: int) -> None:
        with self._clock:
            for k, v in kw.items():
                self.counters[k] += v

    @property
    def view(self) -> View:
        return self.membership.view

    def _entry(self, slot: Slot, resident: bool = True) -> list:
        return [self.node_id, self.incarnation, slot.offset, slot.length, slot.seq, slot.checksum, resident]

    def _dir_owners(self, key: str, view: View | None = None) -> list[str]:
        view = view or self.view
        return owners(key, view.ids, 1 + self.config.directory_replicas)

    def _data_owner(self, key: str, view: View) -> str | None:
        lenders = [m for m, rec in view.members.items() if rec.seg_size > 0]
        found = owners(key, lenders, 1)
        return found[0] if found else None

    def _live_holder(self, entry: list, view: View) -> Member | None:
        m = view.members.get(entry[HOLDER])
        return m if m is not None and m.incarnation == entry[INC] else None

    # ------------------------------------------------------------------ directory shard
    def _dir_set(self, key: str, entry: list, if_absent: bool, view: View) -> bool:
        with self._dlock:
            if (entry[HOLDER], entry[SEQ]) in self._tombs:
                return False  # its holder already dropped this very slot (a re-publish raced it)
            cur = self._dir.get(key)
            if cur is not None and if_absent and cur[HOLDER] != entry[HOLDER] and \
                    self._live_holder(cur, view) is not None:
                return False
            if cur is not None and cur[HOLDER] == entry[HOLDER] and cur[INC] > entry[INC]:
                return False
            if cur is not None and cur[HOLDER] != entry[HOLDER]:
                self._dir_by_holder.get(cur[HOLDER], set()).discard(key)
            self._dir[key] = entry
            self._dir_by_holder.setdefault(entry[HOLDER], set()).add(key)
            return True

    def _dir_pop(self, key: str, holder: str | None = None, seq: int | None = None) -> list | None:
        with self._dlock:
            cur = self._dir.get(key)
            if cur is None or (holder is not None and cur[HOLDER] != holder) or \
                    (seq is not None and cur[SEQ] != seq):
                return None
            del self._dir[key]
            self._dir_by_holder.get(cur[HOLDER], set()).discard(key)
            return cur

    def _h_dir_put(self, req: list) -> list:
        items, if_absent = req
        view = self.view
        return [self._dir_set(k, e, if_absent, view) for k, e in items]

    def _h_dir_get(self, keys: list) -> list:
        view = self.view
        out = []
        with self._dlock:
            for k in keys:
                e = self._dir.get(k)
                out.append(e if e is not None and self._live_holder(e, view) is not None else None)
        return out

    def _h_dir_drop(self, items: list) -> list:
        if any(s is not None for _, _, s in items):
            with self._dlock:
                for _, h, s in items:
                    if s is not None:
                        self._tombs[(h, s)] = None
                while len(self._tombs) > 262144:  # slot generations are never reused: old ones are moot
                    self._tombs.popitem(last=False)
        return [self._dir_pop(k, h, s) is not None for k, h, s in items]

    def _h_dir_delete(self, keys: list) -> list:
        return [self._dir_pop(k) for k in keys]

    # ------------------------------------------------------------------ holder handlers
    def _h_alloc(self, items: list) -> list:
        """Reserve blocks for one-sided writes: [token, offset] per key, True if held, None if full."""
        out = []
        now = time.monotonic()
        with self._rlock:  # expire reservations whose writer vanished (its write may still land)
            for tok, (_, off, n, dl) in list(self._reservations.items()):
                if dl < now:
                    del self._reservations[tok]
                    self._quarantine(off, n)
            while self._quarantined and self._quarantined[0][0] < now:
                _, off, n = self._quarantined.popleft()
                self.segment.release(off, n)
        held = []
        for key, n in items:
            slot = self.segment.lookup(key, touch=False)
            if slot is not None:
                held.append((key, slot))
                out.append(True)
                continue
            off = self.segment.reserve(n)
            if off is None:
                out.append(None)
                continue
            with self._rlock:
                self._next_token += 1
                tok = self._next_token
                self._reservations[tok] = (key, off, n, now + 2 * self.config.timeout)
            out.append([tok, off])
        if held:  # already here: make sure the directory still says so
            self._publish(held)
        self._flush_outbox()
        return out

    def _quarantine(self, off: int, n: int) -> None:
        """Hold a block back from reuse until any late write into it is long over (_rlock held)."""
        self._quarantined.append((time.monotonic() + 2 * self.config.transfer_timeout + 10, off, n))

    def _h_commit(self, items: list) -> list:
        """Publish written blocks whose bytes hash to the writer's checksum; abort the rest."""
        out, new = [], []
        for tok, checksum in items:
            with self._rlock:
                res = self._reservations.pop(tok, None)
            if res is None:
                out.append(False)
                continue
            key, off, n, _ = res
            if checksum is None or checksum_at(self.segment.base + off, n) != checksum:
                with self._rlock:
                    self._quarantine(off, n)  # a write that failed or timed out may still land
                out.append(False)
                continue
            slot = self.segment.commit(key, off, n, checksum)
            if slot is not None:
                new.append((key, slot))
                self._write_through(key, slot)
            out.append(True)
        if new:
            published = self._publish(new)
            for (key, slot), ok in zip(new, published):
                if ok is False:  # another holder won the key: ours is a duplicate
                    self.segment.remove(key, slot.seq)
        return out

    def _h_free(self, items: list) -> list:
        out = []
        for key, seq in items:
            slot = self.segment.remove(key, seq)
            if self.disk is not None:
                self.disk.remove(key)
            out.append(slot is not None)
        return out

    def _h_promote(self, keys: list) -> list:
        out, new = [], []
        for key in keys:
            slot = self.segment.lookup(key, touch=False)
            if slot is None and self.disk is not None:
                slot = self._promote_from_disk(key)
                if slot is not None:
                    new.append((key, slot))
            out.append(self._entry(slot) if slot is not None else None)
        if new:
            self._publish(new)
        return out

    def _promote_from_disk(self, key: str) -> Slot | None:
        meta = self.disk.contains(key) if self.disk is not None else None
        if meta is None:
            return None
        n, checksum = meta
        off = self.segment.reserve(n)
        if off is None:
            return None
        got = self.disk.read_into(key, self.segment.base + off, n)
        if got is None or checksum_at(self.segment.base + off, n) != checksum:
            self.segment.release(off, n)
            return None
        slot = self.segment.commit(key, off, n, checksum) or self.segment.lookup(key)
        self.count(promotes=1)
        return slot

    def _h_clear(self, req: Any) -> list:
        self._clear_local(req if isinstance(req, str) else "")
        return []

    def _h_stats(self, _req: Any) -> dict:
        return self.metrics()

    def _clear_local(self, prefix: str = "") -> None:
        """Drop this node's pages and directory entries (of keys starting with ``prefix``)."""
        dropped = self.segment.clear(prefix)
        with self._dlock:
            for key in [k for k in self._dir if k.startswith(prefix)]:
                entry = self._dir.pop(key)
                self._dir_by_holder.get(entry[HOLDER], set()).discard(key)
        with self._lclock:
            for key in [k for k in self._loc_cache if k.startswith(prefix)]:
                del self._loc_cache[key]
        if self.disk is not None:
            self.disk.clear(prefix)
        # Owners clear their shards too, but a re-publish taken from a snapshot before this
        # clear (re-homing after a view change) can still arrive there afterwards: a drop
        # per slot generation leaves a tombstone that refuses it.
        for key, slot in dropped:
            self._outbox.append(("drop", key, [key, self.node_id, slot.seq]))
        self._flush_outbox()

    # ------------------------------------------------------------------ publishing
    def _publish(self, items: list[tuple[str, Slot]]) -> list:
        """Put-if-absent entries on their owners. Per item: True (published), False (another
        live holder already has the key: the primary owner's word wins), None (no owner answered)."""
        view = self.view
        per_target: dict[str, list[int]] = {}
        primary = []
        for i, (key, _) in enumerate(items):
            ol = self._dir_owners(key, view)
            primary.append(ol[0])
            for t in ol:
                per_target.setdefault(t, []).append(i)
        wire = [[key, self._entry(slot)] for key, slot in items]
        remote = {t: [[wire[i] for i in idx], True] for t, idx in per_target.items() if t != self.node_id}
        answers: dict[str, Any] = self.clients.fan_out(remote, "DirPut") if remote else {}
        if self.node_id in per_target:
            answers[self.node_id] = self._h_dir_put([[wire[i] for i in per_target[self.node_id]], True])
        result: list[bool | None] = [None] * len(items)
        decided = [False] * len(items)
        for t, idx in per_target.items():
            ans = answers.get(t)
            if isinstance(ans, RpcError) or ans is None:
                self.count(rpc_failures=1)
                continue
            for i, ok in zip(idx, ans):
                if t == primary[i]:
                    result[i], decided[i] = bool(ok), True
                elif not decided[i]:
                    result[i] = bool(ok) or bool(result[i])
        failed = [items[i][0] for i, r in enumerate(result) if r is None]
        if failed:
            self.count(publish_failures=len(failed))
            with self._dlock:
                self._unpublished.update(failed)
            self._rehome_event.set()  # retried by the next re-home round
        return result

    def _write_through(self, key: str, slot: Slot) -> None:
        if self.disk is not None:
            import ctypes

            data = ctypes.string_at(self.segment.base + slot.offset, slot.length)
            if self.segment.holds(key, slot.seq):
                self.disk.submit(key, data, slot.checksum)

    def _on_evict(self, key: str, slot: Slot) -> None:
        # under the segment lock: only queue work
        if self.disk is not None and self.disk.contains(key) is not None:
            self._outbox.append(("demote", key, self._entry(slot, resident=False)))
        else:
            self._outbox.append(("drop", key, [key, self.node_id, slot.seq]))
        self._outbox_event.set()

    def _on_disk_evict(self, key: str) -> None:
        if self.segment.lookup(key, touch=False) is None:
            self._outbox.append(("drop", key, [key, self.node_id, None]))
            self._outbox_event.set()

    def _outbox_loop(self) -> None:
        while not self._closed:
            self._outbox_event.wait(0.5)
            self._outbox_event.clear()
            if not self._outbox:
                continue
            time.sleep(0.01)  # let a burst of evictions batch up
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        """Tell the owners about evictions now (a write that evicted returns after this,
        so ``exists`` never reports a page this node already dropped). Serialised: a caller
        also waits for an announcement the background thread has in flight."""
        with self._announce_lock:
            self._flush_outbox_locked()

    def _flush_outbox_locked(self) -> None:
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
        view = self.view
        drops: dict[str, list] = {}
        puts: dict[str, list] = {}
        for op, key, payload in items:
            for t in self._dir_owners(key, view):
                (drops if op == "drop" else puts).setdefault(t, []).append(
                    payload if op == "drop" else [key, payload])
        for t, batch in drops.items():
            if t == self.node_id:
                self._h_dir_drop(batch)
        for t, batch in puts.items():
            if t == self.node_id:
                self._h_dir_put([batch, False])
        remote_d = {t: b for t, b in drops.items() if t != self.node_id}
        remote_p = {t: [b, False] for t, b in puts.items() if t != self.node_id}
        if remote_d:
            self.clients.fan_out(remote_d, "DirDrop")
        if remote_p:
            self.clients.fan_out(remote_p, "DirPut")

    # ------------------------------------------------------------------ membership changes
    def _on_view_change(self, old: View, new: View) -> None:
        # Entries of a holder that left stay but are invisible (readers and DirGet check that
        # the holder is live): a member dropped by a false suspicion comes back with its
        # entries intact. They are purged once it stays away (or restarts) - see _sweep.
        now = time.monotonic()
        for m, rec in old.members.items():
            if m not in new.members or new.members[m].incarnation != rec.incarnation:
                self._gone.setdefault(m, now)
                self.clients.forget(m)
        for m in new.members:
            self._gone.pop(m, None)
        self._rehome_event.set()

    def _rehome_loop(self) -> None:
        published_view: View | None = None
        while not self._closed:
            woke = self._rehome_event.wait(1.0)
            if self._closed:
                return
            try:
                if woke:
                    self._rehome_event.clear()
                    time.sleep(0.05)
                    view = self.view
                    self._rehome(published_view, view)
                    published_view = view
                elif self._unpublished:
                    self._rehome(self.view, self.view)
                self._sweep()
            except Exception:  # noqa: BLE001
                log.exception("re-homing directory entries failed")

    def _rehome(self, old: View | None, new: View) -> None:
        """Publish every held page to the owners that joined its owner set since ``old``
        (and retry the pages no owner accepted yet)."""
        held = self.segment.items()
        n = 1 + self.config.directory_replicas
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
                    if t not in before or old is None or t == self.node_id:
                        by_target.setdefault(t, []).append([key, self._entry(slot)])
        with self._dlock:
            retry, self._unpublished = self._unpublished, set()
        for key in retry:
            slot = self.segment.lookup(key, touch=False)
            if slot is not None:
                for t in owners(key, new_ids, n):
                    by_target.setdefault(t, []).append([key, self._entry(slot)])
        local = by_target.pop(self.node_id, None)
        if local:
            self._h_dir_put([local, True])
        failed: set[str] = set()
        for t, batch in by_target.items():
            for i in range(0, len(batch), 4096):
                try:
                    self.clients.call(t, "DirPut", [batch[i:i + 4096], True])
                except RpcError:
                    self.count(rpc_failures=1)
                    if t in self.view.members:  # still an owner: try again next round
                        failed.update(k for k, _ in batch[i:])
                    break
        if failed:
            with self._dlock:
                self._unpublished |= failed
        if by_target:
            self.count(directory_republishes=sum(len(b) for b in by_target.values()))

    def _sweep(self) -> None:
        """Purge entries of holders gone (or restarted) for 3 TTLs, and, once the view has
        been stable long enough for every node to agree on it, entries this node no longer
        owns (their holders have published them to the new owners)."""
        now = time.monotonic()
        purge = [h for h, t in list(self._gone.items()) if now - t > 3 * self.config.member_ttl]
        view = self.view
        with self._dlock:
            for h in purge:
                self._gone.pop(h, None)
                for k in self._dir_by_holder.pop(h, set()):
                    e = self._dir.get(k)
                    if e is not None and e[HOLDER] == h and self._live_holder(e, view) is None:
                        del self._dir[k]
        settle = self.config.member_ttl + 2 * self.config.heartbeat_interval + 1
        if self._swept_version == view.version or now - view.changed_at < settle:
            return
        self._swept_version = view.version
        n = 1 + self.config.directory_replicas
        ids = view.ids
        with self._dlock:
            for k in [k for k in self._dir if self.node_id not in owners(k, ids, n)]:
                e = self._dir.pop(k)
                self._dir_by_holder.get(e[HOLDER], set()).discard(k)

    # ------------------------------------------------------------------ location lookups
    def _locate(self, keys: list[str], deadline: float, use_cache: bool = True,
                ask_replicas: bool = False) -> list[list | None]:
        """Directory entries of ``keys`` (None: not found), asking owners then replicas.

        A key the primary owner does not know is asked of the next owner when the view
        changed recently (entries may still be moving) or ``ask_replicas`` (reads: the
        caller believes the page exists, so a second round trip for it is worth it).
        """
        view = self.view
        out: list[list | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if use_cache and self.config.location_cache_ttl > 0:
            now = time.monotonic()
            rest = []
            with self._lclock:
                for i in todo:
                    hit = self._loc_cache.pop(keys[i], None)
                    if hit is not None and hit[1] > now and self._live_holder(hit[0], view) is not None:
                        out[i] = hit[0]
                    else:
                        rest.append(i)
            todo = rest
        n = 1 + self.config.directory_replicas
        owner_lists = {i: self._dir_owners(keys[i], view) for i in todo}
        recent = ask_replicas or \
            time.monotonic() - view.changed_at < 3 * self.config.heartbeat_interval + self.config.member_ttl
        for rank in range(n):
            if not todo:
                break
            per: dict[str, list[int]] = {}
            for i in todo:
                ol = owner_lists[i]
                if rank < len(ol):
                    per.setdefault(ol[rank], []).append(i)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            timeout = min(self.config.rpc_timeout, remaining)
            remote = {t: [keys[i] for i in idx] for t, idx in per.items() if t != self.node_id}
            answers: dict[str, Any] = self.clients.fan_out(remote, "DirGet", timeout) if remote else {}
            if self.node_id in per:
                answers[self.node_id] = self._h_dir_get([keys[i] for i in per[self.node_id]])
            nxt = []
            for t, idx in per.items():
                ans = answers.get(t)
                if isinstance(ans, RpcError) or ans is None:
                    self.count(rpc_failures=1)
                    nxt.extend(idx)  # owner unreachable: ask the next replica
                    continue
                for i, e in zip(idx, ans):
                    if e is not None and self._live_holder(e, view) is not None:
                        out[i] = e
                    elif recent:
                        nxt.append(i)  # entries may still be moving after a view change
            todo = nxt
        return out

    def _cache_locations(self, keys: list[str], entries: list) -> None:
        ttl = self.config.location_cache_ttl
        if ttl <= 0:
            return
        until = time.monotonic() + ttl
        with self._lclock:
            for k, e in zip(keys, entries):
                if e is not None and e[HOLDER] != self.node_id:
                    self._loc_cache[k] = (e, until)
            while len(self._loc_cache) > 65536:
                self._loc_cache.popitem(last=False)

    # ------------------------------------------------------------------ public operations
    def exists(self, keys: list[str]) -> list[bool]:
        t0 = time.perf_counter()
        out = [self.segment.lookup(k, touch=False) is not None for k in keys]
        if self.disk is not None:
            out = [o or self.disk.contains(k) is not None for o, k in zip(out, keys)]
        todo = [i for i, o in enumerate(out) if not o]
        if todo:
            deadline = time.monotonic() + self.config.timeout
            sub = [keys[i] for i in todo]
            found = self._locate(sub, deadline, use_cache=False)
            # an entry naming this node for a page it no longer holds is stale
            found = [None if e is not None and e[HOLDER] == self.node_id else e for e in found]
            self._cache_locations(sub, found)
            for i, e in zip(todo, found):
                out[i] = e is not None
        self.count(exists_requests=len(keys), exists_hits=sum(out))
        with self._clock:
            self.latency["exists"].add(time.perf_counter() - t0)
        return out

    def get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout
        out = [False] * len(keys)
        sizes = [page_nbytes(p) for p in pages]
        remote: list[int] = []
        promoted = []
        disk_hits = 0
        local: list[tuple[int, Slot]] = []
        for i, (k, slot) in enumerate(zip(keys, self.segment.lookup_many(keys))):
            if slot is None and self.disk is not None and self.disk.contains(k) is not None:
                slot = self._promote_from_disk(k)
                if slot is not None:
                    promoted.append((k, slot))
                    disk_hits += 1
            if slot is None:
                remote.append(i)
            elif slot.length == sizes[i]:
                local.append((i, slot))
        got = self.segment.read_many([keys[i] for i, _ in local], [pages[i] for i, _ in local],
                                     [s for _, s in local])
        for (i, _), ok in zip(local, got):
            out[i] = ok
        local_hits = sum(got)
        if promoted:  # resident again: owners point readers back at memory
            self._publish(promoted)
            self._flush_outbox()
        if remote:
            self._get_remote(keys, pages, sizes, remote, out, deadline)
        hits = sum(out)
        nbytes = sum(s for s, o in zip(sizes, out) if o)
        self.count(read_requests=len(keys), read_hits=hits, read_local_hits=local_hits,
                   read_disk_hits=disk_hits, read_remote_hits=hits - local_hits,
                   read_misses=len(keys) - hits, bytes_read=nbytes)
        with self._clock:
            self.latency["get"].add(time.perf_counter() - t0)
        return out

    def _get_remote(self, keys, pages, sizes, idx: list[int], out: list[bool], deadline: float,
                    retry: bool = True) -> None:
        entries = self._locate([keys[i] for i in idx], deadline, ask_replicas=True)
        view = self.view
        by_holder: dict[str, list[tuple[int, list]]] = {}
        promote: dict[str, list[int]] = {}
        for i, e in zip(idx, entries):
            if e is None or e[LEN] != sizes[i] or e[HOLDER] == self.node_id:
                continue
            if not e[RESIDENT]:
                promote.setdefault(e[HOLDER], []).append(i)
                continue
            by_holder.setdefault(e[HOLDER], []).append((i, e))
        if promote:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                answers = self.clients.fan_out({h: [keys[i] for i in ii] for h, ii in promote.items()},
                                               "Promote", min(self.config.rpc_timeout * 2, remaining))
                for h, ii in promote.items():
                    ans = answers.get(h)
                    if isinstance(ans, RpcError) or ans is None:
                        continue
                    for i, e in zip(ii, ans):
                        if e is not None and e[LEN] == sizes[i]:
                            by_holder.setdefault(h, []).append((i, e))
        jobs = []
        for holder, items in by_holder.items():
            member = view.members.get(holder)
            if member is None:
                continue
            if len(by_holder) == 1:
                self._read_from(member, items, pages, out)
            else:
                jobs.append(self._pool.submit(self._read_from, member, items, pages, out))
        for j in jobs:
            j.result()
        if retry and self.config.location_cache_ttl > 0:
            # a location cached by exists() may have gone stale: look those up afresh once
            again = [i for i, e in zip(idx, entries) if e is not None and not out[i]]
            if again and deadline - time.monotonic() > self.config.rpc_timeout + self.config.transfer_timeout:
                with self._lclock:
                    for i in again:
                        self._loc_cache.pop(keys[i], None)
                self._get_remote(keys, pages, sizes, again, out, deadline, retry=False)

    def _read_from(self, member: Member, items: list[tuple[int, list]], pages, out: list[bool]) -> None:
        """One holder's pages: one-sided reads, then checksum validation per page.

        By default the engine reads into registered staging chunks and a page is copied into
        the caller's memory only after it validated. A transfer that failed or timed out may
        still land later (a blackholed peer's data arrives after the engine gave up): its
        chunk is retired, so late bytes can never reach memory the caller reuses.
        ``direct_reads`` reads straight into registered caller pages instead (zero-copy,
        without that guarantee).
        """
        if self.config.direct_reads:
            reg = self.transport.page_registered
            direct = [it for it in items if reg(pages[it[0]])]
            if direct:
                self._read_direct(member, direct, pages, out)
            items = [it for it in items if not reg(pages[it[0]])]
            if not items:
                return
            self.count(bounce_reads=len(items))
        self._read_staged(member, items, pages, out)

    def _read_staged(self, member: Member, items: list[tuple[int, list]], pages, out: list[bool]) -> None:
        staging = self.staging
        self.count(staged_reads=len(items))
        cap = staging.arena_bytes
        groups: list[list[tuple[tuple[int, list], int]]] = []
        used = cap
        for item in items:
            n = item[1][LEN]
            if n > cap:
                continue  # larger than a staging chunk: a miss
            if used + n > cap:
                groups.append([])
                used = 0
            groups[-1].append((item, used))
            used += n
        base = member.seg_base
        deadline = time.monotonic() + self.config.transfer_timeout
        g = 0
        while g < len(groups):
            # start as many chunks as we can borrow (all of them when the pool is idle) ...
            wave = []
            while g < len(groups):
                addr = staging.acquire(cap, time.monotonic() if wave else deadline)
                if addr is None:
                    break
                grp = groups[g]
                g += 1
                local = [addr + o for _, o in grp]
                remote = [base + e[OFF] for (_, e), _ in grp]
                lengths = [e[LEN] for (_, e), _ in grp]
                try:
                    bid = self.transport.read_async(member.te_name, local, remote, lengths)
                except Exception:  # noqa: BLE001 - a data-plane error is a miss
                    bid = 0
                wave.append((grp, addr, bid, time.monotonic()))
            if not wave:
                return  # no staging memory within the deadline: misses
            # ... then validate and copy out each page as soon as its transfer landed, while the
            # engine moves the next ones (only the last page's validation is not overlapped)
            for grp, addr, bid, t0 in wave:
                stale = [0]
                landed = self._stage_out(grp, addr, pages, out, stale)
                rc = self.transport.wait(bid, landed, deadline) if bid else -1
                if rc != 0:
                    staging.retire(addr)
                    self.count(**{"read_timeouts" if time.monotonic() - t0 >= self.config.transfer_timeout * 0.9
                                  else "read_failures": 1})
                else:
                    staging.release(addr)
                if stale[0]:
                    self.count(read_stale=stale[0])

    @staticmethod
    def _stage_out(grp, addr: int, pages, out: list[bool], stale: list[int]):
        """``landed`` callback of a staging chunk: the pages a completed transfer covers (one
        transfer = whole pages back to back) are checksummed, and copied out only if valid."""
        at = {addr + o: k for k, (_, o) in enumerate(grp)}

        def landed(lo: int, n: int) -> None:
            k, end = at[lo], lo + n
            while k < len(grp) and addr + grp[k][1] < end:
                (i, e), o = grp[k]
                if checksum_at(addr + o, e[LEN]) == e[CSUM]:
                    scatter(addr + o, pages[i])
                    out[i] = True
                else:
                    stale[0] += 1
                k += 1

        return landed

    PIPELINE_CHUNK = 64 << 20  # direct reads: bytes per async chunk (validation overlaps the next ones)

    def _read_direct(self, member: Member, items: list[tuple[int, list]], pages, out: list[bool]) -> None:
        """Reads straight into registered caller pages. A large batch is split into chunks that
        are all started at once; each chunk is validated as soon as it landed, while the
        engine moves the next ones (checksumming overlaps the transfer)."""
        chunks: list[list[tuple[int, list]]] = [[]]
        size = 0
        for item in items:
            if size >= self.PIPELINE_CHUNK:
                chunks.append([])
                size = 0
            chunks[-1].append(item)
            size += item[1][LEN]
        base = member.seg_base

        def lists(chunk):
            local, remote, lengths = [], [], []
            for i, e in chunk:
                off = base + e[OFF]
                for a, n in pages[i]:
                    local.append(a)
                    remote.append(off)
                    lengths.append(n)
                    off += n
            return local, remote, lengths

        def validate(chunk) -> None:
            stale = 0
            for i, e in chunk:
                ok = checksum_page(pages[i]) == e[CSUM]
                out[i] = ok
                stale += not ok
            if stale:
                self.count(read_stale=stale)

        if len(chunks) == 1:
            if self._transfer(member, *lists(chunks[0])):
                validate(chunks[0])
            return
        t0 = time.monotonic()
        ids = []
        for chunk in chunks:
            try:
                ids.append(self.transport.read_async(member.te_name, *lists(chunk)))
            except Exception:  # noqa: BLE001 - a data-plane error is a miss
                ids.append(0)
        for chunk, bid in zip(chunks, ids):  # wait for every chunk: nothing lands after we return
            rc = self.transport.wait(bid) if bid else -1
            if rc == 0:
                validate(chunk)
            elif time.monotonic() - t0 >= self.config.transfer_timeout * 0.9:
                self.count(read_timeouts=1)
            else:
                self.count(read_failures=1)

    def _transfer(self, member: Member, local, remote, lengths, write: bool = False) -> bool:
        t0 = time.monotonic()
        try:
            rc = (self.transport.write if write else self.transport.read)(member.te_name, local, remote, lengths)
        except Exception as e:  # noqa: BLE001 - a data-plane error is a miss
            log.debug("transfer with %s failed: %s", member.node_id, e)
            rc = -1
        if rc != 0:
            if time.monotonic() - t0 >= self.config.transfer_timeout * 0.9:
                self.count(read_timeouts=1)
            else:
                self.count(read_failures=1)
            return False
        return True

    def put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        t0 = time.perf_counter()
        if self.config.placement == "owner" or not self.config.global_segment_size:
            out = self._put_owner(keys, pages)  # a node that lends nothing writes to the owners
        else:
            out = self._put_local(list(range(len(keys))), keys, pages)
        sizes = [page_nbytes(p) for p in pages]
        self.count(write_requests=len(keys), write_failures=len(keys) - sum(out),
                   bytes_written=sum(s for s, o in zip(sizes, out) if o))
        with self._clock:
            self.latency["put"].add(time.perf_counter() - t0)
        return out

    def _put_local(self, idx: list[int], keys: list[str], pages: list[Page]) -> list[bool]:
        out = [False] * len(idx)
        new = []
        for j, i in enumerate(idx):
            slot, fresh = self.segment.write(keys[i], pages[i])
            if slot is None:
                continue
            out[j] = True
            if fresh:
                new.append((j, keys[i], slot))
                self._write_through(keys[i], slot)
        self._flush_outbox()
        # a page this batch stored may already have been evicted by a later one of it
        new = [(j, k, sl) for j, k, sl in new if self.segment.holds(k, sl.seq)]
        if new:
            self.count(writes_stored=len(new))
            published = self._publish([(k, s) for _, k, s in new])
            for (j, k, s), ok in zip(new, published):
                if ok is False:  # another node already holds this key: keep theirs (idempotent put)
                    self.segment.remove(k, s.seq)
                    if self.disk is not None:
                        self.disk.remove(k)
        return out

    def _put_owner(self, keys: list[str], pages: list[Page]) -> list[bool]:
        view = self.view
        out = [False] * len(keys)
        mine, per_owner = [], {}
        for i, k in enumerate(keys):
            o = self._data_owner(k, view)
            if o == self.node_id:
                mine.append(i)
            elif o is not None:
                per_owner.setdefault(o, []).append(i)
        if mine:
            for i, ok in zip(mine, self._put_local(mine, keys, pages)):
                out[i] = ok
        if per_owner:
            deadline = time.monotonic() + self.config.timeout
            jobs = [self._pool.submit(self._write_to, view.members[o], idx, keys, pages, out, deadline)
                    for o, idx in per_owner.items()]
            for j in jobs:
                j.result()
            # an owner that was full (blocks reserved by in-flight writes) or unreachable: keep
            # the page in this node's own segment instead; readers find it through the directory
            spill = [i for idx in per_owner.values() for i in idx if not out[i]]
            if spill and self.config.global_segment_size:
                self.count(write_spills=len(spill))
                for i, ok in zip(spill, self._put_local(spill, keys, pages)):
                    out[i] = ok
        return out

    def _write_to(self, member: Member, idx: list[int], keys, pages, out: list[bool], deadline: float) -> None:
        sizes = [page_nbytes(pages[i]) for i in idx]
        try:
            # Alloc and Commit publish directory entries themselves (nested calls): twice the time
            grants = self.clients.call(member.node_id, "Alloc", [[keys[i], n] for i, n in zip(idx, sizes)],
                                       min(2 * self.config.rpc_timeout, max(0.01, deadline - time.monotonic())))
        except RpcError:
            self.count(rpc_failures=1)
            return
        todo = []
        for i, n, g in zip(idx, sizes, grants):
            if g is True:
                out[i] = True
            elif g:
                todo.append((i, n, g[0], g[1]))
        if not todo:
            return
        reg = self.transport.page_registered
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
                bid = self.transport.write_async(member.te_name, local, remote, lengths)
            except Exception:  # noqa: BLE001 - a data-plane error is a failed write
                bid = 0
            sums = [checksum_page(pages[i]) for i, n, tok, off in direct] if bid else []
            rc = self.transport.wait(bid) if bid else -1
            if rc != 0:
                self.count(**{"write_timeouts" if time.monotonic() - t0 >= self.config.transfer_timeout * 0.9
                              else "write_transfer_failures": 1})
            commits += [[tok, sums[j] if rc == 0 else None] for j, (i, n, tok, off) in enumerate(direct)]
        if bounced:
            cap = self.staging.arena_bytes
            bounce = self.staging.acquire(cap, deadline)
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
                    ok = self._transfer(member, [bounce + o for _, o in chunk],
                                        [member.seg_base + t[3] for t, _ in chunk], [t[1] for t, _ in chunk],
                                        write=True)
                    commits += [[t[2], checksum_at(bounce + o, t[1]) if ok else None] for t, o in chunk]
            finally:
                if bounce is not None:
                    self.staging.release(bounce)
        try:
            results = self.clients.call(member.node_id, "Commit", commits,
                                        min(2 * self.config.rpc_timeout, max(0.01, deadline - time.monotonic())))
        except RpcError:
            self.count(rpc_failures=1)
            return
        by_tok = {c[0]: r for c, r in zip(commits, results)}
        for i, n, tok, off in todo:
            out[i] = bool(by_tok.get(tok))

    def delete(self, keys: list[str]) -> list[bool]:
        view = self.view
        deadline = time.monotonic() + self.config.timeout
        out = [False] * len(keys)
        for i, k in enumerate(keys):
            if self.segment.remove(k) is not None:
                out[i] = True
            if self.disk is not None:
                self.disk.remove(k)
        with self._lclock:
            for k in keys:
                self._loc_cache.pop(k, None)
        per: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            for t in self._dir_owners(k, view):
                per.setdefault(t, []).append(i)
        # the call's whole deadline, not one control call's: an owner that answers late under
        # load would otherwise keep the entry, and the deleted key would still be found
        answers: dict[str, Any] = self.clients.fan_out(
            {t: [keys[i] for i in idx] for t, idx in per.items() if t != self.node_id}, "DirDelete",
            max(0.01, deadline - time.monotonic()))
        if self.node_id in per:
            answers[self.node_id] = self._h_dir_delete([keys[i] for i in per[self.node_id]])
        frees: dict[str, dict[str, list]] = {}
        for t, idx in per.items():
            ans = answers.get(t)
            if isinstance(ans, RpcError) or ans is None:
                continue
            for i, e in zip(idx, ans):
                if e is not None:
                    out[i] = True
                    if e[HOLDER] != self.node_id:
                        frees.setdefault(e[HOLDER], {})[keys[i]] = [keys[i], e[SEQ]]
        if frees:
            self.clients.fan_out({h: list(v.values()) for h, v in frees.items() if h in view.members}, "Free",
                                 min(self.config.rpc_timeout, max(0.01, deadline - time.monotonic())))
        return out

    def clear(self, prefix: str = "") -> None:
        """Every node drops its pages (of keys starting with ``prefix``) and directory entries."""
        self._clear_local(prefix)
        others = [m for m in self.view.members if m != self.node_id]
        # each node also announces its drops to the owners: more than one control call's time
        self.clients.fan_out({m: prefix or [] for m in others}, "Clear", self.config.timeout)

    def register_memory(self, address: int, nbytes: int) -> None:
        self.transport.register(address, nbytes)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        with self._clock:
            m: dict[str, Any] = dict(self.counters)
        m["evictions"] = self.segment.evictions
        m.update(members=len(self.view.members), pool_keys=self.segment.keys,
                 pool_bytes_used=self.segment.bytes_used, pool_capacity_bytes=self.config.global_segment_size,
                 directory_entries=len(self._dir), view_version=self.view.version)
        if self.disk is not None:
            m.update(disk_keys=self.disk.keys, disk_bytes_used=self.disk.used, disk_writes=self.disk.writes,
                     disk_evictions=self.disk.evictions)
        lat = {}
        for op, l in self.latency.items():
            qs = l.quantiles()
            lat[op] = {"count": l.count, "sum": l.total, **{str(q): v for q, v in qs.items()}}
        m["latency"] = lat
        return m

    # ------------------------------------------------------------------ lifecycle
    def close(self, leave: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self.membership.stop(leave=leave)
        self.server.stop(grace=0.5).wait(2)
        self._outbox_event.set()
        self._rehome_event.set()
        for t in self._threads:
            t.join(5)
        self._pool.shutdown(wait=True)
        self.clients.close()
        if self.disk is not None:
            self.disk.close()
        self.transport.close()
        self.segment.close()
