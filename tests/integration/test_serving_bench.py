"""`kvconnect bench serve` end to end on CPU: the real ``sglang_router`` in front of two servers.

Mocked because CI has no GPU: the SGLang server itself (``kvconnect.connectors.testing.serving_engine``: SGLang's real storage
factory, host pool and HTTP admin surface, kvconnect's real adapter and stores, a model made of
hashes whose output depends on every KV byte it reads; it refuses attach, detach and flush for
0.5 s after each response, as SGLang does until its scheduler is fully idle). Real: the router (round-robin), the
kvconnect metadata service, peer pool seed node and stores, SGLang's built-in ``file`` backend, the
load driver, the output check and the report.
"""

import gzip
import hashlib
import json
import re

import pytest

pytest.importorskip("sglang_router")
pytest.importorskip("aiohttp")
pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from kvconnect.benchmarks import serve  # noqa: E402
from kvconnect.benchmarks.serving import configs, workloads  # noqa: E402
from kvconnect.benchmarks.serving.configs import KVC_HICACHE, Config  # noqa: E402

PAIRS = ("w1:l2_only,w1:sglang_file,w1:kvc_hf3fs,w1:broken,w1:kvc_peer_rdma,w1:kvc_peer_rdma_shm,"
         "w3:l2_only,w3:kvc_hf3fs,w2:l2_only,w2:kvc_memory,w1:no_hicache")


@pytest.fixture
def broken_config(monkeypatch):
    """A configuration SGLang refuses to attach (a bad store option): recorded, and the run goes on."""
    cfg = Config("broken", "kvconnect", "kvconnect hf3fs with a bad option", backend="dynamic",
                 extra=lambda s, i: {**KVC_HICACHE, "store": "hf3fs", "file_path_prefix": str(s.data("x") / "h"),
                                     "file_size": "lots"})
    monkeypatch.setitem(configs.CONFIGS, "broken", cfg)
    return cfg


