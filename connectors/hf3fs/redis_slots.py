"""Which Redis Cluster node serves which hash slot, for the page index (``redis_index.py``).

The index sends every command of a call to one slot (a namespace's keys share one hash
tag), on one pooled connection, in one round trip; it needs no more of a cluster client
than this map: ``CLUSTER SLOTS`` asked of any node that answers (the URL's seeds, then the
nodes last seen), one ``redis.Redis`` connection pool per primary. The map is marked stale
after a ``MOVED`` reply, a lost connection or ``CLUSTERDOWN`` (``invalidate``) and asked
again before the next command, so a failover is followed within the caller's retries; a slot
no live node claims raises ``SlotUnserved`` (a transient error for the caller), never a
command sent to a guess. ``ASK`` (a slot being migrated by a resharding) is handled as
``MOVED``: the map is asked again, and a namespace whose slot is mid-migration misses until the
migration completes (its multi-key scripts could not run on either side meanwhile).
"""

from __future__ import annotations

import random
import threading
import time

SLOTS = 16384


class SlotUnserved(Exception):
    """No node claims the slot (the cluster is forming, or its shard lost its primary)."""


class SlotMap:
    """Hash slot -> primary address and its connection pool, learned from ``CLUSTER SLOTS``.

    Args:
        seeds: ``(host, port)`` of the URL: asked when no known node answers.
        client_kwargs: keyword arguments of every node's ``redis.Redis`` (timeouts,
            credentials, TLS); ``db`` is always 0 (a cluster has one database).
    """

    def __init__(self, seeds, client_kwargs: dict):
        import redis
        from redis.crc import key_slot

        self._redis = redis
        self._key_slot = key_slot
        self._seeds = list(seeds)
        self._kw = {**client_kwargs, "db": 0}
        self._owner: list[tuple[str, int] | None] = [None] * SLOTS
        self._clients: dict[tuple[str, int], object] = {}
        self._slot_of: dict[str, int] = {}
        self._stale = True
        self._lock = threading.RLock()  # refresh holds it while creating clients
        self.refreshes = 0

    def slot(self, key: str) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._slot_of[key] = self._key_slot(key.encode())
        return slot

    def pool(self, slot: int, deadline: float):
        """The connection pool of the primary serving ``slot`` (the map asked again first
        where stale): ``SlotUnserved``, or a ``redis`` connection / timeout error when no
        node answers before ``deadline``."""
        if self._stale:
            self.refresh(deadline)
        addr = self._owner[slot]
        if addr is None:
            self._stale = True
            raise SlotUnserved(f"no primary serves hash slot {slot}")
        return self._client(addr).connection_pool

    def owner(self, slot: int) -> tuple[str, int] | None:
        return self._owner[slot]

    def _client(self, addr: tuple[str, int]):
        c = self._clients.get(addr)
        if c is None:
            with self._lock:
                c = self._clients.get(addr)
                if c is None:
                    c = self._clients[addr] = self._redis.Redis(host=addr[0], port=addr[1], **self._kw)
        return c

    def refresh(self, deadline: float) -> None:
        """Ask ``CLUSTER SLOTS`` of the nodes last seen (in random order), then the seeds,
        until one answers; the first answer replaces the map."""
        with self._lock:
            if not self._stale:
                return  # another thread refreshed it meanwhile
            known = list({a for a in self._owner if a is not None})
            random.shuffle(known)
            last: Exception | None = None
            for addr in known + [s for s in self._seeds if s not in known]:
                if time.monotonic() >= deadline:
                    break
                try:
                    rows = self._ask(addr, deadline)
                except (self._redis.exceptions.RedisError, OSError) as e:
                    last = e
                    continue
                owner: list[tuple[str, int] | None] = [None] * SLOTS
                for row in rows:
                    host = row[2][0].decode() if isinstance(row[2][0], bytes) else str(row[2][0])
                    # an empty host: the node does not know its own address; it is the one asked
                    primary = (host or addr[0], int(row[2][1]))
                    owner[int(row[0]):int(row[1]) + 1] = [primary] * (int(row[1]) - int(row[0]) + 1)
                self._owner = owner
                self._stale = False
                self.refreshes += 1
                return
        if last is not None:
            raise last
        raise self._redis.exceptions.TimeoutError("no time left to ask the cluster for its slots")

    def _ask(self, addr: tuple[str, int], deadline: float) -> list:
        pool = self._client(addr).connection_pool
        conn = pool.get_connection()
        try:
            conn.send_command("CLUSTER", "SLOTS", check_health=False)
            rep = conn.read_response(timeout=max(0.001, deadline - time.monotonic()))
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        if isinstance(rep, Exception):
            raise rep
        return rep

    def invalidate(self, slot: int | None = None) -> None:
        """Ask the cluster again before the next command; drop the idle connections to
        ``slot``'s node (a node that died or was demoted)."""
        self._stale = True
        addr = self._owner[slot] if slot is not None else None
        if addr is not None and addr in self._clients:
            try:
                self._clients[addr].connection_pool.disconnect(inuse_connections=False)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def close(self) -> None:
        for c in list(self._clients.values()):
            try:
                c.close()
                c.connection_pool.disconnect()
            except Exception:  # noqa: BLE001 - closing
                pass
        self._clients.clear()
