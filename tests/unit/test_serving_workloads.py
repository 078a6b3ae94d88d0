"""The serving benchmark's loads, driver summary and report, without processes."""

import math

import pytest

from kvconnect.benchmarks.serving import client, report, workloads
from kvconnect.benchmarks.serving.model import ids_to_text, text_to_ids, write_model_dir


def test_shared_prefix_groups_share_exact_system_prompts():
    w = workloads.shared_prefix(groups=5, per_group=4, system_len=100, question_len=10, output_len=7, rate=50.0)
    assert len(w.requests) == 20 and w.size == 20
    by_group = {}
    for r in w.requests:
        assert len(r.prompt) == 110 and r.max_new_tokens == 7
        by_group.setdefault(r.group, []).append(r.prompt)
    assert len(by_group) == 5
    systems = {g: {tuple(p[:100]) for p in ps} for g, ps in by_group.items()}
    assert all(len(s) == 1 for s in systems.values())                      # one system prompt per group
    assert len({next(iter(s)) for s in systems.values()}) == 5              # distinct across groups
    assert len({tuple(r.prompt[100:]) for r in w.requests}) == 20           # every question differs
    times = [r.at for r in w.requests]
    assert times == sorted(times) and times[0] == 0.0
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests)  # shuffled, as bench_serving
    # same seed, same load
    assert [r.prompt for r in workloads.shared_prefix(5, 4, 100, 10, 7, 50.0).requests] == [r.prompt for r in w.requests]


def test_poisson_rate_is_kept():
    w = workloads.shared_prefix(groups=50, per_group=40, system_len=1, question_len=1, rate=8.0)
    span = w.requests[-1].at
    assert 2000 / span == pytest.approx(8.0, rel=0.1)


def test_trace_blocks_become_shared_token_prefixes():
    w = workloads.trace(sample_every=40, block_tokens=16, time_scale=10.0, max_output=5, limit=200)
    rows = [r for r in workloads.read_trace() if workloads.conversation_of(r) is not None]
    assert 0 < len(w.requests) <= 200
    for r in w.requests:
        assert 1 <= r.max_new_tokens <= 5
    # two requests of one conversation share a token prefix of whole blocks
    by_conv = {}
    for r in w.requests:
        by_conv.setdefault(r.group, []).append(r)
    multi = [rs for rs in by_conv.values() if len(rs) > 1]
    assert multi, "the sample keeps whole conversations"
    a, b = multi[0][0], multi[0][1]
    assert a.prompt[:16] == b.prompt[:16]
    # the shared first block (id 0 in most rows) is the same tokens in every conversation
    firsts = {tuple(r.prompt[:16]) for r in w.requests if len(r.prompt) >= 16}
    assert len(firsts) < len(w.requests)
    # arrival times follow the trace divided by the time scale
    assert w.requests[0].at == 0.0 and all(x.at <= y.at for x, y in zip(w.requests, w.requests[1:]))
    assert len(rows) == 12031


def test_trace_length_scales_with_block_tokens():
    full = workloads.trace(sample_every=200, block_tokens=512, limit=20)
    quarter = workloads.trace(sample_every=200, block_tokens=128, limit=20)
    for f, q in zip(full.requests, quarter.requests):
        assert len(q.prompt) == math.ceil(len(f.prompt) / 4)
    assert 0 < workloads.prefix_reuse(full) < 1


def test_multi_turn_sessions():
    w = workloads.multi_turn(clients=3, rounds=4, request_len=20, output_len=2, max_parallel=2)
    assert w.size == 12 and w.max_parallel == 2
    assert all(len(s.turns) == 4 and all(len(t) == 20 for t in s.turns) for s in w.sessions)


def test_word_tokenizer_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    ids = [1, 5, 127999, 42, 9]
    assert text_to_ids(ids_to_text(ids)) == ids
    d = write_model_dir(tmp_path / "m", "llama-1b")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.encode(ids_to_text(ids)).ids == ids
    assert tok.decode(ids) == ids_to_text(ids)
    with pytest.raises(ValueError, match="accepted values"):
        write_model_dir(tmp_path / "x", "gpt-9")


