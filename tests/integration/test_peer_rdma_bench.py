"""``benchmarks/peer_rdma.py --quick`` runs end to end: kvconnect's pool, PeerCache 0.8.4 and
raw Transfer Engine reads of the same bytes, and the same-host pass (pages copied out of a
peer's shared-memory segment; the run fails if no page went that way), two processes each, in a loopback namespace the
benchmark makes; every system's reads are checked byte-exact inside the run (it fails
otherwise), and the results JSON carries every figure and ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.connectors.testing.peer import skip_reason

ROOT = Path(__file__).resolve().parents[2]


def test_peer_rdma_benchmark_quick(tmp_path):
    why = skip_reason("grpc", "mooncake", "peercache", "numpy")
    if why:
        pytest.skip(why)
    out = tmp_path / "peer_rdma.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "kvconnect.benchmarks.peer_rdma", "--quick", "--out", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    doc = json.loads(out.read_text())
    for label in ("64KiB", "2MiB"):
        fig = doc["figures"][label]
        for k in ("ours_remote_read_gib_s", "ours_remote_write_gib_s", "ours_local_placement_write_gib_s",
                  "peercache_read_gib_s", "peercache_write_gib_s", "te_batch_read_gib_s",
                  "ours_same_host_read_gib_s"):
            assert fig[k] > 0, (label, k)
        assert fig["ours_read_stale"] == 0 and fig["ours_read_failures"] == 0
    metrics = {r["metric"] for r in doc["ratios"]}
    assert {"read_gib_s_64KiB_vs_peercache", "read_gib_s_2MiB_vs_raw_te", "same_host_read_gib_s_2MiB_vs_te_read"} <= metrics
    assert "loadavg" in doc["machine"]
