"""A peer-pool node: one member of the pool, and the objects that do its jobs.

* ``membership`` (membership.py): who is in the pool (heartbeats, the view).
* ``segment`` / ``disk``: the memory this node lends (and its optional disk tier).
* ``directory`` (directory.py): this node's shard of "which holder has key k".
* ``announcer`` (announce.py): publications and evictions told to the directory owners.
* ``rehoming`` (rehome.py): directory entries following the membership.
* ``holder`` (holder.py): reservations for one-sided writes into this segment, commits, frees.
* ``reader`` (reads.py) / ``writer`` (writes.py): the data plane of ``get``/``exists`` and
  ``put``/``delete``.

The node wires them together, serves their control-plane handlers, and keeps what they
share: the configuration, the transport, the counters.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvconnect.connectors.base import Page
from kvconnect.connectors.errors import BackendUnavailable, ConfigError
from kvconnect.connectors.peer_rdma.announce import Announcer
from kvconnect.connectors.peer_rdma.config import PeerRdmaConfig
from kvconnect.connectors.peer_rdma.counters import COUNTERS
from kvconnect.connectors.peer_rdma.directory import DirectoryShard
from kvconnect.connectors.peer_rdma.holder import Holder
from kvconnect.connectors.peer_rdma.membership import Member, Membership, View
from kvconnect.connectors.peer_rdma.placement import owners
from kvconnect.connectors.peer_rdma.reads import Reader
from kvconnect.connectors.peer_rdma.rehome import Rehoming
from kvconnect.connectors.peer_rdma.rpc import Clients, serve
from kvconnect.connectors.peer_rdma.segment import Segment, Slot
from kvconnect.connectors.peer_rdma.writes import Writer
from kvconnect.connectors.rpc import is_loopback, warn_if_open
from kvconnect.connectors.shared_memory import SameHostSegments, SharedSegmentFile
from kvconnect.connectors.transfer_engine import EngineClient, StagingMemory, set_rdma_port

if TYPE_CHECKING:
    from kvconnect.connectors.peer_rdma.registry_membership import RegistryMembership

log = logging.getLogger(__name__)


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
        self._clock = threading.Lock()  # counters and latencies
        self._closed = False

        seed_host = c.seeds[0].rpartition(":")[0]
        bind = c.bind_host
        self.hostname = c.local_hostname or (bind if bind not in ("0.0.0.0", "::", "") else _route_to(seed_host))
        warn_if_open("peer_rdma node (control plane)", bind, c.token, log)
        if c.local_hostname and not is_loopback(c.local_hostname) and is_loopback(bind):
            log.warning("peer_rdma: local_hostname %s is announced to peers but bind_host is %s: no other "
                        "host can reach this node's control port; set bind_host to %s (or 0.0.0.0)",
                        c.local_hostname, bind, c.local_hostname)

        self.directory = DirectoryShard(self)
        self.announcer = Announcer(self)
        self.rehoming = Rehoming(self)
        self.holder = Holder(self)
        self.reader = Reader(self)
        self.writer = Writer(self)
        # All or nothing: a start that fails half way (a port, a read-only disk_path) stops
        # what it started (listener, Transfer Engine, threads) before the error goes up.
        self.segment = self.transport = self.staging = self.clients = self.server = self.disk = None
        self.shared_file: SharedSegmentFile | None = None  # the segment's file (shared_segment)
        self.same_host: SameHostSegments | None = None  # same-host nodes' files (shared_segment)
        self.membership: Membership | RegistryMembership | None = None
        self._threads: list[threading.Thread] = []
        self.io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="peer-io")
        try:
            self._start(c, bind)
        except BaseException:
            self._close_started(leave=False)
            raise

    def _start(self, c: PeerRdmaConfig, bind: str) -> None:
        if c.shared_segment and c.global_segment_size:
            try:
                self.shared_file = SharedSegmentFile(c.shared_segment_dir, max(c.global_segment_size, mmap.PAGESIZE),
                                                     "peer_rdma")
            except OSError as e:
                raise BackendUnavailable("peer_rdma", f"shared_segment: {e}") from e
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if c.global_segment_size > ram:
            raise ConfigError("global_segment_size", f"{c.global_segment_size} bytes is more than this host's memory "
                              f"({ram} bytes): the segment is lent RAM", "a size below the host's memory, e.g. '16gb'")
        try:
            self.segment = Segment(c.global_segment_size, on_evict=self.announcer.evicted,
                                   populate=c.populate_segment, path=self.shared_file.path if self.shared_file else "")
        except OSError as e:
            raise ConfigError("global_segment_size", f"cannot map {c.global_segment_size} bytes: {e}") from e
        set_rdma_port(c.protocol, c.gid_index, c.ib_port, "peer_rdma")
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
        if self.shared_file is not None:
            # same-host nodes find this segment by the Transfer Engine endpoint the pool
            # publishes for this node, and translate addresses through this base
            self.shared_file.publish(self.transport.name, self.segment.base)
        if c.shared_segment:
            self.same_host = SameHostSegments(c.shared_segment_dir, "peer_rdma")
        self.clients = Clients(c.token, c.rpc_timeout)
        handlers = {
            "Heartbeat": lambda r: self.membership.handle_heartbeat(r),
            "Leave": lambda r: self.membership.handle_leave(r),
            "DirPut": self.directory.put, "DirGet": self.directory.get, "DirDrop": self.directory.drop,
            "DirDelete": self.directory.delete, "Alloc": self.holder.alloc, "Commit": self.holder.commit,
            "Free": self.holder.free, "Promote": self.holder.promote,
            "Clear": lambda r: self._clear_local(r if isinstance(r, str) else "") or [],
            "Stats": lambda _r: self.metrics(),
            "Usage": lambda _r: [self.segment.keys, self.segment.bytes_used],
        }
        port = c.control_port
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
            from kvconnect.connectors.peer_rdma.disk import DiskTier

            try:
                self.disk = DiskTier(os.path.join(c.disk_path, self.node_id.replace(":", "_")), c.disk_size,
                                     on_evict=self.announcer.disk_evicted)
            except OSError as e:  # read-only, not a directory, full: say which key, not a bare OSError
                raise ConfigError("disk_path", f"{c.disk_path!r} cannot hold the disk tier: "
                                  f"{e.strerror or e}") from e
        self.me = Member(self.node_id, self.incarnation, self.transport.name, self.segment.base,
                         c.global_segment_size)
        if c.membership_url:
            from kvconnect.connectors.peer_rdma.registry_membership import RegistryMembership, registry_client

            self.membership = RegistryMembership(
                self.me, registry_client(c.membership_url, c.membership_password, c.rpc_timeout), self.clients,
                pool=c.membership_pool, interval=c.heartbeat_interval, ttl=c.member_ttl,
                on_change=self.rehoming.on_view_change)
        else:
            self.membership = Membership(self.me, c.seeds, self.clients, interval=c.heartbeat_interval,
                                         ttl=c.member_ttl, on_change=self.rehoming.on_view_change)
        self.clients.on_reply = self.membership.touch
        self._threads += [threading.Thread(target=self.announcer.loop, name="peer-outbox", daemon=True),
                          threading.Thread(target=self.rehoming.loop, name="peer-rehome", daemon=True)]
        for t in self._threads:
            t.start()
        joined = self.membership.join(c.join_timeout)
        self.membership.start()
        log.info("peer node up: node=%s te=%s segment=%d bytes%s members=%d%s", self.node_id, self.transport.name,
                 c.global_segment_size,
                 f" in {self.shared_file.path} (same-host nodes copy from it)" if self.shared_file else "",
                 len(self.membership.view.members),
                 "" if joined else " (no seed answered yet; retrying in the background)")

    # ------------------------------------------------------------------ shared by the parts
    def count(self, **kw: int) -> None:
        with self._clock:
            for k, v in kw.items():
                self.counters[k] += v

    def timed(self, op: str, t0: float) -> None:
        """Record an operation that started at ``time.perf_counter()`` ``t0``."""
        with self._clock:
            self.latency[op].add(time.perf_counter() - t0)

    @property
    def view(self) -> View:
        return self.membership.view

    @property
    def closed(self) -> bool:
        return self._closed

    def entry(self, slot: Slot, resident: bool = True) -> list:
        """This node's directory entry for a slot it holds."""
        return [self.node_id, self.incarnation, slot.offset, slot.length, slot.seq, slot.checksum, resident]

    def dir_owners(self, key: str, view: View | None = None) -> list[str]:
        view = view or self.view
        return owners(key, view.ids, 1 + self.config.directory_replicas)

    def data_owner(self, key: str, view: View) -> str | None:
        lenders = [m for m, rec in view.members.items() if rec.seg_size > 0]
        found = owners(key, lenders, 1)
        return found[0] if found else None

    def transfer(self, member: Member, local, remote, lengths, write: bool = False) -> bool:
        """One batch of one-sided reads (or writes) with ``member``; a failure is counted, not raised."""
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

    # ------------------------------------------------------------------ the store's calls
    def exists(self, keys: list[str]) -> list[bool]:
        return self.reader.exists(keys)

    def get_into(self, keys: list[str], pages: list[Page], why: dict[int, str] | None = None) -> list[bool]:
        return self.reader.get_into(keys, pages, why)

    def put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self.writer.put_from(keys, pages)

    def delete(self, keys: list[str]) -> list[bool]:
        return self.writer.delete(keys)

    def clear(self, prefix: str = "") -> None:
        """Every node drops its pages (of keys starting with ``prefix``) and directory entries."""
        self._clear_local(prefix)
        others = [m for m in self.view.members if m != self.node_id]
        # each node also announces its drops to the owners: more than one control call's time
        self.clients.fan_out({m: prefix or [] for m in others}, "Clear", self.config.timeout)

    def _clear_local(self, prefix: str = "") -> None:
        """Drop this node's pages and directory entries (of keys starting with ``prefix``)."""
        dropped = self.segment.clear(prefix)
        self.directory.clear(prefix)
        self.reader.forget(prefix)
        if self.disk is not None:
            self.disk.clear(prefix)
        # Owners clear their shards too, but a re-publish taken from a snapshot before this
        # clear (re-homing after a view change) can still arrive there afterwards.
        self.announcer.dropped(dropped)

    def register_memory(self, address: int, nbytes: int) -> None:
        self.transport.register(address, nbytes)

    # ------------------------------------------------------------------ metrics
    def pool_usage(self) -> dict[str, Any]:
        """The whole pool's lent memory: pages and bytes in use in every live member's segment
        (this node's own figures, the others' by one ``Usage`` call each, at ``rpc_timeout``)
        and the sum of the segments they lend (from the view). A member that does not answer
        counts its lent size but none of its bytes (``unanswered`` names it)."""
        view = self.view
        keys, used = self.segment.keys, self.segment.bytes_used
        others = {m: [] for m, rec in view.members.items() if m != self.node_id and rec.seg_size > 0}
        unanswered = []
        for m, a in (self.clients.fan_out(others, "Usage", self.config.rpc_timeout) if others else {}).items():
            if isinstance(a, (list, tuple)) and len(a) == 2:
                keys, used = keys + int(a[0]), used + int(a[1])
            else:
                unanswered.append(m)
        return {"members": len(view.members), "keys": keys, "bytes_used": used,
                "capacity_bytes": sum(rec.seg_size for rec in view.members.values()), "unanswered": sorted(unanswered)}

    def metrics(self) -> dict[str, Any]:
        with self._clock:
            m: dict[str, Any] = dict(self.counters)
        m["evictions"] = self.segment.evictions
        t = self.membership.traffic
        m.update(membership_calls=t.messages, membership_failures=t.failures, membership_snapshots=t.snapshots)
        m.update(shared_segments_mapped=self.same_host.mapped if self.same_host else 0)
        m.update(members=len(self.view.members), pool_keys=self.segment.keys,
                 pool_bytes_used=self.segment.bytes_used, pool_capacity_bytes=self.config.global_segment_size,
                 directory_entries=len(self.directory), view_version=self.view.version)
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
        self._close_started(leave)

    def _close_started(self, leave: bool) -> None:
        """Stop whatever has been started (all of it after a full start)."""
        self._closed = True
        if self.membership is not None:
            self.membership.stop(leave=leave)
        if self.server is not None:
            self.server.stop(grace=0.5).wait(2)
        self.announcer.wake()
        self.rehoming.wake()
        for t in self._threads:
            t.join(5)
        self.io.shutdown(wait=True)
        # (staging memory stays: a transfer given up on may still land in it)
        for part in (self.clients, self.disk, self.transport, self.same_host, self.segment, self.shared_file):
            if part is not None:
                part.close()
