"""``benchmarks/gpu/summarize.py``: the published ``benchmarks/results/gpu_e2e.json`` from the GPU runs' rows.

Nothing is mocked: summarize.py runs as a script (as the README tells) on the committed
``benchmarks/results/runs/gpu-e2e/*.jsonl`` and on small synthetic files, writing to a temporary path. Its ratios
are checked against values this file computes itself from the input rows (a second, independent
reading of the rules in summarize.py's docstring), and the committed gpu_e2e.json against a fresh run.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUMMARIZE = ROOT / "benchmarks" / "gpu" / "summarize.py"
RUNS = sorted((ROOT / "benchmarks" / "results" / "runs" / "gpu-e2e").glob("2026-*.jsonl"))  # name order is time order
MODELS = {"qwen3": "qwen3-32b", "llama": "llama-8b"}


def summarize(files, out: Path, cwd: Path = ROOT) -> tuple[int, str, dict]:
    p = subprocess.run([sys.executable, str(SUMMARIZE), *map(str, files), "--out", str(out)], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert p.stderr.strip() == "" or "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, json.loads(out.read_text())


def expected_ratios(files) -> dict[str, float]:
    """The ratios of summarize.py's docstring, computed from the rows without its code.

    TTFT = meta.e2e_latency (else e2e_client_s); an L3 phase counts only with at least half the
    prompt's tokens from storage; each (model, length, store, phase) keeps the rows of the latest
    file that has any; cold = median over every store of the model and length."""
    vals: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    waves: dict[tuple, tuple[int, dict]] = {}
    for i, f in enumerate(files):
        for line in Path(f).read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            tag = r.get("tag", "")
            if r.get("event") == "pd_wave" and tag.startswith("pd:"):
                key = (tag[3:], r["concurrency"])
                if key not in waves or i >= waves[key][0]:
                    waves[key] = (i, r)
                continue
            if r.get("event") != "gen" or "error" in r or ":" not in tag or r["label"].startswith("warmup"):
                continue
            arch, what = tag.split(":", 1)
            store = re.sub(r"_(A|Bwarm|B)$", "", re.sub(r"^(restart_|cross_)", "", what))
            m = re.fullmatch(r"(\d+)_(?:r\d+_)?(.+)", r["label"])
            n, phase = m.group(1), m.group(2)
            phase = {"1_cold": "cold", "3_L3_hit": "l3_hit"}.get(phase)
            if phase is None:
                continue
            meta = r.get("meta") or {}
            t = meta.get("e2e_latency") or r.get("e2e_client_s")
            if t is None:
                continue
            if phase == "l3_hit" and ((meta.get("cached_tokens_details") or {}).get("storage") or 0) < int(n) // 2:
                phase = "l3_hit_not_from_storage"
            vals[(MODELS.get(arch, arch), n, store, phase)][i].append(t)
    latest = {k: by_file[max(by_file)] for k, by_file in vals.items()}
    out = {}
    for (model, n, store, phase), l3 in latest.items():
        if phase != "l3_hit":
            continue
        cold = [t for (m2, n2, _s, ph), v in latest.items() if (m2, n2, ph) == (model, n, "cold") for t in v]
        if cold:
            out[f"{store}_{model}_{n}_l3_over_cold"] = round(statistics.median(l3) / statistics.median(cold), 4)
        file_l3 = latest.get((model, n, "file", "l3_hit"))
        if file_l3 and store != "file":
            out[f"{store}_{model}_{n}_vs_file"] = round(statistics.median(file_l3) / statistics.median(l3), 4)
    for (tr, c), (_i, w) in waves.items():
        ref = waves.get(("mooncake_ref", c))
        if tr == "mooncake_ref" or not ref or not w["ttft_median_s"] or not ref[1]["ttft_median_s"]:
            continue
        out[f"pd_{tr}_c{c}_ttft_vs_mooncake"] = round(ref[1]["ttft_median_s"] / w["ttft_median_s"], 4)
        out[f"pd_{tr}_c{c}_input_tok_s_vs_mooncake"] = round(w["input_tok_s"] / ref[1]["input_tok_s"], 4)
    return out


def test_committed_runs_reproduce_the_published_results(tmp_path):
    """The committed runs through summarize.py give exactly the committed gpu_e2e.json (figures and
    ratios), and every ratio matches the independent computation."""
    assert len(RUNS) >= 20
    rc, printed, doc = summarize([p.relative_to(ROOT) for p in RUNS], tmp_path / "gpu_e2e.json")
    assert rc == 0, printed
    published = json.loads((ROOT / "benchmarks" / "results" / "gpu_e2e.json").read_text())
    assert doc["figures"] == published["figures"]
    assert doc["ratios"] == published["ratios"]
    assert doc["params"]["sources"] == published["params"]["sources"]

    got = {r["metric"]: r["ratio"] for r in doc["ratios"]}
    want = expected_ratios(RUNS)
    assert got == want
    # the headline rows exist and are what the README says they are
    assert 0 < got["kvc_hf3fs_llama-8b_8192_l3_over_cold"] < 1
    assert got["kvc_mooncake_shm_llama-8b_16384_vs_file"] > 1
    assert {"pd_kvc_peer_rdma_c1_ttft_vs_mooncake", "pd_kvc_mooncake_c32_input_tok_s_vs_mooncake"} <= set(got)
    # the output check read every L3-loaded generation and found them all equal to the cold ones
    check = doc["figures"]["output_check"]
    assert check["mismatches"] == {} and check["l3_generations_checked"] > 100
    assert f"output check: {check['prompts']} prompts, {check['l3_generations_checked']} L3-loaded" in printed
    # the default output path is unchanged (written by the README's command)
    assert "default=str(ROOT / \"benchmarks/results/gpu_e2e.json\")" in SUMMARIZE.read_text()


def _gen(tag, label, seed, t, storage=0, device=0, out=(7,), client=None, n=1024):
    meta = {"prompt_tokens": n, "cached_tokens": storage + device,
            "cached_tokens_details": {"device": device, "host": 0, "storage": storage} if storage + device else None}
    if t is not None:
        meta["e2e_latency"] = t
    return {"event": "gen", "label": label, "n": n, "seed": seed, "status": 200,
            "e2e_client_s": client if client is not None else (t or 0) + 0.01, "meta": meta,
            "output_ids": list(out), "tag": tag}


def _wave(tr, c, ttft, tps):
    return {"event": "pd_wave", "concurrency": c, "ok": c, "n": c, "wall_s": 1.0, "ttft_median_s": ttft,
            "ttft_max_s": ttft * 1.5, "input_tok_s": tps, "output_tok_s": tps / 1000, "tag": f"pd:{tr}"}


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_synthetic_runs_latest_file_wins_and_ratios(tmp_path):
    """Two synthetic runs: the later file's figures replace the earlier's per store and phase, an L3
    "hit" that mostly recomputed is kept apart, cold is the median over stores, PD waves compare
    with mooncake_ref; then a differing output token makes the exit status 1."""
    hit = 960  # 15 of the 1024-token prompt's 64-token pages
    a = _write(tmp_path / "a.jsonl", [
        {"event": "launch", "name": "llama_file", "arch": "llama", "store": "file", "t": 1, "wall": 1},
        _gen("llama:file", "warmup_1024_1_cold", 1, 9.0, out=(99,)),
        _gen("llama:file", "1024_r1_1_cold", 11, 2.0),
        _gen("llama:file", "1024_r1_2_gpu_hit", 11, 0.1, device=hit),
        _gen("llama:file", "1024_r1_3_L3_hit", 11, 0.5, storage=hit),
        _gen("llama:kvc_x", "1024_r1_1_cold", 11, 3.0),
        _gen("llama:kvc_x", "1024_r1_3_L3_hit", 11, 0.9, storage=hit),
        _gen("llama:kvc_x", "1024_r2_3_L3_hit", 11, 1.9, storage=64),   # 64 < 1024 // 2: recomputed
        _wave("kvc_peer_rdma", 1, 5.0, 1000.0),
        _wave("mooncake_ref", 1, 1.0, 8000.0),
    ])
    b_rows = [
        _gen("llama:kvc_x", "1024_r1_1_cold", 11, 4.0),
        _gen("llama:kvc_x", "1024_r1_3_L3_hit", 11, 0.2, storage=hit),
        _gen("llama:kvc_x", "1024_r2_3_L3_hit", 11, 0.6, storage=hit),
        _gen("llama:kvc_x", "1024_r3_3_L3_hit", 11, None, storage=hit, client=0.4),  # no e2e_latency: client time
        {"event": "gen", "label": "1024_r4_3_L3_hit", "n": 1024, "tag": "llama:kvc_x", "error": "HTTP 500"},
        _gen("llama:restart_kvc_x", "1024_L3_after_restart", 11, 0.3, storage=hit),
        _gen("llama:restart_kvc_x", "1024_L3_after_restart_gpu_hit", 11, 0.05, device=hit),
        {"event": "l3_breakdown", "label": "1024_r1_3_L3_hit", "store_get_s": 0.01, "store_get_bytes": 123,
         "store_get_pages": 15, "tag": "llama:kvc_x"},
        _wave("kvc_peer_rdma", 1, 0.8, 10000.0),
        {"seed": 1000, "event": "pd_req", "concurrency": 1, "output_ids": [5, 6], "tag": "pd:kvc_peer_rdma"},
        {"seed": 1000, "event": "pd_req", "concurrency": 1, "output_ids": [5, 6], "tag": "pd:mooncake_ref"},
    ]
    b = _write(tmp_path / "b.jsonl", b_rows)
    rc, printed, doc = summarize([a, b], tmp_path / "out.json")
    assert rc == 0, printed
    got = {r["metric"]: r for r in doc["ratios"]}
    # cold: file's 2.0 (file a) and kvc_x's 4.0 (file b replaced 3.0) -> 3.0
    assert got["file_llama-8b_1024_l3_over_cold"]["ratio"] == round(0.5 / 3.0, 4)
    assert got["kvc_x_llama-8b_1024_l3_over_cold"]["ratio"] == round(0.4 / 3.0, 4)   # median(0.2, 0.6, 0.4)
    assert got["kvc_x_llama-8b_1024_l3_over_cold"]["reference"] == 3.0
    assert got["kvc_x_llama-8b_1024_vs_file"]["ratio"] == round(0.5 / 0.4, 4)
    assert got["pd_kvc_peer_rdma_c1_ttft_vs_mooncake"]["ratio"] == 1.25            # 1.0 / 0.8, file b's wave
    assert got["pd_kvc_peer_rdma_c1_input_tok_s_vs_mooncake"]["ratio"] == 1.25     # 10000 / 8000
    assert {k: v["ratio"] for k, v in got.items()} == expected_ratios([a, b])
    ttft = doc["figures"]["ttft"]["llama-8b"]["1024"]
    assert ttft["kvc_x"]["l3_hit"]["values_s"] == [0.2, 0.6, 0.4]
    assert ttft["kvc_x"]["cold"]["values_s"] == [4.0]
    assert ttft["kvc_x"]["l3_hit_not_from_storage"]["values_s"] == [1.9]
    assert ttft["kvc_x"]["l3_after_restart"]["median_s"] == 0.3
    assert ttft["file"]["gpu_hit"]["values_s"] == [0.1]
    assert "warmup" not in json.dumps(ttft) and "L3_after_restart_gpu_hit" not in json.dumps(ttft)
    assert doc["figures"]["storage_tokens"]["llama-8b|1024|kvc_x|l3_hit"] == [hit, 64, hit, hit, hit]
    assert doc["figures"]["l3_breakdown"]["llama-8b|kvc_x|1024_r1_3_L3_hit"][0]["store_get_pages"] == 15
    assert doc["figures"]["pd"]["kvc_peer_rdma|c1"]["ttft_median_s"] == 0.8
    # every generation of prompt (llama, 1024, 11) gave token 7: L3-loaded ones included
    check = doc["figures"]["output_check"]
    assert check == {"prompts": 2, "l3_generations_checked": 7, "mismatches": {}}

    # wrong KV bytes from L3 change the token: listed, and the exit status says so
    b_rows.append(_gen("llama:restart_kvc_x", "1024_L3_after_restart", 11, 0.3, storage=hit, out=(8,)))
    b_rows.append({"seed": 1000, "event": "pd_req", "output_ids": [5, 9], "tag": "pd:kvc_mooncake"})
    rc, printed, doc = summarize([a, _write(b, b_rows)], tmp_path / "out2.json")
    assert rc == 1
    mism = doc["figures"]["output_check"]["mismatches"]
    assert list(mism) == ["llama|1024|11"]
    assert mism["llama|1024|11"]["[8]"] == ["llama:restart_kvc_x/1024_L3_after_restart/storage"]
    assert "MISMATCH llama|1024|11" in printed
    assert doc["figures"]["pd_output_check"]["mismatches"] == {
        "1000": {"kvc_peer_rdma": [5, 6], "mooncake_ref": [5, 6], "kvc_mooncake": [5, 9]}}


LMCACHE_RUNS = {kind: sorted((ROOT / "benchmarks" / "results" / "runs" / "gpu-lmcache" / kind).glob("2026-*.jsonl"))
                for kind in ("built-ops", "wheel-ops")}


def test_lmcache_runs_reproduce_the_published_results(tmp_path):
    """LMCache in front of SGLang: the committed runs give the committed gpu_lmcache.json (the repeats with
    LMCache's CUDA ops built on the node, pooled with --pool) and gpu_lmcache_wheel_ops.json (as the wheel
    ships), and their restart ratios are the medians of every file's rows, computed here."""
    for kind, published, pool in (("built-ops", "gpu_lmcache.json", ["--pool"]),
                                  ("wheel-ops", "gpu_lmcache_wheel_ops.json", [])):
        files = LMCACHE_RUNS[kind]
        assert files, kind
        want = json.loads((ROOT / "benchmarks" / "results" / published).read_text())
        p = subprocess.run([sys.executable, str(SUMMARIZE), *map(str, (f.relative_to(ROOT) for f in files)), *pool,
                            "--machine", want["params"]["machine"], "--out", str(tmp_path / published)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        doc = json.loads((tmp_path / published).read_text())
        assert doc["figures"] == want["figures"] and doc["ratios"] == want["ratios"]
        rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
        ttft = defaultdict(list)
        for r in rows:
            if r.get("event") == "gen" and not r["label"].startswith("warmup"):
                store = r["tag"].split(":")[1].removeprefix("restart_")
                if re.search(r"_r\d+_1_cold$", r["label"]):
                    ttft["cold"].append(r["meta"]["e2e_latency"])
                elif r["label"].endswith("_L2_after_restart"):
                    assert r["meta"]["cached_tokens"] == 7936, r   # 31 LMCache chunks of the 8,128 cached tokens
                    ttft[store].append(r["meta"]["e2e_latency"])
        got = {r["metric"]: r["ratio"] for r in doc["ratios"]}
        cold = statistics.median(ttft["cold"])
        for store in ("lmcache_kvc_hf3fs", "lmcache_fs"):
            assert len(ttft[store]) == 3 * len(files) if pool else len(ttft[store]) == 2
            assert got[f"{store}_llama-8b_8192_l2_restart_over_cold"] == round(statistics.median(ttft[store]) / cold, 4)
        assert got["lmcache_kvc_hf3fs_llama-8b_8192_l2_restart_vs_lmcache_fs"] == round(
            statistics.median(ttft["lmcache_fs"]) / statistics.median(ttft["lmcache_kvc_hf3fs"]), 4)
