"""Membership: who is in the pool, learned by heartbeats, with no master.

Every node runs the same gRPC ``Heartbeat`` handler, so any node can be a seed. A node
joins by heartbeating any seed; replies carry the sender's live set, and members learned
that way become *candidates*. A member is *live* only after direct contact (a heartbeat
from it, or a reply to ours), so gossip can never keep a dead node alive, and it stops
being live when nothing was heard from it for ``member_ttl`` seconds. Every node
heartbeats every live member, candidate and seed each ``heartbeat_interval``: with a
full mesh, all nodes that can reach each other converge on the same live set within
one TTL, and a healed partition or a restarted node is found again through the seeds or
the recently dropped members. ``Leave`` removes a node at once (clean shutdown).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvconnect.connectors.peer_rdma.rpc import Clients, RpcError

log = logging.getLogger(__name__)


@dataclass
class Member:
    """What a node publishes about itself (sent in every heartbeat)."""

    node_id: str  # control address host:port: the identity used for placement
    incarnation: int  # start time (ns): a restarted node is a new incarnation
    te_name: str  # Transfer Engine segment name (host:rpc_port)
    seg_base: int  # address of its lent segment in its own process
    seg_size: int  # bytes it lends (0: stores no pages)

    def to_wire(self) -> list:
        return [self.node_id, self.incarnation, self.te_name, self.seg_base, self.seg_size]

    @classmethod
    def from_wire(cls, w: list) -> "Member":
        return cls(str(w[0]), int(w[1]), str(w[2]), int(w[3]), int(w[4]))


@dataclass
class _Peer:
    member: Member
    last_seen: float


@dataclass
class View:
    """An immutable snapshot of the live set (self included), sorted by node id."""

    version: int
    members: dict[str, Member] = field(default_factory=dict)
    changed_at: float = 0.0

    def __post_init__(self) -> None:
        self.ids: list[str] = sorted(self.members)  # placement input, computed once per view


class Traffic:
    """Membership calls one node sent (and, where known, their bytes): its cost, as measured."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.snapshots = 0  # full reads of the live set (a start, a gap, a return from a cut-off)
        self.failures = 0  # calls that got no answer in time

    def add(self, out: int, inb: int) -> None:
        self.messages += 1
        self.bytes_out += out
        self.bytes_in += inb


class ViewKeeper:
    """The current view and its change callback, whichever protocol learns the members (a
    subclass's ``_loop`` runs on the thread ``start`` makes)."""

    thread_name = "peer-heartbeat"

    def __init__(self, me: Member, on_change: Callable[[View, View], None] | None):
        self.on_change = on_change
        self.traffic = Traffic()
        self._view = View(1, {me.node_id: me}, time.monotonic())
        self._change_lock = threading.Lock()

    @property
    def view(self) -> View:
        return self._view

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        raise NotImplementedError

    def _publish(self, snapshot: Callable[[], dict[str, Member]]) -> None:
        """A new view if the members (or an incarnation) differ from the current one. The
        snapshot is taken under the change lock, so the latest one always wins."""
        with self._change_lock:
            members = snapshot()
            old = self._view
            same = old.members.keys() == members.keys() and all(
                old.members[k].incarnation == m.incarnation for k, m in members.items())
            if same:
                return
            new = View(old.version + 1, members, time.monotonic())
            self._view = new
            if len(members) <= 16:
                log.info("peer pool view %d: %d member(s): %s", new.version, len(members), ", ".join(new.ids))
            else:
                log.info("peer pool view %d: %d members", new.version, len(members))
        if self.on_change:
            try:
                self.on_change(old, new)
            except Exception:  # noqa: BLE001 - a membership callback never stops heartbeats
                log.exception("peer pool view change handler failed")


