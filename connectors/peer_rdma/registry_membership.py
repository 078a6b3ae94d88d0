"""Membership through a registry in Redis: per-node cost that does not grow with the pool.

The heartbeat mesh (``membership.py``) costs every node one call per member per interval,
each carrying the whole live set: fine for a rack, n² for a thousand nodes. With
``membership_url`` set, each node instead sends **one** script call per
``heartbeat_interval`` to a Redis (or a Sentinel group; the pool's keys share one hash tag),
and learns the changes of the live set from its reply:

* ``{prefix}:{pool}:live`` - sorted set node id -> expiry (ms, the server's clock: node clocks
  never matter), refreshed by each beat to ``now + member_ttl``;
* ``{prefix}:{pool}:rec`` - hash node id -> the member record (``Member.to_wire``, msgpack);
* ``{prefix}:{pool}:ev`` - stream of changes, each numbered by ``{prefix}:{pool}:seq``: a join
  (a new node or a new incarnation) or a leave (``Leave`` at shutdown, or a member whose
  expiry passed: every beat reaps up to ``REAP_PER_BEAT`` of those).

A beat returns the events after the node's last one. A node that starts, or that finds a
gap in the numbers (it was away longer than the stream keeps), reads a snapshot of the
live records once (O(pool), the only such read). In steady state a beat is ~270 bytes, the
request and an empty reply together: flat in the pool size; each join or leave costs every
node one event.

A node that cannot reach the registry for ``member_ttl`` has been dropped by everybody
else; it falls back to a view of itself (it reads and publishes nothing remote, so it never
routes by a view the others no longer share) and rejoins with a snapshot once the registry
answers. The registry is the one thing every node depends on: run it replicated
(``redis+sentinel://``, docs/operations.md).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from typing import Any, Callable

import msgpack

from kvconnect.connectors.peer_rdma.membership import Member, View, ViewKeeper

log = logging.getLogger(__name__)

REAP_PER_BEAT = 64  # expired members one beat removes (bounded script time)
STREAM_KEEP = 20000  # events kept; a node further behind reads a snapshot
EVENTS_PER_BEAT = 1024  # events one reply carries; more come with the next beat

# Events: stream entries whose id is "<number>-0" (numbers from the counter {..}:seq, so a
# gap is seen by number), one field 'e' = kind byte ('j' join / 'l' leave) + the record.
_EVENT = """
local function event(kind, rec)
  local s = redis.call('INCR', KEYS[4])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', %d, s .. '-0', 'e', kind .. rec)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
