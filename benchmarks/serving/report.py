"""From a run's ``runs.jsonl`` (+ ``requests.jsonl.gz``) to ``serving.json`` and ``serving.png``.

Ratios are named ``<workload>_<config>_<metric>_over_baseline`` (ours / HiCache-L2-only; for TTFT
lower is better, for ``input_tps`` higher is better) and ``<workload>_<config>_<metric>_vs_<anchor>``
(oriented so that higher means kvconnect is better: anchor TTFT / ours, our throughput / anchor's).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Iterable, Optional

from . import workloads
from .configs import BASELINE, CONFIGS

SHARED_KVC = ("kvc_hf3fs", "kvc_peer_rdma", "kvc_peer_rdma_shm", "kvc_mooncake", "kvc_mooncake_shm")


def load_runs(path: Path) -> tuple[dict, list[dict]]:
    """The last start header of ``path`` (a runs.jsonl) and the pair records written after it.

    A capacity event lands in the header (``capacity``, and the rescaled load's ``workloads``
    params); a resume event only says which pairs an earlier call had measured.
    """
    header, records = {}, []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        event = row.get("event")
        if event == "start":
            header, records = row, []
        elif event == "capacity":
            header.setdefault("capacity", {})[row["workload"]] = row
            if "params" in row:
                header.setdefault("workloads", {})[row["workload"]] = row["params"]
        elif event is None:
            records.append(row)
    return header, records


def merge_runs(run_dirs: list[Path]) -> tuple[list[dict], list[dict]]:
    """Headers of every run, and per (workload, config) the measured record of the latest run that has one.

    Ratios are computed within a workload; a workload whose pairs come from several runs says so
    in each record's ``run`` index.
    """
    headers, chosen = [], {}
    for n, d in enumerate(run_dirs):
        header, records = load_runs(Path(d) / "runs.jsonl")
        headers.append(header)
        caveats = _caveats(Path(d))
        for r in records:
            key = (r["workload"], r["config"])
            if "summary" in r or key not in chosen:
                chosen[key] = {**r, "run": n}
                if f"{key[0]}:{key[1]}" in caveats:
                    chosen[key]["caveat"] = caveats[f"{key[0]}:{key[1]}"]
    return headers, list(chosen.values())


def ratios_within_runs(run_dirs: list[Path], records: list[dict]) -> list[dict]:
    """Every ratio from one run: each run's pairs against that run's baseline and anchors, and per
    metric the latest run that has it (a pair measured again in a later run replaces its rows).

    ``records`` are the chosen ones (``merge_runs``), whose summaries may have been completed; a
    run's superseded pairs are read again from its runs.jsonl.
    """
    chosen = {(r["run"], r["workload"], r["config"]): r for r in records}
    latest: dict = {}
    for n, d in enumerate(run_dirs):
        own = [chosen.get((n, r["workload"], r["config"]), {**r, "run": n})
               for r in load_runs(Path(d) / "runs.jsonl")[1]]
        for row in ratios(figures_of(own)):
            latest[row["metric"]] = {**row, "run": n}
    return list(latest.values())


def _caveats(run_dir: Path) -> dict:
    """``WORKLOAD:CONFIG`` -> what was found after the run about that pair's figures
    (``caveats.json`` beside ``runs.jsonl``, written by hand with the evidence's location)."""
    path = run_dir / "caveats.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _ours(config: str) -> bool:
    """A kvconnect configuration: an L3 for HiCache, or the L2 of an lmcache server in front of SGLang."""
    return bool(CONFIGS.get(config)) and CONFIGS[config].kind in ("kvconnect", "lmcache_kvconnect")


def _row(metric, ours, reference, ratio, reference_system, lower_is_better=False) -> dict:
    return {"metric": metric, "ours": round(ours, 4), "reference": round(reference, 4), "ratio": round(ratio, 4),
            "reference_system": reference_system, "lower_is_better": lower_is_better}


def ratios(figures: dict) -> list[dict]:
    out = []
    for w, by_cfg in figures.items():
        base = by_cfg.get(BASELINE)
        anchors = [a for a, f in by_cfg.items() if CONFIGS.get(a) and CONFIGS[a].kind == "anchor"]
        for c, f in by_cfg.items():
            if c == BASELINE:
                continue
            if base:
                for m in ("ttft_p50", "ttft_p99"):
                    out.append(_row(f"{w}_{c}_{m}_over_baseline", f[f"{m}_s"], base[f"{m}_s"],
                                    f[f"{m}_s"] / base[f"{m}_s"], BASELINE, lower_is_better=True))
                out.append(_row(f"{w}_{c}_input_tps_over_baseline", f["input_tps"], base["input_tps"],
                                f["input_tps"] / base["input_tps"], BASELINE))
            if CONFIGS.get(c) and CONFIGS[c].kind == "lmcache_kvconnect" and CONFIGS[c].counterpart in by_cfg:
                a = CONFIGS[c].counterpart   # LMCache in front: kvconnect's L2 against LMCache's own
                fa = by_cfg[a]
                for m in ("ttft_p50", "ttft_p99"):
                    out.append(_row(f"{w}_{c}_{m}_vs_{a}", f[f"{m}_s"], fa[f"{m}_s"], fa[f"{m}_s"] / f[f"{m}_s"], a))
                out.append(_row(f"{w}_{c}_input_tps_vs_{a}", f["input_tps"], fa["input_tps"],
                                f["input_tps"] / fa["input_tps"], a))
            if CONFIGS.get(c) and CONFIGS[c].kind == "kvconnect":
                for a in anchors:
                    fa = by_cfg[a]
                    out.append(_row(f"{w}_{c}_ttft_p50_vs_{a}", f["ttft_p50_s"], fa["ttft_p50_s"],
                                    fa["ttft_p50_s"] / f["ttft_p50_s"], a))
                    out.append(_row(f"{w}_{c}_input_tps_vs_{a}", f["input_tps"], fa["input_tps"],
                                    f["input_tps"] / fa["input_tps"], a))
    return out


def _get(rows: list[dict], metric: str) -> Optional[float]:
    for r in rows:
        if r["metric"] == metric:
            return r["ratio"]
    return None


# Per workload: best kvconnect TTFT p50 / baseline (<=), every shared kvconnect store's p50 vs each
# SGLang/PeerCache counterpart (>=), every kvconnect store's p99 / baseline (<=).
SPEED_TARGETS = {"w1": (0.5, 1.2, 1.0), "w2": (0.5, None, 1.0)}
W3_CEILING_PP = 2.0          # W3: every shared store's hit rate within this many points of the trace's ceiling
L3_OVER_L2, L3_OVER_RECOMPUTED = 1.5, 0.5   # TTFT of L3-hit requests, best kvconnect store (W1)


def targets(figures: dict, rows: list[dict], bounds_: Optional[dict] = None, l3: Optional[dict] = None) -> list[dict]:
    """The serving targets, each with the measured value and whether it is met."""
    out = []
    bounds_, l3 = bounds_ or {}, l3 or {}

    def add(name, value, bound, cmp):
        if value is not None:
            out.append({"target": name, "value": round(value, 4), "bound": bound,
                        "met": value <= bound if cmp == "<=" else value >= bound})

    for w, by_cfg in figures.items():
        kvc = [c for c in by_cfg if CONFIGS.get(c) and CONFIGS[c].kind == "kvconnect"]
        anchors = [a for a in by_cfg if CONFIGS.get(a) and CONFIGS[a].kind == "anchor"]
        for c, f in by_cfg.items():   # below capacity, or the pair compares queues
            if f.get("offered_over_capacity") is not None:
                add(f"{w}: {c} offered load / capacity", f["offered_over_capacity"], 0.9, "<=")
        if not kvc or BASELINE not in by_cfg:
            continue
        best = min(kvc, key=lambda c: by_cfg[c]["ttft_p50_s"])
        if w in SPEED_TARGETS:
            p50_bound, every_bound, p99_bound = SPEED_TARGETS[w]
            add(f"{w}: best kvconnect ({best}) TTFT p50 / baseline",
                _get(rows, f"{w}_{best}_ttft_p50_over_baseline"), p50_bound, "<=")
            for c in kvc:
                if every_bound and c in SHARED_KVC:
                    for a in anchors:
                        add(f"{w}: {c} TTFT p50 vs {a}", _get(rows, f"{w}_{c}_ttft_p50_vs_{a}"), every_bound, ">=")
                add(f"{w}: {c} TTFT p99 / baseline", _get(rows, f"{w}_{c}_ttft_p99_over_baseline"), p99_bound, "<=")
        if w == "w3" and bounds_.get(w, {}).get("reuse_ceiling") is not None:
            ceiling = bounds_[w]["reuse_ceiling"]
            for c in kvc:
                if c in SHARED_KVC and by_cfg[c].get("input_tokens"):
                    hit = by_cfg[c]["cached_tokens"] / by_cfg[c]["input_tokens"]
                    add(f"{w}: {c} hit rate points below the trace's ceiling ({ceiling:.3f})",
                        100.0 * (ceiling - hit), W3_CEILING_PP, "<=")
        path = l3.get(w, {})
        with_l3 = [c for c in kvc if path.get(c, {}).get("l3_over_l2_hit") is not None]
        if with_l3:
            fastest = min(with_l3, key=lambda c: path[c]["l3_hit_ttft_p50_s"])
            add(f"{w}: L3-hit TTFT p50 / L2-hit, best kvconnect ({fastest})", path[fastest]["l3_over_l2_hit"],
                L3_OVER_L2, "<=")
            add(f"{w}: L3-hit TTFT p50 / recomputed, best kvconnect ({fastest})",
                path[fastest].get("l3_over_recomputed"), L3_OVER_RECOMPUTED, "<=")
    for w, by_cfg in figures.items():
        for c, f in by_cfg.items():
            if _ours(c):
                add(f"{w}: {c} failed requests", f["failed"], 0, "<=")
                if f.get("probe_mismatches") is not None:
                    add(f"{w}: {c} output mismatches on the sample", f["probe_mismatches"], 0, "<=")
    return out


def l3_path(figs: dict, reqs: dict) -> dict:
    """Where an L3 hit's time goes, per pair: TTFT by prefix source (GPU, host, L3, recomputed;
    SGLang's own per-request counts) and, for the L3-hit requests, the store's share of it.

    ``lookup_to_load_s_mean``: SGLang's wait from an L3 lookup to the load of that prefix, per
    prefetch (kvconnect's adapter timestamps both calls).
    ``l3_over_l2_hit``: L3-hit TTFT p50 / that of requests served from GPU or host memory, same
    pair; ``l3_over_host_hit``: over the requests served from host memory alone (HiCache's own
    L2 tier, whose load path an L3 hit ends in; small samples: a GPU hit is the common case);
    ``l3_over_recomputed``: over the baseline's recomputed requests (same run), else the
    pair's own. ``store_s_per_l3_hit``: seconds inside the store's get and exists calls (all
    servers) per L3-hit request; ``outside_store_s``: the L3-hit TTFT above the L2-hit one that the
    store's calls do not account for (SGLang's prefetch scheduling, host-to-device load, the
    scheduler's wait for the prefetch).
    """
    from .client import percentile, source_of

    out: dict = {}
    for w, by_cfg in figs.items():
        def rows_of(c):
            f = by_cfg.get(c)
            return [r for r in reqs.get((f["run"], w, c), []) if r.get("ok")] if f else []

        for c, f in by_cfg.items():
            rows = rows_of(c)
            # the baseline of the pair's own run (a later run may have measured the baseline again)
            base_recomputed = [r["ttft"] for r in reqs.get((f["run"], w, BASELINE), [])
                               if r.get("ok") and source_of(r.get("cached_from") or {}) == "recomputed"]
            by = f.get("ttft_by_source") or {}
            if not by and rows:
                from .client import ttft_by_source
                by = ttft_by_source(rows)
            entry: dict = {"by_source": by}
            l3_rows = [r["ttft"] for r in rows if source_of(r.get("cached_from") or {}) == "l3"]
            l2_rows = [r["ttft"] for r in rows if source_of(r.get("cached_from") or {}) in ("gpu", "host")]
            host_rows = [r["ttft"] for r in rows if source_of(r.get("cached_from") or {}) == "host"]
            own_recomputed = [r["ttft"] for r in rows if source_of(r.get("cached_from") or {}) == "recomputed"]
            if l3_rows:
                l3 = percentile(l3_rows, 50)
                entry["l3_hit_ttft_p50_s"] = round(l3, 4)
                if l2_rows:
                    l2 = percentile(l2_rows, 50)
                    entry["l2_hit_ttft_p50_s"] = round(l2, 4)
                    entry["l3_over_l2_hit"] = round(l3 / l2, 4)
                if host_rows:
                    entry["host_hit_ttft_p50_s"] = round(percentile(host_rows, 50), 4)
                    entry["l3_over_host_hit"] = round(l3 / percentile(host_rows, 50), 4)
                recomputed = base_recomputed or own_recomputed
                if recomputed:
                    entry["recomputed_ttft_p50_s"] = round(percentile(recomputed, 50), 4)
                    entry["l3_over_recomputed"] = round(l3 / percentile(recomputed, 50), 4)
                io = f.get("store_io") or {}
                store_s = sum((io.get(op) or {}).get("seconds", 0.0) for op in ("get", "exists"))
                wait = io.get("lookup_to_load") or {}
                if wait.get("calls"):
                    entry["lookup_to_load_s_mean"] = _sig(wait["seconds"] / wait["calls"])
                if store_s:
                    entry["store_s_per_l3_hit"] = _sig(store_s / len(l3_rows))
                    if l2_rows:
                        entry["outside_store_s"] = _sig(max(0.0, l3 - percentile(l2_rows, 50) - store_s / len(l3_rows)))
            out.setdefault(w, {})[c] = entry
    return out


def figures_of(records: Iterable[dict]) -> dict:
    figs: dict = {}
    for r in records:
        if "summary" not in r:
            continue
        s = dict(r["summary"])
        p = r.get("probe", {})
        s.update({"probe_prompts": p.get("prompts"), "probe_ok": p.get("ok"),
                  "probe_storage_tokens": p.get("storage_tokens"), "probe_mismatches": p.get("mismatches")})
        s["store_counters"] = _counters(r.get("store_metrics", {}))
        io = store_io(r.get("store_metrics", {}))
        if io:
            s["store_io"] = io
        s["run"] = r.get("run", 0)
        load = r.get("load") or {}
        if load:
            s["capacity_input_tps"] = load["capacity_input_tps"]
            s["offered_over_capacity"] = round(load["offered_over_capacity"], 4)
            s["overloaded"] = load["overloaded"]
        if r.get("prefetch_policy"):
            s["prefetch_policy"] = r["prefetch_policy"]
        s["admin_refusals"] = r.get("admin_refusals", 0)
        if r.get("caveat"):
            s["caveat"] = r["caveat"]
        figs.setdefault(r["workload"], {})[r["config"]] = s
    return figs


def _counters(metrics: dict) -> dict:
    """Per server, the hit/miss/read/write counters of its store (what the guides' checks grep for)."""
    keep = ("hit", "miss", "read", "write", "remote", "members", "keys")
    out = {}
    for server, series in metrics.items():
        out[server] = {k: v for k, v in series.items()
                       if any(w in k for w in keep) and not k.endswith(("_created", "_bucket")) and "quantile" not in k}
    return out


LOOKUP_TO_LOAD = "kvconnect_hicache_lookup_to_load_seconds"
_OP = re.compile(r'[{,]op="([a-z_]+)"')


def _sig(x: float) -> float:
    """Four significant digits: small pairs' figures (KB in ms) keep their meaning."""
    return float(f"{x:.4g}")


def store_io(metrics: dict) -> dict:
    """Where a kvconnect configuration's L3 time went, per store operation, summed over the
    servers (kvconnect's own series): ``calls``, ``seconds`` spent inside those calls, ``bytes``
    moved (get, put), ``ms_per_call`` and ``gb_per_s`` (bytes / seconds in the calls: the rate
    an engine's prefetch or write-back thread saw)."""
    ops: dict = {}
    for series in metrics.values():
        for key, value in series.items():
            name = key.split("{", 1)[0]
            if name in ("kvconnect_store_latency_seconds_count", "kvconnect_store_latency_seconds_sum"):
                m = _OP.search(key)
                if m:
                    field = "calls" if name.endswith("_count") else "seconds"
                    op = ops.setdefault(m.group(1), {})
                    op[field] = op.get(field, 0.0) + value
            elif name in (f"{LOOKUP_TO_LOAD}_count", f"{LOOKUP_TO_LOAD}_sum"):
                # SGLang's wait between an L3 lookup and the load of that prefix (the adapter's timestamps)
                op = ops.setdefault("lookup_to_load", {})
                field = "calls" if name.endswith("_count") else "seconds"
                op[field] = op.get(field, 0.0) + value
            elif name in ("kvconnect_get_bytes_total", "kvconnect_put_bytes_total"):
                op = ops.setdefault(name.split("_")[1], {})
                op["bytes"] = op.get("bytes", 0.0) + value
    for op in ops.values():
        calls, secs = op.setdefault("calls", 0.0), op.setdefault("seconds", 0.0)
        op["ms_per_call"] = _sig(1e3 * secs / calls) if calls else None
        if "bytes" in op:
            op["gb_per_s"] = _sig(op["bytes"] / secs / 1e9) if secs else None
        op["seconds"] = _sig(secs)
    return {k: ops[k] for k in sorted(ops)}


def _requests_by_pair(run_dirs: list[Path]) -> dict:
    out: dict = {}
    for n, d in enumerate(run_dirs):
        reqs = Path(d) / "requests.jsonl.gz"
        if reqs.exists():
            with gzip.open(reqs, "rt") as f:
                for line in f:
                    r = json.loads(line)
                    out.setdefault((n, r["workload"], r["config"]), []).append(r)
    return out


def bounds(figs: dict, headers: list[dict]) -> dict:
    """What any L3 could do on each workload, measured on the baseline of the same run.

    ``reuse_ceiling``: share of prompt pages an unbounded prefix cache could serve (from the load
    itself); ``baseline_cached_share``: share the baseline's GPU + host caches served; their
    difference is the most L3 can add. ``input_tps_ratio_bound``: the offered prompt tokens/s over
    the baseline's, which bounds any throughput ratio of an open-loop run. ``offered_over_served``:
    the same ratio for every configuration; above ~1.05 the servers could not keep up with the
    offered load, a queue grew for the whole run and TTFT measures that queue (a short stall early in
    such a run shows up as seconds of TTFT for every later request).
    """
    params = {}
    for h in headers:
        params.update(h.get("workloads") or {})
    out = {}
    for w, by_cfg in figs.items():
        base = by_cfg.get(BASELINE)
        b: dict = {}
        if w in params and workloads.from_params(w, params[w]).requests:   # chat prompts depend on answers
            load = workloads.from_params(w, params[w])
            spec = next((h.get("spec") for h in headers if h.get("spec")), {}) or {}
            cache = int(spec.get("max_total_tokens", 0) * (1 + spec.get("hicache_ratio", 0)))
            ceiling, kept = workloads.prefix_hits(load, int(spec.get("page_size", 64)), int(spec.get("servers", 1)),
                                                  cache)
            b["reuse_ceiling"] = round(ceiling, 4)
            if cache:
                # what the baseline's GPU + host caches could keep (LRU model): the room left to L3
                b["modelled_baseline_share"] = round(kept, 4)
                b["modelled_l3_room_share"] = round(max(0.0, ceiling - kept), 4)
        if base:
            share = base["cached_tokens"] / base["input_tokens"] if base["input_tokens"] else 0.0
            b["baseline_cached_share"] = round(share, 4)
            if "reuse_ceiling" in b:
                b["l3_room_share"] = round(max(0.0, b["reuse_ceiling"] - share), 4)
            if base.get("offered_input_tps"):
                b["input_tps_ratio_bound"] = round(base["offered_input_tps"] / base["input_tps"], 4)
        load = {c: round(f["offered_input_tps"] / f["input_tps"], 4) for c, f in by_cfg.items()
                if f.get("offered_input_tps") and f.get("input_tps")}
        if load:
            b["offered_over_served"] = load
        cap = [h.get("capacity", {}).get(w) for h in headers if h.get("capacity", {}).get(w)]
        if cap and "served_input_tps" in cap[-1]:
            b["capacity_input_tps"] = round(cap[-1]["served_input_tps"], 1)
            b["offered_input_tps"] = round(cap[-1].get("offered_input_tps", 0.0), 1)
            over = {c: f["offered_over_capacity"] for c, f in by_cfg.items() if f.get("overloaded")}
            b["overloaded_pairs"] = over
        out[w] = b
    return out


def build(run_dirs: list[Path], out_json: Path, command: str = "") -> dict:
    from .client import offered

    headers, records = merge_runs(run_dirs)
    reqs = _requests_by_pair(run_dirs)
    for r in records:   # runs recorded before the summary carried the offered load
        if "summary" in r and "offered_input_tps" not in r["summary"]:
            r["summary"].update(offered(reqs.get((r["run"], r["workload"], r["config"]), [])))
    figs = figures_of(records)
    rows = ratios_within_runs(run_dirs, records)
    bounds_, path = bounds(figs, headers), l3_path(figs, reqs)
    first = headers[0] if headers else {}
    doc = {"name": "serving", "when": first.get("when"), "machine": first.get("machine"), "command": command,
           "runs": [{"dir": str(d), "when": h.get("when"), "spec": h.get("spec"), "workloads": h.get("workloads")}
                    for d, h in zip(run_dirs, headers)],
           "figures": figs, "ratios": rows, "targets": targets(figs, rows, bounds_, path), "bounds": bounds_,
           "l3_path": path,
           "failed_pairs": [{k: r.get(k) for k in ("workload", "config", "error", "skipped")}
                            for r in records if "summary" not in r],
           "caveats": [{"pair": f"{r['workload']}:{r['config']}", "run": r["run"], "caveat": r["caveat"]}
                       for r in records if r.get("caveat")],
           "notes": ["TTFT: send -> first streamed output token, through sglang_router; input_tps: prompt tokens "
                     "of successful requests / (last completion - first send).",
                     "probe: after each pair, GPU and host caches emptied, a sample of the workload's prompts sent "
                     "one at a time; outputs compared token for token with the baseline's (L3 pages vs recompute)."]}
    out_json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def plot(run_dirs: list[Path], doc: dict, out_png: Path) -> Optional[Path]:
    """TTFT CDF per configuration and input throughput, one row per workload (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[serve] matplotlib is not installed: no picture (pip install matplotlib)")
        return None
    ttfts: dict = {}
    for n, d in enumerate(run_dirs):
        reqs = Path(d) / "requests.jsonl.gz"
        if not reqs.exists():
            continue
        with gzip.open(reqs, "rt") as f:
            for line in f:
                r = json.loads(line)
                fig = doc["figures"].get(r["workload"], {}).get(r["config"])
                if r.get("ok") and fig is not None and fig["run"] == n:
                    ttfts.setdefault(r["workload"], {}).setdefault(r["config"], []).append(r["ttft"])
    workloads = [w for w in doc["figures"] if w in ttfts]
    if not workloads:
        return None
    fig, axes = plt.subplots(len(workloads), 3, figsize=(19, 4.2 * len(workloads)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2, 3]})
    for row, w in enumerate(workloads):
        ax, bx, cx = axes[row]
        _plot_by_source(cx, w, doc)
        names = list(doc["figures"][w])
        for c in names:
            v = sorted(ttfts[w].get(c, []))
            if not v:
                continue
            style = "-" if _ours(c) else "--"
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], style, label=c, linewidth=1.6)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{w}: TTFT CDF (left is better)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        tps = [doc["figures"][w][c]["input_tps"] for c in names]
        colors = ["#2a7" if _ours(c) else
                  "#888" if c == BASELINE or (CONFIGS.get(c) and CONFIGS[c].kind == "reference") else "#c74"
                  for c in names]
        bx.barh(names, tps, color=colors)
        bx.invert_yaxis()
        bx.set_xlabel("input tokens/s (higher is better)")
        bx.set_title(f"{w}: input throughput")
        bx.grid(True, axis="x", alpha=0.3)
    # each workload's figures come from one run; say which (date of that run)
    dates = [str(r.get("when") or "")[:10] for r in doc.get("runs", [])]
    used = {w: sorted({dates[f["run"]] for f in by.values() if f.get("run", 0) < len(dates)})
            for w, by in doc["figures"].items()}
    when = "; ".join(f"{w} {', '.join(d)}" for w, d in used.items()) or (doc.get("when") or "")
    gpus = ", ".join((doc.get("machine") or {}).get("gpus", [])[:1])
    fig.suptitle(f"kvconnect serving benchmark ({when}) {gpus}  (green: kvconnect, orange: alternatives, grey: "
                 f"HiCache L2 only)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _plot_by_source(ax, w: str, doc: dict) -> None:
    """TTFT p50 of each configuration's requests grouped by where their prefix came from."""
    names = list(doc["figures"][w])
    sources = [("gpu", "#4a8"), ("host", "#8bd"), ("l3", "#e83"), ("recomputed", "#999")]
    width = 0.8 / len(sources)
    for k, (src, color) in enumerate(sources):
        xs, ys, counts = [], [], []
        for i, c in enumerate(names):
            by = (doc.get("l3_path", {}).get(w, {}).get(c, {}).get("by_source")
                  or doc["figures"][w][c].get("ttft_by_source") or {})
            if src in by:
                xs.append(i + (k - 1.5) * width)
                ys.append(by[src]["ttft_p50_s"])
                counts.append(by[src]["requests"])
        bars = ax.bar(xs, ys, width, color=color, label=src)
        for b, n in zip(bars, counts):
            ax.annotate(str(n), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=6)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(f"{w}: TTFT p50 by where the prefix came from (requests on top)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