class Membership(ViewKeeper):
    def __init__(self, me: Member, seeds: list[str], clients: Clients, *, interval: float, ttl: float,
                 on_change: Callable[[View, View], None] | None = None):
        super().__init__(me, on_change)
        self.me = me
        self.seeds = [s for s in seeds if s and s != me.node_id]
        self.clients = clients
        self.interval = interval
        self.ttl = ttl
        self._lock = threading.Lock()
        self._live: dict[str, _Peer] = {}
        self._candidates: dict[str, float] = {}  # address -> forget-after time
        self._left: dict[str, int] = {}  # node_id -> incarnation that said Leave
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- public ---------------------------------------------------------------------
    def join(self, wait: float) -> bool:
        """One heartbeat round now; with seeds, wait up to ``wait`` s until one answered."""
        deadline = time.monotonic() + wait
        while True:
            self._round()
            with self._lock:  # members learned from the seed's reply: contact them too
                pending = [c for c in self._candidates if c not in self.seeds]
            joined = len(self._view.members) > 1
            if not self.seeds or (joined and not pending) or time.monotonic() >= deadline:
                return joined or not self.seeds
            if not joined:
                time.sleep(min(0.2, self.interval))

    def stop(self, leave: bool = True) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(self.interval + self.clients.timeout + 1)
        if leave:
            targets = {p.member.node_id: [self.me.node_id, self.me.incarnation] for p in self._live.values()}
            self.clients.fan_out(targets, "Leave", timeout=min(1.0, self.clients.timeout))

    # -- handlers (called by the gRPC server) ------------------------------------------
    def touch(self, node_id: str) -> None:
        """Any reply from a live member counts as hearing from it (busy peers answer data
        calls even when a heartbeat is late)."""
        peer = self._live.get(node_id)
        if peer is not None:
            peer.last_seen = time.monotonic()

    def handle_heartbeat(self, req: list) -> list:
        sender = Member.from_wire(req[0])
        self._heard(sender)
        self._learn(req[1])
        return [self.me.to_wire(), self._live_wire()]

    def handle_leave(self, req: list) -> list:
        node_id, incarnation = str(req[0]), int(req[1])
        with self._lock:
            self._left[node_id] = incarnation
            peer = self._live.get(node_id)
            if peer and peer.member.incarnation == incarnation:
                del self._live[node_id]
        self._publish_view()
        return []

    # -- internals ---------------------------------------------------------------------
    def _live_wire(self) -> list:
        with self._lock:
            return [p.member.to_wire() for p in self._live.values()]

    def _heard(self, m: Member) -> None:
        if m.node_id == self.me.node_id:
            return
        with self._lock:
            if self._left.get(m.node_id, -1) >= m.incarnation:
                return  # a late heartbeat of a node that left
            cur = self._live.get(m.node_id)
            if cur and cur.member.incarnation > m.incarnation:
                return  # a stale incarnation
            self._live[m.node_id] = _Peer(m, time.monotonic())
            self._candidates.pop(m.node_id, None)
        self._publish_view()

    def _learn(self, members: list) -> None:
        now = time.monotonic()
        with self._lock:
            for w in members:
                node_id, inc = str(w[0]), int(w[1])
                if node_id == self.me.node_id or node_id in self._live:
                    continue
                if self._left.get(node_id, -1) >= inc:
                    continue
                self._candidates.setdefault(node_id, now + 3 * self.ttl)

    def _round(self) -> None:
        now = time.monotonic()
        with self._lock:
            targets = set(self._live) | set(self._candidates) | set(self.seeds)
            for a, until in list(self._candidates.items()):
                if until < now and a not in self.seeds:
                    del self._candidates[a]
        req = [self.me.to_wire(), self._live_wire()]
        # a late reply still proves liveness: wait up to half the TTL (a busy 2-core host
        # can stall a Python gRPC peer for a second), but never past the next round
        timeout = max(self.clients.timeout, min(2 * self.interval, self.ttl / 2))
        replies = self.clients.fan_out({t: req for t in targets}, "Heartbeat", timeout=timeout)
        self.traffic.messages += len(targets)
        for target, rep in replies.items():
            if isinstance(rep, RpcError):
                self.traffic.failures += 1
                if rep.code == "UNAUTHENTICATED":
                    log.warning("peer %s refused our token", target)
                else:
                    log.debug("heartbeat to %s failed: %s", target, rep)
                continue
            member = Member.from_wire(rep[0])
            if member.node_id != target:  # a seed's address differs from its node id
                with self._lock:
                    self._candidates.pop(target, None)
            self._heard(member)
            self._learn(rep[1])
        self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        dropped = []
        with self._lock:
            for node_id, p in list(self._live.items()):
                if now - p.last_seen > self.ttl:
                    del self._live[node_id]
                    dropped.append(node_id)
                    # keep trying it for a while: a healed partition or a restart rejoins
                    self._candidates[node_id] = now + 10 * self.ttl + 60
        if dropped:
            log.warning("peer pool: dropped silent member(s) %s", ", ".join(dropped))
            self._publish_view()

    def _publish_view(self) -> None:
        def members() -> dict[str, Member]:
            with self._lock:
                out = {self.me.node_id: self.me}
                out.update({k: p.member for k, p in self._live.items()})
            return out

        self._publish(members)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._round()
            except Exception:  # noqa: BLE001
                log.exception("peer heartbeat round failed")
