"""``benchmarks/lmcache_l2.py`` starts every run on a Mooncake cluster empty.

Every ``lmcache bench l2`` process stores the same keys with the same bytes, and Mooncake
answers a put of a key it already holds with success while it keeps the bytes it has. What one
run left in the cluster's segment holder would make the next run's puts of those keys free,
and its reads would return the earlier run's bytes. Here, against a real ``mooncake_master``
and segment holder: a kept object shadows a later put of other bytes; after the benchmark's
``clear_mooncake`` the later put's bytes are the ones read back. And the benchmark clears the
cluster before every run of a Mooncake system (warm-up included) and before the Mooncake
client's own figures; ``--between-runs keep`` leaves it as it is.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lmcache")

from kvconnect.benchmarks import lmcache_l2 as bench  # noqa: E402

NBYTES = 64 * 1024

_PUT_GET = r"""
import ctypes, json, sys
from kvconnect.connectors.testing.lmcache_mooncake_store import open_client
params, key, fill, n = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = open_client(params)
try:
    src, dst = ctypes.create_string_buffer(bytes([fill]) * n, n), ctypes.create_string_buffer(n)
    for b in (src, dst):
        client.register_buffer(ctypes.addressof(b), n)
    put = client.put_from(key, ctypes.addressof(src), n)
    got = client.get_into(key, ctypes.addressof(dst), n)
    print("RESULT " + json.dumps([put, got, sorted(set(dst.raw))]))
finally:
    client.close()
"""


def _put_get(prefix: list[str], params: dict, key: str, fill: int) -> tuple[int, int, list[int]]:
    """A client process that lends nothing (the object lands in the holder and outlives it):
    put ``NBYTES`` bytes of ``fill`` under ``key``, read the key back; (put rc, get rc, the
    distinct byte values read)."""
    result, rc, out = bench.child_line(prefix, _PUT_GET, [json.dumps(bench.lending_nothing(params)), key, str(fill),
                                                          str(NBYTES)], "RESULT", 120)
    assert rc == 0 and result is not None, out
    put, got, values = json.loads(result)
    return put, got, values


def test_clear_mooncake_gives_the_next_run_its_own_bytes(tmp_path):
    from kvconnect.connectors.testing.harness import harness_class

    cls = harness_class("mooncake")
    why = cls.skip_reason()
    if why:
        pytest.skip(why)
    with cls(tmp_path / "mooncake") as h:
        params, prefix = h.options(0), h.exec_prefix()
        key = "lmcache-bench-chunk-0"
        assert _put_get(prefix, params, key, 0xA1) == (0, NBYTES, [0xA1])  # run 1
        # run 2 with run 1's object kept: its put "succeeds", yet it reads run 1's bytes
        assert _put_get(prefix, params, key, 0xB2) == (0, NBYTES, [0xA1])
        assert bench.clear_mooncake(params, prefix) == 1
        # run 3 on the cleared cluster: its put moves its bytes, and they are what it reads
        assert _put_get(prefix, params, key, 0xC3) == (0, NBYTES, [0xC3])
        assert bench.clear_mooncake(params, prefix) == 1
        assert bench.clear_mooncake(params, prefix) == 0


def test_benchmark_clears_the_cluster_before_every_mooncake_run(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []

    def spec(self, name):
        return {"type": "plugin", "name": name, "adapter_params": {"master_server_address": "m"}}, ["ns"]

    def run_bench(adapter, shape, prefix=None, timeout=240):
        events.append(("run", adapter["name"]))
        return {"store_MBps": 1.0, "load_MBps": 1.0, "lookup_keys_per_s": 1.0}

    def clear(params, prefix):
        assert params == {"master_server_address": "m"} and prefix == ["ns"]
        events.append(("clear", ""))
        return 0

    monkeypatch.setattr(bench.Systems, "spec", spec)
    monkeypatch.setattr(bench, "run_bench", run_bench)
    monkeypatch.setattr(bench, "clear_mooncake", clear)
    monkeypatch.setattr(bench, "probe_native", lambda *a: {})
    monkeypatch.setattr(bench, "run_client", lambda *a: events.append(("client", "")) or {})
    args = ["--stores", "mooncake", "--repeats", "2", "--ttfc", "off", "--remote", "off", "--dir", str(tmp_path / "w")]
    assert bench.main(args + ["--out", str(tmp_path / "clear.json")]) == 0
    runs = [i for i, e in enumerate(events) if e[0] != "clear"]
    # one warm-up, both systems in each repeat, then the Mooncake client's own figures
    assert [events[i][0] for i in runs] == ["run"] * (1 + 2 * 2) + ["client"], events
    assert all(events[i - 1] == ("clear", "") for i in runs), events
    doc = json.loads((tmp_path / "clear.json").read_text())
    assert doc["params"]["between_runs"] == "clear"
    assert any(n.startswith("Mooncake cluster between runs: every object removed") for n in doc["notes"])

    events.clear()  # --between-runs keep: the old behaviour, nothing removed
    assert bench.main(args + ["--between-runs", "keep", "--out", str(tmp_path / "keep.json")]) == 0
    assert events and all(e[0] != "clear" for e in events)
    assert json.loads((tmp_path / "keep.json").read_text())["params"]["between_runs"] == "keep"