""" % STREAM_KEEP

# KEYS: live, rec, ev, seq. ARGV: node id, record, ttl ms, number of the last event seen, its
# tag (the first 8 hex digits of the SHA-1 of its field). Returns {number of the last event in
# the blob, blob} (blob: per event a 4-byte big-endian length and the field), or {-1} when the
# node's history is not the registry's: events after its last one are gone (trimmed), or its
# last one is not there with that tag (a failover to a replica that had not received it).
_BEAT = _EVENT + """
local now = now_ms()
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, %d)) do
  local rec = redis.call('HGET', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  if rec then event('l', rec) end
end
local prev = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
if prev ~= ARGV[2] then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  event('j', ARGV[2])
end
local last = tonumber(ARGV[4])
if last > 0 then
  local mine = redis.call('XRANGE', KEYS[3], last .. '-0', last .. '-0')
  if mine[1] == nil or string.sub(redis.sha1hex(mine[1][2][2]), 1, 8) ~= ARGV[5] then return {-1} end
end
local evs = redis.call('XRANGE', KEYS[3], '(' .. last .. '-0', '+', 'COUNT', %d)
if #evs == 0 then
  -- nothing after ours: the counter must be ours (else trimmed, or the registry was reset)
  if tonumber(redis.call('GET', KEYS[4]) or '0') ~= last then return {-1} end
  return {last, ''}
end
local first = tonumber(string.match(evs[1][1], '^(%%d+)'))
if first ~= last + 1 then return {-1} end
local parts = {}
for i, ev in ipairs(evs) do
  parts[i] = struct.pack('>I4', #ev[2][2]) .. ev[2][2]
end
return {last + #evs, table.concat(parts)}
""" % (REAP_PER_BEAT, EVENTS_PER_BEAT)

# KEYS: live, rec, ev, seq. Returns {number of the last event, its tag, records of live members}.
_SNAPSHOT = _EVENT + """
local now = now_ms()
local out = {}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  local rec = redis.call('HGET', KEYS[2], m)
  if rec then out[#out + 1] = rec end
end
local seq = tonumber(redis.call('GET', KEYS[4]) or '0')
local tag = ''
local last = redis.call('XRANGE', KEYS[3], seq .. '-0', seq .. '-0')
if last[1] then tag = string.sub(redis.sha1hex(last[1][2][2]), 1, 8) end
return {seq, tag, out}
"""

# KEYS: live, rec, ev, seq. ARGV: node id, record. Leaves only the same incarnation.
_LEAVE = _EVENT + """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
event('l', ARGV[2])
return 1
"""


@functools.lru_cache(maxsize=8192)
def _member(record: bytes) -> Member:
    """A record read back (cached: every node of a pool reads the same few records)."""
    return Member.from_wire(msgpack.unpackb(record, raw=False))


def _reply_bytes(rep: Any) -> int:
    """The size of a RESP reply (what came over the wire, near enough)."""
    if isinstance(rep, (bytes, bytearray)):
        return len(rep) + 8
    if isinstance(rep, (list, tuple)):
        return 4 + sum(_reply_bytes(x) for x in rep)
    return 8


def registry_client(url: str, password: str | None, timeout: float, *, connections: int = 0, pool_wait: float = 0.0):
    """A redis-py client for a ``redis://`` or ``redis+sentinel://`` URL (read strictly by the
    page index's parser: one URL language for every Redis the package talks to). Every call
    is one attempt bounded by ``timeout``, but a connection found closed (a restarted
    server, a healed partition) is retried once at once. ``connections`` > 0: at most that
    many, shared by the threads of one process, waiting up to ``pool_wait`` s for one (the
    scale simulation's thousand members in one process)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from kvconnect.connectors.redis_url import parse_redis_url

    u = parse_redis_url(url, "membership_url")
    common = dict(socket_timeout=timeout, socket_connect_timeout=timeout, db=u.db, username=u.username,
                  password=password, retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)))
    if u.tls:
        common.update(ssl=True)
    if u.sentinel:
        from redis.sentinel import Sentinel

        return Sentinel(list(u.hosts), sentinel_kwargs={"socket_timeout": timeout}, **common).master_for(
            u.master, **common)
    host, port = u.hosts[0]
    if connections:
        return redis.Redis(connection_pool=redis.BlockingConnectionPool(
            host=host, port=port, max_connections=connections, timeout=pool_wait, **common))
    return redis.Redis(host=host, port=port, **common)


class RegistryMembership(ViewKeeper):
    """The live set kept in a Redis registry; the same surface as ``Membership``."""

    thread_name = "peer-registry"

    def __init__(self, me: Member, client, clients=None, *, pool: str = "default", prefix: str = "kvc:peer",
                 interval: float, ttl: float, on_change: Callable[[View, View], None] | None = None):
        super().__init__(me, on_change)
        self.me = me
        self.r = client  # a redis-py client (its socket timeouts bound every beat)
        self.clients = clients  # the node's gRPC clients (unused here: nothing to send to peers)
        self.interval = interval
        self.ttl = ttl
        base = f"{prefix}:{{{pool}}}:"
        self.keys = [base + "live", base + "rec", base + "ev", base + "seq"]
        self._record = msgpack.packb(me.to_wire(), use_bin_type=True)
        self._members: dict[str, Member] = {me.node_id: me}
        self._last_seq: int | None = None  # None: read a snapshot first
        self._last_tag = ""  # the tag of event number _last_seq (see _BEAT)
        self._last_ok = time.monotonic()
        self._cut_off = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scripts = {name: client.register_script(src) for name, src in
                         (("beat", _BEAT), ("snapshot", _SNAPSHOT), ("leave", _LEAVE))}
        self._sizes = {name: len(s.sha) + sum(len(k) for k in self.keys) + 40 for name, s in self._scripts.items()}

    # -- the Membership surface ----------------------------------------------------------
    def join(self, wait: float) -> bool:
        """Register and read the live set; retry until ``wait`` s have passed."""
        deadline = time.monotonic() + wait
        while True:
            if self.beat():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, self.interval))

    def stop(self, leave: bool = True) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(self.interval + 2 * self._timeout() + 1)
        if leave:
            try:
                self._run("leave", [self.me.node_id, self._record])
            except Exception as e:  # noqa: BLE001 - the registry drops us after member_ttl anyway
                log.debug("peer registry: leave failed: %s", e)

    def touch(self, node_id: str) -> None:
        """Liveness comes from the registry, not from peers' replies."""

    def handle_heartbeat(self, req: list) -> list:
        """A mesh node's heartbeat: answered so that it learns who we are, with no live set
        (a registry pool does not spread members peer to peer)."""
        return [self.me.to_wire(), []]

    def handle_leave(self, req: list) -> list:
        return []  # leaves go through the registry

    # -- one beat ---------------------------------------------------------------------------
    def beat(self) -> bool:
        """Refresh this node's record and apply the changes since the last beat. False if
        the registry did not answer (never raises)."""
        try:
            if self._last_seq is None:
                self._snapshot()
            rep = self._run("beat", [self.me.node_id, self._record, int(self.ttl * 1000), self._last_seq,
                                     self._last_tag])
            if int(rep[0]) < 0:
                self._last_seq = None  # events we never saw are gone: read a snapshot now
                self._snapshot()
            else:
                self._apply(int(rep[0]), rep[1])
            self._last_ok = time.monotonic()
            self._cut_off = False
            self._publish(self._members_now)
            return True
        except Exception as e:  # noqa: BLE001 - an unreachable registry is a state, not an error
            self.traffic.failures += 1
            log.debug("peer registry beat failed: %s", e)
            if not self._cut_off and time.monotonic() - self._last_ok > self.ttl:
                # everybody else has dropped us by now: keep no view they do not share
                log.warning("peer registry unreachable for %.1f s: this node works alone until it answers",
                            time.monotonic() - self._last_ok)
                self._cut_off = True
                self._last_seq = None
                with self._lock:
                    self._members = {self.me.node_id: self.me}
                self._publish(self._members_now)
            return False

    # -- internals ------------------------------------------------------------------------
    def _timeout(self) -> float:
        kw = getattr(getattr(self.r, "connection_pool", None), "connection_kwargs", {})
        return float(kw.get("socket_timeout") or 1.0)

    def _run(self, name: str, args: list) -> Any:
        rep = self._scripts[name](keys=self.keys, args=args)
        self.traffic.add(self._sizes[name] + sum(len(a) if isinstance(a, (bytes, str)) else 8 for a in args),
                         _reply_bytes(rep))
        return rep

    def _snapshot(self) -> None:
        seq, tag, records = self._run("snapshot", [])
        self.traffic.snapshots += 1
        members = {self.me.node_id: self.me}
        for rec in records:
            m = _member(rec)
            if m.node_id != self.me.node_id:
                members[m.node_id] = m
        with self._lock:
            self._members = members
            self._last_seq, self._last_tag = int(seq), tag.decode() if isinstance(tag, bytes) else str(tag)

    def _apply(self, last: int, blob: bytes) -> None:
        """Apply the events of a beat's reply, in order, up to event number ``last``."""
        view = memoryview(blob)
        off = 0
        field = b""
        with self._lock:
            while off < len(view):
                n = int.from_bytes(view[off:off + 4], "big")
                field = bytes(view[off + 4:off + 4 + n])
                kind, m = field[0], _member(field[1:])
                off += 4 + n
                if m.node_id == self.me.node_id:
                    continue
                cur = self._members.get(m.node_id)
                if kind == 0x6A:  # 'j'
                    if cur is None or cur.incarnation <= m.incarnation:
                        self._members[m.node_id] = m
                elif cur is not None and cur.incarnation <= m.incarnation:
                    del self._members[m.node_id]
            self._last_seq = last
            if field:
                self._last_tag = hashlib.sha1(field).hexdigest()[:8]

    def _members_now(self) -> dict[str, Member]:
        with self._lock:
            return dict(self._members)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()