def test_summary_percentiles_and_failures():
    rs = [client.Result(f"r{i}", sent=i * 0.1, ok=True, ttft=t, latency=t + 1, prompt_tokens=100,
                        completion_tokens=4, cached_from={"storage": 50}) for i, t in enumerate([0.1, 0.2, 0.3, 0.4])]
    rs.append(client.Result("bad", error="HTTP 500: boom"))
    s = client.summarize(rs, wall_s=3.0)
    assert s["ok"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["ttft_p50_s"] == pytest.approx(0.25) and s["ttft_p99_s"] == pytest.approx(0.397)
    assert s["input_tokens"] == 400 and s["storage_hit_share"] == pytest.approx(0.5)
    assert s["input_tps"] == pytest.approx(400 / (0.3 + 1.4))


def _fig(p50, p99, tps, mism=0):
    return {"ttft_p50_s": p50, "ttft_p99_s": p99, "input_tps": tps, "failed": 0, "probe_mismatches": mism}


def test_ratio_names_and_orientation():
    figs = {"w1": {"l2_only": _fig(1.0, 4.0, 100.0), "sglang_hf3fs": _fig(0.5, 3.0, 120.0),
                   "kvc_hf3fs": _fig(0.25, 2.0, 150.0), "kvc_peer_rdma": _fig(0.5, 5.0, 100.0, mism=1)}}
    rows = {r["metric"]: r for r in report.ratios(figs)}
    assert rows["w1_kvc_hf3fs_ttft_p50_over_baseline"]["ratio"] == 0.25
    assert rows["w1_kvc_hf3fs_ttft_p50_over_baseline"]["lower_is_better"]
    assert rows["w1_kvc_hf3fs_ttft_p99_over_baseline"]["ratio"] == 0.5
    assert rows["w1_kvc_hf3fs_input_tps_over_baseline"]["ratio"] == 1.5
    assert rows["w1_kvc_hf3fs_ttft_p50_vs_sglang_hf3fs"]["ratio"] == 2.0       # anchor / ours
    assert rows["w1_kvc_hf3fs_input_tps_vs_sglang_hf3fs"]["ratio"] == 1.25      # ours / anchor
    assert "w1_sglang_hf3fs_ttft_p50_vs_sglang_hf3fs" not in rows              # anchors are not compared to anchors
    targets = {t["target"]: t for t in report.targets(figs, list(rows.values()))}
    assert targets["w1: best kvconnect (kvc_hf3fs) TTFT p50 / baseline"]["met"]
    assert targets["w1: kvc_hf3fs TTFT p50 vs sglang_hf3fs"]["met"]             # 2.0 >= 1.2
    assert not targets["w1: kvc_peer_rdma TTFT p50 vs sglang_hf3fs"]["met"]    # 1.0 < 1.2
    assert not targets["w1: kvc_peer_rdma TTFT p99 / baseline"]["met"]        # 1.25 > 1.0
    assert not targets["w1: kvc_peer_rdma output mismatches on the sample"]["met"]
    # below capacity or not; W3's hit rate against the trace's ceiling
    figs["w1"]["l2_only"].update(offered_over_capacity=0.95)
    figs["w3"] = {"l2_only": {**_fig(1.0, 4.0, 100.0), "cached_tokens": 30, "input_tokens": 100},
                  "kvc_hf3fs": {**_fig(0.8, 3.0, 100.0), "cached_tokens": 49, "input_tokens": 100}}
    targets = {t["target"]: t for t in report.targets(figs, report.ratios(figs), {"w3": {"reuse_ceiling": 0.5}})}
    assert not targets["w1: l2_only offered load / capacity"]["met"]
    t = targets["w3: kvc_hf3fs hit rate points below the trace's ceiling (0.500)"]
    assert t["met"] and t["value"] == pytest.approx(1.0)


def test_offered_load_bounds_open_loop_throughput():
    rs = [client.Result(f"r{i}", sent=float(i), ok=True, ttft=0.1, latency=3.0, prompt_tokens=1000,
                        completion_tokens=1) for i in range(5)]
    s = client.summarize(rs, wall_s=8.0)
    assert s["arrival_span_s"] == 4.0 and s["offered_input_tps"] == pytest.approx(5000 / 4.0)
    assert s["input_tps"] == pytest.approx(5000 / 7.0)   # last completion at 4 + 3 s
    figs = {"w1": {"l2_only": {**s, "cached_tokens": 2500}}}
    b = report.bounds(figs, [{"workloads": {"w1": {"groups": 3, "per_group": 4, "system_len": 128,
                                                   "question_len": 64, "output_len": 1, "rate": 10.0}}}])["w1"]
    assert b["input_tps_ratio_bound"] == pytest.approx(7.0 / 4.0)
    assert b["offered_over_served"] == {"l2_only": pytest.approx(7.0 / 4.0, abs=1e-4)}
    assert b["baseline_cached_share"] == 0.5
    # 3 groups x 4 prompts of 2 + 1 pages: every group's first 2 pages repeat in its 3 later prompts
    assert b["reuse_ceiling"] == pytest.approx(3 * 3 * 2 / (12 * 3), abs=1e-4)
    assert b["l3_room_share"] == 0.0


def test_workload_rebuilt_from_recorded_params():
    w = workloads.trace(sample_every=200, block_tokens=32, limit=10)
    again = workloads.from_params("w3", w.params)
    assert [r.prompt for r in again.requests] == [r.prompt for r in w.requests]


def test_a_caveat_written_beside_a_run_follows_its_pair_into_the_report(tmp_path):
    import json

    run = tmp_path / "run"
    run.mkdir()
    summary = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "input_tps": 10.0, "failed": 0}
    rows = [{"event": "start", "workloads": {}},
            {"workload": "w1", "config": "l2_only", "summary": summary},
            {"workload": "w1", "config": "kvc_hf3fs", "summary": summary}]
    (run / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "caveats.json").write_text(json.dumps({"w1:kvc_hf3fs": "ran first: a one-time build"}))
    _, records = report.merge_runs([run])
    figs = report.figures_of(records)
    assert figs["w1"]["kvc_hf3fs"]["caveat"] == "ran first: a one-time build"
    assert "caveat" not in figs["w1"]["l2_only"]


