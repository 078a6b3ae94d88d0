"""``peer_rdma``: the peer memory pool as a ``PageStore`` (one embedded node per store)."""

from __future__ import annotations

import logging
from typing import Any

from kvconnect.connectors.base import Capability, Page, PageStore, StoreUsage
from kvconnect.connectors.peer_rdma.config import PeerRdmaConfig
from kvconnect.connectors.peer_rdma.counters import COUNTERS, DISK_COUNTERS, GAUGES

log = logging.getLogger(__name__)

# Prometheus: the node's counters (``kvconnect_peer_<name>_total``) and gauges (``kvconnect_peer_<name>``)
PROM_COUNTERS = COUNTERS + DISK_COUNTERS
PROM_GAUGES = GAUGES


class PeerRdmaStore(PageStore):
    """Pages in a peer-to-peer pool of lent host memory; one-sided reads through Mooncake TE.

    Every store embeds a pool node (see ``kvconnect.connectors.peer_rdma.node``). Options: see
    ``PeerRdmaConfig`` (``kvconnect stores peer_rdma``).
    """

    name = "peer_rdma"
    config_class = PeerRdmaConfig
    # pages live in the lending nodes' memory: shared while they run, gone with them
    capabilities = frozenset({Capability.SHARED, Capability.ZERO_COPY, Capability.ANY_PAGE_SIZE})
    needs_registered_memory = True  # registered pages are read in place; others via a bounce buffer

    def __init__(self, config: PeerRdmaConfig | None = None, context: Any = None):
        super().__init__(context)
        from kvconnect.connectors.peer_rdma.node import PeerNode

        self.config = config or PeerRdmaConfig()
        self.node = PeerNode(self.config)

    # -- primitives ------------------------------------------------------------------
    def _exists(self, keys: list[str]) -> list[bool]:
        return self._guard("exists", keys, lambda: self.node.exists(keys))

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self._guard("get_into", keys, lambda: self.node.get_into(keys, pages))

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self._guard("put_from", keys, lambda: self.node.put_from(keys, pages))

    def _delete(self, keys: list[str]) -> list[bool]:
        return self._guard("delete", keys, lambda: self.node.delete(keys))

    def _clear(self) -> None:
        self.node.clear()

    def _clear_prefix(self, prefix: str) -> None:
        self.node.clear(prefix)

    def _register_memory(self, address: int, nbytes: int) -> None:
        self.node.register_memory(address, nbytes)

    def _guard(self, op: str, keys: list[str], fn) -> list[bool]:
        """A backend error is a miss / failed write, never an exception into engine threads."""
        try:
            return fn()
        except Exception:  # noqa: BLE001
            log.exception("peer_rdma %s failed; reporting %d misses", op, len(keys))
            self.record_error()
            return [False] * len(keys)

    def _usage(self) -> StoreUsage:
        m = self.node.metrics()
        extra = {k: v for k, v in m.items() if k != "latency"}
        extra["node_id"] = self.node.node_id
        extra["latency"] = m["latency"]
        return StoreUsage(keys=m["pool_keys"], bytes_used=m["pool_bytes_used"],
                          capacity_bytes=m["pool_capacity_bytes"], evictions=m["evictions"], extra=extra)

    def metric_families(self, label_names: list[str], label_values: list[str]):
        """Peer-pool series for ``kvconnect.connectors.metrics`` (counters, gauges, latency quantiles)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

        m = self.node.metrics()
        for name in PROM_COUNTERS:
            if name in m:
                f = CounterMetricFamily(f"kvconnect_peer_{name}", f"peer pool {name}", labels=label_names)
                f.add_metric(label_values, float(m[name]))
                yield f
        for name in PROM_GAUGES:
            if name in m:
                f = GaugeMetricFamily(f"kvconnect_peer_{name}", f"peer pool {name}", labels=label_names)
                f.add_metric(label_values, float(m[name]))
                yield f
        # a summary with quantiles over the most recent calls (like PeerCache's op_latency_seconds)
        lat = Metric("kvconnect_peer_op_latency_seconds", "peer pool operation latency", "summary")
        base = dict(zip(label_names, label_values))
        for op, v in m["latency"].items():
            for qn in ("0.5", "0.9", "0.99"):
                lat.add_sample("kvconnect_peer_op_latency_seconds", {**base, "op": op, "quantile": qn}, v[qn])
            lat.add_sample("kvconnect_peer_op_latency_seconds_count", {**base, "op": op}, v["count"])
            lat.add_sample("kvconnect_peer_op_latency_seconds_sum", {**base, "op": op}, v["sum"])
        yield lat

    def _close(self) -> None:
        from kvconnect.connectors.metrics import unexport_store

        unexport_store(self)
        self.node.close()

    @property
    def node_id(self) -> str:
        return self.node.node_id
