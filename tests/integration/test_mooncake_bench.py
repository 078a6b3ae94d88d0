"""``benchmarks/mooncake.py --quick`` runs end to end: real master + segment holder in a
loopback netns, every system moves the same SGLang host-pool pages byte-exact (the
worker checks the bytes after every read and fails otherwise), results JSON written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.connectors.testing.mooncake import mooncake_skip_reason

ROOT = Path(__file__).resolve().parents[2]


def _run_quick(tmp_path, *options: str) -> dict:
    """``benchmarks/mooncake.py --quick --reps 2 OPTIONS``; its result JSON."""
    reason = mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")
    out = tmp_path / "mooncake.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    p = subprocess.run([sys.executable, "-m", "kvconnect.benchmarks.mooncake", "--quick", "--reps", "2", *options,
                        "--output", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(out.read_text())


def test_mooncake_benchmark_quick(tmp_path):
    doc = _run_quick(tmp_path)
    fig = doc["figures"]
    for name in ("raw", "kvc", "kvc_hicache", "sglang", "raw_per_segment"):
        assert fig[name]["get_gib_s"] > 0 and fig[name]["put_gib_s"] > 0
    assert fig["kvc"]["path"]["direct_pages"] > 0 and fig["kvc"]["path"]["staged_pages"] == 0
    metrics = {r["metric"] for r in doc["ratios"]}
    assert "get_gib_s kvconnect MooncakeStore / raw" in metrics
    assert "get_gib_s kvconnect HiCache / SGLang MooncakeStore" in metrics
    assert "loadavg" in doc["machine"]


def test_mooncake_benchmark_shared_segment_quick(tmp_path):
    """``--shared-segment``: the holder is a kvconnect store process lending shared memory;
    kvconnect's gets are copies from it (counted), byte-exact like every other system."""
    doc = _run_quick(tmp_path, "--shared-segment", "--systems", "raw,kvc", "--processes", "2")
    fig = doc["figures"]
    assert doc["params"]["caller"] == "thread" and doc["params"]["processes"] == 2
    assert len(fig["kvc"]["get_all_s"]) == len(fig["raw"]["get_all_s"]) == 2 * 2  # 2 processes x 2 reps
    # every get of both reps in both processes (counters summed over the processes)
    assert fig["kvc"]["path"]["shared_copy_pages"] >= 2 * 2 * doc["params"]["pages"]
    assert fig["raw"]["get_gib_s"] > 0
    assert "get_gib_s kvconnect MooncakeStore / raw [kvconnect reads shared memory]" in \
        {r["metric"] for r in doc["ratios"]}
    assert not list(Path("/dev/shm").glob("kvc-bench-*")), "the benchmark left its shared segment behind"
