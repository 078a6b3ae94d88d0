"""Prometheus metrics: every store's figures exported the same way (docs/metrics.md).

``export_store(store, **labels)`` adds a collector that reads ``store.stats()`` at scrape
time (no cost on the data path); ``serve_metrics(port, host)`` exposes ``/metrics`` on
127.0.0.1 unless told otherwise. Every series carries ``store``, ``engine``, ``pool``,
``tp_rank`` and ``pp_rank`` (from the store's ``EngineContext``) plus any label the caller
adds. A store's own figures (``stats().extra``) become ``<metric_prefix>_<name>_total``
counters when named in its ``metric_counters``, gauges otherwise.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from typing import Any

from kvconnect.connectors.base import LATENCY_BUCKETS, MISS_CAUSES

log = logging.getLogger(__name__)

BASE_LABELS = ("store", "engine", "pool", "tp_rank", "pp_rank")

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
_USAGE = {  # StoreStats field -> (name, help, type)
    "keys": ("kvconnect_store_keys", "keys held", "gauge"),
    "bytes_used": ("kvconnect_store_used_bytes", "bytes held", "gauge"),
    "capacity_bytes": ("kvconnect_store_capacity_bytes", "capacity in bytes", "gauge"),
    "evictions": ("kvconnect_store_evictions_total", "pages evicted", "counter"),
}

_lock = threading.Lock()
_exported: list[tuple[Any, dict[str, str]]] = []
_registered = False


def store_labels(store: Any, labels: dict[str, str]) -> dict[str, str]:
    ctx = getattr(store, "context", None)
    out = {"store": store.name, "engine": getattr(ctx, "engine", "") or "", "pool": getattr(ctx, "pool", "") or "",
           "tp_rank": str(getattr(ctx, "tp_rank", "")), "pp_rank": str(getattr(ctx, "pp_rank", ""))}
    if ctx is None:
        out["tp_rank"] = out["pp_rank"] = ""
    out.update(labels)
    return out


class _Families:
    """Metric families of one scrape, created on first use, with one label set for all."""

    def __init__(self, label_names: list[str]):
        self.label_names = label_names
        self.fams: dict[str, Any] = {}

    def add(self, kind: str, name: str, help_: str, labels: dict[str, str], value: Any, extra: tuple = ()) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[kind]
        names = self.label_names + [k for k, _ in extra]
        fam = self.fams.get(name)
        if fam is None:
            fam = self.fams[name] = cls(name, help_, labels=names)
        lv = [labels.get(k, "") for k in self.label_names] + [v for _, v in extra]
        if kind == "histogram":
            buckets, total = value
            fam.add_metric(lv, buckets, total)
        else:
            fam.add_metric(lv, float(value))


def _histogram(counts: list[int]) -> list[tuple[str, float]]:
    out, acc = [], 0
    for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts):
        acc += n
        out.append((bound, float(acc)))
    return out


def _store_series(f: _Families, store: Any, s: Any, labels: dict[str, str]) -> None:
    f.add("gauge", "kvconnect_store_up", "1 while the store's backend answers, 0 when down or closed",
          labels, 1 if s.up else 0)
    for op, hits in (("exists", s.exists_hits), ("get", s.get_hits)):
        f.add("counter", "kvconnect_store_hits", "keys found (exists) or pages read (get)", labels, hits,
              (("op", op),))
        by = s.misses.get(op, {})
        for cause in MISS_CAUSES:
            f.add("counter", "kvconnect_store_misses", "keys that missed, by cause", labels, by.get(cause, 0),
                  (("op", op), ("cause", cause)))
    for op, counts in sorted(s.latency.items()):
        f.add("histogram", "kvconnect_store_latency_seconds", "store call latency (one batch)", labels,
              (_histogram(counts), s.latency_sum.get(op, 0.0)), (("op", op),))
    for name, help_ in _COUNTERS.items():
        f.add("counter", f"kvconnect_{name}", help_, labels, getattr(s, name))
    for field_, (name, help_, kind) in _USAGE.items():
        v = getattr(s, field_)
        if v is not None:
            f.add(kind, name, help_, labels, v)
    prefix = getattr(store, "metric_prefix", "") or f"kvconnect_{s.store}"
    counters = getattr(store, "metric_counters", frozenset())
    for name, v in s.extra.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if name in counters:
                f.add("counter", f"{prefix}_{name}", f"{s.store} {name}", labels, v)
            else:
                f.add("gauge", f"{prefix}_{name}", f"{s.store} {name}", labels, v)


class _StoreCollector:
    def describe(self):
        # Without describe(), REGISTRY.register() calls collect() to learn the names, and
        # export_store() registers while holding _lock, which collect() takes: a deadlock.
        return []

    def collect(self):
        with _lock:
            stores = list(_exported)
        label_names = list(BASE_LABELS) + sorted({k for _, ls in stores for k in ls} - set(BASE_LABELS))
        f = _Families(label_names)
        for store, labels in stores:
            s = None
            if not getattr(store, "closed", False):
                try:
                    s = store.stats()
                except Exception:  # noqa: BLE001 - a scrape must not fail because a store did
                    log.debug("stats() failed for %r", store, exc_info=True)
            if s is None:
                f.add("gauge", "kvconnect_store_up", "1 while the store's backend answers, 0 when down or closed",
                      labels, 0)
                continue
            _store_series(f, store, s, labels)
        yield from f.fams.values()


def export_store(store: Any, **labels: str) -> None:
    """Expose ``store.stats()`` on the default Prometheus registry."""
    global _registered
    with _lock:
        _exported.append((store, store_labels(store, {k: str(v) for k, v in labels.items()})))
        if not _registered:
            from prometheus_client import REGISTRY

            REGISTRY.register(_StoreCollector())
            _registered = True


def unexport_store(store: Any) -> None:
    with _lock:
        _exported[:] = [(s, l) for s, l in _exported if s is not store]


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, what: str) -> None:
    """One WARNING when an unauthenticated endpoint binds beyond loopback."""
    if not is_loopback(host):
        log.warning("kvconnect: %s binds %s, beyond loopback: it has no authentication, anyone who reaches "
                    "that address can read it", what, host)


_servers: dict[tuple[str, int], Any] = {}


_histograms: dict[str, Any] = {}


def process_histogram(name: str, help_: str) -> Any:
    """One process-wide Prometheus histogram on the default registry (``LATENCY_BUCKETS``),
    created on first use: an engine process that attaches a backend again reuses it."""
    from prometheus_client import Histogram

    with _lock:
        if name not in _histograms:
            _histograms[name] = Histogram(name, help_, buckets=LATENCY_BUCKETS)
        return _histograms[name]


_counters: dict[str, Any] = {}


def process_counter(name: str, help_: str) -> Any:
    """One process-wide Prometheus counter on the default registry (``name`` without its
    ``_total`` suffix, which the client adds), created on first use like ``process_histogram``."""
    from prometheus_client import Counter

    with _lock:
        if name not in _counters:
            _counters[name] = Counter(name, help_)
        return _counters[name]


def serve_metrics(port: int, host: str = "127.0.0.1", registry: Any = None) -> int:
    """Start (once per address) an HTTP ``/metrics`` endpoint; returns the bound port."""
    from prometheus_client import REGISTRY, start_http_server

    warn_if_exposed(host, "the /metrics endpoint")
    with _lock:
        if (host, port) in _servers and port:
            return port
        server, _thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
        bound = server.server_address[1]
        _servers[(host, bound)] = server
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


def stop_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Close an endpoint ``serve_metrics`` started (a service stopping inside a longer-lived process)."""
    with _lock:
        server = _servers.pop((host, port), None)
    if server is not None:
        server.shutdown()
        server.server_close()
