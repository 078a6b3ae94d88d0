"""Serving under load: N SGLang servers behind sglang_router, W1/W2/W3 loads, every L3 option side by side.

Runs on a GPU node with SGLang, sglang-router and the stores installed (see docs/serving.md):

    kvconnect bench serve                                   # every workload x every configuration
    kvconnect bench serve --workloads w1 --configs l2_only,sglang_hf3fs,kvc_hf3fs
    kvconnect bench serve --pairs w1:l2_only,w1:kvc_hf3fs,w3:l2_only,w3:kvc_hf3fs --deadline-s 1200
    kvconnect bench serve --report RUN_DIR [RUN_DIR...]       # rebuild serving.json + serving.png from raw runs
    kvconnect bench serve --pd --workloads w1,w2              # 1P1D on GPUs 0 and 1, every PD transfer backend
    kvconnect bench serve --configs l2_only,lmcache_kvc_hf3fs,lmcache_fs   # LMCache in front of SGLang

Each (workload, configuration) pair is measured on the same servers: L3 backends are switched at run
time through SGLang's admin API. Writes ``<out>/runs.jsonl`` and ``<out>/requests.jsonl.gz`` while it
runs, then ``benchmarks/results/serving.json`` (figures, ``ratios``, targets) and ``serving.png`` (TTFT
CDF, throughput).

``lmcache_kvc_hf3fs`` / ``lmcache_fs`` (named with ``--configs``, not in the default run): every
server launched with ``--enable-lmcache`` instead of HiCache, all clients of one ``lmcache server``
(``--lmcache-l1-gb``) whose L2 is kvconnect's plugin over hf3fs, or LMCache's ``fs``; they run last,
each launching its servers once for all workloads, and are compared with each other.

``--pd``: the SGLang PD guide's 1P1D instead of HiCache servers: a prefill server on the first GPU,
a decode server on the second, ``sglang_router --pd-disaggregation`` in front, the transfer backend
as the configuration (``pd_mooncake``, SGLang's own, is the baseline; ``pd_kvc_direct``, the
kvconnect relays over Mooncake and hf3fs where their store can serve the KV's device, and
``*_late`` variants where decode's request arrives ``--pd-decode-delay-s`` after prefill's); one
non-disaggregated server (``no_pd``) gives the outputs every PD pair must equal. The same loads,
capacity probe (on ``pd_mooncake``), budget and resume; ``benchmarks/results/pd_serving.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .serving import report, workloads
from .serving.configs import (BASELINE, CONFIGS, HICACHE_NAMES, LMCACHE_CONFIGS, PD_BASELINE, PD_CONFIGS, PD_REFERENCE,
                              by_information, default_ports, parse_names)
from .serving.run import Plan, ServerSpec, execute

from kvconnect.connectors.config import parse_size

RESULTS = Path(__file__).resolve().parent / "results"

# Each workload's generator and its knobs, (keyword, type, default, help): --wN-KEYWORD on the command line
WORKLOAD_KNOBS = {
    "w1": (workloads.shared_prefix, [("groups", int, 64, None), ("per_group", int, 16, None),
                                     ("system_len", int, 2048, None), ("question_len", int, 128, None),
                                     ("output_len", int, 256, None),
                                     ("rate", float, 8.0, "requests/s (Poisson); replaced by --load-fraction"),
                                     ("prefetch_policy", str, "", "SGLang prefetch policy at attach (default: "
                                      "the server's)")]),
    "w2": (workloads.multi_turn, [("clients", int, 20, None), ("rounds", int, 10, None),
                                  ("request_len", int, 2048, None), ("output_len", int, 16, None),
                                  ("max_parallel", int, 4, None),
                                  ("rate", float, 20.0, "turns/s (Poisson); replaced by --load-fraction"),
                                  ("prefetch_policy", str, "wait_complete", "SGLang prefetch policy at attach")]),
    "w3": (workloads.trace, [("sample_every", int, 80, "keep conversations with crc32(id) %% N == 0"),
                             ("block_tokens", int, 128, "tokens per 512-token trace block"),
                             ("time_scale", float, 60.0, "trace time / replay time"), ("max_output", int, 64, None),
                             ("limit", int, 0, "at most this many requests (0: all sampled)")]),
}


def build_workloads(a: argparse.Namespace) -> dict:
    if a.quick:
        return {"w1": workloads.shared_prefix(4, 4, 256, 32, 8, rate=20.0),
                "w2": workloads.multi_turn(3, 2, 64, 8, max_parallel=2),
                "w3": workloads.trace(sample_every=400, block_tokens=16, time_scale=600.0, max_output=8, limit=24)}
    return {w: make(**{k: getattr(a, f"{w}_{k}") for k, *_ in knobs}) for w, (make, knobs) in WORKLOAD_KNOBS.items()}


def plan_pairs(a: argparse.Namespace, loads: dict) -> list:
    if a.pairs:
        pairs = []
        for item in a.pairs.split(","):
            w, _, c = item.strip().partition(":")
            if w not in loads or c not in CONFIGS:
                raise SystemExit(f"--pairs: {item!r} is not WORKLOAD:CONFIG (workloads {', '.join(loads)}; "
                                 f"configs {', '.join(CONFIGS)})")
            pairs.append((loads[w], c))
        return pairs
    chosen = [w.strip() for w in a.workloads.split(",") if w.strip()]
    bad = [w for w in chosen if w not in loads]
    if bad:
        raise SystemExit(f"--workloads: unknown {', '.join(bad)}; accepted values: {', '.join(loads)}")
    if a.pd:
        names = parse_names(a.configs) if a.configs else list(PD_CONFIGS)
        other = [n for n in names if n not in PD_CONFIGS]
        if other:
            raise SystemExit(f"--pd: {', '.join(other)} are not PD configurations ({', '.join(PD_CONFIGS)})")
        # the baseline first (its servers take the capacity probes), then the non-disaggregated
        # reference (the outputs the others are checked against as they run); configuration by
        # configuration, so each deployment is launched once for all workloads
        first = [n for n in (a.pd_baseline, PD_REFERENCE) if n in names]
        names = first + [n for n in names if n not in first]
        return [(loads[w], c) for c in names for w in chosen]
    names = parse_names(a.configs) if a.configs else list(HICACHE_NAMES)
    names = [BASELINE] + [n for n in names if n != BASELINE]   # the baseline first: the output reference
    # LMCache in front: its servers are launched for each configuration, so those run last,
    # configuration by configuration (one launch for all workloads)
    return [(loads[w], c) for w in chosen for c in names if c not in LMCACHE_CONFIGS] + \
        [(loads[w], c) for c in names if c in LMCACHE_CONFIGS for w in chosen]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvconnect bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--workloads", default="w1,w2,w3", help="comma-separated: w1 (shared prefix), w2 (multi-turn), "
                   "w3 (production trace) (default: all)")
    g.add_argument("--configs", default="", help=f"comma-separated, default all: {', '.join(CONFIGS)}")
    g.add_argument("--pairs", default="", help="explicit WORKLOAD:CONFIG list in run order (overrides the two above)")
    g.add_argument("--list-configs", action="store_true", help="describe the configurations and exit")
    g.add_argument("--quick", action="store_true", help="tiny workloads (a smoke run)")
    g.add_argument("--pd", action="store_true", help="1P1D PD disaggregation behind sglang_router "
                   "--pd-disaggregation (prefill on the first of --gpus, decode on the second; default 0,1), "
                   "the PD configurations; results to pd_serving.json")
    g.add_argument("--pd-baseline", default=PD_BASELINE, help=f"--pd: the configuration the capacity probe runs "
                   f"on and the others are compared with (default {PD_BASELINE})")
    g.add_argument("--pd-decode-delay-s", type=float, default=2.0,
                   help="--pd, the *_late configurations: decode's request reaches it this long after prefill's")
    g.add_argument("--deadline-s", type=float, default=0, help="start no pair after this many seconds (0: none)")
    g.add_argument("--budget-s", type=float, default=0,
                   help="like --deadline-s, and the pairs reordered so the most informative finish first: each "
                        "workload's baseline, then every kvconnect store next to the alternative it replaces")
    g.add_argument("--resume", action="store_true",
                   help="keep the pairs OUT/runs.jsonl already measured (and its capacity probes), run the rest")
    g.add_argument("--load-fraction", type=float, default=0.7,
                   help="offer W1/W2 at this share of the capacity a probe measures on the baseline first "
                        "(0: the --wN-rate as given); pairs above 0.9 are flagged overloaded")
    g.add_argument("--capacity-requests", type=int, default=128, help="requests (chat turns) in the capacity probe")
    g.add_argument("--report", metavar="DIR", nargs="+",
                   help="only rebuild serving.json/png from DIR/runs.jsonl (several DIRs: the latest run of each "
                        "pair wins) into --out")
    s = p.add_argument_group("servers")
    s.add_argument("--servers", type=int, default=2, help="SGLang servers (default 2)")
    s.add_argument("--gpus", default="0", help="GPU ids, server i uses gpus[i %% len] (default 0: all share GPU 0)")
    s.add_argument("--shape", default="llama3-8b", help="dummy model shape: llama3-8b | llama-1b")
    s.add_argument("--model-path", default=None, help="a real model directory instead of dummy weights")
    s.add_argument("--mem-fraction", type=float, default=0.35, help="--mem-fraction-static per server")
    s.add_argument("--max-total-tokens", type=int, default=32768, help="GPU KV tokens per server")
    s.add_argument("--hicache-ratio", type=float, default=1.2, help="host pool / GPU pool (the guides: 1.2)")
    s.add_argument("--router-policy", default="round_robin", help="sglang_router policy (round_robin, cache_aware)")
    s.add_argument("--server-module", default="sglang.launch_server", help=argparse.SUPPRESS)
    s.add_argument("--kv-device", default="cuda", help=argparse.SUPPRESS)   # cpu: the CPU stand-in servers
    s.add_argument("--server-arg", action="append", default=[], help="extra sglang.launch_server argument (repeat)")
    s.add_argument("--l3-per-server", default="16gb", help="memory each server lends (peer pools, memory store)")
    s.add_argument("--l3-file-size", default="32gb", help="size of the hf3fs files (kvconnect's and SGLang's)")
    s.add_argument("--write-behind", default="0", help="kvconnect configurations: the adapter's write_behind, a "
                   "staging buffer per server for L3 writes (e.g. 4gb; default 0: write through, as the guides deploy)")
    s.add_argument("--lmcache-l1-gb", type=float, default=8.0,
                   help="lmcache_* configurations: the lmcache server's L1 (host memory, GB; default 8)")
    s.add_argument("--port-base", type=int, default=0, help="offset added to every port")
    s.add_argument("--workdir", default="/tmp/kvconnect-serve", help="logs, model, store data")
    s.add_argument("--out", default=None, help="raw results of this run: runs.jsonl, requests.jsonl.gz "
                   "(default: WORKDIR/out)")
    s.add_argument("--results-dir", default=str(RESULTS), help="where serving.json and serving.png go "
                   "(default: benchmarks/results)")
    s.add_argument("--probe", type=int, default=8, help="prompts in the output check of each pair")
    w = p.add_argument_group("workloads (defaults: the guides' shapes, scaled to one GPU)")
    for wl, (_, knobs) in WORKLOAD_KNOBS.items():
        for k, kind, default, doc in knobs:
            w.add_argument(f"--{wl}-{k.replace('_', '-')}", type=kind, default=default, help=doc)
    return p


def render(run_dirs: list, out: Path, command: str, pd: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if pd:
        from .serving import pd_report

        return pd_report.render([Path(d) for d in run_dirs], out / "pd_serving.json", command)
    doc = report.build([Path(d) for d in run_dirs], out / "serving.json", command)
    png = report.plot([Path(d) for d in run_dirs], doc, out / "serving.png")
    print(f"results written to {out / 'serving.json'}" + (f" and {png}" if png else ""))
    for t in doc["targets"]:
        print(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['value']} (bound {t['bound']})")
    for w, b in doc["bounds"].items():
        print(f"  {w}: what any L3 could do here: " + ", ".join(f"{k} {v}" for k, v in b.items()))
    for w, by_cfg in doc["figures"].items():
        for c, f in by_cfg.items():
            io = f.get("store_io", {})
            moved = [f"{op} {v['bytes'] / 1e9:.4g} GB in {v['seconds']:.4g} s ({v['gb_per_s']} GB/s, "
                     f"{v['ms_per_call']} ms a call)" for op, v in io.items() if v.get("bytes") and v.get("gb_per_s")]
            if moved:
                print(f"  {w}/{c} store time: " + "; ".join(moved))
    return doc


def _stop_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C: servers and services are stopped, measured pairs are kept."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.list_configs:
        for name, c in CONFIGS.items():
            print(f"{name:<18} {c.kind:<9} {c.description}")
        return 0
    if a.report:
        render(a.report, Path(a.results_dir), "kvconnect bench serve --report " + " ".join(a.report), a.pd)
        return 0
    loads = build_workloads(a)
    pairs = plan_pairs(a, loads)
    if a.budget_s and not a.pd:   # --pd keeps its order: each deployment launches once
        pairs = by_information(pairs)
    gpus = tuple(x for x in a.gpus.split(",") if x)
    if a.pd and len(gpus) < 2:
        gpus = ("0", "1") if gpus == ("0",) else gpus + gpus   # prefill on the first, decode on the second
    # --pd: the non-disaggregated reference is one server, on the prefill's GPU
    spec = ServerSpec(servers=1 if a.pd else a.servers, gpus=gpus, shape=a.shape,
                      model_path=a.model_path, mem_fraction=a.mem_fraction, max_total_tokens=a.max_total_tokens,
                      hicache_ratio=a.hicache_ratio, router_policy=a.router_policy,
                      extra_args=tuple(a.server_arg), server_module=a.server_module, kv_device=a.kv_device)
    out = Path(a.out or Path(a.workdir) / "out")
    l3_per_server, l3_file = ("256mb", "1gb") if a.quick else (a.l3_per_server, a.l3_file_size)
    limit_s = min(x for x in (a.deadline_s, a.budget_s, float("inf")) if x)
    plan = Plan(pairs, spec, Path(a.workdir), out, default_ports(a.port_base), a.probe,
                deadline=time.time() + limit_s if limit_s != float("inf") else 0.0, l3_bytes_per_server=l3_per_server,
                l3_file_bytes=parse_size(l3_file), write_behind="64mb" if a.quick else a.write_behind,
                load_fraction=a.load_fraction, capacity_requests=a.capacity_requests, resume=a.resume,
                pd_decode_delay_s=a.pd_decode_delay_s, lmcache_l1_gb=0.25 if a.quick else a.lmcache_l1_gb,
                **({"baseline": a.pd_baseline, "reference": PD_REFERENCE} if a.pd else {}))
    where = f"PD 1P1D on GPUs {gpus[0]} (prefill) and {gpus[1]} (decode)" if a.pd else f"{a.servers} servers"
    print(f"[serve] {len(pairs)} pairs on {where}: " + ", ".join(f"{w.name}:{c}" for w, c in pairs), flush=True)
    _stop_on_sigterm()
    records = execute(plan)
    render([out], Path(a.results_dir), "kvconnect bench serve " + " ".join(sys.argv[1:] if argv is None else argv),
           a.pd)
    # a configuration its store cannot serve here (the relay's capability check) is a finding, not a failure
    return 0 if records and all("summary" in r or r.get("refused") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
