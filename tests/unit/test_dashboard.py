"""dashboards/kvconnect.json: every PromQL expression parses, and every metric and label it
uses is one kvconnect exports: the names are collected from the registries after exercising a
store and the metadata service, not from a list written by hand."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "kvconnect.json"

FUNCTIONS = {"sum", "rate", "irate", "increase", "histogram_quantile", "clamp_min", "clamp_max", "avg", "max",
             "min", "count", "topk", "label_values"}
KEYWORDS = {"by", "without", "and", "or", "unless", "on", "ignoring", "bool", "group_left", "group_right"}
GRAFANA_VARS = re.compile(r"\$(__rate_interval|__interval|__range|store|engine)\b")
TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?(?:e-?\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<dur>\[[0-9a-z_$]+\])'
                   r"|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<op>=~|!=|!~|==|>=|<=|[-+*/^%(){},=<>]))")


def parse(expr: str) -> tuple[set[str], set[str]]:
    """A small PromQL reader: checks the tokens and the bracket nesting, and returns the metric
    names (identifiers that are neither functions, keywords nor labels) and label names used."""
    expr = GRAFANA_VARS.sub(lambda m: "5m" if m.group(1).startswith("__") else "x", expr)
    pos, tokens = 0, []
    while pos < len(expr.rstrip()):
        m = TOKEN.match(expr, pos)
        assert m and m.end() > pos, f"cannot parse {expr[pos:]!r} in {expr!r}"
        tokens.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    metrics, labels, stack = set(), set(), []
    for i, (kind, text) in enumerate(tokens):
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        prev = tokens[i - 1][1] if i else ""
        if kind == "op" and text in "({":
            stack.append((text, prev))
        elif kind == "op" and text in ")}":
            assert stack and stack.pop()[0] == {")": "(", "}": "{"}[text], f"unbalanced {text!r} in {expr!r}"
        elif kind == "ident":
            inside = stack[-1] if stack else ("", "")
            if inside[0] == "{" or inside[1] in ("by", "without"):
                labels.add(text)
            elif text in FUNCTIONS or text in KEYWORDS:
                continue
            else:
                assert nxt != "(", f"unknown function {text!r} in {expr!r}"
                metrics.add(text)
    assert not stack, f"unclosed {stack} in {expr!r}"
    return metrics, labels


def exported() -> tuple[set[str], set[str]]:
    """Sample and label names kvconnect exports: a store exercised, the metadata service called."""
    from prometheus_client import REGISTRY, generate_latest

    from kvconnect.connectors import metrics
    from kvconnect.connectors.buffers import HostBuffer
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.hf3fs.client import RemoteMetadata
    from kvconnect.connectors.hf3fs.service import MetaServer
    from kvconnect.connectors.memory import MemoryStore, MemoryStoreConfig

    store = MemoryStore(MemoryStoreConfig(capacity=2 * 256), EngineContext(engine="sglang-hicache"))
    engine = f"dash-{uuid.uuid4().hex[:8]}"
    metrics.export_store(store, engine=engine)
    srv = MetaServer("127.0.0.1", 0, None, fsync="never", metrics_port=0).start()
    try:
        b = HostBuffer(3, 256, 1)
        store.put_from(["a", "b", "c"], [b.page(i) for i in range(3)])
        store.get_into(["a", "c"], [b.page(0), b.page(1)])
        store.exists(["b", "z"])
        c = RemoteMetadata(srv.address, None)
        c.connect()
        try:
            c.initialize("0:kv", 8, 256)
            c.exists("0:kv", [b"a"])
            meta = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        finally:
            c.close()
        texts = [generate_latest(REGISTRY).decode(), meta]
    finally:
        srv.stop(0)
        store.close()
        metrics.unexport_store(store)
    names, labels = set(), set()
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if fam.name.startswith("kvconnect_"):
                for s in fam.samples:
                    names.add(s.name)
                    labels.update(s.labels)
    return names, labels


def expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    for v in dash["templating"]["list"]:  # label_values(metric, label): the label must be the metric's
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", v["query"]).groups()
        out.append((f"variable {v['name']}", f"count by ({label}) ({metric})"))
    return out


def test_parser_catches_what_it_should():
    assert parse('sum by (le) (rate(x_bucket{a="b"}[$__rate_interval]))') == ({"x_bucket"}, {"le", "a"})
    with pytest.raises(AssertionError):
        parse("sum(rate(x[5m])")
    with pytest.raises(AssertionError):
        parse("frobnicate(x)")


def test_every_dashboard_expression_uses_only_exported_metrics_and_labels():
    names, labels = exported()
    assert "kvconnect_store_misses_total" in names and "kvconnect_meta_requests_total" in names  # the collection works
    exprs = expressions()
    assert len(exprs) >= 12
    used_names: set[str] = set()
    for title, expr in exprs:
        m, ls = parse(expr)
        assert m, f"{title}: no metric in {expr!r}"
        assert m <= names, f"{title}: {sorted(m - names)} not exported by kvconnect"
        assert ls <= labels, f"{title}: labels {sorted(ls - labels)} not exported by kvconnect"
        used_names |= m
    # the panels the dashboard promises
    for needed in ("kvconnect_store_up", "kvconnect_store_misses_total", "kvconnect_store_hits_total",
                   "kvconnect_store_latency_seconds_bucket", "kvconnect_store_capacity_bytes",
                   "kvconnect_store_used_bytes"):
        assert needed in used_names, needed
