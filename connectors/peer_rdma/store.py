"""``peer_rdma``: the peer memory pool as a ``PageStore`` (one embedded node per store)."""

from __future__ import annotations

import logging
import threading
import time

from kvconnect.connectors.base import Capability, Page, PageStore, StoreUsage
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.peer_rdma.config import PeerRdmaConfig
from kvconnect.connectors.peer_rdma.counters import COUNTERS, DISK_COUNTERS, MEMBERSHIP_COUNTERS

log = logging.getLogger(__name__)



class PeerRdmaStore(PageStore):
    """Pages in a peer-to-peer pool of lent host memory; one-sided reads through Mooncake TE.

    Every store embeds a pool node (see ``kvconnect.connectors.peer_rdma.node``). Options: see
    ``PeerRdmaConfig`` (``kvconnect stores peer_rdma``).
    """

    name = "peer_rdma"
    config_class = PeerRdmaConfig
    # pages live in the lending nodes' memory: shared while they run, gone with them
    # registered pages are read in place; others via a bounce buffer
    capabilities = frozenset({Capability.SHARED, Capability.ZERO_COPY, Capability.ANY_PAGE_SIZE,
                              Capability.NEEDS_REGISTERED_MEMORY})
    # Prometheus: the node's counters are kvconnect_peer_<name>_total, its gauges kvconnect_peer_<name>
    metric_prefix = "kvconnect_peer"
    metric_counters = frozenset(COUNTERS + DISK_COUNTERS + MEMBERSHIP_COUNTERS)

    def __init__(self, config: PeerRdmaConfig | None = None, context: EngineContext | None = None):
        super().__init__(context)
        from kvconnect.connectors.peer_rdma.node import PeerNode

        self.config = config or PeerRdmaConfig()
        self.node = PeerNode(self.config)
        self._pool_lock = threading.Lock()
        self._pool_snap: tuple[float, dict] | None = None

    # -- primitives ------------------------------------------------------------------
    def _exists(self, keys: list[str]) -> list[bool]:
        return self._guard("exists", keys, lambda: self.node.exists(keys))

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        why: dict[int, str] = {}
        out = self._guard("get_into", keys, lambda: self.node.get_into(keys, pages, why))
        causes: dict[str, int] = {}
        for i, cause in why.items():
            if not out[i]:
                causes[cause] = causes.get(cause, 0) + 1
        for cause, n in causes.items():
            self._miss(cause, n)
        return out

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        try:
            return self._guard("put_from", keys, lambda: self.node.put_from(keys, pages))
        finally:
            self._drop_pool_usage()

    def _delete(self, keys: list[str]) -> list[bool]:
        try:
            return self._guard("delete", keys, lambda: self.node.delete(keys))
        finally:
            self._drop_pool_usage()

    def _clear(self) -> None:
        self.node.clear()
        self._drop_pool_usage()

    def _clear_prefix(self, prefix: str) -> None:
        self.node.clear(prefix)
        self._drop_pool_usage()

    def _register_memory(self, address: int, nbytes: int) -> None:
        self.node.register_memory(address, nbytes)

    def _guard(self, op: str, keys: list[str], fn) -> list[bool]:
        """A backend error is a miss / failed write, never an exception into engine threads."""
        try:
            return fn()
        except Exception:  # noqa: BLE001
            log.exception("peer_rdma %s failed; reporting %d misses", op, len(keys))
            self.record_error()
            self._miss("unavailable")
            return [False] * len(keys)

    def describe(self) -> str:
        n, c = self.node, self.config
        asked = "" if n.transport.protocol == c.protocol else f" (asked for {c.protocol})"
        return (f"node {n.node_id}, peers via {', '.join(c.seeds)} ({len(n.view.members)} members), auth "
                f"{'on' if c.token else 'off'}, transport {n.transport.protocol}{asked}, lends {c.global_segment_size} "
                f"bytes")

    def _usage(self) -> StoreUsage:
        """Keys, used and capacity bytes of the whole pool (every live member's lent segment,
        ``PeerNode.pool_usage``, asked at most once per ``pool_usage_interval``; 0: this node's
        segment only); this node's own figures stay in ``extra`` (``pool_bytes_used``,
        ``pool_capacity_bytes``: its segment)."""
        m = self.node.metrics()
        extra = {k: v for k, v in m.items() if k != "latency"}
        extra["node_id"] = self.node.node_id
        extra["latency"] = m["latency"]
        if self.config.pool_usage_interval <= 0:
            return StoreUsage(keys=m["pool_keys"], bytes_used=m["pool_bytes_used"],
                              capacity_bytes=m["pool_capacity_bytes"], evictions=m["evictions"], extra=extra)
        pool = self._pool_usage()
        extra["pool_members_unanswered"] = len(pool["unanswered"])
        return StoreUsage(keys=pool["keys"], bytes_used=pool["bytes_used"], capacity_bytes=pool["capacity_bytes"],
                          evictions=m["evictions"], extra=extra)

    def _pool_usage(self) -> dict:
        now = time.monotonic()
        with self._pool_lock:
            if self._pool_snap is not None and now - self._pool_snap[0] < self.config.pool_usage_interval:
                return self._pool_snap[1]
        pool = self.node.pool_usage()
        with self._pool_lock:
            self._pool_snap = (time.monotonic(), pool)
        return pool

    def _drop_pool_usage(self) -> None:
        with self._pool_lock:
            self._pool_snap = None

    def _close(self) -> None:
        from kvconnect.connectors.metrics import unexport_store

        unexport_store(self)
        self.node.close()

    @property
    def node_id(self) -> str:
        return self.node.node_id
