"""``kvconnect bench scale --quick``: 10 and 100 engines running the real membership,
directory and index code on real ``redis-server`` processes (the simulation's quick run).

The engines are objects in one process and directory calls are function calls (the
benchmark's docstring says what else is simulated); the registry, the index, their Lua
scripts and a partition (a loopback relay that stops passing bytes) are real.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvconnect.connectors.testing.processes import child_env, python
from kvconnect.connectors.testing.redis_cluster import redis_skip_reason


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    why = redis_skip_reason()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("scale")
    proc = subprocess.run([python(), "-m", "kvconnect", "bench", "scale", "--quick", "--out", str(out / "scale.json")],
                          env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "scale.json").read_text()), out, proc.stdout


def test_every_view_converges_after_joins_leaves_crashes_and_a_healed_partition(quick_run):
    doc, _, _ = quick_run
    figures = doc["figures"]
    ttl, interval = figures["member_ttl"], figures["heartbeat_interval"]
    assert [r["engines"] for r in figures["registry"]] == [10, 100]
    for r in figures["registry"]:
        # a join or a Leave is one beat away; a healed partition a beat and a snapshot
        for key in ("join_converge_s", "leave_converge_s", "heal_converge_s"):
            assert r[key] is not None and r[key] <= 2 * ttl, (r["engines"], key, r[key])
        # a crash and a cut-off side are expiry: member_ttl and a few beats
        for key in ("crash_converge_s", "partition_converge_s"):
            assert r[key] is not None and ttl - interval <= r[key] <= 3 * ttl, (r["engines"], key, r[key])
        assert r["partition_engines"] == r["engines"] // 10
        assert r["requests"] > 0 and r["lookup_errors"] == 0
        assert r["directory_entries_per_engine"]["max"] > 0
        assert 0 < r["index_lookup_s"]["p50"] <= r["index_lookup_s"]["p99"]


def test_per_engine_cost_is_flat_with_the_registry_and_grows_with_the_mesh(quick_run):
    doc, _, _ = quick_run
    figures = doc["figures"]
    small, large = figures["registry"]
    interval = figures["heartbeat_interval"]
    for r in (small, large):  # one call per engine per heartbeat_interval
        assert abs(r["steady_messages_per_engine_s"] * interval - 1) < 0.15, r
    assert large["steady_messages_per_engine_s"] / small["steady_messages_per_engine_s"] < 1.5
    assert large["steady_bytes_per_engine_s"] / small["steady_bytes_per_engine_s"] < 1.5
    m10, m30 = figures["mesh"]
    assert m30["messages_per_engine_s"] / m10["messages_per_engine_s"] > 2.5  # the mesh: n calls per engine
    assert m30["bytes_per_engine_s"] / m10["bytes_per_engine_s"] > 5  # ... each carrying n members


def test_the_run_writes_its_ratios_and_plot(quick_run):
    doc, out, stdout = quick_run
    assert {r["metric"] for r in doc["ratios"]} >= {
        "registry_messages_per_engine_s_100_vs_10_lower_is_better",
        "registry_bytes_per_engine_s_100_vs_10_lower_is_better"}
    assert (out / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "registry membership, 100 engines:" in stdout  # progress while it runs
