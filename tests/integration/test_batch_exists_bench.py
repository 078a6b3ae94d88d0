"""``kvconnect bench batch_exists --quick`` end to end: a real ``mooncake_master`` and segment
holder in a loopback namespace, kvconnect's HiCache backend over ``mooncake`` and over
``hf3fs`` with its metadata service next to SGLang 0.5.23's own ``mooncake`` and ``hf3fs``
backends (mock client, ``mini_3fs_metadata_server``), all built by SGLang's storage factory.
The benchmark itself fails unless every system's pages read back byte-exact before timing
and every ``batch_exists`` answer is the one expected (hit, half, miss); here the result
JSON is checked. No timing is asserted: figures are ratios of the same run, for the record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.connectors.testing.mooncake import mooncake_skip_reason
from kvconnect.connectors.testing.netns import netns_available

ROOT = Path(__file__).resolve().parents[2]


def test_batch_exists_benchmark_quick(tmp_path):
    reason = netns_available() or mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("sglang", reason="the references are SGLang 0.5.23's mooncake and hf3fs backends")
    pytest.importorskip("grpc", reason="the HF3FS metadata service needs grpcio")
    out = tmp_path / "batch_exists.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    p = subprocess.run([sys.executable, "-m", "kvconnect", "bench", "batch_exists", "--quick", "--keys", "32",
                        "--stored", "64", "--systems", "kvc_mooncake,sglang_mooncake,kvc_hf3fs,sglang_hf3fs",
                        "--output", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    doc = json.loads(out.read_text())
    fig = doc["figures"]
    for name in ("kvc_mooncake", "sglang_mooncake", "kvc_hf3fs", "sglang_hf3fs"):
        for kind in ("hit", "prefix", "miss"):
            assert fig[name][kind]["us_per_key"] > 0 and len(fig[name][kind]["us_per_key_all"]) == 3, (name, kind)
    for name in ("floor_kvc_mooncake", "floor_sglang_mooncake"):  # the RPC alone, answers checked as well
        for kind in ("hit", "prefix", "miss"):
            assert fig[name][kind]["us_per_key"] > 0 and len(fig[name][kind]["us_per_key_all"]) == 3, (name, kind)
    assert set(fig["overhead_us_per_key"]) == {"kvc_mooncake", "sglang_mooncake"}
    metrics = {r["metric"]: r for r in doc["ratios"]}
    for kind in ("hit", "prefix", "miss"):
        row = metrics[f"us_per_key {kind} kvc_mooncake / sglang_mooncake"]
        assert row["ratio"] > 0 and 0 <= row["reps_kvconnect_cheaper"] <= 1 and len(row["ratio_q25_q75"]) == 2
        assert metrics[f"us_per_key {kind} floor_kvc_mooncake / floor_sglang_mooncake"]["ratio"] > 0
        assert metrics[f"us_per_key {kind} kvc_hf3fs / sglang_hf3fs"]["ratio"] > 0
    assert doc["params"]["keys"] == 32 and doc["machine"]["loadavg"]
