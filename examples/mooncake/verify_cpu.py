"""The Mooncake Store deployment guide (external reuse), runnable on a CPU machine.

    sudo .venv/bin/python examples/mooncake/verify_cpu.py [--metadata http|p2p] [--pages 32]

Everything runs inside a network namespace made for the run (root needed) that has only
``lo`` and a veth pair with a private address (Mooncake advertises a LAN address):

1. ``mooncake_master`` with its HTTP metadata server (1_master.sh);
2. a standalone store: ``kvconnect mooncake-store`` contributing a segment (2_store.sh);
3. "SGLang run 1": a process with a real SGLang host KV pool writes pages through
   kvconnect's HiCache adapter (``KVConnectStorage``, ``"store":"mooncake"``, configured
   only by the guide's ``MOONCAKE_*`` variables, contributing no memory), then exits;
4. "SGLang run 2" (a new process: the engine restarted, master and store kept) asks
   ``batch_exists`` and reads the pages with ``batch_get_v1``; the bytes must equal run 1's.

What cannot run here is the GPU server itself (3_sglang.sh): this drives the same storage
class SGLang would load, with the same host pool class, on CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def engine(role: str, pages: int, keys: list[str]) -> dict:
    """One SGLang engine lifetime (runs in its own process)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvconnect.connectors.engines.sglang_hicache import KVConnectStorage
    from kvconnect.connectors.testing.sglang import fill_pages, make_cpu_host_pool, page_bytes

    host = make_cpu_host_pool("page_first_direct", page_size=64, layer_num=4, head_num=2, head_dim=64,
                              host_tokens=64 * (pages + 2))
    idx = host.alloc(pages * 64)
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="Qwen/Qwen2.5-1.5B-Instruct",
                               extra_config={"backend_name": "kvconnect", "interface_v1": 1, "store": "mooncake"})
    storage = KVConnectStorage(cfg, {})
    storage.register_mem_pool_host(host)
    if role == "write":
        fill_pages(host, idx, seed=42)
        ok = storage.batch_set_v1(keys, idx)
    else:
        hits = storage.batch_exists(keys)
        ok = storage.batch_get_v1(keys, idx)
    digests = [hashlib.sha256(page_bytes(host, int(idx[i * 64]))).hexdigest() for i in range(pages)]
    out = {"ok": sum(ok), "digests": digests, "stats": storage.store.stats().extra}
    if role == "read":
        out["hits"] = hits
    storage.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metadata", choices=["http", "p2p"], default="http",
                    help="Transfer Engine metadata: the master's HTTP server (as the guide does) or P2PHANDSHAKE")
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--engine", choices=["write", "read"], help=argparse.SUPPRESS)
    ap.add_argument("--keys", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        print("RESULT " + json.dumps(engine(args.engine, args.pages, json.loads(args.keys))), flush=True)
        return 0

    from kvconnect.connectors.testing.mooncake import MasterProcess
    from kvconnect.connectors.testing.netns import Netns

    keys = [hashlib.sha256(f"seed4-prefix-page-{i}".encode()).hexdigest() for i in range(args.pages)]
    ns = Netns("kvc-mc")
    procs: list[subprocess.Popen] = []
    # With a metadata server, Mooncake's Transfer Engine advertises a LAN address of the host
    # (MOONCAKE_LOCAL_HOSTNAME=localhost, as in the guide); a loopback-only namespace has
    # none, so the run gives its namespace a veth pair (both ends inside it) with a
    # private address that exists only there.
    env = dict(os.environ, PYTHONPATH=str(ROOT), LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1",
               GLOG_minloglevel="2", MOONCAKE_LOCAL_HOSTNAME="localhost", MOONCAKE_MASTER="127.0.0.1:50051",
               MOONCAKE_PROTOCOL="tcp",
               MOONCAKE_TE_META_DATA_SERVER="http://127.0.0.1:8080/metadata" if args.metadata == "http"
               else "P2PHANDSHAKE")
    try:
        if args.metadata == "http":  # a veth pair with both ends inside the namespace
            for cmd in (["link", "add", "lan0", "type", "veth", "peer", "name", "lan1"],
                        ["addr", "add", "10.254.0.1/24", "dev", "lan0"],
                        ["link", "set", "lan0", "up"], ["link", "set", "lan1", "up"]):
                subprocess.run(ns.exec_prefix() + ["ip", *cmd], check=True, capture_output=True)
        extra = ("--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 "--http_metadata_server_port=8080", "--eviction_high_watermark_ratio=0.95")
        master = MasterProcess(ns, extra_args=extra if args.metadata == "http" else ()).start()
        print(f"[1] mooncake_master up on {master.address} in netns {ns.name}")
        store = subprocess.Popen(ns.exec_prefix() + [sys.executable, "-m", "kvconnect.connectors.cli", "mooncake-store"],
                                 env=dict(env, MOONCAKE_GLOBAL_SEGMENT_SIZE="512mb", MOONCAKE_LOCAL_BUFFER_SIZE="0"),
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(store)
        print("[2] " + store.stdout.readline().strip())  # type: ignore[union-attr]
        results = {}
        for step, role in (("3", "write"), ("4", "read")):
            t0 = time.monotonic()
            p = subprocess.run(ns.exec_prefix() + [sys.executable, __file__, "--engine", role, "--pages",
                                                   str(args.pages), "--keys", json.dumps(keys)],
                               env=dict(env, MOONCAKE_GLOBAL_SEGMENT_SIZE="0"), capture_output=True, text=True,
                               timeout=300)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            results[role] = json.loads(line[7:])
            r = results[role]
            print(f"[{step}] SGLang run {'1 (write)' if role == 'write' else '2 (after restart)'}: "
                  f"{r['ok']}/{args.pages} pages {'written' if role == 'write' else 'read'}"
                  + (f", batch_exists -> {r['hits']}" if role == "read" else "")
                  + f", zero-copy pages {r['stats']['direct_pages']}, {time.monotonic() - t0:.1f}s")
        same = results["read"]["digests"] == results["write"]["digests"]
        print(f"bytes read after the restart equal the bytes written: {same}")
        return 0 if same and results["read"]["ok"] == args.pages else 1
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        try:
            master.kill()  # type: ignore[possibly-undefined]
        except NameError:
            pass
        ns.delete()


if __name__ == "__main__":
    sys.exit(main())
