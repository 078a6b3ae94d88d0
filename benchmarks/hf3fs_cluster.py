"""HF3FS page index on Redis Cluster: lookup throughput with 1 and 3 shards, same clients, same run.

Run: ``kvconnect bench hf3fs_cluster [--quick]`` or ``python -m kvconnect.benchmarks.hf3fs_cluster [--quick]``.

Two Redis Clusters side by side (``RedisClusterSet``: real ``redis-server --cluster-enabled
yes`` on 127.0.0.1, AOF every second, no replicas: lookups do not replicate), one of 1 primary
and one of 3 (the hash slots split evenly), each holding the same namespaces with the same
keys. ``--clients`` worker processes (12) send lookups through ``RedisMetadata`` over
``redis+cluster://``: ``exists`` of 128 keys (what SGLang's ``batch_exists`` asks; one script
call on one shard), cycling over the namespaces; passes of ``--seconds`` alternate between
the two clusters, ``--reps`` times, and each rep drives each shard of the 3-shard cluster alone
too (all clients on that shard's namespaces only).

**The namespace mix.** One namespace (key prefix = model deployment, TP rank, pool) lives on
one shard, so a single engine's lookups never spread: shards add throughput only across
namespaces. The mix is six model deployments at TP 8 with their KV pool (48 namespaces, every
namespace looked up equally often), a cluster serving several models' engines. Hashing puts
14 / 17 / 17 of them on the three shards: the best 3-shard figure this mix allows is
48 / 17 = 2.82x of one shard (``ceiling_from_placement``).

**The bound of the machine.** Per pass the benchmark reads each server's CPU time (``INFO
cpu``) and each client's (its process time): ``server_cpu_us_per_call`` (per shard),
``client_cpu_us_per_call``, ``busy_cores`` (all of them over the wall time) and
``machine_busy_fraction`` (the whole machine, other work included, from /proc/stat). Where the
machine is busy (>= 0.9) the measured ratio is the machine's, not the index's. Then ``capacity/3_vs_1_shards`` says what the servers allow, from their measured CPU
per call and the measured share of each shard, with a core per shard (the busiest shard
saturates first): ``(1 / max_i(share_i * us_per_call_i)) / (1 / us_per_call_1)``. On a
crowded machine a shard serving a third of the calls is woken per call and costs more per
call than one kept busy; ``capacity_saturated/3_vs_1_shards`` therefore takes each shard's CPU
per call from the pass that drives it alone (as busy as the 1-shard cluster), and
``shard_alone_vs_1_shard_cluster`` compares such a shard's throughput with the 1-shard
cluster's (a shard of a cluster costs what a cluster of one costs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `connectors` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult  # noqa: E402

MODELS = ("llama-3-8b", "qwen2.5-7b", "mistral-7b", "deepseek-v2-lite", "llama-3-70b", "qwen2.5-32b")
TP = 8
BATCH = 128
KEYS_PER_NS = 1024
NUM_PAGES = 4096
PAGE_BYTES = 4096


def namespaces() -> list[tuple[str, str]]:
    """(key prefix, namespace) of the mix: a deployment per model, a namespace per TP rank."""
    return [(f"kvc:{m}", f"{r}:kv") for m in MODELS for r in range(TP)]


def ns_keys(prefix: str, ns: str) -> list[bytes]:
    """Page keys as SGLang sends them: SHA-256 hex (the index reads their digest, no hashing)."""
    return [hashlib.sha256(f"{prefix}/{ns}/page-{i}".encode()).hexdigest().encode() for i in range(KEYS_PER_NS)]


def _client(url: str, prefix: str):
    """An index client of one deployment (an engine's, with its key prefix)."""
    from kvconnect.connectors.hf3fs.redis_index import RedisMetadata

    return RedisMetadata(url, timeout=5.0, key_prefix=prefix)


def load(url: str) -> None:
    """Every namespace of the mix with ``KEYS_PER_NS`` confirmed keys."""
    from kvconnect.connectors.hf3fs.index import PUT_OK

    clients = {}
    for prefix, ns in namespaces():
        c = clients.get(prefix) or clients.setdefault(prefix, _client(url, prefix))
        c.initialize(ns, NUM_PAGES, PAGE_BYTES)
        keys = ns_keys(prefix, ns)
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            slots, gens = c.lease(ns, len(batch))
            if c.put(ns, batch, slots, gens, [0] * len(batch)) != bytes([PUT_OK]) * len(batch):
                raise RuntimeError(f"loading {prefix}/{ns}: not every key stored")
    for c in clients.values():
        c.close()


# ---------------------------------------------------------------------------- worker process


def worker(cfg_path: Path) -> None:
    """Connect and warm up, say so (``<out>.ready``), wait for ``<cfg>.go`` (the pass's start
    and end, wall clock: every worker the same), send lookups until the end; figures to
    ``<out>``."""
    cfg = json.loads(cfg_path.read_text())
    rng = random.Random(cfg["seed"])
    mix = [tuple(x) for x in cfg["namespaces"]]
    clients = {p: _client(cfg["url"], p) for p in {p for p, _ in mix}}
    work = []
    for prefix, ns in mix:
        keys = ns_keys(prefix, ns)
        work.append((clients[prefix], ns, [keys[i:i + BATCH] for i in range(0, len(keys), BATCH)]))
    rng.shuffle(work)  # each worker its own order of the namespaces
    for c, ns, batches in work:  # scripts loaded, connections open
        c.exists(ns, batches[0])
    Path(cfg["out"] + ".ready").write_text("1")
    go = Path(str(cfg_path) + ".go")
    while not go.exists():
        time.sleep(0.002)
    t_go, until = json.loads(go.read_text())
    while time.time() < t_go:
        time.sleep(0.0005)
    calls = hits = 0
    cpu0 = time.process_time()
    i = 0
    while time.time() < until:
        c, ns, batches = work[i % len(work)]
        hits += c.exists(ns, batches[(i // len(work)) % len(batches)]).count(1)
        calls += 1
        i += 1
    out = {"calls": calls, "hits": hits, "cpu_s": time.process_time() - cpu0}
    for c in clients.values():
        c.close()
    Path(cfg["out"]).write_text(json.dumps(out))


# ---------------------------------------------------------------------------- the run


def _server_cpu(node) -> float:
    info = node.command("INFO", "cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat), every process's, not only ours."""
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)
    return sum(v) - idle, sum(v)


def _calls_by_node(node) -> int:
    stats = node.command("INFO", "commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def run_pass(cluster, clients: int, seconds: float, tmp: Path, tag: str, mix: list | None = None) -> dict:
    """One pass: ``clients`` worker processes looking up the namespaces of ``mix`` (default:
    all) for ``seconds``; the figures, the servers' CPU and command counts included."""
    procs, outs = [], []
    for w in range(clients):
        out = tmp / f"{tag}-w{w}.json"
        cfg_path = tmp / f"{tag}-w{w}.cfg"
        outs.append(out)
        cfg_path.write_text(json.dumps({"url": cluster.url, "seed": w, "out": str(out),
                                        "namespaces": mix or namespaces()}))
        procs.append(cfg_path)
    started = [subprocess.Popen([sys.executable, "-m", "kvconnect.benchmarks.hf3fs_cluster", "--worker", str(p)],
                                stdout=subprocess.DEVNULL, stderr=open(str(p) + ".err", "w")) for p in procs]
    try:
        deadline = time.monotonic() + 120
        while not all(Path(str(o) + ".ready").exists() for o in outs):
            for p, path in zip(started, procs):
                if p.poll() is not None:
                    raise RuntimeError(f"worker exited {p.returncode}: {Path(str(path) + '.err').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("benchmark workers did not start")
            time.sleep(0.02)
        t_go = time.time() + 0.2
        primaries = cluster.primaries()
        cpu0 = {n.addr: _server_cpu(n) for n in primaries}
        machine0 = _machine_cpu()
        calls0 = {n.addr: _calls_by_node(n) for n in primaries}
        for path in procs:  # the start, known once all are ready
            tmp_go = Path(str(path) + ".go.tmp")
            tmp_go.write_text(json.dumps([t_go, t_go + seconds]))
            tmp_go.rename(str(path) + ".go")
        for p in started:
            p.wait(seconds + 120)
        machine1 = _machine_cpu()
        wall = time.time() - t_go
        cpu = {n.addr: _server_cpu(n) - cpu0[n.addr] for n in primaries}
        calls_by = {n.addr: _calls_by_node(n) - calls0[n.addr] for n in primaries}
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    res = [json.loads(o.read_text()) for o in outs]
    calls = sum(r["calls"] for r in res)
    client_cpu = sum(r["cpu_s"] for r in res)
    server_cpu = sum(cpu.values())
    return {
        "shards": len(primaries), "calls": calls, "wall_s": round(wall, 3),
        "lookups_per_s": round(calls / seconds, 1), "keys_per_s": round(calls * BATCH / seconds, 1),
        "hit_ratio": round(sum(r["hits"] for r in res) / max(1, calls * BATCH), 6),
        "server_cpu_s": {a: round(v, 3) for a, v in cpu.items()},
        "calls_by_shard": calls_by,
        "server_cpu_us_per_call": {a: round(cpu[a] / calls_by[a] * 1e6, 2) if calls_by[a] else None for a in cpu},
        "client_cpu_s": round(client_cpu, 3),
        "client_cpu_us_per_call": round(client_cpu / max(1, calls) * 1e6, 2),
        "busy_cores": round((server_cpu + client_cpu) / seconds, 3),
        # the whole machine's, other work included: near 1, the pass was bound by the CPU
        "machine_busy_fraction": round((machine1[0] - machine0[0]) / max(1.0, machine1[1] - machine0[1]), 3),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def capacity(p: dict) -> float:
    """Lookups/s the servers allow with a core per shard: the busiest shard saturates first."""
    total = sum(p["calls_by_shard"].values())
    worst = max(p["calls_by_shard"][a] / total * p["server_cpu_us_per_call"][a]
                for a in p["calls_by_shard"] if p["calls_by_shard"][a])
    return 1e6 / worst


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvconnect bench hf3fs_cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition of 1 s passes (~30 s)")
    ap.add_argument("--clients", type=int, default=12,
                    help="client processes, the same for both clusters (default 12: enough lookups in flight "
                         "to keep a server busy, not woken per call)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per pass (default 4; quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="passes per cluster, alternating (default 3; quick 1)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/hf3fs_cluster.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0

    from kvconnect.connectors.testing.redis_cluster import RedisClusterSet, redis_skip_reason

    skip = redis_skip_reason()
    if skip:
        print(f"kvconnect bench hf3fs_cluster: {skip}", file=sys.stderr)
        return 2
    seconds = args.seconds or (1.0 if args.quick else 4.0)
    reps = args.reps or (1 if args.quick else 3)
    result = BenchResult("hf3fs_cluster", params={
        "quick": args.quick, "clients": args.clients, "seconds_per_pass": seconds, "reps": reps, "batch": BATCH,
        "op": "exists", "namespaces": len(namespaces()), "mix": f"{len(MODELS)} model deployments x TP {TP}, kv pool",
        "keys_per_namespace": KEYS_PER_NS, "replicas": 0, "appendfsync": "everysec"})
    result.limits["cores"] = os.cpu_count()
    result.notes.append("machine shared with other work: absolute figures move with load (machine.loadavg); "
                        "the two clusters' passes alternate in one run")
    tmp = Path(tempfile.mkdtemp(prefix="kvc-cluster-bench-"))
    clusters = {}
    try:
        for shards in (1, 3):
            print(f"[hf3fs_cluster] starting a {shards}-shard cluster and loading {len(namespaces())} namespaces",
                  flush=True)
            clusters[shards] = RedisClusterSet(shards=shards, replicas=0, workdir=tmp / f"c{shards}").start()
            load(clusters[shards].url)
        c3 = clusters[3]
        placement: dict[str, list[tuple[str, str]]] = {}
        for prefix, ns in namespaces():
            key = f"{prefix}:{{{prefix}/{ns}}}:m"
            placement.setdefault(c3.primary_for(key).addr, []).append((prefix, ns))
        result.figures["placement_3_shards"] = {a: len(v) for a, v in placement.items()}
        result.figures["ceiling_from_placement"] = round(len(namespaces()) / max(map(len, placement.values())), 3)
        passes: dict[int, list] = {1: [], 3: []}
        alone: dict[str, list] = {a: [] for a in placement}
        for rep in range(reps):
            for shards in ((1, 3) if rep % 2 == 0 else (3, 1)):
                p = run_pass(clusters[shards], args.clients, seconds, tmp, f"r{rep}s{shards}")
                passes[shards].append(p)
                print(f"[hf3fs_cluster] rep {rep + 1}/{reps}, {shards} shard(s): {p['lookups_per_s']:.0f} lookups/s "
                      f"({p['keys_per_s']:.0f} keys/s), busy cores {p['busy_cores']:.2f}, hit ratio {p['hit_ratio']}",
                      flush=True)
            for addr, mix in placement.items():  # each shard of the 3 driven alone, by all the clients
                p = run_pass(c3, args.clients, seconds, tmp, f"r{rep}a{addr.replace(':', '_')}", mix)
                alone[addr].append(p)
                print(f"[hf3fs_cluster] rep {rep + 1}/{reps}, shard {addr} alone ({len(mix)} namespaces): "
                      f"{p['lookups_per_s']:.0f} lookups/s, busy cores {p['busy_cores']:.2f}", flush=True)
        result.figures["passes"] = passes
        result.figures["alone_passes"] = alone
        summary = {}
        for shards, ps in passes.items():
            summary[shards] = {
                "lookups_per_s": _median([p["lookups_per_s"] for p in ps]),
                "busy_cores": _median([p["busy_cores"] for p in ps]),
                "machine_busy_fraction": _median([p["machine_busy_fraction"] for p in ps]),
                "client_cpu_us_per_call": _median([p["client_cpu_us_per_call"] for p in ps]),
                "server_cpu_us_per_call": _median([u for p in ps for u in p["server_cpu_us_per_call"].values() if u]),
                "capacity_lookups_per_s": round(_median([capacity(p) for p in ps]), 1),
                "hit_ratio": min(p["hit_ratio"] for p in ps),
            }
        share = {a: len(v) / len(namespaces()) for a, v in placement.items()}
        us_alone = {a: _median([p["server_cpu_us_per_call"][a] for p in ps]) for a, ps in alone.items()}
        summary["alone"] = {a: {"lookups_per_s": _median([p["lookups_per_s"] for p in ps]),
                                "server_cpu_us_per_call": us_alone[a], "share": round(share[a], 4)}
                            for a, ps in alone.items()}
        # each shard's server as busy as the 1-shard one (driven alone): its CPU per lookup, and the
        # busiest shard (share x CPU per lookup) saturating its core first
        summary[3]["capacity_saturated_lookups_per_s"] = round(1e6 / max(share[a] * us_alone[a] for a in share), 1)
        summary[1]["capacity_saturated_lookups_per_s"] = summary[1]["capacity_lookups_per_s"]
        result.figures["summary"] = summary
        cores = os.cpu_count() or 1
        bound = summary[3]["machine_busy_fraction"] >= 0.9
        result.limits["cpu_bound_3_shards"] = bound
        result.ratio("lookup_throughput/3_vs_1_shards", summary[3]["lookups_per_s"], summary[1]["lookups_per_s"],
                     "the same index on 1 shard (same clients, same run), measured")
        result.ratio("capacity/3_vs_1_shards", summary[3]["capacity_lookups_per_s"],
                     summary[1]["capacity_lookups_per_s"],
                     "1 shard: servers' measured CPU per lookup and shard shares, a core per shard")
        result.ratio("capacity_saturated/3_vs_1_shards", summary[3]["capacity_saturated_lookups_per_s"],
                     summary[1]["capacity_saturated_lookups_per_s"],
                     "1 shard: each shard's CPU per lookup when driven alone by all clients, shard shares, "
                     "a core per shard")
        result.ratio("shard_alone_vs_1_shard_cluster", _median([v["lookups_per_s"] for v in summary["alone"].values()]),
                     summary[1]["lookups_per_s"], "a 1-shard cluster, same clients, same run: a shard of three is as "
                     "fast as a cluster of one")
        if bound:
            result.notes.append(
                f"the 3-shard passes kept the machine's {cores} cores {summary[3]['machine_busy_fraction']:.0%} busy "
                f"({summary[3]['busy_cores']:.2f} cores of it this benchmark's servers and clients): the measured "
                "ratio is the machine's bound, not the index's; capacity/3_vs_1_shards is what the servers allow")
    finally:
        for c in clusters.values():
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
