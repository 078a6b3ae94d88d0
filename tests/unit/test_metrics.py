"""Prometheus metrics: one shape for every store (types, labels, misses by cause, latency
histograms, health), the metrics host setting, and the metadata service's own /metrics and
gRPC health check. Scraped from the real registry / a real HTTP endpoint, values checked."""

from __future__ import annotations

import ctypes
import logging
import urllib.request
import uuid

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvconnect.connectors import metrics  # noqa: E402
from kvconnect.connectors.base import MISS_CAUSES, ConfigError  # noqa: E402
from kvconnect.connectors.context import EngineContext  # noqa: E402
from kvconnect.connectors.engines.common import serve_store_metrics, split_engine_options  # noqa: E402
from kvconnect.connectors.memory import MemoryStore, MemoryStoreConfig  # noqa: E402

PAGE = 64


def scrape(text: str | None = None, **match: str) -> dict:
    """{(family name, type): [(sample name, labels, value)]} of the samples whose labels include ``match``."""
    out: dict = {}
    for fam in text_string_to_metric_families(text if text is not None else generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if all(s.labels.get(k) == v for k, v in match.items()):
                out.setdefault((fam.name, fam.type), []).append((s.name, s.labels, s.value))
    return out


def value(fams: dict, name: str, kind: str, sample: str | None = None, **labels: str) -> float:
    hits = [v for n, ls, v in fams[(name, kind)]
            if n == (sample or name) and all(ls.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, fams.get((name, kind)))
    return hits[0]


class Pages:
    def __init__(self, n: int, size: int = PAGE):
        self.size = size
        self.buf = ctypes.create_string_buffer(n * size)
        self.base = ctypes.addressof(self.buf)

    def page(self, i: int, size: int | None = None):
        return [(self.base + i * self.size, size or self.size)]


@pytest.fixture
def engine_label():
    return f"test-{uuid.uuid4().hex[:8]}"


def test_store_series_types_labels_and_miss_causes(engine_label):
    ctx = EngineContext(engine="sglang-hicache", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    store = MemoryStore(MemoryStoreConfig(capacity=3 * PAGE), ctx)
    metrics.export_store(store, engine=engine_label)
    try:
        src = Pages(4)
        ctypes.memmove(src.base, bytes(range(256)), 4 * PAGE)
        assert store.put_from([f"k{i}" for i in range(4)], [src.page(i) for i in range(4)]) == [True] * 4  # k0 evicted
        dst = Pages(4)
        got = store.get_into(["k0", "k1", "nope", "k2"],
                             [dst.page(0), dst.page(1), dst.page(2), dst.page(3, PAGE // 2)])
        assert got == [False, True, False, False]
        assert dst.buf.raw[PAGE:2 * PAGE] == bytes(range(256))[PAGE:2 * PAGE]
        assert store.exists(["k1", "k3", "gone"]) == [True, True, False]

        f = scrape(engine=engine_label)
        labels = {"store": "memory", "engine": engine_label, "pool": "kv", "tp_rank": "1", "pp_rank": "1"}
        ((_, ls, up),) = f[("kvconnect_store_up", "gauge")]
        assert up == 1 and ls == labels  # separate rank labels, no combined one
        by_cause = {c: value(f, "kvconnect_store_misses", "counter", "kvconnect_store_misses_total", op="get", cause=c)
                    for c in MISS_CAUSES}
        assert by_cause == {"not_found": 1, "evicted": 1, "deadline": 0, "corrupt": 0, "unavailable": 0,
                            "mismatch": 1}
        assert value(f, "kvconnect_store_misses", "counter", "kvconnect_store_misses_total", op="exists",
                     cause="not_found") == 1
        assert value(f, "kvconnect_store_hits", "counter", "kvconnect_store_hits_total", op="get") == 1
        assert value(f, "kvconnect_store_hits", "counter", "kvconnect_store_hits_total", op="exists") == 2
        assert value(f, "kvconnect_store_latency_seconds", "histogram", "kvconnect_store_latency_seconds_count",
                     op="get") == 1
        assert value(f, "kvconnect_store_latency_seconds", "histogram", "kvconnect_store_latency_seconds_bucket",
                     op="put", le="+Inf") == 1
        assert value(f, "kvconnect_store_capacity_bytes", "gauge") == 3 * PAGE
        assert value(f, "kvconnect_store_used_bytes", "gauge") == 3 * PAGE
        assert value(f, "kvconnect_store_keys", "gauge") == 3
        assert value(f, "kvconnect_store_evictions", "counter", "kvconnect_store_evictions_total") == 1
        assert value(f, "kvconnect_get_hits", "counter", "kvconnect_get_hits_total") == 1
        assert not [k for k in f if k[1] in ("summary", "untyped")], f.keys()
    finally:
        store.close()
        metrics.unexport_store(store)


class _FlakyBackend(MemoryStore):
    """A memory store whose backend can be 'down': every key then misses as unavailable."""

    down = False

    def _get_into(self, keys, pages):
        if self.down:
            self._miss("unavailable")
            return [False] * len(keys)
        return super()._get_into(keys, pages)


def test_unavailable_misses_mark_the_store_down_until_a_clean_call(engine_label):
    store = _FlakyBackend(MemoryStoreConfig(capacity=1 << 20))
    metrics.export_store(store, engine=engine_label)
    try:
        p = Pages(2)
        store.put_from(["a"], [p.page(0)])
        store.down = True
        assert store.get_into(["a", "b"], [p.page(0), p.page(1)]) == [False, False]
        f = scrape(engine=engine_label)
        assert value(f, "kvconnect_store_up", "gauge") == 0
        assert value(f, "kvconnect_store_misses", "counter", "kvconnect_store_misses_total", op="get",
                     cause="unavailable") == 2
        store.down = False
        assert store.get_into(["a", "b"], [p.page(0), p.page(1)]) == [True, False]
        f = scrape(engine=engine_label)
        assert value(f, "kvconnect_store_up", "gauge") == 1
        assert value(f, "kvconnect_store_misses", "counter", "kvconnect_store_misses_total", op="get",
                     cause="not_found") == 1
        with pytest.raises(ValueError, match="not_found, evicted, deadline, corrupt, unavailable, mismatch"):
            store._miss("bogus")
        store.close()
        assert value(scrape(engine=engine_label), "kvconnect_store_up", "gauge") == 0  # closed: down
    finally:
        metrics.unexport_store(store)


def test_metrics_host_option_and_the_warning_beyond_loopback(caplog):
    eo = split_engine_options({"store": "memory", "metrics_port": 0, "metrics_host": "10.1.2.3"}, where="t")
    assert (eo.metrics_port, eo.metrics_host) == (0, "10.1.2.3") and "metrics_host" not in eo.store_options
    assert split_engine_options({"store": "memory", "metrics_bind_host": "10.1.2.4"}, where="t").metrics_host == \
        "10.1.2.4"  # the older spelling
    assert split_engine_options({"store": "memory"}, where="t").metrics_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="metrics_host"):
        split_engine_options({"store": "memory", "metrics_host": "a", "metrics_bind_host": "b"}, where="t")

    store = MemoryStore()
    try:
        caplog.set_level(logging.WARNING, logger="kvconnect")
        # 192.0.2.1 (TEST-NET-1) is on no interface here: the warning comes first, then binding fails
        # (logged, not raised: metrics never stop an engine), so no listener leaves loopback
        assert serve_store_metrics(store, 0, "192.0.2.1") is None
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "192.0.2.1" in r.getMessage()]
        assert len(warned) == 1 and "no authentication" in warned[0].getMessage()
        caplog.clear()
        port = serve_store_metrics(store, 0, "127.0.0.1")
        assert port and not [r for r in caplog.records if r.levelno >= logging.WARNING]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "# TYPE kvconnect_store_up gauge" in body
        metrics.stop_metrics(port)
    finally:
        store.close()
        metrics.unexport_store(store)


def test_metadata_service_metrics_and_grpc_health(tmp_path):
    pytest.importorskip("grpc")
    from kvconnect.connectors import grpc_health
    from kvconnect.connectors.hf3fs import protocol as P
    from kvconnect.connectors.hf3fs.client import RemoteMetadata
    from kvconnect.connectors.hf3fs.service import MetaServer

    srv = MetaServer("127.0.0.1", 0, str(tmp_path / "meta"), token="s3cret", fsync="never", metrics_port=0).start()
    try:
        # the standard health check, hand-encoded on the wire, needs no token
        assert grpc_health.check(srv.address) == grpc_health.SERVING
        assert grpc_health.check(srv.address, P.SERVICE) == grpc_health.SERVING
        import grpc

        with pytest.raises(grpc.RpcError) as e:
            grpc_health.check(srv.address, "no.such.Service")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

        c = RemoteMetadata(srv.address, "s3cret")
        c.connect()
        try:
            c.initialize("0:kv", 32, 4096)
            c.initialize("1:kv", 16, 4096)
            status, slots, gens = c.reserve("0:kv", [b"a", b"b", b"c"])
            c.commit("0:kv", [b"a", b"b", b"c"], slots, gens, [0, 0, 0], b"\x01\x01\x01")
            for _ in range(3):
                assert c.exists("0:kv", [b"a", b"zz"]) == b"\x01\x00"
            body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
            f = scrape(body)
            assert value(f, "kvconnect_meta_requests", "counter", "kvconnect_meta_requests_total",
                         method="Exists", code="OK") == 3
            assert value(f, "kvconnect_meta_request_seconds", "histogram", "kvconnect_meta_request_seconds_count",
                         method="Exists") == 3
            assert value(f, "kvconnect_meta_keys", "gauge") == 3
            assert value(f, "kvconnect_meta_namespaces", "gauge") == 2
            assert value(f, "kvconnect_meta_connections", "gauge", transport="tcp") == 1
        finally:
            c.close()
    finally:
        srv.stop(0)


def test_one_start_up_line_per_store_in_the_kvconnect_log(caplog):
    from kvconnect.connectors.registry import create_store

    caplog.set_level(logging.INFO, logger="kvconnect")
    store = create_store("memory", {"capacity": 4096}, context=EngineContext(engine="lmcache", pool="kv"))
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "kvconnect" and r.levelno == logging.INFO]
        assert lines == ["kvconnect memory: this process's memory, 4096 bytes (LRU), shared with no other process; "
                         "for lmcache  [kv] tp0/1 (per-rank) on cpu"], lines
    finally:
        store.close()


def test_the_documented_peercache_relabel_rules_give_peercache_names():
    """docs/metrics.md's metric_relabel_configs, applied as Prometheus does (anchored regex,
    ${1} replacement) to every peer pool series: each rule matches something, and every name
    it produces is one PeerCache exports."""
    import re
    from pathlib import Path

    from kvconnect.connectors.peer_rdma.counters import COUNTERS, DISK_COUNTERS, GAUGES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    block = doc[doc.index("metric_relabel_configs:"):]
    rules = re.findall(r"regex: (\S+)\n\s+target_label: __name__\n\s+replacement: (\S+)", block)
    assert len(rules) == 3, rules
    ours = [f"kvconnect_peer_{n}_total" for n in COUNTERS + DISK_COUNTERS] + [f"kvconnect_peer_{n}" for n in GAUGES]
    peercache_counters = ("read_requests", "read_hits", "read_misses", "read_local_hits", "read_remote_hits",
                          "read_disk_hits", "write_requests", "bytes_read", "bytes_written", "evictions",
                          "disk_writes", "disk_bytes_written", "disk_evictions", "promotes", "read_failures",
                          "directory_republishes", "directory_lookups_saved", "exists_requests", "exists_pages_found")
    try:  # the installed PeerCache's own list, where it is installed
        from peercache.metrics import _COUNTERS as peercache_counters  # type: ignore[no-redef]
    except ImportError:
        pass
    theirs = {f"peercache_{n}_total" for n in peercache_counters} | {
        f"peercache_{n}" for n in ("pool_bytes_used", "pool_capacity_bytes", "pool_keys", "members",
                                   "disk_bytes_used", "disk_keys")}
    renamed = {}
    for regex, replacement in rules:
        hits = [n for n in ours if re.fullmatch(regex, n)]
        assert hits, regex
        for n in hits:
            renamed[n] = re.fullmatch(regex, n).expand(replacement.replace("${1}", r"\1"))
    assert set(renamed.values()) <= theirs, sorted(set(renamed.values()) - theirs)
    assert renamed["kvconnect_peer_exists_hits_total"] == "peercache_exists_pages_found_total"
    assert renamed["kvconnect_peer_read_hits_total"] == "peercache_read_hits_total"
    assert len(renamed) == 23, sorted(renamed)
