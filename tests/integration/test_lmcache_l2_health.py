"""``backend_ok`` of the LMCache L2 plugin, as an operator sees it: a real ``lmcache server``
over a store that a file turns bad and good again (``FaultyStore``'s ``fault_flag``), read
through the plugin's Prometheus ``/metrics`` (``kvconnect_lmcache_backend_ok``, its ``reason``)
and LMCache's ``GET /status`` (``backend_ok``, ``backend_reason``): each flip within 5 s, with
and without traffic, while the server stays healthy and serves its chunks' bytes from L1."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("prometheus_client")

from kvconnect.connectors.testing.lmcache import EngineClient, Server, wait_for  # noqa: E402
from kvconnect.connectors.testing.processes import free_port, wait_until  # noqa: E402

FLIP_S = 5.0
OK = re.compile(r'^kvconnect_lmcache_backend_ok\{[^}]*reason="(\w+)"[^}]*\} (\S+)$', re.M)


def backend_gauge(port: int) -> tuple[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    (m,) = OK.findall(text)  # one adapter: one series
    return m[0], float(m[1])


def seconds_until(pred, timeout: float = 3 * FLIP_S) -> float:
    return wait_until(pred, timeout, "backend_ok flip")


def test_backend_ok_gauge_and_status_flip_within_5s(tmp_path):
    flag, port = tmp_path / "fault", free_port()
    params = {"store": "kvconnect.connectors.testing.stores:FaultyStore", "inner": "memory",
              "inner_options": {"capacity": "64mb"}, "raise_on": ["exists", "get_into", "put_from", "stats"],
              "fault_flag": str(flag), "metrics_port": port}
    server = Server(params, tmp_path / "server.log")
    client = None
    try:
        server.wait_healthy()
        assert backend_gauge(port) == ("ok", 1.0)
        st = server.adapter_status()
        assert st["backend_ok"] is True and st["backend_reason"] == ""
        client = EngineClient(server)
        good = client.store_sequence(0)
        wait_for(lambda: server.adapter_status()["store_stats"]["put_written"] >= len(good), 30, "chunks in L2")
        time.sleep(1.5)  # nothing left in flight: what follows has no traffic

        # the backend fails with no traffic: seen through its stats
        flag.touch()
        took = seconds_until(lambda: backend_gauge(port)[1] == 0.0)
        assert took <= FLIP_S, took
        assert backend_gauge(port) == ("stats_failing", 0.0)
        st = server.adapter_status()
        assert st["backend_ok"] is False and "injected fault" in st["backend_reason"], st
        # traffic meets the failing store: its calls fail, the server stays up, L1 serves
        assert client.store_sequence(1)
        assert client.retrieve_sequence(0) == good
        seconds_until(lambda: backend_gauge(port)[0] == "store_calls_failing")
        st = server.adapter_status()
        assert st["consecutive_failures"] >= 1 and "injected fault" in st["backend_reason"], st
        assert server.status()["is_healthy"] is True

        # the backend recovers, no traffic: the adapter's probe sees it
        flag.unlink()
        took = seconds_until(lambda: backend_gauge(port) == ("ok", 1.0))
        assert took <= FLIP_S, took
        st = server.adapter_status()
        assert st["backend_ok"] is True and st["consecutive_failures"] == 0 and st["backend_reason"] == ""
        assert client.retrieve_sequence(0) == good
    finally:
        if client is not None:
            client.close()
        assert server.stop() is not None, server.log()[-3000:]
