"""``benchmarks/results/pd_serving.json``: the PD runs of ``kvconnect bench serve --pd``.

Built from the same raw runs and with the same figures as ``serving.json`` (``report.merge_runs``,
``report.figures_of``, ``report.bounds``); the comparisons are PD's own: every kvconnect data plane
against SGLang's ``mooncake`` transfer backend on the same GPUs (TTFT p50 and p99, decode
throughput), each ``*_late`` relay against the direct plane under the same late decode, every
``*_late`` against its plane with decode on time, and every PD pair's sampled outputs against the
non-disaggregated server's, token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import report
from .configs import CONFIGS, PD_BASELINE, PD_REFERENCE

# pd_kvc_direct against pd_mooncake: TTFT p50 and p99 at most 1.0x, decode throughput at least 1.0x.
DIRECT = "pd_kvc_direct"
TTFT_BOUND, DECODE_TPS_BOUND = 1.0, 1.0


def _outputs(records: list[dict]) -> dict:
    return {(r["workload"], r["config"]): r["probe"]["outputs"] for r in records if "probe" in r}


def compare_outputs(figs: dict, records: list[dict]) -> None:
    """Each PD pair's probe outputs against ``no_pd``'s (same prompts, greedy): ``identical_to_no_pd``
    of ``probe_prompts``, ``mismatches_vs_no_pd``; a pair without a reference gets neither."""
    outs = _outputs(records)
    for w, by_cfg in figs.items():
        ref = outs.get((w, PD_REFERENCE))
        for c, f in by_cfg.items():
            mine = outs.get((w, c))
            if c == PD_REFERENCE or ref is None or mine is None:
                continue
            same = sum(a == b and a != "" for a, b in zip(ref, mine))
            f["identical_to_no_pd"], f["mismatches_vs_no_pd"] = same, len(ref) - same


def ratios(figs: dict) -> list[dict]:
    rows = []
    for w, by_cfg in figs.items():
        for c, f in by_cfg.items():
            cfg = CONFIGS.get(c)
            if cfg is None or cfg.pd is None or c == PD_BASELINE:
                continue
            twin = c[:-len("_late")] if c.endswith("_late") else None   # the same plane, decode on time
            refs = [r for r in (PD_BASELINE, cfg.counterpart, twin) if r and r in by_cfg and r != c]
            for ref in dict.fromkeys(refs):
                b = by_cfg[ref]
                for m in ("ttft_p50", "ttft_p99"):
                    if b[f"{m}_s"]:
                        rows.append(report._row(f"{w}_{c}_{m}_vs_{ref}", f[f"{m}_s"], b[f"{m}_s"],
                                                f[f"{m}_s"] / b[f"{m}_s"], ref, lower_is_better=True))
                for m, what in (("output_tps", "decode_tps"), ("input_tps", "input_tps")):
                    if b[m]:
                        rows.append(report._row(f"{w}_{c}_{what}_vs_{ref}", f[m], b[m], f[m] / b[m], ref))
    return rows


def relay_cost(figs: dict) -> dict:
    """Where a relay's time goes, by workload: the time inside its store's calls over the pair
    (prefill's puts, decode's lookups and gets: ``store_io``, and per request), and, where the
    direct plane ran under the same conditions, the TTFT p50 and p99 the relay adds over it (ms)
    and the ratios."""
    out = {}
    for w, by_cfg in figs.items():
        for c, f in by_cfg.items():
            cfg = CONFIGS.get(c)
            if cfg is None or cfg.pd is None or "relay" not in c:
                continue
            io = f.get("store_io", {})
            row = {"store_io": io, "store_s_per_request": round(sum(
                (v.get("seconds") or 0.0) for k, v in io.items() if k in ("get", "put", "exists")) / f["ok"], 6)
                if f["ok"] else None}
            over = DIRECT + ("_late" if c.endswith("_late") else "")
            direct = by_cfg.get(over)
            if direct:
                row.update({
                    "over": over,
                    "ttft_p50_added_ms": round(1e3 * (f["ttft_p50_s"] - direct["ttft_p50_s"]), 2),
                    "ttft_p99_added_ms": round(1e3 * (f["ttft_p99_s"] - direct["ttft_p99_s"]), 2),
                    "ttft_p50_ratio": round(f["ttft_p50_s"] / direct["ttft_p50_s"], 4) if direct["ttft_p50_s"]
                    else None,
                    "decode_tps_ratio": round(f["output_tps"] / direct["output_tps"], 4) if direct["output_tps"]
                    else None})
            out.setdefault(w, {})[c] = row
    return out


def targets(figs: dict, rows: list[dict]) -> list[dict]:
    out = []

    def add(name, value, bound, cmp):
        if value is not None:
            out.append({"target": name, "value": round(value, 4), "bound": bound,
                        "met": value <= bound if cmp == "<=" else value >= bound})

    for w, by_cfg in figs.items():
        if DIRECT in by_cfg and PD_BASELINE in by_cfg:
            for m in ("ttft_p50", "ttft_p99"):
                add(f"{w}: {DIRECT} TTFT {m[5:]} / {PD_BASELINE}",
                    report._get(rows, f"{w}_{DIRECT}_{m}_vs_{PD_BASELINE}"), TTFT_BOUND, "<=")
            add(f"{w}: {DIRECT} decode tokens/s / {PD_BASELINE}",
                report._get(rows, f"{w}_{DIRECT}_decode_tps_vs_{PD_BASELINE}"), DECODE_TPS_BOUND, ">=")
        for c, f in by_cfg.items():
            if f.get("offered_over_capacity") is not None:
                add(f"{w}: {c} offered load / capacity", f["offered_over_capacity"], 0.9, "<=")
            if CONFIGS.get(c) and CONFIGS[c].pd is not None:
                add(f"{w}: {c} failed requests", f["failed"], 0, "<=")
                add(f"{w}: {c} output mismatches vs {PD_REFERENCE} on the sample", f.get("mismatches_vs_no_pd"), 0,
                    "<=")
    return out


def device(machine: dict) -> str:
    gpus = (machine or {}).get("gpus") or []
    return ", ".join(gpus) if gpus else "cpu (no GPU: the CPU stand-in servers)"


def build(run_dirs: list[Path], out_json: Path, command: str = "") -> dict:
    headers, records = report.merge_runs(run_dirs)
    figs = report.figures_of(records)
    compare_outputs(figs, records)
    rows = ratios(figs)
    first = headers[0] if headers else {}
    doc = {"name": "pd_serving", "when": first.get("when"), "device": device(first.get("machine")),
           "machine": first.get("machine"), "command": command,
           "runs": [{"dir": str(d), "when": h.get("when"), "spec": h.get("spec"), "workloads": h.get("workloads")}
                    for d, h in zip(run_dirs, headers)],
           "configs": {c: CONFIGS[c].description for c in sorted({r["config"] for r in records}) if c in CONFIGS},
           "figures": figs, "ratios": rows, "targets": targets(figs, rows), "relay_cost": relay_cost(figs),
           "bounds": report.bounds(figs, headers),
           "refused": [{k: r.get(k) for k in ("workload", "config", "skipped")} for r in records if r.get("refused")],
           "failed_pairs": [{k: r.get(k) for k in ("workload", "config", "error", "skipped")}
                            for r in records if "summary" not in r and not r.get("refused")],
           "notes": ["TTFT: send -> first streamed token through sglang_router --pd-disaggregation (prefill, "
                     "the KV transfer, decode's first step); decode_tps: generated tokens of successful "
                     "requests / (last completion - first send).",
                     f"outputs: after each pair a sample of the load's prompts, one at a time through the router "
                     f"(greedy), compared token for token with {PD_REFERENCE}'s, one non-disaggregated server.",
                     "*_late: a proxy holds decode's request --pd-decode-delay-s; the relay's prefill finishes and "
                     "frees its KV without decode, the direct plane's waits for decode's destinations."]}
    out_json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def render(run_dirs: list[Path], out_json: Path, command: str) -> dict:
    doc = build(run_dirs, out_json, command)
    print(f"results written to {out_json} ({doc['device']})")
    for t in doc["targets"]:
        print(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['value']} (bound {t['bound']})")
    for r in doc["refused"]:
        print(f"  refused {r['workload']}:{r['config']}: {r['skipped']}")
    for w, by in doc["relay_cost"].items():
        for c, v in by.items():
            vs = f"TTFT p50 +{v['ttft_p50_added_ms']} ms over {v['over']} ({v['ttft_p50_ratio']}x); " if "over" in v \
                else ""
            calls = ", ".join(f"{op} {x.get('calls', 0):.0f} calls {x.get('seconds')} s"
                              for op, x in v["store_io"].items())
            print(f"  {w}/{c}: {vs}store calls {v['store_s_per_request']} s per request: {calls}")
    return doc
