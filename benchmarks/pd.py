"""PD transfer: time from prefill's first ``send()`` to decode-side ``KVPoll.Success``.

For 1, 8 and 64 concurrent requests of 8k tokens of Llama-8B-shaped KV (8 KV heads x 128
head dim, bf16, 4 KiB per token per layer), per kvconnect transport (``peer_rdma`` direct,
``mooncake`` and ``hf3fs`` store relay), side by side with SGLang's own ``mooncake``
transfer backend over TCP (``mooncake_tcp``) in the same run. Both sides are real SGLang
0.5.23 classes in two processes on CPU (``kvconnect.connectors.testing.pd``), in a
loopback-only network namespace.

Memory: a full Llama-8B request (32 layers, 8k tokens) is 1 GiB; 64 of them do not fit this
machine, so by default every request carries ``--layers 1`` (32 MiB per request, 2 GiB per
64-request wave on each side). Bytes scale linearly with layers; say so when quoting.

    .venv/bin/python -m kvconnect.benchmarks.pd            # full: 8192 tokens, waves 1/8/64
    .venv/bin/python -m kvconnect.benchmarks.pd --quick    # 1024 tokens, same waves (CI smoke)

Writes benchmarks/results/pd.json (ratio = reference seconds / ours: > 1 means faster).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any


from kvconnect.benchmarks.harness import load_limits, machine_info

LLAMA8B = {"heads": 8, "head_dim": 128, "dtype": "bfloat16"}
BYTES_PER_TOKEN_LAYER = 2 * 8 * 128 * 2


def _waves(levels: list[int], npages: int, chunk_pages: int, base: int) -> list[list[dict]]:
    return [[{"room": base + 1000 * w + i, "npages": npages, "chunk_pages": chunk_pages} for i in range(n)]
            for w, n in enumerate(levels)]


def run_transport(name: str, pd_config: dict | None, backend: str, args: argparse.Namespace,
                  plugin_path: str | None, stores_env: dict, ns: Any, port: int) -> dict[str, Any]:
    from kvconnect.connectors.testing import pd as pdt

    npages = args.tokens // args.page_size
    chunk_pages = max(1, args.chunk_tokens // args.page_size)
    # wave 0 warms up (connections, threads, store lanes) and is not reported
    waves = _waves([2] + args.levels, npages, chunk_pages, base=(port * 1_000_003) % (1 << 40))
    pool_pages = max(args.levels) * npages + 2
    common = {**LLAMA8B, "layers": args.layers, "page_size": args.page_size, "pool_pages": pool_pages,
              "aux_slots": max(args.levels) + 8, "waves": waves, "deadline_s": args.deadline_s,
              "bootstrap_port": port, "http_port": port + 1, "verify": args.quick, "alloc": "sequential",
              "settle_s": 0.2}
    env = dict(stores_env)
    if backend == "mooncake_tcp":
        env["MC_FORCE_TCP"] = "1"
    with pdt.pair(common, {}, {}, pd_config, plugin_path, ns=ns, **env) as p:
        p.specs["prefill"]["backend"] = p.specs["decode"]["backend"] = backend
        p.start("prefill")
        p.start("decode")
        dec = p.wait("decode", args.deadline_s * len(waves) + 120)
        p.stop()
        pre = p.wait("prefill", 60)
    out = {"name": name, "backend": backend, "config": pd_config, "levels": [],
           "store_stats": {"prefill": pre.get("leftovers", {}).get("store_stats"),
                           "decode": dec.get("leftovers", {}).get("store_stats")}}
    for level, wave, dres, pres in zip(args.levels, waves[1:], dec["waves"][1:], pre["waves"][1:]):
        lat, starts, ends, failed = [], [], [], 0
        for r in wave:
            d, s = dres.get(str(r["room"]), {}), pres.get(str(r["room"]), {})
            wrong = d.get("pages_ok") is False or d.get("aux_ok") is False  # --quick checks every byte
            if d.get("status") != "success" or not s.get("t_first_send") or wrong:
                failed += 1
                continue
            lat.append(d["t_done"] - s["t_first_send"])
            starts.append(s["t_first_send"])
            ends.append(d["t_done"])
        wall = (max(ends) - min(starts)) if ends else None
        nbytes = level * npages * args.page_size * BYTES_PER_TOKEN_LAYER * args.layers
        out["levels"].append({
            "concurrency": level, "failed": failed, "bytes": nbytes, "wall_seconds": wall,
            "latency_median_s": statistics.median(lat) if lat else None,
            "latency_max_s": max(lat) if lat else None,
            "gib_per_s": (nbytes / wall / (1 << 30)) if wall else None,
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1024 tokens per request, every byte checked (CI)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per request (default 8192; quick 1024)")
    ap.add_argument("--layers", type=int, default=1, help="Llama-8B layers carried per request (full model: 32)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=4096, help="chunked-prefill size")
    ap.add_argument("--levels", type=str, default="1,8,64")
    ap.add_argument("--transports", type=str, default="peer_rdma,mooncake,hf3fs,sglang_mooncake")
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--out", type=str, default=None)
    ap.add_argument("--pd-config", type=str, default="{}",
                    help="extra KVCONNECT_PD_CONFIG keys for the kvconnect transports (JSON)")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (1024 if args.quick else 8192)
    args.levels = [int(x) for x in args.levels.split(",")]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if "sglang_mooncake" in transports and len(transports) > 1:
        # the machine is shared and noisy: bracket kvconnect's runs with the reference, average both
        transports = ["sglang_mooncake"] + [t for t in transports if t != "sglang_mooncake"] + ["sglang_mooncake"]
    import json

    extra = json.loads(args.pd_config)

    import tempfile

    from kvconnect.benchmarks.harness import BenchResult
    from kvconnect.connectors.testing import pd as pdt

    t0 = time.time()
    results: list[dict] = []
    segment = f"{max(1, (max(args.levels) * args.tokens * BYTES_PER_TOKEN_LAYER * args.layers) // (1 << 30) + 1)}gb"
    with tempfile.TemporaryDirectory(prefix="kvcpd-bench-") as workdir:
        plugin_path = pdt.plugin_dist_dir(os.path.join(workdir, "ep"))
        port = 19400
        for t in transports:
            port += 10
            with contextlib.ExitStack() as stack:
                if t in ("mooncake", "hf3fs"):
                    try:
                        ns, opts, _ = stack.enter_context(pdt.store_service(t, workdir, segment=segment))
                    except pdt.StoreUnavailable as e:
                        print(f"[pd] skipping {t}: {e}", file=sys.stderr)
                        continue
                    res = run_transport(f"kvconnect {t} relay", {**extra, "transport": "relay",
                                                                  "store": {"store": t, **opts}},
                                        "kvconnect", args, plugin_path, {}, ns, port)
                else:
                    ns = stack.enter_context(pdt.loopback_ns("kvcpd"))
                    if t == "sglang_mooncake":
                        res = run_transport("sglang mooncake_tcp (reference)", None, "mooncake_tcp", args, None, {},
                                            ns, port)
                    elif t == "peer_rdma":
                        res = run_transport("kvconnect peer_rdma", {**extra, "transport": "direct", "protocol": "tcp"},
                                            "kvconnect", args, plugin_path, {}, ns, port)
                    else:
                        raise SystemExit(f"unknown transport {t!r}")
            results.append(res)
            for lv in res["levels"]:
                print(f"[pd] {res['name']:34s} x{lv['concurrency']:<3d} wall={lv['wall_seconds'] or float('nan'):.3f}s "
                      f"median={lv['latency_median_s'] or float('nan'):.3f}s "
                      f"{lv['gib_per_s'] or float('nan'):.2f} GiB/s failed={lv['failed']}", flush=True)

    bench = BenchResult("pd", params={
        "tokens": args.tokens, "layers": args.layers, "page_size": args.page_size, "levels": args.levels,
        "bytes_per_token": BYTES_PER_TOKEN_LAYER * args.layers, "quick": args.quick,
        "note": "Llama-8B layer shape (8 KV heads x 128, bf16); per-request bytes = tokens x 4 KiB x layers; "
                "TCP over loopback in a network namespace on a shared 2-core machine; the reference runs "
                "before and after kvconnect's transports and its mean wall time is the ratio base",
    })
    refs = [r for r in results if r["backend"] == "mooncake_tcp"]
    ref = None
    if refs:
        ref = {"name": refs[0]["name"], "backend": "mooncake_tcp", "runs": [r["levels"] for r in refs], "levels": []}
        for per_level in zip(*ref["runs"]):
            walls = [lv["wall_seconds"] for lv in per_level if lv["wall_seconds"]]
            ref["levels"].append({**per_level[0], "wall_seconds": statistics.mean(walls) if walls else None,
                                  "wall_seconds_runs": walls})
    for r in results:
        if any(r.get("store_stats", {}).values()):
            bench.notes.append(f"{r['name']} store calls (whole run, warm-up included): {json.dumps(r['store_stats'])}")
    for r in [x for x in results if x["backend"] != "mooncake_tcp"] + ([ref] if ref else []):
        bench.figures[r["name"]] = r["levels"]
        if ref is None or r is ref:
            continue
        for ours, theirs in zip(r["levels"], ref["levels"]):
            if ours["wall_seconds"] and theirs["wall_seconds"]:
                bench.ratio(f"{r['name']} x{ours['concurrency']} send->Success seconds", ours["wall_seconds"],
                            theirs["wall_seconds"], reference_system="SGLang 0.5.23 mooncake backend over TCP",
                            higher_is_better=False)
    bench.limits = load_limits()
    path = bench.finish(args.out)
    print(f"[pd] wrote {path} in {time.time() - t0:.0f}s; machine {machine_info().get('loadavg')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