def test_store_io_sums_each_operation_over_the_servers():
    """The report's "where the store time went": calls, seconds and bytes of each operation from the
    servers' scraped kvconnect series, and the rate an engine thread saw."""
    def server(get_s, get_bytes):
        lbl = 'engine="sglang",pool="kv",store="peer_rdma",tp_rank="0"'
        return {f'kvconnect_store_latency_seconds_count{{{lbl},op="get"}}': 10.0,
                f'kvconnect_store_latency_seconds_sum{{{lbl},op="get"}}': get_s,
                f'kvconnect_store_latency_seconds_bucket{{{lbl},op="get",le="0.1"}}': 7.0,
                f'kvconnect_store_latency_seconds_count{{op="exists",{lbl}}}': 4.0,
                f'kvconnect_store_latency_seconds_sum{{op="exists",{lbl}}}': 0.004,
                f'kvconnect_get_bytes_total{{{lbl}}}': get_bytes,
                f'kvconnect_put_bytes_total{{{lbl}}}': 0.0,
                'kvconnect_peer_bytes_read_total{node="a"}': get_bytes}
    io = report.store_io({"0": server(1.0, 3e9), "1": server(3.0, 5e9)})
    assert io["get"] == {"calls": 20.0, "seconds": 4.0, "bytes": 8e9, "ms_per_call": 200.0, "gb_per_s": 2.0}
    assert io["exists"] == {"calls": 8.0, "seconds": 0.008, "ms_per_call": 1.0}
    assert io["put"] == {"bytes": 0.0, "calls": 0.0, "seconds": 0.0, "ms_per_call": None, "gb_per_s": None}
    assert report.store_io({}) == {}


def test_multi_turn_defaults_are_mooncakes_published_flags_and_turns_are_paced():
    w = workloads.multi_turn()
    assert (len(w.sessions), len(w.sessions[0].turns), len(w.sessions[0].turns[0])) == (20, 10, 2048)
    assert w.sessions[0].max_new_tokens == 16 and w.max_parallel == 4 and w.rate == 20.0
    assert w.params["prefetch_policy"] == "wait_complete"
    times = w.turn_arrivals()
    assert len(times) == 200 and times == sorted(times)
    assert 200 / times[-1] == pytest.approx(20.0, rel=0.2)
    # a turn carries its chat's history: turn k of a chat sends k+1 chunks and k answers
    assert w.prompt_tokens_mean == pytest.approx(sum((k + 1) * 2048 + k * 16 for k in range(10)) / 10)
    assert workloads.multi_turn(rate=0).turn_arrivals() == []


def test_capacity_sample_and_rescaled_load():
    w = workloads.shared_prefix(groups=8, per_group=4, system_len=100, question_len=10, rate=2.0)
    burst = workloads.capacity_sample(w, 12)
    assert [r.prompt for r in burst.requests] == [r.prompt for r in w.requests[:12]]
    assert all(r.at == 0.0 for r in burst.requests)
    # offered at 1,100 prompt tokens/s: 110-token prompts at 10 requests/s, the same prompts in the same order
    fast = workloads.at_load(w, 1100.0)
    assert fast.params["rate"] == pytest.approx(10.0)
    assert [r.prompt for r in fast.requests] == [r.prompt for r in w.requests]
    assert fast.requests[-1].at == pytest.approx(w.requests[-1].at / 5.0)
    chats = workloads.multi_turn(clients=10, rounds=3, request_len=8, output_len=2, max_parallel=2)
    sample = workloads.capacity_sample(chats, 7)
    assert [s.sid for s in sample.sessions] == ["w2-c000", "w2-c001", "w2-c002"] and sample.rate == 0


