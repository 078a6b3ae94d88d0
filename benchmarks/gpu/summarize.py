#!/usr/bin/env python3
"""Summarize run_e2e.sh results (one or more results.jsonl) into benchmarks/results/gpu_e2e.json.

  python3 benchmarks/gpu/summarize.py benchmarks/results/runs/gpu-e2e/2026-*.jsonl [--out PATH]

TTFT of a request = SGLang's server-side ``e2e_latency`` with max_new_tokens=1.
Ratios (issue's names):
  <store>_<model>_<len>_l3_over_cold  L3-hit TTFT / cold TTFT (lower is better); cold prefill never touches
                                      L3, so the cold TTFT is the median over every store's runs of that
                                      model and length (one run's cold can be a fresh machine's slow first)
  <store>_<model>_<len>_vs_file       file-backend L3-hit TTFT / this store's L3-hit TTFT (higher is better)
  <store>_<model>_<len>_l2_restart_over_cold  LMCache in front (lmcache_* stores): TTFT of a prompt served from
                                      LMCache's L2 after SGLang and the lmcache server both restarted / cold TTFT
  lmcache_kvc_hf3fs_<model>_<len>_l2_restart_vs_lmcache_fs  the same TTFT, LMCache's fs L2 / kvconnect's plugin
An L3 hit counts only if SGLang reports the prompt's pages as loaded from storage
(``cached_tokens_details.storage``; for lmcache_* stores, the cached tokens not found on the GPU);
otherwise it is listed under ``not_from_storage``.
Files are given oldest first: a later file's figures replace an earlier one's for the same
model, length, store and phase (a re-run after a change supersedes the old measurement); with
--pool the files are repeats of one configuration and every file's figures count.
Correctness: every generation of one prompt (same model shape, length and seed: dummy weights are
deterministic) must produce the same output token, whether its KV was computed, found on the GPU or
loaded from L3; wrong KV bytes change the logits. Mismatches are listed and make the exit status 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kvconnect.benchmarks.harness import BenchResult  # noqa: E402

MODELS = {"qwen3": "qwen3-32b", "llama": "llama-8b"}
PHASES = {"1_cold": "cold", "2_gpu_hit": "gpu_hit", "3_L3_hit": "l3_hit", "4_gpu_hit_again": "gpu_hit_again",
          "L3_after_restart": "l3_after_restart", "L3_cross_instance": "l3_cross_instance",
          "L2_after_restart": "l2_after_restart"}
LOADED_PHASES = ("l3", "l2_")   # phases whose prompt should come from the store


def ttft(rec):
    return (rec.get("meta") or {}).get("e2e_latency") or rec.get("e2e_client_s")


def storage_tokens(rec, store=""):
    meta = rec.get("meta") or {}
    d = meta.get("cached_tokens_details") or {}
    if "lmcache_" in store:  # SGLang's LMCache path loads through its own connector, not HiCache's tiers
        return (meta.get("cached_tokens") or 0) - (d.get("device") or 0)
    return d.get("storage") or 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.jsonl files from run_e2e.sh")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_e2e.json"))
    p.add_argument("--pool", action="store_true", help="the files are repeats: keep every file's figures")
    p.add_argument("--machine", default="NVIDIA H200 (one; two of one host for the PD phases), SGLang 0.5.17 wheels, "
                                        "dummy weights", help="what ran it, for the JSON's params")
    a = p.parse_args(argv)
    recs = []
    for i, f in enumerate(a.results):
        for line in open(f):
            if line.strip():
                r = json.loads(line)
                r["_src"] = i
                recs.append(r)
    outputs = defaultdict(lambda: defaultdict(list))  # (arch, n, seed) -> output ids -> [where]
    for r in recs:
        if r.get("event") == "gen" and r.get("output_ids") and ":" in r.get("tag", ""):
            det = (r.get("meta") or {}).get("cached_tokens_details") or {}
            store = r["tag"].split(":", 1)[1]
            src = "storage" if storage_tokens(r, store) > 0 else "device" if det.get("device") else "computed"
            outputs[(r["tag"].split(":")[0], r["n"], r["seed"])][tuple(r["output_ids"])].append(
                f"{r['tag']}/{r['label']}/{src}")
    mismatches = {"|".join(map(str, k)): {str(list(o)): w for o, w in v.items()}
                  for k, v in outputs.items() if len(v) > 1}
    checked_l3 = sum(1 for v in outputs.values() for w in v.values() for x in w if x.endswith("/storage"))
    # figures[model][len][store][phase] = [ttft...]
    fig = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    storage = defaultdict(list)
    breakdown = defaultdict(list)
    lmcache_breakdown = defaultdict(list)
    for r in recs:
        tag = r.get("tag", "")
        if ":" not in tag:
            continue
        arch, what = tag.split(":", 1)
        model = MODELS.get(arch, arch)
        store = what
        for pre in ("restart_", "cross_"):
            if store.startswith(pre):
                store = store[len(pre):]
        store = store.removesuffix("_A").removesuffix("_Bwarm").removesuffix("_B")
        if r.get("event") == "l3_breakdown":
            breakdown[(model, store, r["label"])].append(r)
            continue
        if r.get("event") == "lmcache_breakdown":  # the lmcache server's own log of the request
            lmcache_breakdown[(model, store, r["label"])].append(r)
            continue
        if r.get("event") != "gen" or "error" in r or r["label"].startswith("warmup"):
            continue
        n, _, phase = r["label"].partition("_")
        if phase.startswith("r") and "_" in phase:
            phase = phase.split("_", 1)[1]
        before, cold_first, i = phase.partition("_cold_first_")
        phase = f"cold_after_restart_{i}" if cold_first else PHASES.get(phase, phase)
        if phase.endswith("_gpu_hit"):
            continue
        t = ttft(r)
        if t is None:
            continue
        if phase.startswith(LOADED_PHASES):
            st = storage_tokens(r, store)
            storage[(model, n, store, phase)].append(st)
            if st < int(n) // 2:  # mostly recomputed: not an L3 hit
                fig[model][n][store][phase + "_not_from_storage"].append((r["_src"], t))
                continue
        fig[model][n][store][phase].append((r["_src"], t))

    for by_n in fig.values():  # keep each figure's latest source file only
        for by_store in by_n.values():
            for d in by_store.values():
                for ph, vals in d.items():
                    last = max(i for i, _ in vals)
                    d[ph] = [t for i, t in vals if a.pool or i == last]
    res = BenchResult("gpu_e2e")
    res.params = {"sources": a.results, "ttft": "server-side e2e_latency, max_new_tokens=1",
                  "machine": a.machine}
    out = {m: {n: {s: {ph: {"values_s": v, "median_s": statistics.median(v)} for ph, v in d.items()}
                   for s, d in by_store.items()} for n, by_store in by_n.items()} for m, by_n in fig.items()}
    res.figures = {"ttft": out,
                   "storage_tokens": {"|".join(k): v for k, v in storage.items()},
                   "l3_breakdown": {"|".join(k): v for k, v in breakdown.items()},
                   "output_check": {"prompts": len(outputs), "l3_generations_checked": checked_l3,
                                    "mismatches": mismatches}}
    if lmcache_breakdown:
        res.figures["lmcache_breakdown"] = {"|".join(k): v for k, v in lmcache_breakdown.items()}
    for model, by_n in fig.items():
        for n, by_store in by_n.items():
            file_l3 = by_store.get("file", {}).get("l3_hit")
            cold = [t for d in by_store.values() for t in d.get("cold", [])]
            for store, d in by_store.items():
                l3, l2r = d.get("l3_hit"), d.get("l2_after_restart")
                for hits, what in ((l3, "l3"), (l2r, "l2_restart")):
                    if cold and hits:
                        c, l = statistics.median(cold), statistics.median(hits)
                        res.ratios.append({"metric": f"{store}_{model}_{n}_{what}_over_cold", "ours": l, "reference": c,
                                           "ratio": round(l / c, 4), "lower_is_better": True,
                                           "reference_system": f"cold prefill, median of {len(cold)} runs (all stores)"})
                fs_l2r = by_store.get("lmcache_fs", {}).get("l2_after_restart")
                if store == "lmcache_kvc_hf3fs" and l2r and fs_l2r:
                    f, o = statistics.median(fs_l2r), statistics.median(l2r)
                    res.ratios.append({"metric": f"{store}_{model}_{n}_l2_restart_vs_lmcache_fs", "ours": o,
                                       "reference": f, "ratio": round(f / o, 4),
                                       "reference_system": "LMCache's fs L2 adapter, same phases",
                                       "note": "TTFT: ratio = reference / ours, higher is better"})
                if l3 and file_l3 and store != "file":
                    fl, ol = statistics.median(file_l3), statistics.median(l3)
                    res.ratios.append({"metric": f"{store}_{model}_{n}_vs_file", "ours": ol, "reference": fl,
                                       "ratio": round(fl / ol, 4), "reference_system": "SGLang file backend L3 hit",
                                       "note": "TTFT: ratio = reference / ours, higher is better"})
    pd_mismatches = add_pd(recs, res)
    res.print_ratios()
    res.write(Path(a.out))
    print(f"output check: {len(outputs)} prompts, {checked_l3} L3-loaded generations, "
          f"{len(mismatches)} prompt(s) with differing outputs")
    for k, v in mismatches.items():
        print(f"  MISMATCH {k}: {v}")
    return 1 if mismatches or pd_mismatches else 0


def add_pd(recs, res):
    """PD phases (pd_driver.py): per transport and concurrency, the latest run's wave; ratios against
    SGLang's own mooncake backend (mooncake_ref); output tokens of a prompt compared across transports."""
    waves, reqs = {}, defaultdict(dict)
    for r in recs:
        tag = r.get("tag", "")
        if not tag.startswith("pd:"):
            continue
        tr = tag[3:]
        if r.get("event") == "pd_wave":
            key = (tr, r["concurrency"])
            if key not in waves or r["_src"] >= waves[key]["_src"]:  # the latest run wins
                waves[key] = r
        elif r.get("event") == "pd_req" and r.get("output_ids"):
            reqs[r["seed"]][tr] = tuple(r["output_ids"])
    if not waves:
        return {}
    res.figures["pd"] = {f"{tr}|c{c}": {k: w[k] for k in ("ok", "n", "wall_s", "ttft_median_s", "ttft_max_s",
                                                           "input_tok_s", "output_tok_s")}
                         for (tr, c), w in sorted(waves.items())}
    for (tr, c), w in sorted(waves.items()):
        ref = waves.get(("mooncake_ref", c))
        if tr == "mooncake_ref" or not ref or not w["ttft_median_s"] or not ref["ttft_median_s"]:
            continue
        res.ratios.append({"metric": f"pd_{tr}_c{c}_ttft_vs_mooncake", "ours": w["ttft_median_s"],
                           "reference": ref["ttft_median_s"], "ratio": round(ref["ttft_median_s"] / w["ttft_median_s"], 4),
                           "reference_system": "SGLang mooncake PD backend, TCP", "note": "median TTFT: reference / ours"})
        res.ratios.append({"metric": f"pd_{tr}_c{c}_input_tok_s_vs_mooncake", "ours": w["input_tok_s"],
                           "reference": ref["input_tok_s"], "ratio": round(w["input_tok_s"] / max(ref["input_tok_s"], 1e-9), 4),
                           "reference_system": "SGLang mooncake PD backend, TCP"})
    mism = {str(seed): {tr: list(o) for tr, o in by.items()} for seed, by in reqs.items() if len(set(by.values())) > 1}
    res.figures["pd_output_check"] = {"prompts": len(reqs), "mismatches": mism}
    print(f"PD output check: {len(reqs)} prompts compared across transports, {len(mism)} differing")
    return mism


if __name__ == "__main__":
    sys.exit(main())
