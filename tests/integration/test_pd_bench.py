"""``benchmarks/pd.py --quick`` end to end: every kvconnect transport and SGLang's own mooncake
backend (the reference) move the same requests between two real SGLang processes on CPU;
in quick mode decode checks every page and aux row byte for byte (a wrong byte counts as a
failed request), and the results JSON carries the ratios and the machine's load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_pd_benchmark_quick(tmp_path):
    pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda")
    out = tmp_path / "pd.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    p = subprocess.run([sys.executable, "-m", "kvconnect.benchmarks.pd", "--quick", "--levels", "1,8", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    doc = json.loads(out.read_text())
    names = set(doc["figures"])
    assert names == {"kvconnect peer_rdma", "kvconnect mooncake relay", "kvconnect hf3fs relay",
                     "sglang mooncake_tcp (reference)"}, names
    for name, levels in doc["figures"].items():
        assert [lv["concurrency"] for lv in levels] == [1, 8], name
        for lv in levels:
            assert lv["failed"] == 0 and lv["wall_seconds"] > 0, (name, lv)
    assert len(doc["ratios"]) == 6 and all(r["ratio"] > 0 for r in doc["ratios"])
    assert "loadavg" in doc["machine"]
