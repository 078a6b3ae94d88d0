"""HF3FS page index on Redis + Sentinel: throughput vs the kvconnect service and SGLang's mini server, failover figures.

Run: ``kvconnect bench hf3fs_ha [--quick]`` or ``python -m kvconnect.benchmarks.hf3fs_ha [--quick]``.

Index (same run, same machine, each server its own process on 127.0.0.1): the Redis page
index (``RedisMetadata`` through ``redis+sentinel://``: a primary with AOF fsync every second,
one replica, three sentinels; Debian's redis-server 7.0) against ``kvconnect hf3fs-meta
serve`` (durable journal, fsync every 50 ms) and SGLang 0.5.23's
``mini_3fs_metadata_server`` (FastAPI, in memory), on the same batches of 128 keys: the
metadata work of writing new keys (reserve + confirm: for Redis a ``reserve`` script and a
``commit`` script; for the kvconnect service what its client sends, Lease + Put; for SGLang
``reserve_and_allocate_page_indices`` + ``confirm_write``), then get, then exists; with one
client thread and with ``--threads`` (8) threads sharing the batches; the systems' passes
interleaved in tenths. ``reserve_confirm_wait`` repeats the write row with ``WAIT 1``;
``roundtrip_floor`` sends one ``PING`` per batch on the Redis index's own connections (its
keys/s: 128 keys per round trip of nothing, the client + network + server dispatch floor).

Store (same run): ``HF3FSStore`` (POSIX client, one file, 512 KiB pages, batches of 128,
4 workers) with its index in the kvconnect service, in Redis with the page identity check
(``verify_pages: auto``, what a Redis index runs with), and in Redis without it; interleaved
repetitions (the order rotating), best of each. Sets write new keys into a file of three
batches (each set evicts the keys of the set two before and overwrites their pages: the dirty
page cache stays small, no set waits for disk writeback; the index runs its full-file path);
gets read the last set's keys (warm page cache).

Failover (``kvconnect.connectors.testing.hf3fs_failover``): per scenario (kill -9, SIGSTOP, network
partition, lagging replica promoted) and durability mode (``async``: AOF everysec,
asynchronous replication; ``wait``: the same + ``WAIT 1`` on every confirm), three store
processes writing and reading through Sentinel: ``confirmed_lost``, ``wrong_bytes``,
``seconds_to_first_hit``, ``calls_over_bound`` and more; plus the lagging case without the
identity check (the control: what the check prevents).

Ratios (> 1 = the Redis index better): ``index/<op>/c<threads>`` vs mini_3fs_metadata_server,
``index_vs_service/<op>/c<threads>`` vs the kvconnect service, ``store_get`` / ``store_set``
vs the store on the kvconnect service, ``verify_get`` / ``verify_set`` (the identity check on
vs off: its cost).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `connectors` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult, gib_per_s  # noqa: E402
from kvconnect.benchmarks.hf3fs import _best, _cpu, _free_port, _keys, _stop, _timed_split, _wait_port  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
ROOT = Path(__file__).resolve().parent.parent
MINI = "SGLang 0.5.23 mini_3fs_metadata_server (FastAPI, in-memory)"
SERVICE = "kvconnect hf3fs-meta serve (journal, fsync 50 ms)"
NS = "0:kv"


def _start_service(tmp: Path, port: int, token: str) -> subprocess.Popen:
    (tmp / "token").write_text(token)
    return subprocess.Popen([sys.executable, "-m", "kvconnect.connectors.cli", "--log-level", "WARNING", "hf3fs-meta", "serve",
                             "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp / "meta"),
                             "--token-file", str(tmp / "token")], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---------------------------------------------------------------------------------
# Index: Redis vs the kvconnect service vs mini_3fs_metadata_server
# ---------------------------------------------------------------------------------


def bench_index(result: BenchResult, ha, batches: int, concurrency: int, tmp: Path) -> None:
    from sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server import Hf3fsGlobalMetadataClient

    from kvconnect.connectors.hf3fs.client import RemoteMetadata
    from kvconnect.connectors.hf3fs.redis_index import RedisMetadata

    B = 128
    num_pages = batches * B * 8  # five passes write new keys, leases hold more: never evict
    sport, mport = _free_port(), _free_port()
    token = os.urandom(8).hex()
    svc_p = _start_service(tmp, sport, token)
    mini_p = subprocess.Popen([sys.executable, "-m", "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server",
                               "--host", "127.0.0.1", "--port", str(mport)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    redis_pid = ha.primary.proc.pid
    clients: list = []
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="index-client")
    try:
        _wait_port(sport, svc_p)
        _wait_port(mport, mini_p)
        rd = RedisMetadata(ha.url, timeout=30)
        rdw = RedisMetadata(ha.url, timeout=30, wait_replicas=1, wait_timeout=5)
        svc = RemoteMetadata(f"127.0.0.1:{sport}", token, timeout=30)
        svc.connect()
        mini = Hf3fsGlobalMetadataClient(f"http://127.0.0.1:{mport}")
        clients += [rd, rdw, svc]
        for c in (rd, svc):
            c.initialize(NS, num_pages, 4096)
        mini.initialize(0, num_pages)
        state: dict[str, list] = {}

        def fresh(tag: str) -> None:
            state["kb"] = [[k.encode() for k in _keys(B, f"{tag}{b}")] for b in range(batches)]
            state["ks"] = [[k.decode() for k in batch] for batch in state["kb"]]

        failed: dict[int, int] = {}

        def kv_rc(c):
            def run(a, b):
                for batch in state["kb"][a:b]:
                    st, sl, gn = c.reserve(NS, batch)
                    ok = c.commit(NS, batch, sl, gn, [0] * B, b"\x01" * B)
                    if ok != b"\x01" * B:  # with WAIT: a confirm no replica acknowledged in time
                        assert c.wait_replicas, ok
                        failed[id(c)] = failed.get(id(c), 0) + B - sum(ok)
            return run

        def kv_get(c):
            def run(a, b):
                for batch in state["kb"][a:b]:
                    assert min(c.get(NS, batch)[0]) >= 0
            return run

        def kv_exists(c):
            def run(a, b):
                for batch in state["kb"][a:b]:
                    assert c.exists(NS, batch) == b"\x01" * B
            return run

        def redis_ping(a, b):  # the round-trip floor: one no-op call per batch, same client path, no Lua
            for _ in range(a, b):
                rd._exec([b"*1\r\n$4\r\nPING\r\n"], time.monotonic() + 30)

        def mini_rc(a, b):
            for batch in state["ks"][a:b]:
                r = mini.reserve_and_allocate_page_indices(0, [(k, "") for k in batch])
                mini.confirm_write(0, [(k, i) for k, (_, i) in zip(batch, r)], [])

        def mini_get(a, b):
            for batch in state["ks"][a:b]:
                assert None not in mini.get_page_indices(0, batch)

        def mini_exists(a, b):
            for batch in state["ks"][a:b]:
                assert all(mini.exists(0, batch))

        # warm every client (connections, script cache, code paths) outside the measured keys
        fresh("warm")
        for c in (rd, svc):
            kv_rc(c)(0, 3)
        mini_rc(0, 3)
        svc.release_leases(NS)
        barrier = threading.Barrier(concurrency)
        list(pool.map(lambda _: barrier.wait(), range(concurrency)))

        def timed(fn, a: int, b: int, threads: int) -> float:
            return _timed_split(pool, fn, a, b, threads)

        n = batches * B
        chunk = max(1, batches // 10)
        fig: dict[str, Any] = {"batch": B, "batches": batches}
        pids = {"redis": redis_pid, "service": svc_p.pid, "mini": mini_p.pid}
        for threads in (1, concurrency):
            rows = [("reserve_confirm", {"redis": kv_rc(rd), "service": kv_rc(svc), "mini": mini_rc}),
                    ("get", {"redis": kv_get(rd), "service": kv_get(svc), "mini": mini_get}),
                    ("exists", {"redis": kv_exists(rd), "service": kv_exists(svc), "mini": mini_exists}),
                    ("reserve_confirm_wait", {"redis": kv_rc(rdw)}),
                    ("roundtrip_floor", {"redis": redis_ping})]
            for op, systems in rows:
                if op.startswith("reserve_confirm"):
                    fresh(f"{op}{threads}-")  # new keys, the same for every system
                secs = dict.fromkeys(systems, 0.0)
                cpu0 = {s: _cpu(pids[s]) for s in systems}
                for c in range(0, batches, chunk):
                    for s, fn in systems.items():
                        secs[s] += timed(fn, c, min(batches, c + chunk), threads)
                cpu = {s: _cpu(pids[s]) - cpu0[s] for s in systems}
                row = {f"{s}_keys_s": n / secs[s] for s in systems}
                row.update({f"{s}_server_cpu_us_per_key": cpu[s] / n * 1e6 for s in systems})
                if op == "reserve_confirm_wait":
                    row["redis_failed_writes"] = failed.pop(id(rdw), 0)  # WAIT not acknowledged in time
                fig[f"{op}/c{threads}"] = row
                print(f"[index {op}, {threads} client thread(s)] " + ", ".join(
                    f"{s} {n / secs[s]:,.0f} keys/s" for s in systems), flush=True)
        fig["loadavg"] = os.getloadavg()
        result.figures["index"] = fig
        for threads in (1, concurrency):
            for op in ("reserve_confirm", "get", "exists"):
                row = fig[f"{op}/c{threads}"]
                result.ratio(f"index/{op}/c{threads}", row["redis_keys_s"], row["mini_keys_s"],
                             f"{MINI}, {threads} client thread(s); ours: Redis + Sentinel (async, AOF everysec)")
            for op in ("reserve_confirm", "get", "exists"):
                row = fig[f"{op}/c{threads}"]
                result.ratio(f"index_vs_service/{op}/c{threads}", row["redis_keys_s"], row["service_keys_s"],
                             f"{SERVICE}, {threads} client thread(s)")
    finally:
        for c in clients:
            c.close()
        pool.shutdown()
        _stop(svc_p)
        _stop(mini_p)


# ---------------------------------------------------------------------------------
# Store: get / set through each index
# ---------------------------------------------------------------------------------


def bench_store(result: BenchResult, ha, page: int, batch: int, workers: int, reps: int, tmp: Path) -> None:
    from kvconnect.connectors.buffers import HostBuffer
    from kvconnect.connectors.hf3fs.config import HF3FSConfig
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.hf3fs.store import HF3FSStore

    port = _free_port()
    token = os.urandom(8).hex()
    (tmp / "svc").mkdir()
    svc_p = _start_service(tmp / "svc", port, token)
    # three batches: the sets of a run overwrite the same pages of the file (evicting the keys
    # of two sets before), so dirty page cache stays small and no set waits on disk writeback
    file_size = page * batch * 3
    buf = HostBuffer(batch, page, 1)
    for i in range(batch):
        ctypes.memset(buf.page(i)[0][0], (i * 7 + 1) & 0xFF, page)
    pages = [buf.page(i) for i in range(batch)]
    nbytes = page * batch
    stores: dict[str, HF3FSStore] = {}
    try:
        _wait_port(port, svc_p)
        common = {"file_size": file_size, "numjobs": workers, "entries": max(1, batch // workers)}
        systems = {
            "service": {"metadata_server_url": f"http://127.0.0.1:{port}", "auth_token": token},
            "redis": {"metadata_server_url": ha.url},
            "redis_noverify": {"metadata_server_url": ha.url, "verify_pages": "off", "metadata_key_prefix": "kvc:nv"},
        }
        for name, opts in systems.items():
            stores[name] = HF3FSStore(HF3FSConfig(file_path_prefix=str(tmp / name / "hicache"), **common, **opts),
                                      EngineContext(page_bytes=page))
        last: dict[str, list[str]] = {}

        def put(name, r):
            last[name] = _keys(batch, f"{name}-{r}")
            assert all(stores[name].put_from(last[name], pages))

        def get(name):
            assert all(stores[name].get_into(last[name], pages))

        for name in stores:
            put(name, 99)  # the first writes allocate the files' page cache
        t_set = {n: [] for n in stores}
        t_get = {n: [] for n in stores}
        names = list(stores)
        for r in range(reps):  # the order rotates each repetition: no system always follows another
            for name in names[r % 3:] + names[:r % 3]:
                t_set[name] += _best(lambda _: put(name, r), 1)
        for r in range(reps + 1):
            for name in names[r % 3:] + names[:r % 3]:
                t_get[name] += _best(lambda _: get(name), 1)
        tag = f"{page // KiB}KiB"
        fig = {f"set_gib_s/{n}": gib_per_s(nbytes, min(t)) for n, t in t_set.items()}
        fig.update({f"get_gib_s/{n}": gib_per_s(nbytes, min(t)) for n, t in t_get.items()})
        fig["stale_reads"] = {n: s.stale_reads for n, s in stores.items()}
        fig["loadavg"] = os.getloadavg()
        result.figures.setdefault("store", {})[f"{tag}/w{workers}"] = fig
        print(f"[store {tag}, {workers} workers] " + ", ".join(f"{k} {v:.2f}" for k, v in fig.items()
                                                             if isinstance(v, float)), flush=True)
        ref = f"HF3FSStore on the kvconnect service ({tag} pages, batch {batch}, {workers} workers)"
        result.ratio("store_get", fig["get_gib_s/redis"], fig["get_gib_s/service"], ref)
        result.ratio("store_set", fig["set_gib_s/redis"], fig["set_gib_s/service"], ref)
        ref = f"HF3FSStore on Redis with verify_pages off ({tag} pages): the identity check's cost"
        result.ratio("verify_get", fig["get_gib_s/redis"], fig["get_gib_s/redis_noverify"], ref)
        result.ratio("verify_set", fig["set_gib_s/redis"], fig["set_gib_s/redis_noverify"], ref)
    finally:
        for s in stores.values():
            s.close()
        _stop(svc_p)


# ---------------------------------------------------------------------------------
# Failover
# ---------------------------------------------------------------------------------

KEEP = ("confirmed", "confirmed_counted", "confirmed_lost", "wrong_bytes", "seconds_to_first_hit",
        "seconds_to_first_hit_min", "calls_over_bound", "bound_s", "max_call_s", "exceptions", "stale_reads",
        "failover_s", "gets", "hits", "puts", "wait_replicas", "appendonly", "appendfsync", "verify_pages")


def bench_failover(result: BenchResult, scenarios: list[str], modes: list[str], control: bool, tmp: Path) -> None:
    from kvconnect.connectors.testing.hf3fs_failover import run_scenario
    from kvconnect.connectors.testing.netns import netns_available

    why = netns_available()
    runs = [(s, m, "auto") for s in scenarios for m in modes]
    if control:
        runs.append(("lagging", "async", "off"))
    out = result.figures.setdefault("failover", {})
    for scenario, mode, verify in runs:
        if scenario in ("partition", "lagging") and why:
            out[f"{scenario}/{mode}"] = {"skipped": why}
            continue
        fig = run_scenario(scenario, mode, verify_pages=verify, workdir=str(tmp))
        key = f"{scenario}/{mode}" + ("/verify_off" if verify == "off" else "")
        out[key] = {k: fig[k] for k in KEEP}
        print(f"[failover {key}] " + ", ".join(f"{k}={fig[k]}" for k in KEEP[:7] + ("failover_s", "stale_reads")),
              flush=True)


# ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvconnect bench hf3fs_ha", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer batches and repetitions; failover: kill9 and lagging only (~2 min)")
    ap.add_argument("--batches", type=int, default=None, help="index batches of 128 keys (default 400; quick 80)")
    ap.add_argument("--threads", type=int, default=8, help="client threads of the concurrent index pass (default 8)")
    ap.add_argument("--page", type=int, default=512 * KiB, help="store page bytes (default 512 KiB)")
    ap.add_argument("--reps", type=int, default=None, help="store repetitions, best of (default 15; quick 6)")
    ap.add_argument("--skip-index", action="store_true")
    ap.add_argument("--skip-store", action="store_true")
    ap.add_argument("--skip-failover", action="store_true")
    ap.add_argument("--scenarios", default=None, help="comma-separated (default kill9,sigstop,partition,lagging)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/hf3fs_ha.json)")
    args = ap.parse_args(argv)

    from kvconnect.connectors.testing.redis_cluster import DURABILITY, SENTINEL_SETTINGS, RedisHA, redis_skip_reason

    why = redis_skip_reason()
    if why:
        print(f"kvconnect bench hf3fs_ha: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
    import logging

    import sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server  # noqa: F401 - sets logging up on import

    logging.getLogger().setLevel(logging.WARNING)
    batches = args.batches or (80 if args.quick else 400)
    reps = args.reps or (6 if args.quick else 15)
    scenarios = (args.scenarios.split(",") if args.scenarios else
                 (["kill9", "lagging"] if args.quick else ["kill9", "sigstop", "partition", "lagging"]))
    result = BenchResult("hf3fs_ha", params={
        "quick": args.quick, "index_batches": batches, "index_batch_keys": 128, "threads": args.threads,
        "store_page": args.page, "store_batch": 128, "store_workers": 4, "reps": reps, "scenarios": scenarios,
        "modes": {k: vars(v) for k, v in DURABILITY.items()}, "sentinel": SENTINEL_SETTINGS,
        "failover_client": {"client_timeout": 1.0, "meta_retries": 3, "workers": 3, "page": 8192, "batch": 8}})
    result.notes.append("machine shared with other work (2 vCPUs): figures move with load "
                        "(see machine.loadavg); compare ratios, which come from one run")
    tmp = Path(tempfile.mkdtemp(prefix="kvc-hf3fs-ha-bench-"))
    try:
        if not (args.skip_index and args.skip_store):
            with RedisHA(workdir=tmp / "redis") as ha:
                if not args.skip_index:
                    bench_index(result, ha, batches, args.threads, tmp)
                if not args.skip_store:
                    bench_store(result, ha, args.page, 128, 4, reps, tmp)
        if not args.skip_failover:
            bench_failover(result, scenarios, list(DURABILITY), control=True, tmp=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.finish(args.out)
    print(json.dumps(result.figures.get("failover", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
