"""Prometheus metrics: every store's ``stats()`` exported the same way.

``export_store(store, **labels)`` adds a collector that reads ``store.stats()`` at scrape
time (no cost on the data path); ``serve_metrics(port)`` exposes ``/metrics`` on
127.0.0.1 unless told otherwise. Stores add their own figures through ``stats().extra``
(numbers become gauges named ``kvconnect_<store>_<name>``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_COUNTERS = {
    "exists_keys": "keys looked up",
    "exists_hits": "keys found by lookups",
    "get_pages": "pages read (requested)",
    "get_hits": "pages read successfully",
    "get_bytes": "bytes read into caller memory",
    "put_pages": "pages written (requested)",
    "put_written": "pages stored or already present",
    "put_failed": "page writes that failed",
    "put_bytes": "bytes written from caller memory",
    "deletes": "keys deleted",
    "errors": "backend errors turned into misses",
    "get_seconds": "seconds spent in reads",
    "put_seconds": "seconds spent in writes",
}
_GAUGES = {
    "keys": "keys held",
    "bytes_used": "bytes held",
    "capacity_bytes": "capacity in bytes",
    "evictions": "pages evicted (total)",
}

_lock = threading.Lock()
_exported: list[tuple[Any, dict[str, str]]] = []
_registered = False


class _StoreCollector:
    def describe(self):
        # Without describe(), REGISTRY.register() calls collect() to learn the names, and
        # export_store() registers while holding _lock, which collect() takes: a deadlock.
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with _lock:
            stores = list(_exported)
        label_names = sorted({k for _, labels in stores for k in labels} | {"store"})
        fams: dict[str, Any] = {}
        for store, labels in stores:
            if getattr(store, "closed", False):
                continue
            try:
                s = store.stats()
            except Exception:  # noqa: BLE001 - a scrape must not fail because a store did
                log.debug("stats() failed for %r", store, exc_info=True)
                continue
            values = {"store": s.store, **labels}
            lv = [str(values.get(k, "")) for k in label_names]
            for name, help_ in _COUNTERS.items():
                fam = fams.get(name) or fams.setdefault(
                    name, CounterMetricFamily(f"kvconnect_{name}", help_, labels=label_names))
                fam.add_metric(lv, float(getattr(s, name)))
            for name, help_ in _GAUGES.items():
                v = getattr(s, name)
                if v is None:
                    continue
                fam = fams.get(name) or fams.setdefault(
                    name, GaugeMetricFamily(f"kvconnect_{name}", help_, labels=label_names))
                fam.add_metric(lv, float(v))
            families = getattr(store, "metric_families", None)
            if families is not None:  # a store's own series (e.g. the peer pool's counters)
                try:
                    for fam in families(label_names, lv):
                        fams[f"own_{fam.name}_{id(store)}"] = fam
                except Exception:  # noqa: BLE001 - a scrape must not fail because a store did
                    log.debug("metric_families() failed for %r", store, exc_info=True)
            for name, v in s.extra.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    key = f"extra_{s.store}_{name}"
                    fam = fams.get(key) or fams.setdefault(
                        key, GaugeMetricFamily(f"kvconnect_{s.store}_{name}", f"{s.store} {name}",
                                               labels=label_names))
                    fam.add_metric(lv, float(v))
        yield from fams.values()


def export_store(store: Any, **labels: str) -> None:
    """Expose ``store.stats()`` on the default Prometheus registry."""
    global _registered
    with _lock:
        _exported.append((store, {k: str(v) for k, v in labels.items()}))
        if not _registered:
            from prometheus_client import REGISTRY

            REGISTRY.register(_StoreCollector())
            _registered = True


def unexport_store(store: Any) -> None:
    with _lock:
        _exported[:] = [(s, l) for s, l in _exported if s is not store]


_servers: dict[tuple[str, int], Any] = {}


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Start (once per address) an HTTP ``/metrics`` endpoint; returns the bound port."""
    from prometheus_client import start_http_server

    with _lock:
        if (host, port) in _servers and port:
            return port
        server, _thread = start_http_server(port, addr=host)
        bound = server.server_address[1]
        _servers[(host, bound)] = server
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
