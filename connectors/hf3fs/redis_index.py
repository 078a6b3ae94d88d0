"""The HF3FS page index on Redis / Valkey: replicas, Sentinel failover, no single point of failure.

``metadata_server_url`` selects it by scheme:

* ``redis://[user@]host:port[/db]`` - one server (or a proxy / managed endpoint);
* ``rediss://...`` - the same over TLS (``metadata_tls_*`` files);
* ``redis+sentinel://[user@]host:port,host:port,.../master-name[/db]`` - Sentinel finds the
  primary and the client follows it after a failover (``rediss+sentinel://``: TLS to the
  sentinels and the data nodes);
* ``redis+cluster://[user@]host:port,host:port,...`` - Redis Cluster: the hosts are seeds
  (any node of the cluster); the index is sharded by namespace (below) and follows each
  shard's failover.

The password of the ACL user never sits in the URL: it comes from ``auth_token_file`` (or
``auth_token`` / ``$KVCONNECT_HF3FS_TOKEN``), like the kvconnect service's token.

``RedisMetadata`` has the semantics of ``PageIndex`` (``index.py``) with the state in
Redis: per-namespace keys under one hash tag, one Lua script per batch call (``redis_lua.py``;
atomic, so reserve -> write -> confirm, leases and LRU eviction hold across any number of
clients), replies as packed arrays. It differs in one way the store must know about
(``may_serve_stale``): replication is asynchronous, so a replica promoted by a failover can
be behind and map a key to a slot that has since been given to another key. The store
therefore checks each page's identity (``pageid.py``) on every read when it talks to this
index (``verify_pages: auto``); a stale mapping is a miss, and ``forget`` drops it.

Every call is bounded: at most ``meta_retries`` attempts within ``client_timeout`` seconds
(each attempt's socket timeouts are a share of it), then a ``MetadataError`` (a miss / a
failed write for the store) and ``cooldown`` seconds of fast failures. Transient errors
(connection lost, timeout, ``READONLY`` from a demoted primary, ``LOADING``,
``MASTERDOWN``, no primary known to Sentinel yet) drop idle connections, so the next
attempt asks Sentinel again. ``wait_replicas`` > 0 sends ``WAIT`` after each confirm; a
confirm not acknowledged by that many replicas within ``wait_timeout`` is reported as a
failed write (the page stays visible on the primary but is not promised to survive).

``WAIT`` is sent only while the primary has enough replicas to answer it: the client learns
how many are attached (``INFO replication``: replicas ``online`` whose last acknowledgement
is at most ``REPLICA_MAX_LAG_S`` old), trusts a count that is enough for
``REPLICAS_TRUSTED_S`` and one that is not for ``REPLICAS_RECHECK_S``, and asks again after a
shortfall and after every reconnection (a failover). With too few, a confirm runs its script
without ``WAIT`` and is reported as a failed write at once (``no_replica_writes``; a warning
at most every ``NO_REPLICA_LOG_S``), instead of blocking the engine's thread for
``wait_timeout`` to learn the same.

**On Redis Cluster** a namespace's keys share one hash tag that names the deployment too
(``{key_prefix}/{namespace}``: the key prefix and the data file's namespace, i.e. model
deployment, rank and pool), so one namespace lives in one hash slot, on one shard, and every
call is one script on one node in one round trip; different namespaces (engines of other
models, pools or ranks) spread over the shards. Which node serves which slot comes from
``CLUSTER SLOTS`` (``redis_slots.py``), asked again after ``MOVED``, ``CLUSTERDOWN`` or a
lost connection. Everything above holds per shard: ``WAIT`` and the replica count are the
shard primary's, a call that fails for good cools off only its slot (the other shards go on
serving), and a shard's failover is treated as Sentinel's (``may_serve_stale``: the store's
page identity check; leases dropped). A standalone server or Sentinel group keeps the
namespace-only tag (``{namespace}``) its data was written with.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import threading
import time

from kvconnect.connectors.base import ConfigError, MissingDependency
from kvconnect.connectors.hf3fs import protocol as P
from kvconnect.connectors.hf3fs.client import AuthError, LeasedWrites, MetadataError
from kvconnect.connectors.hf3fs.index import DEFAULT_READ_LEASE_S, DEFAULT_WRITE_LEASE_S, PUT_LOST, PUT_OK, NamespaceInfo
from kvconnect.connectors.hf3fs.ownership import new_identity
from kvconnect.connectors.hf3fs.pageid import key_digests
from kvconnect.connectors.hf3fs.redis_lua import MAX_PAGES, SCRIPTS, SUFFIXES
from kvconnect.connectors.hf3fs.redis_slots import SlotUnserved
from kvconnect.connectors.retry import AT_ONCE, RETRY, CoolOff, RetriesFailed, call_with_retries

from kvconnect.connectors.redis_url import (DEFAULT_KEY, SCHEMES, URL_FORMS, RedisURL,  # noqa: F401 - re-exported
                                            is_redis_url, parse_redis_url)

log = logging.getLogger("kvconnect.hf3fs")

KEY = DEFAULT_KEY
MAX_BATCH = 1000  # keys per script call (Lua's C stack takes ~8000 arguments)
_ENTRY = struct.Struct("<qqI")  # an index entry (and a get reply item): slot, generation, crc
_PAGE = struct.Struct("<qq")  # slot, generation
_I64 = struct.Struct("<q")
REPLICAS_TRUSTED_S = 1.0  # a replica count that satisfies WAIT is trusted this long ...
REPLICAS_RECHECK_S = 0.25  # ... one that does not is asked again after this long
REPLICA_MAX_LAG_S = 2  # a replica whose last acknowledgement is older does not count (it sends one a second)
NO_REPLICA_LOG_S = 10.0  # at most one warning about writes failed for want of replicas per this many seconds
_TRANSIENT = ("READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS", "BUSY", "CLUSTERDOWN")


@functools.lru_cache(maxsize=64)
def _entries(n: int) -> struct.Struct:
    """``n`` index entries back to back (a get reply)."""
    return struct.Struct("<" + "qqI" * n)


def _online_replicas(info: str) -> int | None:
    """Replicas that count for ``WAIT`` in an ``INFO replication`` reply (None: not a primary)."""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    if fields.get("role", "").strip() != "master":
        return None
    n = 0
    for k, v in fields.items():
        if k.startswith("slave") and k[5:].isdigit():
            kv = dict(x.split("=", 1) for x in v.strip().split(",") if "=" in x)
            if kv.get("state") == "online" and kv.get("lag", "").lstrip("-").isdigit() \
                    and int(kv["lag"]) <= REPLICA_MAX_LAG_S:
                n += 1
    return n


def _tag(ns: str) -> str:
    """``ns`` made safe inside a ``{hash tag}``."""
    return ns.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


class RedisMetadata(LeasedWrites):
    """The page index in Redis / Valkey (a server, a Sentinel-managed primary + replicas, or
    a Redis Cluster).

    Args:
        url: a ``redis[s][+sentinel]://`` or ``redis+cluster://`` URL (see the module docstring).
        password: the ACL user's password (None: no AUTH).
        timeout: seconds; the bound of one logical call including its retries.
        retries: attempts per call.
        cooldown: seconds during which calls fail fast after a call failed for good.
        wait_replicas: ``WAIT`` for this many replicas after each confirm (0: none).
        wait_timeout: seconds ``WAIT`` may take.
        key_prefix: prefix of every Redis key (several deployments can share a server).
        tls_ca_file, tls_cert_file, tls_key_file: TLS trust anchor and client certificate.
        sentinel_auth: send the user and password to the sentinels too.
        read_lease_s, write_lease_s: leases of namespaces this client creates.
        lease_ahead: slots leased ahead per namespace for writes (0: every write reserves),
            as ``RemoteMetadata``: a batch's write is then one ``put`` call.
    """

    may_serve_stale = True

    def __init__(self, url: str | RedisURL, password: str | None = None, *, timeout: float = 5.0,
                 retries: int = 3, cooldown: float = 0.25, wait_replicas: int = 0, wait_timeout: float = 0.5,
                 key_prefix: str = "kvc:hf3fs", tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None, sentinel_auth: bool = False,
                 read_lease_s: float = DEFAULT_READ_LEASE_S, write_lease_s: float = DEFAULT_WRITE_LEASE_S,
                 lease_ahead: int = 4096):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
            from redis.sentinel import Sentinel
        except ImportError as e:
            raise MissingDependency("hf3fs", "redis", e) from e
        self._redis = redis
        self.url = url if isinstance(url, RedisURL) else parse_redis_url(url)
        self.address = self.url.describe()
        self.timeout = timeout
        self.retries = max(1, retries)
        self.cooldown = cooldown
        self.wait_replicas = wait_replicas
        self.wait_timeout = wait_timeout
        self.prefix = key_prefix
        self.read_lease_ms = int(read_lease_s * 1000)
        self.write_lease_ms = int(write_lease_s * 1000)
        self._cool_off = CoolOff(cooldown)  # per hash slot on a cluster, else None
        self._lock = threading.Lock()
        self._init_leases(lease_ahead)
        self._keys: dict[str, tuple[str, ...]] = {}
        self._heads: dict[tuple, bytes] = {}  # packed EVALSHA heads (_packed)
        self._registry = f"{key_prefix}:spaces"
        self._src = {n: s.encode() for n, s in SCRIPTS.items()}
        self._sha = {n: hashlib.sha1(s).hexdigest() for n, s in self._src.items()}
        # counters (tests, usage)
        self.failed_calls = 0
        self.wait_shortfalls = 0
        self.no_replica_writes = 0  # confirms failed at once: fewer replicas attached than WAIT needs
        self.reconnects = 0
        # (replicas attached to the primary, trusted until), per hash slot on a cluster, else None
        self._replicas: dict[int | None, tuple[int, float]] = {}
        self._replicas_unknowable = False  # the ACL user may not run INFO: always WAIT
        self._no_replica_logged = -NO_REPLICA_LOG_S
        self._no_replica_unlogged = 0

        attempt = max(0.05, timeout / self.retries)
        common = {"socket_timeout": attempt + (wait_timeout if wait_replicas else 0.0),
                  "socket_connect_timeout": attempt, "retry": Retry(NoBackoff(), 0), "health_check_interval": 0,
                  "driver_info": None, "db": self.url.db,
                  "username": self.url.username, "password": password}
        if self.url.tls:
            common.update(ssl=True, ssl_ca_certs=tls_ca_file, ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file,
                          ssl_cert_reqs="required")
        self._sentinel = None
        self._slots = None
        if self.url.cluster:
            from kvconnect.connectors.hf3fs.redis_slots import SlotMap

            self._slots = SlotMap(self.url.hosts, common)
            self._r = None
        elif self.url.sentinel:
            s_timeout = max(0.05, min(0.5, attempt / 3))
            skw = {"socket_timeout": s_timeout, "socket_connect_timeout": s_timeout, "retry": Retry(NoBackoff(), 0),
                   "driver_info": None}
            if self.url.tls:
                skw.update({k: v for k, v in common.items() if k.startswith("ssl")})
            if sentinel_auth:
                skw.update(username=self.url.username, password=password)
            self._sentinel = Sentinel(list(self.url.hosts), sentinel_kwargs=skw, **common)
            self._r = self._sentinel.master_for(self.url.master, **common)
        else:
            host, port = self.url.hosts[0]
            self._r = redis.Redis(host=host, port=port, **common)

    # -- plumbing -----------------------------------------------------------------------
    def _ns_keys(self, ns: str) -> tuple[str, ...]:
        keys = self._keys.get(ns)
        if keys is None:
            # on a cluster the tag names the deployment too: each (prefix, namespace) its own slot
            tag = _tag(f"{self.prefix}/{ns}" if self._slots is not None else ns)
            base = f"{self.prefix}:{{{tag}}}:"
            keys = self._keys[ns] = tuple(base + s for s in SUFFIXES)
        return keys

    def _slot(self, route: str) -> int | None:
        """The hash slot of key ``route`` on a cluster (None: one server serves all)."""
        return None if self._slots is None else self._slots.slot(route)

    def _pool(self, route: str, deadline: float):
        if self._slots is None:
            return self._r.connection_pool
        return self._slots.pool(self._slots.slot(route), deadline)

    def _exec(self, cmds: list[tuple], deadline: float, route: str) -> list:
        """Send ``cmds`` on one pooled connection (one round trip) to the node serving key
        ``route`` and read their replies, each read bounded by ``deadline``; error replies
        come back as exception values."""
        R = self._redis.exceptions
        pool = self._pool(route, deadline)
        conn = pool.get_connection()  # connecting is bounded by the connect and Sentinel timeouts
        try:
            if len(cmds) == 1 and isinstance(cmds[0], bytes):  # packed by _packed: one send
                conn.send_packed_command([cmds[0]], check_health=False)
            elif len(cmds) == 1:
                conn.send_command(*cmds[0], check_health=False)
            else:
                conn.send_packed_command([c if isinstance(c, bytes) else b"".join(conn.pack_command(*c))
                                          for c in cmds], check_health=False)
            out = []
            for _ in cmds:
                try:
                    out.append(conn.read_response(timeout=max(0.001, deadline - time.monotonic())))
                except R.ResponseError as e:
                    out.append(e)
            return out
        except BaseException:
            conn.disconnect()  # never reuse a connection with a reply still on its way
            raise
        finally:
            pool.release(conn)

    def _packed(self, name: str, keys: tuple[str, ...], args) -> bytes:
        """``EVALSHA`` of script ``name`` in the protocol's bytes: the script's and the
        namespace's part packed once, the arguments (bytes or ints) appended (one buffer, one
        send; redis-py's packer costs about as much per call as a 128-key script's Lua)."""
        head = self._heads.get((name, keys))
        if head is None:
            head = self._heads[(name, keys)] = b"".join(
                b"$%d\r\n%s\r\n" % (len(x), x) for x in (b"EVALSHA", self._sha[name].encode(),
                                                          str(len(keys)).encode(), *(k.encode() for k in keys)))
        parts = [b"*%d\r\n" % (3 + len(keys) + len(args)), head]
        for a in args:
            a = a if isinstance(a, bytes) else str(int(a)).encode()
            parts += (b"$%d\r\n" % len(a), a, b"\r\n")
        return b"".join(parts)

    def _eval(self, name: str, keys: tuple[str, ...], args, deadline: float, wait: int = 0) -> list:
        """Run script ``name`` (loading it where the server lacks it: a new primary, a
        restarted server), then ``WAIT`` for ``wait`` replicas in the same round trip.
        Replies: [script reply] or [script reply, replicas that acknowledged]."""
        cmds = [self._packed(name, keys, args)]
        if wait:
            ms = max(1, int(min(self.wait_timeout, (deadline - time.monotonic()) * 0.8) * 1000))
            cmds.append(("WAIT", wait, ms))
        for _ in range(2):
            out = self._exec(cmds, deadline, keys[0])
            if isinstance(out[0], self._redis.exceptions.NoScriptError):
                self._exec([("SCRIPT", "LOAD", self._src[name])], deadline, keys[0])
                continue
            for r in out:
                if isinstance(r, Exception):
                    raise r
            return out
        raise MetadataError(f"redis index at {self.address}: script {name} could not be loaded")

    def _reset(self, slot: int | None = None) -> None:
        """Drop idle connections: the next attempt connects anew (asking Sentinel where the
        primary is, or the cluster which node serves ``slot``), and none is left pointing at
        a primary that was since demoted. Drop the write leases taken ahead too: a new
        primary may not know them (its copy can be behind) and may hand their slots to
        others."""
        self.reconnects += 1
        with self._lock:
            self._replicas.clear()  # another primary, perhaps: ask it how many replicas it has
            for pool in self._leases.values():
                pool.chunks.clear()
                pool.stale = ([], [])
        if self._slots is not None:
            self._slots.invalidate(slot)
            return
        try:
            self._r.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def _call(self, what: str, fn, route: str):
        """``fn(deadline)`` with retries of transient failures, all within ``timeout``
        (``connectors/retry.py``); ``route`` is a key of the call (on a cluster: whose slot
        cools off after a failure)."""
        slot = self._slot(route)
        if not self._cool_off.allow(slot):
            raise MetadataError(f"redis index at {self.address} is down (cooling off)")
        try:
            return call_with_retries(fn, attempts=self.retries, timeout=self.timeout,
                                     on_error=lambda e: self._retryable(e, what, slot))
        except RetriesFailed as failed:
            last = failed.last
        self._cool_off.trip(slot)
        with self._lock:
            self.failed_calls += 1
        raise MetadataError(f"redis index {what} at {self.address} failed: {last!r}" if last else
                            f"redis index {what} at {self.address}: no time left")

    def _retryable(self, e: Exception, what: str, slot: int | None) -> str | None:
        """What a failed try means (``call_with_retries``' ``on_error``)."""
        R = self._redis.exceptions
        if isinstance(e, (R.AuthenticationError, R.NoPermissionError, R.AuthenticationWrongNumberOfArgsError)):
            raise AuthError(f"redis index at {self.address} refused the credentials (config keys "
                            f"'metadata_server_url' (user), 'auth_token_file'): {e}") from e
        if isinstance(e, R.AskError):  # MOVED (and ASK): the slot is served elsewhere now; ask at once
            self._reset(slot)
            return AT_ONCE
        if isinstance(e, (R.ReadOnlyError, R.BusyLoadingError, R.ClusterDownError, R.TryAgainError, SlotUnserved)):
            self._reset(slot)  # a demoted primary, a server loading its data, a shard without a primary ...
            return RETRY
        if isinstance(e, R.ResponseError):
            if not str(e).startswith(_TRANSIENT):
                self.failed_calls += 1
                raise MetadataError(f"redis index {what} at {self.address}: {e}") from e
            self._reset(slot)
            return RETRY
        if isinstance(e, (R.ConnectionError, R.TimeoutError, OSError)):  # MasterNotFoundError included
            self._reset(slot)
            return RETRY
        if isinstance(e, MetadataError):
            return None
        self.failed_calls += 1  # a malformed reply is a failed call, never a crash
        raise MetadataError(f"redis index {what} at {self.address}: {e!r}") from e

    def _script(self, name: str, ns: str, args) -> object:
        keys = self._ns_keys(ns)
        return self._call(name, lambda deadline: self._eval(name, keys, args, deadline)[0], keys[0])

    def _cmds(self, what: str, cmds: list[tuple], route: str) -> list:
        """``cmds`` in one round trip to the node serving key ``route`` (every key of them
        in its slot)."""
        def run(deadline):
            out = self._exec(cmds, deadline, route)
            for r in out:
                if isinstance(r, Exception):
                    raise r
            return out

        return self._call(what, run, route)

    def connect(self) -> None:
        """One round trip (fails like any call: ``MetadataError`` / ``AuthError``)."""
        self._cmds("ping", [("PING",)], self._registry)

    def identity(self) -> str:
        """This index's identity (``ownership.py``): the value of ``{key_prefix}:id``, set by
        the first client that asks (``SET NX``; one round trip), so every client of this
        server (or Sentinel group), database and key prefix names the same index, across
        restarts and failovers. Flushing the keys makes a new index (a new identity)."""
        key = f"{self.prefix}:id"
        _, got = self._cmds("identity", [("SET", key, new_identity("redis"), "NX"), ("GET", key)], key)
        return got.decode() if isinstance(got, bytes) else str(got)

    # -- the index ------------------------------------------------------------------------
    def initialize(self, ns, num_pages, page_bytes):
        if num_pages > MAX_PAGES:
            raise ConfigError("file_size", f"{num_pages} pages of {page_bytes} bytes in one file: the Redis index "
                              f"holds at most {MAX_PAGES} pages per file (larger pages or a smaller file_size)")
        np_, pb, rl, wl = self._script("initialize", ns, (int(num_pages), int(page_bytes), self.read_lease_ms,
                                                          self.write_lease_ms))
        np_, pb = int(np_), int(pb)
        if num_pages > 0 and np_ and pb != page_bytes:
            raise ConfigError("page_bytes", f"namespace {ns!r} holds pages of {pb} bytes, not {page_bytes}: engines "
                              "sharing a file must use the same page geometry (or another file_path_prefix)")
        if np_:
            self._cmds("register", [("HSET", self._registry, ns, f"{np_} {pb}")], self._registry)
        return NamespaceInfo(ns, np_, pb, int(rl) / 1000.0, int(wl) / 1000.0)

    def reserve_call(self, ns, keys):
        if len(keys) > MAX_BATCH:
            parts = [self.reserve_call(ns, keys[i:i + MAX_BATCH]) for i in range(0, len(keys), MAX_BATCH)]
            return b"".join(p[0] for p in parts), sum((p[1] for p in parts), []), sum((p[2] for p in parts), [])
        n = len(keys)
        if not n:
            return b"", [], []
        rep = self._script("reserve", ns, (key_digests(keys),))
        return rep[:n], P.read_i64(rep, n, n), P.read_i64(rep, 9 * n, n)

    def commit_call(self, ns, keys, slots, gens, crcs, confirm):
        n = len(keys)
        if n > MAX_BATCH:
            return b"".join(self.commit_call(ns, keys[i:i + MAX_BATCH], slots[i:i + MAX_BATCH],
                                             gens[i:i + MAX_BATCH], crcs[i:i + MAX_BATCH],
                                             bytes(confirm[i:i + MAX_BATCH])) for i in range(0, n, MAX_BATCH))
        if not n:
            return b""
        confirm = bytes(confirm)
        args = (b"".join(map(_ENTRY.pack, slots, gens, crcs)), confirm, key_digests(keys))
        rep, acked = self._write("commit", ns, args, any(confirm))
        # visible on the primary, but not on enough replicas to be promised: a failed write
        return rep if acked else bytes(0 if c else o for o, c in zip(rep, confirm))

    def _write(self, name: str, ns: str, args, wait: bool) -> tuple[bytes, bool]:
        """A write script, with ``WAIT`` when asked; (reply, acknowledged by enough replicas).

        Without enough replicas attached to the primary (``_attached_replicas``) the script
        runs without ``WAIT`` and the write is reported unacknowledged at once."""
        nsk = self._ns_keys(ns)
        if not (wait and self.wait_replicas):
            return self._call(name, lambda deadline: self._eval(name, nsk, args, deadline)[0], nsk[0]), True
        slot = self._slot(nsk[0])

        def attempt(deadline):
            have = self._attached_replicas(deadline, nsk[0])
            if have is not None and have < self.wait_replicas:
                return self._eval(name, nsk, args, deadline)[0], None
            return self._eval(name, nsk, args, deadline, self.wait_replicas)

        rep, acked = self._call(name, attempt, nsk[0])
        if acked is None:
            self._note_no_replicas(slot)
            return rep, False
        if acked >= self.wait_replicas:
            return rep, True
        with self._lock:
            self.wait_shortfalls += 1
            self._replicas.pop(slot, None)  # a replica went away (or stalls): count them again before the next WAIT
        return rep, False

    def _attached_replicas(self, deadline: float, route: str) -> int | None:
        """Replicas attached to the primary serving key ``route`` and acknowledging (``INFO replication``: state
        ``online``, last acknowledgement at most ``REPLICA_MAX_LAG_S`` old), cached (see the
        module docstring); None where unknown (not a primary: the write will meet
        ``READONLY`` and reconnect; an ACL user without ``INFO``: always ``WAIT``)."""
        if self._replicas_unknowable:
            return None
        now = time.monotonic()
        slot = self._slot(route)
        known = self._replicas.get(slot)
        if known is not None and now < known[1]:
            return known[0]
        rep = self._exec([("INFO", "replication")], deadline, route)[0]
        if isinstance(rep, self._redis.exceptions.NoPermissionError):
            self._replicas_unknowable = True
            log.warning("hf3fs: redis index at %s: the ACL user may not run INFO, so writes cannot tell that no "
                        "replica is attached and WAIT for %d each time (grant +info to fail them at once)",
                        self.address, self.wait_replicas)
            return None
        if isinstance(rep, Exception):
            raise rep
        have = _online_replicas(rep.decode() if isinstance(rep, bytes) else str(rep))
        if have is None:
            return None
        with self._lock:
            self._replicas[slot] = (have, now + (REPLICAS_TRUSTED_S if have >= self.wait_replicas
                                                 else REPLICAS_RECHECK_S))
        return have

    def _note_no_replicas(self, slot: int | None) -> None:
        now = time.monotonic()
        with self._lock:
            self.no_replica_writes += 1
            self._no_replica_unlogged += 1
            if now - self._no_replica_logged < NO_REPLICA_LOG_S:
                return
            n, self._no_replica_unlogged, self._no_replica_logged = self._no_replica_unlogged, 0, now
            have = self._replicas[slot][0] if slot in self._replicas else 0
        log.warning("hf3fs: redis index at %s: the primary has %d replica(s) attached, metadata_wait_replicas "
                    "needs %d: %d write(s) failed at once since the last report (pages stay readable; the "
                    "engine recomputes them; docs/hf3fs_ha.md: a layout that keeps writing after one loss)",
                    self.address, have, self.wait_replicas, n)

    def lease(self, ns, need, extra=0, give_back=((), ())):
        rep, _ = self._write("lease", ns, (int(need), int(extra), b"".join(map(_PAGE.pack, *give_back))), False)
        wl, gen = _PAGE.unpack_from(rep)
        self._ttl = wl / 1000.0
        slots: list[int] = []
        for first, count in _PAGE.iter_unpack(memoryview(rep)[16:]):  # runs of adjacent slots
            slots += range(first, first + count)
        return slots, [gen] * len(slots)

    def put(self, ns, keys, slots, gens, crcs):
        if len(keys) > MAX_BATCH:
            return b"".join(self.put(ns, keys[i:i + MAX_BATCH], slots[i:i + MAX_BATCH], gens[i:i + MAX_BATCH],
                                     crcs[i:i + MAX_BATCH]) for i in range(0, len(keys), MAX_BATCH))
        if not keys:
            return b""
        rep, acked = self._write("put", ns, (b"".join(map(_ENTRY.pack, slots, gens, crcs)), key_digests(keys)), True)
        # stored on the primary but not on enough replicas to be promised: failed writes
        return rep if acked else bytes(PUT_LOST if s == PUT_OK else s for s in rep)

    def unlease(self, ns, slots, gens):
        if not slots:
            return b""
        return self._write("unlease", ns, (b"".join(map(_PAGE.pack, slots, gens)),), False)[0]

    def get(self, ns, keys):
        n = len(keys)
        if n > MAX_BATCH:
            parts = [self.get(ns, keys[i:i + MAX_BATCH]) for i in range(0, n, MAX_BATCH)]
            return tuple(sum((p[j] for p in parts), []) for j in range(3))
        if not n:
            return [], [], []
        rep = self._script("get", ns, (key_digests(keys),))
        t = _entries(n).unpack(rep)  # one C call; then every third item
        return list(t[0::3]), list(t[1::3]), list(t[2::3])

    def validate(self, ns, slots, gens):
        """Without the keys this index cannot tell (it maps keys, not slots): every page is
        reported changed, which the store turns into misses. The store calls
        ``validate_keys``."""
        return bytes(len(slots))

    def validate_keys(self, ns, keys, slots, gens):
        if not keys:
            return b""
        return self._script("validate", ns, (b"".join(map(_PAGE.pack, slots, gens)), key_digests(keys)))

    def exists(self, ns, keys):
        if len(keys) > MAX_BATCH:
            return b"".join(self.exists(ns, keys[i:i + MAX_BATCH]) for i in range(0, len(keys), MAX_BATCH))
        return self._script("exists", ns, (key_digests(keys),)) if keys else b""

    def delete(self, ns, keys):
        if len(keys) > MAX_BATCH:
            return b"".join(self.delete(ns, keys[i:i + MAX_BATCH]) for i in range(0, len(keys), MAX_BATCH))
        return self._script("delete", ns, (b"", key_digests(keys))) if keys else b""

    def forget(self, ns, keys, slots, gens):
        """Remove keys whose page failed its identity check, where they still map to the
        (slot, generation) that was read (a key rewritten meanwhile stays)."""
        if not keys:
            return b""
        return self._script("delete", ns, (b"".join(map(_PAGE.pack, slots, gens)), key_digests(keys)))

    def clear(self, ns, prefix=b""):
        if prefix:
            # The index keeps key digests, not keys (pageid.key_digests): a prefix cannot be
            # matched here. Refused rather than widened to the whole namespace.
            raise MetadataError("the Redis page index cannot clear by key prefix (it stores key digests); "
                                "clear the whole store, or use the kvconnect metadata service")
        return int(self._script("clear", ns, ()))

    def usage(self, ns):
        m, k, _l, f, p = self._ns_keys(ns)[:5]
        (np_, pb, ev, ex, fr, leased), keys, reserved, free = self._cmds(
            "usage", [("HMGET", m, "np", "pb", "ev", "ex", "fr", "ls"), ("HLEN", k), ("HLEN", p), ("ZCARD", f)], m)
        if np_ is None:
            return {"keys": 0, "num_pages": 0, "page_bytes": 0}
        return {"keys": max(0, keys - 1),  # less the field that keeps the hash a hash table (redis_lua.py)
                "num_pages": int(np_), "page_bytes": int(pb), "reserved": reserved, "leased": int(leased or 0),
                "evictions": int(ev), "expired": int(ex), "free": free + int(np_) - int(fr),
                "wait_shortfalls": self.wait_shortfalls, "no_replica_writes": self.no_replica_writes}

    def spaces(self, prefix):
        flat = self._cmds("spaces", [("HGETALL", self._registry)], self._registry)[0]
        out = []
        pairs = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2])  # RESP3 / RESP2
        for name, v in pairs:
            name = name.decode()
            if name.startswith(prefix):
                np_, pb = v.split()
                out.append([name, int(np_), int(pb)])
        return sorted(out)

    def close(self):
        """Give unused leased slots back (best effort, within 1 s: else they expire), close
        the connections."""
        self.timeout = min(self.timeout, 1.0)
        for ns in list(self._leases):
            self.release_leases(ns)
        if self._slots is not None:
            self._slots.close()
        else:
            try:
                self._r.close()
                self._r.connection_pool.disconnect()
            except Exception:  # noqa: BLE001 - closing
                pass
        if self._sentinel is not None:
            for s in self._sentinel.sentinels:
                try:
                    s.close()
                except Exception:  # noqa: BLE001
                    pass
