"""One side of the two-process Mooncake test (``tests/integration/test_mooncake.py``).

``writer``: contributes a memory segment, builds a real SGLang host KV pool, fills pages,
writes them through the SGLang HiCache adapter (``KVConnectStorage``, ``"store":
"mooncake"``, zero-copy v1) and prints ``READY`` + the page digests as JSON; it then
stays alive (its segment holds the pages) until stdin closes.

``reader``: contributes no segment, builds an empty pool of the same geometry, asks
``batch_exists`` and reads with ``batch_get_v1``; prints the hit count and the digests
of what landed in its host pool.

Both run inside the test's loopback-only network namespace.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys


def _storage(master: str, segment: str, layout: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvconnect.connectors.engines.sglang_hicache import KVConnectStorage

    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name="tiny/model",
        extra_config={"backend_name": "kvconnect", "module_path": "kvconnect.connectors.engines.sglang_hicache",
                      "class_name": "KVConnectStorage", "interface_v1": 1, "store": "mooncake",
                      "master_server_address": master, "protocol": "tcp", "local_hostname": "127.0.0.1",
                      "metadata_server": "P2PHANDSHAKE", "global_segment_size": segment,
                      "staging_size": "8mb", "setup_timeout": 15, "op_timeout": 5})
    return KVConnectStorage(cfg, {})


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["writer", "reader"])
    p.add_argument("--master", required=True)
    p.add_argument("--pages", type=int, default=24)
    p.add_argument("--layout", default="page_first_direct")
    p.add_argument("--keys", default="")
    args = p.parse_args(argv)

    from kvconnect.connectors.testing.sglang import fill_pages, make_cpu_host_pool, page_bytes

    host = make_cpu_host_pool(args.layout, page_size=4, layer_num=3, head_num=2, head_dim=8,
                              host_tokens=4 * (args.pages + 2))
    idx = host.alloc(args.pages * host.page_size)
    ps = host.page_size
    if args.role == "writer":
        storage = _storage(args.master, "64mb", args.layout)
        storage.register_mem_pool_host(host)
        fill_pages(host, idx, seed=7)
        keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(args.pages)]
        ok = storage.batch_set_v1(keys, idx)
        digests = [hashlib.sha256(page_bytes(host, int(idx[i * ps]))).hexdigest() for i in range(args.pages)]
        print("READY " + json.dumps({"ok": ok, "keys": keys, "digests": digests,
                                     "stats": storage.store.stats().extra}), flush=True)
        sys.stdin.read()
        storage.close()
        return 0
    storage = _storage(args.master, "0", args.layout)
    storage.register_mem_pool_host(host)
    keys = json.loads(args.keys)
    hits = storage.batch_exists(keys)
    ok = storage.batch_get_v1(keys, idx)
    digests = [hashlib.sha256(page_bytes(host, int(idx[i * ps]))).hexdigest() for i in range(len(keys))]
    print("RESULT " + json.dumps({"hits": hits, "ok": ok, "digests": digests,
                                  "stats": storage.store.stats().extra}), flush=True)
    storage.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
