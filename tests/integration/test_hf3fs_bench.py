"""``benchmarks/hf3fs.py --quick`` runs end to end against SGLang's references and writes its ratios."""

import json

import pytest

pytest.importorskip("sglang", reason="the benchmark's references are SGLang 0.5.23's HiCacheHF3FS and mini server")
pytest.importorskip("grpc", reason="the metadata service needs grpcio")


def test_quick_benchmark_writes_ratios(tmp_path):
    from kvconnect.benchmarks import hf3fs

    out = tmp_path / "hf3fs.json"
    assert hf3fs.main(["--quick", "--meta-batches", "20", "--out", str(out), "--dir", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    metrics = {r["metric"]: r for r in doc["ratios"]}
    for name in ("store_set", "store_get", "meta_ops", "meta_ops/get", "meta_ops/exists"):
        assert name in metrics and metrics[name]["ours"] > 0 and metrics[name]["reference"] > 0, name
    assert doc["figures"]["store"]["512KiB/w4"]["set_gib_s"]["sglang"] > 0
    # our write path as the store runs it: one Put per batch, leases amortized, no Reserve
    calls = doc["figures"]["meta"]["reserve_confirm/c1"]["kvconnect_calls_per_batch"]
    assert calls["Put"] == 1.0 and 0 < calls["Lease"] < 0.5 and set(calls) == {"Lease", "Put"}, calls
    assert "Lease+Put" in metrics["meta_ops"]["reference_system"]
    assert doc["machine"]["loadavg"]
    assert not list(tmp_path.glob("kvc-hf3fs-bench-*")), "the benchmark leaves no data files behind"
