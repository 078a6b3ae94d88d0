"""SGLang linker vs HiCache adapter: load throughput of the same pages from the same store.

Run: ``kvconnect bench linker [--quick]`` or ``python -m kvconnect.benchmarks.linker [--quick]``.

One store per run (``memory``, and ``hf3fs`` on POSIX files with a ``kvconnect hf3fs-meta
serve`` process on 127.0.0.1), two readers in this process, the same key space and the same
keys (the linker's KV pages are the HiCache adapter's ``layer_first`` pages):

* ours: kvconnect's ``KVConnectLinker``, built by SGLang 0.5.23's ``create_unified_cache_linker``
  over a real CPU ``MHATokenToKVPool``; a load is ``load`` + ``start_layer_wise_loading`` +
  ``finish_layer_wise_loading`` of one batch of pages into device slots (SGLang's
  ``UnifiedCacheLinkerWrapper`` calls), with ``layer_groups`` 1; beside it ``layer_groups`` 4
  (per-layer-group keys) and ``"staging": "host"`` (the store reads into host buffers, then one
  indexed copy per device buffer: what a GPU server does with a store that cannot write GPU
  memory);
* reference: kvconnect's HiCache adapter (``KVConnectStorage``, SGLang's storage factory)
  ``batch_get_v1`` of the same pages into a real ``MHATokenToKVPoolHost`` (``layer_first``).

Geometry: 16 layers, 4 KV heads of 128, bf16, 16-token pages (512 KiB), batches of 64 pages.
Repetitions alternate between the readers, the order flipping each time; best and median
kept. Ratios (linker / HiCache, higher is better): ``load/<store>`` (best), ``.../median``, and
``load/<store>/linker_lg4``, ``load/<store>/linker_staged`` (+ ``/median``).
Not timed: SGLang's tree (match, lookup), which the HiCache path has in its own form too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `connectors` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult, gib_per_s  # noqa: E402
from kvconnect.benchmarks.hf3fs import _best, _keys  # noqa: E402

GEOMETRY = {"layers": 16, "heads": 4, "head_dim": 128, "page_size": 16}
REFERENCE = "kvconnect HiCache adapter (KVConnectStorage.batch_get_v1 into a layer_first MHATokenToKVPoolHost)"


def store_options(name: str, tmp: Path, meta) -> dict:
    if name == "memory":
        return {"store": "kvconnect.connectors.testing.stores:SharedMemoryStore", "space": "bench-linker",
                "capacity": "1gb"}
    return {"store": "hf3fs", "file_path_prefix": str(tmp / "files" / "kv"), "file_size": "256mb", "numjobs": 4,
            "entries": 16, "client": "posix", "metadata_server_url": meta.url}


def bench_store(result: BenchResult, name: str, options: dict, batch: int, reps: int) -> None:
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvconnect.connectors.testing.linker import MODEL, LinkedServer
    from kvconnect.connectors.testing.sglang import make_cpu_host_pool, storage_config

    g = GEOMETRY
    ps = g["page_size"]
    tokens = batch * ps
    shape = dict(page_size=ps, layers=g["layers"], heads=g["heads"], head_dim=g["head_dim"], tokens=2 * tokens)
    servers = {f"linker_lg{n}": LinkedServer({**options, "layer_groups": n}, **shape) for n in (1, 4)}
    servers["linker_staged"] = LinkedServer({**options, "staging": "host"}, **shape)
    host = make_cpu_host_pool(layout="layer_first", page_size=ps, layer_num=g["layers"], head_num=g["heads"],
                              head_dim=g["head_dim"], host_tokens=tokens + ps)
    hicache = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config=options, model_name=MODEL, layout="layer_first"), host)
    hicache.register_mem_pool_host(host)
    try:
        keys = _keys(batch, f"linker-bench-{name}")
        gen = torch.Generator().manual_seed(1)
        for label, server in servers.items():  # each key space gets the batch (lg4 is a space of its own)
            if label == "linker_staged":
                server.bench_slots = server.allocator.alloc(tokens).to(torch.int64)
                continue  # lg1's key space: reads lg1's pages
            slots = server.allocator.alloc(tokens).to(torch.int64)
            for buf in server._kv_buffers():
                buf[slots] = torch.randn(buf[slots].shape, generator=gen).to(buf.dtype)
            lk = server.linker
            assert lk.offload([PoolTransfer(name=PoolName.KV, device_indices=slots, keys=keys)])
            while lk.num_completed_offloads() == 0:
                pass
            assert lk.pop_completed_offload()
            server.bench_slots = slots
        host_idx = host.alloc(tokens)
        assert hicache.kv.keyspace.prefix == servers["linker_lg1"].linker.linked["kv"].store.keyspace.prefix

        def linker_load(server: LinkedServer) -> None:
            lk = server.linker
            assert lk.load("bench", [PoolTransfer(name=PoolName.KV, device_indices=server.bench_slots, keys=keys)])
            assert lk.finish_layer_wise_loading(lk.start_layer_wise_loading())

        def hicache_load() -> None:
            assert all(hicache.batch_get_v1(keys, host_idx))

        readers = {"hicache": hicache_load, **{n: (lambda s=s: linker_load(s)) for n, s in servers.items()}}
        for fn in readers.values():
            fn()  # warm: page cache, first-call paths
        times: dict[str, list[float]] = {n: [] for n in readers}
        order = list(readers)
        for r in range(reps):
            for n in (order if r % 2 == 0 else order[::-1]):
                times[n] += _best(lambda _: readers[n](), 1)
        nbytes = batch * servers["linker_lg1"].page_nbytes()
        fig = {"page_bytes": nbytes // batch, "batch_pages": batch, "loadavg": os.getloadavg()}
        for n, t in times.items():
            fig[f"load_gib_s/{n}"] = gib_per_s(nbytes, min(t))
            fig[f"load_gib_s_median/{n}"] = gib_per_s(nbytes, statistics.median(t))
        result.figures.setdefault("stores", {})[name] = fig
        print(f"[{name}] " + ", ".join(f"{k} {v:.2f}" for k, v in fig.items() if isinstance(v, float)), flush=True)
        ref = f"{REFERENCE}, store {name}, {batch} pages of {nbytes // batch // 1024} KiB"
        for n in servers:
            suffix = "" if n == "linker_lg1" else f"/{n}"
            result.ratio(f"load/{name}{suffix}", fig[f"load_gib_s/{n}"], fig["load_gib_s/hicache"], ref)
            result.ratio(f"load/{name}{suffix}/median", fig[f"load_gib_s_median/{n}"],
                         fig["load_gib_s_median/hicache"], ref + ", medians")
    finally:
        hicache.close()
        for server in servers.values():
            server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvconnect bench linker", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, memory store only (~15 s)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each reader (default 31; quick 5)")
    ap.add_argument("--batch", type=int, default=64, help="pages per load (default 64)")
    ap.add_argument("--stores", default=None, help="comma-separated: memory,hf3fs (default both; quick memory)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/linker.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from kvconnect.connectors.testing.hf3fs import MetaProcess

    reps = args.reps or (5 if args.quick else 31)
    stores = (args.stores or ("memory" if args.quick else "memory,hf3fs")).split(",")
    for s in stores:
        if s not in ("memory", "hf3fs"):
            ap.error(f"--stores: unknown store {s!r} (accepted: memory, hf3fs)")
    result = BenchResult("linker", params={"quick": args.quick, "reps": reps, "batch": args.batch,
                                           "stores": stores, **GEOMETRY, "dtype": "bfloat16"})
    result.notes.append("machine shared with other work: absolute figures move with load (loadavg per store); "
                        "the ratios come from alternating repetitions in one run")
    tmp = Path(tempfile.mkdtemp(prefix="kvc-linker-bench-"))
    meta = MetaProcess(tmp / "meta").start() if "hf3fs" in stores else None
    try:
        for i, name in enumerate(stores, 1):
            print(f"store {i}/{len(stores)}: {name}", flush=True)
            bench_store(result, name, store_options(name, tmp, meta), args.batch, reps)
    finally:
        if meta is not None:
            meta.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