def test_ttft_split_by_where_the_prefix_came_from():
    rows = [{"ok": True, "ttft": t, "prompt_tokens": 100, "cached_tokens": sum(c.values()), "cached_from": c}
            for t, c in [(0.05, {"device": 64}), (0.06, {"device": 64, "host": 0}), (0.07, {"host": 64, "device": 0}),
                         (0.12, {"device": 0, "storage": 64}), (0.14, {"device": 64, "storage": 64}),
                         (0.2, {})]] + [{"ok": False, "ttft": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                         "cached_from": {}}]
    by = client.ttft_by_source(rows)
    assert {k: v["requests"] for k, v in by.items()} == {"gpu": 2, "host": 1, "l3": 2, "recomputed": 1}
    assert by["l3"]["ttft_p50_s"] == pytest.approx(0.13) and by["gpu"]["ttft_p50_s"] == pytest.approx(0.055)
    figs = {"w1": {"l2_only": {"run": 0, "ttft_by_source": {}}, "kvc_hf3fs": {
        "run": 0, "store_io": {"get": {"seconds": 0.04}, "exists": {"seconds": 0.01}}}}}
    reqs = {(0, "w1", "kvc_hf3fs"): rows, (0, "w1", "l2_only"): [{**rows[-2], "ttft": 0.25}, {**rows[-2], "ttft": 0.15}]}
    path = report.l3_path(figs, reqs)["w1"]["kvc_hf3fs"]
    assert path["l3_hit_ttft_p50_s"] == pytest.approx(0.13) and path["l2_hit_ttft_p50_s"] == pytest.approx(0.06)
    assert path["l3_over_l2_hit"] == pytest.approx(0.13 / 0.06, rel=1e-3)
    assert path["recomputed_ttft_p50_s"] == pytest.approx(0.2)        # the baseline's recomputed requests
    assert path["store_s_per_l3_hit"] == pytest.approx(0.025)          # 0.05 s of get + exists over 2 L3 hits
    assert path["outside_store_s"] == pytest.approx(0.13 - 0.06 - 0.025, abs=1e-4)


def test_budget_order_puts_baselines_then_each_store_beside_its_counterpart():
    from kvconnect.benchmarks.serving.configs import by_information

    w1, w2 = workloads.shared_prefix(2, 2, 8, 2), workloads.multi_turn(2, 2, 8, 2)
    names = ["sglang_hf3fs", "kvc_mooncake_shm", "l2_only", "sglang_mooncake", "kvc_hf3fs", "sglang_file"]
    pairs = [(w1, c) for c in names] + [(w2, c) for c in ("kvc_hf3fs", "l2_only")]
    got = [f"{w.name}:{c}" for w, c in by_information(pairs)]
    assert got == ["w1:l2_only", "w2:l2_only", "w1:kvc_mooncake_shm", "w1:sglang_mooncake", "w1:kvc_hf3fs",
                   "w1:sglang_hf3fs", "w2:kvc_hf3fs", "w1:sglang_file"]


def test_admin_calls_retry_only_sglangs_not_idle_refusal(tmp_path):
    """The engine's admin API is scripted here (answers in order); the real refusal is exercised by
    the end-to-end test against the stand-in server."""
    from kvconnect.benchmarks.serving.cluster import SGLangServer

    server = SGLangServer(0, 1, tmp_path, [], tmp_path)
    server.proc.alive = lambda: True
    busy = (400, "Reject detach: scheduler is not idle. #queue-req=0 #running-req=0")
    answers = [busy, busy, (200, "detached")]
    server.admin = lambda *a, **k: answers.pop(0)
    assert server.detach() == 2 and not answers
    answers[:] = [busy, (400, "Failed: file_size: 'lots' is not a size")]
    with pytest.raises(RuntimeError, match=r"attach dynamic on server 0: HTTP 400 after 2 tries .*file_size"):
        server.attach("dynamic", {})
    answers[:] = [busy] * 100
    with pytest.raises(RuntimeError, match="scheduler is not idle"):
        server.detach(timeout_s=0.3)


