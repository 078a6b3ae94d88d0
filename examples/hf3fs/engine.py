"""One SGLang engine's HiCache storage side on CPU, backed by kvconnect's ``hf3fs`` store.

    python examples/hf3fs/engine.py write --config engine.json [--out result.json]
    python examples/hf3fs/engine.py read  --config engine.json [--out result.json] [--wait-for FILE]

What runs is what ``sglang.launch_server --hicache-storage-backend dynamic`` runs, minus
the GPU: a real SGLang 0.5.23 host KV pool in CPU memory (``make_cpu_host_pool``) and the
kvconnect backend ``KVConnectStorage`` built by SGLang's own ``StorageBackendFactory`` from
the extra-config JSON ``{"store": "hf3fs", ...}``. Then:

* ``write``: fills ``pages`` pages with bytes derived from ``seed`` and backs them up with
  ``batch_set_v1`` in batches of 128 (what the HiCache controller's backup thread does);
* ``read``: (after ``--wait-for`` exists) zeroes its own pool, asks ``batch_exists`` and
  loads the pages with ``batch_get_v1`` (the prefetch thread's calls), then checks every
  page against the bytes the writer wrote, recomputed here from ``seed``.

``engine.json``: ``{"pages": 300, "seed": 7, "store": {<hf3fs store options>}}`` where the
store options are the HF3FS keys (``file_path_prefix``, ``file_size``, ``numjobs``,
``entries``, ``metadata_server_url``, ``auth_token_file``, ...); or leave them out and set
``SGLANG_HICACHE_HF3FS_CONFIG_PATH`` as with SGLang's built-in hf3fs backend.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

EXTRA = {"backend_name": "kvconnect", "module_path": "kvconnect.connectors.engines.sglang_hicache",
         "class_name": "KVConnectStorage", "interface_v1": 1, "store": "hf3fs"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["write", "read"])
    ap.add_argument("--config", required=True, help="engine JSON (pages, seed, store options)")
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--wait-for", help="read mode: start reading once this file exists")
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvconnect.connectors.testing.sglang import fill_pages, make_cpu_host_pool, page_bytes, zero_pages

    n = int(cfg.get("pages", 300))
    ps = int(cfg.get("page_size", 4))
    host = make_cpu_host_pool(layout=cfg.get("layout", "page_first"), page_size=ps, layer_num=cfg.get("layers", 4),
                              head_num=cfg.get("heads", 2), head_dim=cfg.get("head_dim", 16),
                              host_tokens=(n + 2) * ps)
    sc = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                              is_mla_model=False, enable_storage_metrics=False,
                              is_page_first_layout=host.layout == "page_first",
                              model_name=cfg.get("model", "tiny/model"),
                              extra_config={**EXTRA, **cfg.get("store", {})})
    backend = StorageBackendFactory.create_backend("dynamic", sc, host)
    backend.register_mem_pool_host(host)
    idx = host.alloc(n * ps)
    seed = int(cfg.get("seed", 0))
    hashes = [hashlib.sha256(f"{seed}/{i}".encode()).hexdigest() for i in range(n)]
    out: dict = {"mode": args.mode, "pages": n, "page_bytes": len(page_bytes(host, int(idx[0])))}
    t0 = time.perf_counter()
    if args.mode == "write":
        fill_pages(host, idx, seed=seed)
        ok = []
        for b in range(0, n, 128):
            ok += backend.batch_set_v1(hashes[b:b + 128], idx[b * ps:(b + 128) * ps])
        out["written"] = sum(ok)
        out["digest"] = hashlib.sha256(b"".join(page_bytes(host, int(idx[i * ps])) for i in range(n))).hexdigest()
        print(f"engine 1: backed up {sum(ok)}/{n} pages of {out['page_bytes']} bytes "
              f"in {time.perf_counter() - t0:.2f}s")
    else:
        if args.wait_for:
            deadline = time.monotonic() + 300
            while not os.path.exists(args.wait_for) and time.monotonic() < deadline:
                time.sleep(0.05)
        zero_pages(host, idx)
        t0 = time.perf_counter()
        out["exists"] = backend.batch_exists(hashes)
        ok = []
        for b in range(0, n, 128):
            ok += backend.batch_get_v1(hashes[b:b + 128], idx[b * ps:(b + 128) * ps])
        dt = time.perf_counter() - t0
        got = [page_bytes(host, int(idx[i * ps])) for i in range(n)]
        fill_pages(host, idx, seed=seed)  # the bytes engine 1 wrote, recomputed from the seed
        want = [page_bytes(host, int(idx[i * ps])) for i in range(n)]
        out["hits"] = sum(ok)
        out["exact"] = sum(1 for i in range(n) if ok[i] and got[i] == want[i])
        out["wrong"] = sum(1 for i in range(n) if ok[i] and got[i] != want[i])
        out["digest"] = hashlib.sha256(b"".join(want)).hexdigest()
        print(f"engine 2: {out['exists']}/{n} pages exist, {out['hits']} loaded, {out['exact']} byte-exact, "
              f"{out['wrong']} wrong, in {dt:.2f}s")
    out["stats"] = backend.store.stats().as_dict()
    backend.close()
    if args.out:
        tmp = args.out + ".tmp"
        Path(tmp).write_text(json.dumps(out, default=str))
        os.replace(tmp, args.out)
    return 0 if args.mode == "write" or (out["exact"] == n and out["wrong"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
