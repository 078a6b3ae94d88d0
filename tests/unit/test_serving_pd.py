"""`kvconnect bench serve --pd` without processes: the plan, the relay's capability check, the
per-pair store figures and pd_serving.json's comparisons on records shaped like a two-GPU run's
(the pd_mooncake / pd_kvc_direct comparisons run nowhere else on CPU)."""

import json
from pathlib import Path

import pytest

from kvconnect.benchmarks import serve
from kvconnect.benchmarks.serving import configs, pd_report
from kvconnect.benchmarks.serving.run import since


def _pairs(*argv):
    a = serve.parser().parse_args(["--quick", *argv])
    return [f"{w.name}:{c}" for w, c in serve.plan_pairs(a, serve.build_workloads(a))]


def test_pd_plan_launches_each_deployment_once():
    got = _pairs("--pd", "--workloads", "w1,w2")
    configs_in_order = list(dict.fromkeys(p.split(":")[1] for p in got))
    assert configs_in_order[:3] == ["pd_mooncake", "no_pd", "pd_kvc_direct"]   # baseline, reference, the rest
    assert configs_in_order.index("pd_kvc_direct_late") == configs_in_order.index("pd_kvc_direct") + 1
    assert got[:2] == ["w1:pd_mooncake", "w2:pd_mooncake"]                       # configuration by configuration
    assert set(configs_in_order) == set(configs.PD_CONFIGS)
    assert not set(configs.PD_CONFIGS) & {p.split(":")[1] for p in _pairs("--workloads", "w1")}  # not by default
    with pytest.raises(SystemExit, match="not PD configurations"):
        _pairs("--pd", "--configs", "pd_kvc_direct,kvc_hf3fs")


def test_relay_refused_where_its_store_cannot_hold_the_kv_device(tmp_path):
    setup = configs.Setup(tmp_path, configs.default_ports(), 1)
    hf3fs, direct = configs.CONFIGS["pd_kvc_relay_hf3fs"], configs.CONFIGS["pd_kvc_direct"]
    why = configs.pd_refusal(hf3fs, setup, "cuda")
    assert why.startswith("MissingCapability") and "device_memory" in why and "hf3fs" in why
    assert configs.pd_refusal(hf3fs, setup, "cpu") is None
    assert configs.pd_refusal(direct, setup, "cuda") is None and configs.pd_refusal(configs.CONFIGS["no_pd"],
                                                                                  setup, "cuda") is None


def test_a_store_that_outlives_the_pair_counts_only_the_pair():
    before = {'kvconnect_get_bytes_total{store="hf3fs"}': 100.0, "_error": "x"}
    after = {'kvconnect_get_bytes_total{store="hf3fs"}': 350.0, 'kvconnect_put_bytes_total{store="hf3fs"}': 7.0}
    assert since(after, before) == {'kvconnect_get_bytes_total{store="hf3fs"}': 250.0,
                                    'kvconnect_put_bytes_total{store="hf3fs"}': 7.0}
    assert since(after, None) is after


def _record(config, ttft, tps, outputs, ok=20, failed=0):
    return {"workload": "w1", "config": config,
            "summary": {"requests": ok + failed, "ok": ok, "failed": failed, "errors": [], "ttft_p50_s": ttft,
                        "ttft_p99_s": 2 * ttft, "ttft_mean_s": ttft, "duration_s": 10.0, "input_tokens": 1000,
                        "input_tps": 100.0, "output_tps": tps, "cached_tokens": 0, "cached_from": {},
                        "storage_hit_share": 0.0, "ttft_by_source": {}},
            "probe": {"prompts": len(outputs), "ok": len(outputs), "storage_tokens": 0, "outputs": outputs},
            "load": {"capacity_input_tps": 150.0, "offered_input_tps": 100.0, "offered_over_capacity": 0.67,
                     "overloaded": False}}


