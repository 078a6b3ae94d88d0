"""``connectors.mooncake.master_metrics``: the URL ``master_metrics`` names, the three figures
out of ``mooncake_master``'s Prometheus text (as the master prints them), reuse, ``forget`` and
the back-off after a failed read, against a real HTTP server on loopback."""

from __future__ import annotations

import http.server
import threading

from kvconnect.connectors.mooncake.master_metrics import ClusterUsage, MasterMetrics, metrics_url, parse

TEXT = """# HELP master_allocated_bytes Total memory bytes currently allocated across all segments
# TYPE master_allocated_bytes gauge
master_allocated_bytes {used}
# TYPE master_total_capacity_bytes gauge
master_total_capacity_bytes 33554432
segment_allocated_bytes{{segment="127.0.0.1:14240"}} {used}
# TYPE master_key_count gauge
master_key_count 4
master_value_size_bytes_bucket{{le="4096.000000"}} 2
"""


def test_url_from_the_setting():
    assert metrics_url("auto", "10.0.0.1:50051") == "http://10.0.0.1:9003/metrics"
    assert metrics_url("10.0.0.2:9100", "10.0.0.1:50051") == "http://10.0.0.2:9100/metrics"
    assert metrics_url("http://m:1/x", "10.0.0.1:50051") == "http://m:1/x"
    assert metrics_url("", "10.0.0.1:50051") == ""


def test_parse_takes_the_master_totals_not_the_per_segment_series():
    assert parse(TEXT.format(used=4194304)) == ClusterUsage(bytes_used=4194304, capacity_bytes=33554432, keys=4)
    assert parse("master_allocated_bytes 1\n") is None  # not all three figures


def serve(state: dict) -> http.server.HTTPServer:
    """A metrics endpoint on loopback: the text above, or HTTP 500 while ``state["fail"]``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            state["asked"] += 1
            body = TEXT.format(used=state["used"]).encode()
            self.send_response(500 if state.get("fail") else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_reuse_forget_and_back_off():
    state = {"used": 1 << 20, "asked": 0}
    srv = serve(state)
    try:
        url = f"http://127.0.0.1:{srv.server_port}/metrics"
        m = MasterMetrics(url, ttl=60)
        assert m.read().bytes_used == 1 << 20 and state["asked"] == 1
        state["used"] = 2 << 20
        assert m.read().bytes_used == 1 << 20 and state["asked"] == 1  # reused within ttl
        m.forget()  # after this process's own write
        assert m.read().bytes_used == 2 << 20 and state["asked"] == 2
        state["fail"] = True
        bad = MasterMetrics(url, retry_after=60)
        assert bad.read() is None and "HTTPError" in bad.error and state["asked"] == 3
        bad.forget()  # a failed read is not retried before retry_after, forget or not
        assert bad.read() is None and state["asked"] == 3
        again = MasterMetrics(url, retry_after=0)  # past retry_after: asks again, and recovers
        assert again.read() is None
        state["fail"] = False
        assert again.read().bytes_used == 2 << 20
    finally:
        srv.shutdown()
        srv.server_close()