@pytest.mark.timeout(900)  # eleven pairs, two capacity probes, three server launches: ~400 s on a 2-core machine
def test_serve_quick_end_to_end(tmp_path, broken_config, capsys):
    out, results = tmp_path / "out", tmp_path / "results"
    argv = ["--quick", "--server-module", "kvconnect.connectors.testing.serving_engine", "--workdir",
            str(tmp_path / "work"), "--out", str(out), "--results-dir", str(results), "--port-base", "1500"]
    rc = serve.main([*argv, "--pairs", PAIRS])
    assert rc == 1  # one pair failed on purpose
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert rows[0]["event"] == "start"
    # W1 and W2 are offered 0.7 of what a capacity probe on the baseline measured (W3 keeps its trace timing)
    capacity = {r["workload"]: r for r in rows if r.get("event") == "capacity"}
    assert set(capacity) == {"w1", "w2"}
    for w, cap in capacity.items():
        assert cap["failed"] == 0 and cap["served_input_tps"] > 0
        assert cap["offered_input_tps"] == pytest.approx(0.7 * cap["served_input_tps"])
        load = workloads.from_params(w, cap["params"])
        assert cap["params"]["rate"] == pytest.approx(cap["offered_input_tps"] / load.prompt_tokens_mean, rel=1e-3)
    pairs = {(r["workload"], r["config"]): r for r in rows[1:] if "event" not in r}
    assert len(pairs) == 11
    # the stand-in refused admin calls while "not idle"; every pair waited them out
    assert sum(r.get("admin_refusals", 0) for r in pairs.values()) > 0
    assert pairs[("w1", "kvc_hf3fs")]["load"]["capacity_input_tps"] == capacity["w1"]["served_input_tps"]
    assert pairs[("w2", "kvc_memory")]["prefetch_policy"] == "wait_complete"

    broken = pairs[("w1", "broken")]
    assert "attach dynamic on server 0: HTTP 400" in broken["error"] and "file_size" in broken["error"]

    for key, r in pairs.items():
        if key[1] == "broken":
            continue
        s = r["summary"]
        assert s["failed"] == 0 and s["ok"] == s["requests"] > 0, (key, s["errors"])
        assert s["ttft_p50_s"] > 0 and s["input_tps"] > 0
        # the output check: every sampled prompt answered, tokens equal to the baseline's
        p = r["probe"]
        assert p["ok"] == p["prompts"] > 0
        if key[1] != "l2_only":
            assert p["mismatches"] == 0, key
    # pages came back from L3 (read through the adapter into host pages, bytes checked by the output)
    for key in [("w1", "sglang_file"), ("w1", "kvc_hf3fs"), ("w1", "kvc_peer_rdma"), ("w1", "kvc_peer_rdma_shm"),
                ("w3", "kvc_hf3fs")]:
        assert pairs[key]["probe"]["storage_tokens"] > 0, key
    assert pairs[("w1", "l2_only")]["probe"]["storage_tokens"] == 0
    assert pairs[("w1", "no_hicache")]["probe"]["storage_tokens"] == 0   # the servers were relaunched without L3
    assert pairs[("w1", "kvc_hf3fs")]["summary"]["cached_from"]["storage"] > 0
    # round-robin put pages on both servers and each read the other's: the peer-pool guide's check
    # (counted after the output check, whose pages all come from L3: the load itself is too short to be
    # sure every server reads the other's pages before the scrape)
    peer = pairs[("w1", "kvc_peer_rdma")]["store_metrics_after_probe"]
    for server in ("0", "1"):
        remote = [v for k, v in peer[server].items() if k.startswith("kvconnect_peer_read_remote_hits_total")]
        written = [v for k, v in peer[server].items() if k.startswith("kvconnect_peer_write_requests_total")]
        assert remote and remote[0] > 0 and written and written[0] > 0, server
    # with shared segments the same-host servers copied each other's pages instead of transferring them
    shm = pairs[("w1", "kvc_peer_rdma_shm")]["store_metrics_after_probe"]
    for server in ("0", "1"):
        copied = [v for k, v in shm[server].items() if k.startswith("kvconnect_peer_shared_reads_total")]
        mapped = [v for k, v in shm[server].items() if k.startswith("kvconnect_peer_shared_segments_mapped")]
        assert copied and copied[0] > 0 and mapped and mapped[0] >= 1, server

    with gzip.open(out / "requests.jsonl.gz", "rt") as f:
        reqs = [json.loads(line) for line in f]
    assert len(reqs) == sum(r["summary"]["requests"] for r in pairs.values() if "summary" in r)

    doc = json.loads((results / "serving.json").read_text())
    names = {r["metric"] for r in doc["ratios"]}
    assert "w1_kvc_hf3fs_ttft_p50_over_baseline" in names
    assert "w1_kvc_hf3fs_input_tps_over_baseline" in names
    assert "w1_kvc_peer_rdma_ttft_p50_vs_sglang_file" in names
    assert "w3_kvc_hf3fs_ttft_p99_over_baseline" in names
    assert all(re.fullmatch(r"w[123]_[a-z0-9_]+_(ttft_p50|ttft_p99|input_tps)_(over_baseline|vs_[a-z0-9_]+)",
                            n) for n in names)
    assert {f["workload"] for f in doc["failed_pairs"]} == {"w1"}
    assert any(t["target"].startswith("w1: best kvconnect") for t in doc["targets"])
    if (results / "serving.png").exists():
        assert (results / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # where the store time went, from the servers' own series
    io = doc["figures"]["w1"]["kvc_peer_rdma"]["store_io"]
    assert io["get"]["bytes"] > 0 and io["get"]["seconds"] > 0 and io["get"]["gb_per_s"] > 0
    assert io["put"]["calls"] > 0 and io["exists"]["calls"] > 0
    printed = capsys.readouterr().out
    assert "[serve] w1/kvc_hf3fs" in printed
    assert re.search(r"w1/kvc_peer_rdma_shm store time: get [0-9.e+-]+ GB in [0-9.e+-]+ s", printed)
    # SGLang's first L3 lookup was taken before any pair, by a backend attached for it and gone after
    assert printed.index("[serve] L3 path warmed up") < printed.index("[serve] w1/l2_only")
    assert not (tmp_path / "work" / "data" / "warm_up").exists()
    # each pair records the extra config it attached; the quick run turns write_behind on
    assert pairs[("w1", "kvc_hf3fs")]["extra_config"]["write_behind"] == "64mb"
    assert pairs[("w1", "sglang_file")]["extra_config"] == {"file_storage_path": str(tmp_path / "work" / "data" /
                                                                                    "sglang_file")}
    # TTFT by where each request's prefix came from, and the store's share of an L3 hit
    by = pairs[("w1", "kvc_hf3fs")]["summary"]["ttft_by_source"]
    assert by["l3"]["requests"] > 0 and by["recomputed"]["requests"] > 0
    assert sum(v["requests"] for v in by.values()) == pairs[("w1", "kvc_hf3fs")]["summary"]["ok"]
    path = doc["l3_path"]["w1"]["kvc_hf3fs"]
    assert path["l3_hit_ttft_p50_s"] > 0 and path["store_s_per_l3_hit"] > 0 and path["l3_over_recomputed"] > 0
    # the adapter timed each prefix from its lookup to its load
    wait = doc["figures"]["w1"]["kvc_hf3fs"]["store_io"]["lookup_to_load"]
    assert wait["calls"] > 0 and wait["seconds"] > 0 and path["lookup_to_load_s_mean"] > 0
    assert doc["bounds"]["w1"]["capacity_input_tps"] == round(capacity["w1"]["served_input_tps"], 1)
    assert any(t["target"] == "w1: kvc_hf3fs offered load / capacity" for t in doc["targets"])

    # a resumed run keeps what was measured (and the capacity it measured) and runs only the rest
    rc = serve.main([*argv, "--resume", "--pairs", "w1:l2_only,w1:kvc_hf3fs,w1:kvc_memory"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r.get("event") for r in rows].count("capacity") == 2 and rows[-2]["event"] == "resume"
    assert (rows[-1]["workload"], rows[-1]["config"]) == ("w1", "kvc_memory") and "summary" in rows[-1]
    assert rows[-1]["probe"]["mismatches"] == 0    # compared with the first call's baseline outputs
    assert rows[-1]["load"]["capacity_input_tps"] == capacity["w1"]["served_input_tps"]
    doc = json.loads((results / "serving.json").read_text())
    assert {"l2_only", "kvc_hf3fs", "kvc_memory"} <= set(doc["figures"]["w1"])


PD_PAIRS = "w1:pd_kvc_relay_hf3fs,w1:pd_kvc_relay_hf3fs_late,w1:no_pd"


@pytest.mark.timeout(300)  # one PD launch, one router + proxy restart, one plain launch: ~65 s on a 2-core machine
def test_serve_pd_behind_the_real_router(tmp_path, capsys):
    """`kvconnect bench serve --pd` on CPU: the real ``sglang_router --pd-disaggregation`` in front of a
    prefill and a decode server, the kvconnect relay over the hf3fs store (with its metadata service)
    as the transfer backend, a late-decode variant and the non-disaggregated output reference.

    Mocked because CI has no GPU: the model (``serving_engine``'s hash model: a request's output is a
    digest of every KV byte decode received). Real: the router, SGLang 0.5.23's PD classes in both
    servers (plugin loader, ``get_kv_class``, the prefill's bootstrap server, senders and receivers
    over a CPU ``MHATokenToKVPool``), kvconnect's PD backend and relay, the hf3fs store and metadata
    service, the delaying proxy, the load driver, the capacity probe, the output check and the report.
    SGLang's own mooncake backend and the direct plane (Mooncake's Transfer Engine, which listens on
    every interface) are not started here: ``tests/integration/test_sglang_pd.py`` runs them in a
    network namespace.
    """
    from kvconnect.connectors.testing.hash_model import output_tokens, page_bytes, page_keys

    out, results = tmp_path / "out", tmp_path / "results"
    argv = ["--pd", "--quick", "--server-module", "kvconnect.connectors.testing.serving_engine", "--kv-device", "cpu",
            "--workdir", str(tmp_path / "work"), "--out", str(out), "--results-dir", str(results),
            "--port-base", "1700", "--pd-baseline", "pd_kvc_relay_hf3fs", "--pd-decode-delay-s", "0.5",
            "--capacity-requests", "16", "--l3-file-size", "64mb", "--pairs", PD_PAIRS]
    assert serve.main(argv) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    cap = next(r for r in rows if r.get("event") == "capacity")
    assert cap["workload"] == "w1" and cap["failed"] == 0 and cap["served_input_tps"] > 0
    pairs = {r["config"]: r for r in rows if "event" not in r}
    assert set(pairs) == {"pd_kvc_relay_hf3fs", "pd_kvc_relay_hf3fs_late", "no_pd"}
    for c, r in pairs.items():
        s = r["summary"]
        assert s["failed"] == 0 and s["ok"] == s["requests"] > 0, (c, s["errors"])
        assert s["ttft_p50_s"] > 0 and s["output_tps"] > 0
        assert r["load"]["capacity_input_tps"] == cap["served_input_tps"]
    # the tokens decode streamed are the hash model's digest of the page bytes prefill computed: every
    # byte of every page crossed prefill -> store -> decode (a non-disaggregated server gives the same)
    load = workloads.from_params("w1", cap["params"])
    page, nbytes = 64, 2 * 2 * 2 * 8 * 2 * 64   # the stand-in's KV page: K+V x 2 layers x 2 heads x 8 x bf16
    expected = []
    for ids in load.sample(8):
        keys = page_keys(ids, page)
        digest = hashlib.sha256(b"".join(page_bytes(k, nbytes) for k in keys) +
                                json.dumps(ids[len(keys) * page:]).encode()).digest()
        expected.append(" ".join(f"w{t}" for t in output_tokens(digest, 16)))
    for c, r in pairs.items():
        assert r["probe"]["ok"] == r["probe"]["prompts"] == 8
        assert r["probe"]["outputs"] == expected, c
    # the late variant: the same servers, decode's half held 0.5 s by the proxy (TTFT includes it)
    assert pairs["pd_kvc_relay_hf3fs_late"]["summary"]["ttft_p50_s"] > 0.5
    assert printed.count("[serve] launching PD prefill + decode") == 1

    doc = json.loads((results / "pd_serving.json").read_text())
    assert doc["name"] == "pd_serving" and doc["device"].startswith("cpu") and doc["when"]
    figs = doc["figures"]["w1"]
    for c in ("pd_kvc_relay_hf3fs", "pd_kvc_relay_hf3fs_late"):
        assert figs[c]["identical_to_no_pd"] == 8 and figs[c]["mismatches_vs_no_pd"] == 0
    names = {r["metric"] for r in doc["ratios"]}
    late = next(r for r in doc["ratios"] if r["metric"] == "w1_pd_kvc_relay_hf3fs_late_ttft_p50_vs_pd_kvc_relay_hf3fs")
    assert late["ours"] > late["reference"] + 0.4 and late["lower_is_better"]   # the 0.5 s decode delay, vs on time
    assert "w1_pd_kvc_relay_hf3fs_decode_tps_vs_pd_mooncake" not in names     # no pd_mooncake pair in this run
    assert any(t["target"] == "w1: pd_kvc_relay_hf3fs failed requests" and t["met"] for t in doc["targets"])
    assert any(t["target"].startswith("w1: pd_kvc_relay_hf3fs_late output mismatches") and t["met"]
               for t in doc["targets"])
    assert doc["failed_pairs"] == [] and doc["refused"] == []
    # where the relay's time went: this pair's store calls (prefill's puts, decode's gets), from both servers'
    # /metrics, less what the warm-up and the capacity probe had counted before it
    for c in ("pd_kvc_relay_hf3fs", "pd_kvc_relay_hf3fs_late"):
        cost, io = doc["relay_cost"]["w1"][c], figs[c]["store_io"]
        assert io["put"]["calls"] > 0 and io["get"]["calls"] > 0 and io["get"]["bytes"] > 0, io
        # 128 KV bytes a token: this pair's full pages (plus aux rows), not the warm-up's and probe's as well
        assert 0.5 < io["get"]["bytes"] / (figs[c]["input_tokens"] * 128) < 1.5, io
        assert cost["store_s_per_request"] > 0 and "over" not in cost    # no direct plane ran here
    assert not list((tmp_path / "work" / "data").glob("pd_hf3fs/*"))   # the relay's files went with its services



@pytest.mark.timeout(600)  # one HiCache launch, two LMCache launches, two lmcache servers: ~150 s on 2 cores
def test_serve_lmcache_in_front_of_sglang(tmp_path, capsys):
    """``lmcache_kvc_hf3fs`` / ``lmcache_fs``: the stand-in servers launched with ``--enable-lmcache``
    (mocked: the model and SGLang's LMCRadixCache, as in the test above), all clients of one real
    ``lmcache server`` whose L2 is kvconnect's real plugin over the hf3fs store and metadata service,
    or LMCache's own ``fs``. The servers and the lmcache server are launched once per configuration
    for all its workloads, after the HiCache pairs (whatever order ``--pairs`` gave); prompts come
    back from LMCache byte-checked (outputs equal the baseline's), and the plugin wrote the chunks
    LMCache stored into the hf3fs file."""
    pytest.importorskip("lmcache.v1.multiprocess.server")
    from kvconnect.benchmarks.serving.configs import CONFIGS, HICACHE_NAMES

    assert "lmcache_kvc_hf3fs" not in HICACHE_NAMES   # named with --configs, not in the default run
    assert CONFIGS["lmcache_kvc_hf3fs"].counterpart == "lmcache_fs"
    out, results = tmp_path / "out", tmp_path / "results"
    rc = serve.main(["--quick", "--server-module", "kvconnect.connectors.testing.serving_engine", "--workdir",
                     str(tmp_path / "work"), "--out", str(out), "--results-dir", str(results), "--port-base", "1700",
                     "--configs", "l2_only,lmcache_kvc_hf3fs,lmcache_fs", "--workloads", "w1,w2"])
    assert rc == 0, capsys.readouterr().out[-3000:]
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    order = [(r["workload"], r["config"]) for r in rows if "event" not in r]
    assert order == [("w1", "l2_only"), ("w2", "l2_only"), ("w1", "lmcache_kvc_hf3fs"), ("w2", "lmcache_kvc_hf3fs"),
                     ("w1", "lmcache_fs"), ("w2", "lmcache_fs")]
    pairs = {(r["workload"], r["config"]): r for r in rows if "event" not in r}
    for key, r in pairs.items():
        s = r["summary"]
        assert s["failed"] == 0 and s["ok"] == s["requests"] > 0, (key, s["errors"])
        assert r["probe"]["ok"] == r["probe"]["prompts"] > 0
        if key[1] != "l2_only":
            assert r["probe"]["mismatches"] == 0, key            # LMCache's chunks arrived byte-exact
            assert r["probe"]["storage_tokens"] == 0 and "extra_config" not in r, key   # no HiCache backend
        if key[0] == "w1" and key[1] != "l2_only":   # (the quick W2's prompts are under one 256-token chunk)
            assert r["probe"]["host_tokens"] > 0, key            # after a flush, the prompts came from LMCache
    assert pairs[("w1", "lmcache_kvc_hf3fs")]["summary"]["cached_from"]["host"] > 0
    # kvconnect's plugin (one lmcache server, scraped under server 0) wrote LMCache's chunks to the store
    put = {k: v for k, v in pairs[("w1", "lmcache_kvc_hf3fs")]["store_metrics"]["0"].items()
           if k.startswith("kvconnect_put_bytes")}
    assert put and sum(put.values()) > 0, pairs[("w1", "lmcache_kvc_hf3fs")]["store_metrics"]
    assert pairs[("w1", "lmcache_kvc_hf3fs")]["store_metrics"]["1"] == {}
    printed = capsys.readouterr().out
    assert printed.count("launching 2 SGLang servers (lmcache)") == 2
    doc = json.loads((results / "serving.json").read_text())
    names = {r["metric"] for r in doc["ratios"]}
    assert {"w1_lmcache_kvc_hf3fs_ttft_p50_vs_lmcache_fs", "w2_lmcache_kvc_hf3fs_input_tps_vs_lmcache_fs",
            "w1_lmcache_kvc_hf3fs_ttft_p50_over_baseline"} <= names
    assert not any("lmcache" in t["target"] and "vs sglang" in t["target"] for t in doc["targets"])