def test_pd_serving_json_compares_planes_and_outputs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    gpu = "NVIDIA H100 80GB HBM3, 81559 MiB"
    rows = [{"event": "start", "when": "2026-12-08T10:00:00Z", "machine": {"gpus": [gpu]}, "spec": {},
             "workloads": {}, "pairs": []},
            _record("pd_mooncake", 0.20, 1000.0, ["w1 w2", "w3"]),
            _record("no_pd", 0.15, 900.0, ["w1 w2", "w3"]),
            _record("pd_kvc_direct", 0.19, 1010.0, ["w1 w2", "w3"]),
            _record("pd_kvc_direct_late", 2.2, 700.0, ["w1 w2", "w3"]),
            _record("pd_kvc_relay_mooncake", 0.30, 900.0, ["w1 w2", "w4"], ok=19, failed=1),
            _record("pd_kvc_relay_mooncake_late", 2.25, 690.0, ["w1 w2", "w3"]),
            {"workload": "w1", "config": "pd_kvc_relay_hf3fs", "skipped": "MissingCapability: ...", "refused": True}]
    rows[6]["store_metrics"] = {"0": {'kvconnect_store_latency_seconds_sum{op="put",store="mooncake"}': 1.5,
                                      'kvconnect_store_latency_seconds_count{op="put",store="mooncake"}': 30.0},
                                "1": {'kvconnect_store_latency_seconds_sum{op="get",store="mooncake"}': 0.5,
                                      'kvconnect_store_latency_seconds_count{op="get",store="mooncake"}': 30.0}}
    (run / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = pd_report.build([run], tmp_path / "pd_serving.json", "test")
    assert doc["device"] == gpu and doc["when"] == "2026-12-08T10:00:00Z"
    assert json.loads((tmp_path / "pd_serving.json").read_text())["name"] == "pd_serving"
    figs = doc["figures"]["w1"]
    assert figs["pd_kvc_direct"]["mismatches_vs_no_pd"] == 0
    assert figs["pd_kvc_relay_mooncake"]["mismatches_vs_no_pd"] == 1   # one token list differs from no_pd's
    ratio = {r["metric"]: r["ratio"] for r in doc["ratios"]}
    assert ratio["w1_pd_kvc_direct_ttft_p50_vs_pd_mooncake"] == pytest.approx(0.95)
    assert ratio["w1_pd_kvc_direct_decode_tps_vs_pd_mooncake"] == pytest.approx(1.01)
    assert ratio["w1_pd_kvc_relay_mooncake_late_ttft_p50_vs_pd_kvc_direct_late"] == pytest.approx(2.25 / 2.2, rel=1e-3)
    assert ratio["w1_pd_kvc_direct_late_ttft_p50_vs_pd_kvc_direct"] == pytest.approx(2.2 / 0.19, rel=1e-3)
    met = {t["target"]: t["met"] for t in doc["targets"]}
    assert met["w1: pd_kvc_direct TTFT p50 / pd_mooncake"] and met["w1: pd_kvc_direct TTFT p99 / pd_mooncake"]
    assert met["w1: pd_kvc_direct decode tokens/s / pd_mooncake"]
    assert not met["w1: pd_kvc_relay_mooncake failed requests"]
    assert not met["w1: pd_kvc_relay_mooncake output mismatches vs no_pd on the sample"]
    assert met["w1: pd_kvc_relay_mooncake_late offered load / capacity"]
    cost = doc["relay_cost"]["w1"]
    assert cost["pd_kvc_relay_mooncake"]["ttft_p50_added_ms"] == pytest.approx(110.0)
    late = cost["pd_kvc_relay_mooncake_late"]
    assert late["over"] == "pd_kvc_direct_late" and late["store_s_per_request"] == pytest.approx(2.0 / 20)
    assert late["store_io"]["put"]["calls"] == 30 and late["store_io"]["get"]["seconds"] == pytest.approx(0.5)
    assert doc["refused"] == [{"workload": "w1", "config": "pd_kvc_relay_hf3fs", "skipped": "MissingCapability: ..."}]
    assert doc["failed_pairs"] == []