def test_prefix_hits_models_the_baselines_caches_against_the_ceiling():
    # 4 groups x 4 prompts of 2 shared pages + 1 own page; round-robin over 2 servers
    w = workloads.shared_prefix(groups=4, per_group=4, system_len=128, question_len=64, rate=100.0)
    ceiling, kept = workloads.prefix_hits(w, page=64)
    assert ceiling == pytest.approx((16 - 4) * 2 / 48)        # every group's first prompt misses its 2 pages
    assert kept == pytest.approx(ceiling)                      # one unbounded cache keeps all of it
    _, two = workloads.prefix_hits(w, page=64, servers=2)
    assert two < ceiling                                       # a group's first prompt on each server misses
    _, tiny = workloads.prefix_hits(w, page=64, servers=2, cache_tokens=64)
    assert tiny == 0.0                                         # a one-page cache keeps no 2-page prefix


def test_the_committed_serving_results_rebuild_from_the_committed_run(tmp_path):
    """benchmarks/results/serving.json is what --report makes of the run directory it names."""
    import json
    from pathlib import Path

    root = Path(report.__file__).resolve().parents[1]
    committed = json.loads((root / "results" / "serving.json").read_text())
    dirs = [root.parent / d["dir"] if not Path(d["dir"]).is_absolute() else Path(d["dir"]) for d in committed["runs"]]
    # the records live under benchmarks/results/runs/ (its MANIFEST.md); the list is serving.json's own
    assert dirs and all(Path(d["dir"]).parts[:3] == ("benchmarks", "results", "runs") for d in committed["runs"])
    assert all((d / "runs.jsonl").is_file() for d in dirs)
    doc = report.build(dirs, tmp_path / "serving.json", committed["command"])
    doc = json.loads((tmp_path / "serving.json").read_text())
    for key in ("figures", "ratios", "targets", "bounds", "l3_path", "failed_pairs"):
        assert doc[key] == committed[key], key
    assert "H100" in committed["machine"]["gpus"][0]


def test_scrape_reads_a_real_prometheus_endpoint_with_the_library_parser():
    """A real prometheus_client HTTP endpoint on 127.0.0.1 (its own registry)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

    from kvconnect.benchmarks.serving.run import scrape

    registry = CollectorRegistry()
    Counter("kvconnect_peer_read_remote_hits", "hits", ["store"], registry=registry).labels("peer_rdma").inc(3)
    Histogram("kvconnect_store_latency_seconds", "latency", ["op"], registry=registry).labels("get").observe(0.2)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        out = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
    assert out['kvconnect_peer_read_remote_hits_total{store="peer_rdma"}'] == 3.0
    assert out['kvconnect_store_latency_seconds_count{op="get"}'] == 1.0
    assert out['kvconnect_store_latency_seconds_sum{op="get"}'] == pytest.approx(0.2)
    assert report.store_io({"0": out})["get"] == {"calls": 1.0, "seconds": 0.2, "ms_per_call": 200.0}
    assert scrape(None) == {} and "_error" in scrape("http://127.0.0.1:1/metrics")


def test_ratios_never_cross_runs(tmp_path):
    """A later run that measured only some pairs: its pairs are compared with its own baseline and
    anchors, the earlier run's remaining pairs with the earlier run's; no ratio mixes two runs."""
    import json

    def run(d, pairs):
        d.mkdir()
        rows = [{"event": "start", "when": d.name}] + [
            {"workload": "w1", "config": c, "summary": {"ttft_p50_s": p50, "ttft_p99_s": 2 * p50, "input_tps": 100.0}}
            for c, p50 in pairs.items()]
        (d / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    first = run(tmp_path / "a", {"l2_only": 1.0, "kvc_hf3fs": 0.5, "sglang_mooncake": 0.8, "kvc_mooncake_shm": 0.4})
    second = run(tmp_path / "b", {"l2_only": 2.0, "kvc_hf3fs": 0.5, "sglang_hf3fs": 1.0})
    _, records = report.merge_runs([first, second])
    rows = {r["metric"]: r for r in report.ratios_within_runs([first, second], records)}
    assert rows["w1_kvc_hf3fs_ttft_p50_over_baseline"]["ratio"] == 0.25 and rows["w1_kvc_hf3fs_ttft_p50_over_baseline"]["run"] == 1
    assert rows["w1_kvc_hf3fs_ttft_p50_vs_sglang_hf3fs"]["ratio"] == 2.0
    # measured only in the first run: against the first run's baseline (1.0), not the second's (2.0)
    assert rows["w1_kvc_mooncake_shm_ttft_p50_over_baseline"]["ratio"] == 0.4
    assert rows["w1_kvc_mooncake_shm_ttft_p50_vs_sglang_mooncake"]["run"] == 0
    assert "w1_kvc_mooncake_shm_ttft_p50_vs_sglang_hf3fs" not in rows
    assert rows["w1_kvc_hf3fs_ttft_p50_vs_sglang_mooncake"]["run"] == 0   # the first run's own pair
