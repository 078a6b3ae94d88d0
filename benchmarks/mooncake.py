"""Mooncake store: kvconnect vs raw MooncakeDistributedStore vs SGLang's own MooncakeStore.

Run: ``kvconnect bench mooncake [--quick]`` or ``python -m kvconnect.benchmarks.mooncake [--quick]``
(root: it makes a loopback-only network namespace).

The Mooncake Store deployment guide's setup, on one machine: a ``mooncake_master`` and a process that only
contributes a memory segment (the standalone store), both in a loopback-only netns made
for the run; the engine side contributes no memory, so every page crosses the Transfer
Engine's TCP path, as between SGLang and a standalone store. With ``--shared-segment`` the
holder is a ``kvconnect mooncake-store -o shared_segment=true`` process instead: kvconnect's
systems then copy pages out of its shared memory (the same-host path), while ``raw`` and
``sglang`` still move them over TCP; the ratios then compare the deployments, not the
adapters' overhead (results in ``benchmarks/results/mooncake_shared.json``).

One worker process (inside the namespace) builds a real SGLang host KV pool
(``page_first_direct``: K and V of a page are two separate segments) filled with the same
bytes for every system, then, one system after the other, on the same pages:

* ``raw``: ``MooncakeDistributedStore.batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` on the pool's page segments (one object per page), the
  calls kvconnect makes, without kvconnect;
* ``kvc``: kvconnect's ``MooncakeStore.put_from`` / ``get_into`` (registered pool: direct
  zero-copy path, default ``call_mode="worker"``) -- target >= 95 % of ``raw``;
* ``kvc_inline`` / ``kvc_hicache_inline``: ``kvc`` / ``kvc_hicache`` with
  ``call_mode="inline"`` (Mooncake calls on the caller's thread, no hand-off); set up
  last, because an inline store sets Mooncake's timeout variables for the whole process;
* ``kvc_hicache``: SGLang's HiCache interface over kvconnect
  (``KVConnectStorage`` with ``"store": "mooncake"``, ``batch_set_v1`` / ``batch_get_v1``);
* ``sglang``: SGLang 0.5.23's own ``MooncakeStore`` backend (``batch_set_v1`` /
  ``batch_get_v1``, two objects per page: K and V), driven on CPU -- ``kvc_hicache``
  against it: target >= 1.0x;
* ``raw_per_segment``: raw calls with one object per segment (SGLang's object layout),
  to show which object layout is faster.

Each system is called from an I/O thread of its own that waits on a queue between calls,
the way SGLang's HiCache and LMCache's server call a store (``_IOThread``; ``--caller
main`` calls every system from the main thread instead). All clients are set up first;
each repetition then runs every system once, in a rotating order (interleaved, so load changes on the shared machine hit all alike). Every put writes keys not stored before (a fresh prefix per repetition); every get reads
all pages of the batch; then all objects are removed, so the next put reuses segment
memory (steady state) instead of paying first-touch page faults in the holder. Figures are medians over the repetitions; ratios are same-run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable, and keep this
    # file (benchmarks/mooncake.py) from shadowing the `mooncake` package
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_here)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult, gib_per_s, run_worker, systems_arg  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("raw", "kvc", "kvc_hicache", "sglang", "raw_per_segment", "kvc_inline", "kvc_hicache_inline")


# ---------------------------------------------------------------------------------
# worker side (runs inside the namespace)
# ---------------------------------------------------------------------------------


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _IOThread:
    """One system's calls on a thread of their own that waits on a queue between calls, the
    way engines call a store: SGLang's HiCache prefetch / backup threads and LMCache's L2
    workers block on a queue, make one batch call, and block again. The call is timed on
    that thread, so handing it work is not counted (an engine does not count it either).

    Why it matters: Mooncake's caller waits for a transfer by polling in a loop, and on a
    2-vCPU host how fast a call runs depends on which thread polls -- a call made from the
    busy main thread ran up to ~15 % faster than the same call from any thread that sleeps
    between calls (measured; ``--caller main`` reproduces it).
    """

    def __init__(self, name: str):
        import queue
        import threading

        self._jobs: Any = queue.SimpleQueue()
        self._done: Any = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"bench-{name}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn = self._jobs.get()
            t0 = time.perf_counter()
            try:
                fn()
                self._done.put((time.perf_counter() - t0, None))
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                self._done.put((0.0, e))

    def timed(self, fn) -> float:
        self._jobs.put(fn)
        dt, exc = self._done.get()
        if exc is not None:
            raise exc
        return dt


def _check(name: str, what: str, results, ok) -> None:
    bad = [r for r in results if not ok(r)]
    if bad:
        raise RuntimeError(f"{name}: {what} failed for {len(bad)} of {len(results)} pages: {bad[:4]}")


def _checked(name: str, what: str, call: Any, arg: Any) -> Any:
    """``call(keys, arg)`` for a batch of keys, every page's answer checked to be true."""
    return lambda keys: _check(name, what, call(keys, arg), bool)


def _worker(args: argparse.Namespace) -> int:
    import hashlib

    import torch

    from kvconnect.connectors.testing.sglang import fill_pages, make_cpu_host_pool

    p = json.loads(args.params)
    n, reps, ps = p["pages"], p["reps"], p["page_size"]
    host = make_cpu_host_pool("page_first_direct", page_size=ps, layer_num=p["layers"], head_num=p["heads"],
                              head_dim=p["head_dim"], host_tokens=ps * (n + 2))
    idx = host.alloc(n * ps)
    ptrs, sizes = host.get_page_buffer_meta(idx)
    per = len(ptrs) // n
    pages = [[(ptrs[i * per + j], sizes[i * per + j]) for j in range(per)] for i in range(n)]
    page_nbytes = sum(s for _, s in pages[0])
    kv = host.kv_buffer
    region = (kv.data_ptr(), kv.numel() * kv.element_size())
    master = args.master
    out: dict[str, Any] = {"page_nbytes": page_nbytes, "segments_per_page": per}

    kv.zero_()
    fill_pages(host, idx, seed=1)
    pristine = kv.clone()  # refilling / checking with memcpy / memcmp keeps the CPU for the systems
    kv_bytes, pristine_bytes = kv.view(-1).view(torch.uint8), pristine.view(-1).view(torch.uint8)

    def verify(name: str) -> None:
        if not torch.equal(kv_bytes, pristine_bytes):  # bytes, not bf16 values (NaN != NaN)
            raise RuntimeError(f"{name}: pages read back differ from the pages written")

    def zero() -> None:
        kv.zero_()

    systems: dict[str, tuple[Any, Any]] = {}
    closers: list[Any] = []
    # --shared-segment: kvconnect's stores read the holder's published shared memory
    shared = {"shared_segment_dir": p["shared_segment_dir"]} if p.get("shared_segment_dir") else {}
    kvc_stores: dict[str, Any] = {}

    def kvc_options(name: str) -> dict:
        """kvconnect's Mooncake options, alike for its store and its HiCache backend."""
        return {"master_server_address": master, "protocol": "tcp", "local_hostname": "127.0.0.1",
                "global_segment_size": 0, **shared, "staging_size": "8mb",
                "call_mode": "inline" if name.endswith("_inline") else "worker"}

    for name in p["systems"]:
        if name in ("raw", "raw_per_segment"):
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig

            s = MooncakeDistributedStore()
            rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
            assert rc == 0, f"raw setup rc={rc}"
            assert s.register_buffer(*region) == 0
            closers.append(s.close)
            cfg = ReplicateConfig()
            mp = [[a for a, _ in pg] for pg in pages]
            ms = [[b for _, b in pg] for pg in pages]
            if name == "raw":
                def put(keys, s=s, mp=mp, ms=ms, cfg=cfg):
                    _check("raw", "put", s.batch_put_from_multi_buffers(keys, mp, ms, cfg), lambda r: r == 0)

                def get(keys, s=s, mp=mp, ms=ms):
                    _check("raw", "get", s.batch_get_into_multi_buffers(keys, mp, ms), lambda r: r == page_nbytes)
            else:
                fp = [a for pg in pages for a, _ in pg]
                fs = [b for pg in pages for _, b in pg]

                def put(keys, s=s, fp=fp, fs=fs, cfg=cfg):
                    sk = [f"{k}_{j}" for k in keys for j in range(per)]
                    _check("raw_per_segment", "put", s.batch_put_from(sk, fp, fs, cfg), lambda r: r == 0)

                def get(keys, s=s, fp=fp, fs=fs):
                    sk = [f"{k}_{j}" for k in keys for j in range(per)]
                    _check("raw_per_segment", "get", s.batch_get_into(sk, fp, fs), lambda r: r > 0)
            systems[name] = (put, get)
        elif name in ("kvc", "kvc_inline"):
            from kvconnect.connectors.registry import create_store

            st = create_store("mooncake", kvc_options(name))
            st.register_memory(*region)
            closers.append(st.close)
            systems[name] = (_checked(name, "put", st.put_from, pages), _checked(name, "get", st.get_into, pages))
            kvc_stores[name] = st
        elif name in ("kvc_hicache", "kvc_hicache_inline", "sglang"):
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

            extra = {"backend_name": "kvconnect", "interface_v1": 1, "store": "mooncake",
                     **kvc_options(name)} if name != "sglang" else None
            cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                       attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                       is_page_first_layout=False, model_name="bench/model", extra_config=extra)
            if name != "sglang":
                from kvconnect.connectors.engines.sglang_hicache import KVConnectStorage

                b = KVConnectStorage(cfg, {})
            else:
                from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

                os.environ.update({"MOONCAKE_MASTER": master, "MOONCAKE_PROTOCOL": "tcp",
                                   "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
                                   "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0"})
                b = MooncakeStore(cfg, host)
            b.register_mem_pool_host(host)
            closers.append(b.close)
            systems[name] = (_checked(name, "batch_set_v1", b.batch_set_v1, idx),
                             _checked(name, "batch_get_v1", b.batch_get_v1, idx))

    # Objects of a finished run are removed, so every put lands in segment memory that was
    # written before (steady state: a store's memory is touched once, then reused); without
    # it first-touch page faults in the holder dominate and swamp the comparison.
    from mooncake.store import MooncakeDistributedStore

    admin = MooncakeDistributedStore()
    assert admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    closers.append(admin.close)

    # Interleaved: every repetition runs each system once, in a rotating order, so load
    # changes on the shared machine hit all systems alike. Repetition 0 warms up.
    names = list(systems)
    timers = {n: (_IOThread(n).timed if p.get("caller", "thread") == "thread" else _timed) for n in names}
    times: dict[str, dict[str, list[float]]] = {n: {"put": [], "get": []} for n in names}
    for r in range(reps + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            put, get = systems[name]
            keys = [hashlib.sha256(f"{name}-{os.getpid()}-{r}-{i}".encode()).hexdigest() for i in range(n)]
            kv.copy_(pristine)
            tp = timers[name](lambda: put(keys))
            zero()
            tg = timers[name](lambda: get(keys))
            verify(name)
            admin.remove_all(True)
            if r:
                times[name]["put"].append(tp)
                times[name]["get"].append(tg)
    for name in names:
        out[name] = {**_op_figures("put", times[name]["put"], n * page_nbytes),
                     **_op_figures("get", times[name]["get"], n * page_nbytes)}
        print(f"# {name}: put {out[name]['put_gib_s']:.3f} GiB/s, get {out[name]['get_gib_s']:.3f} GiB/s",
              file=sys.stderr, flush=True)
    for name, st in kvc_stores.items():
        out[name]["path"] = {k: st.stats().extra[k] for k in ("direct_pages", "staged_pages", "shared_copy_pages",
                                                              "call_mode")}
    for close in closers:
        close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------------------------
# orchestrator
# ---------------------------------------------------------------------------------


def _op_figures(op: str, times: list[float], batch_bytes: int) -> dict:
    """Median seconds and GiB/s of one operation's repetitions, and the repetitions."""
    med = statistics.median(times)
    return {f"{op}_s": med, f"{op}_gib_s": gib_per_s(batch_bytes, med), f"{op}_all_s": times}


def _merge(figs: list[dict], batch_bytes: int) -> dict:
    """One figure set from several worker processes: every system's repetitions, process
    after process (pairs stay within a repetition); medians over all of them."""
    out = dict(figs[0])
    for name, f in figs[0].items():
        if not isinstance(f, dict) or "put_all_s" not in f:
            continue
        merged = dict(f)
        for op in ("put", "get"):
            merged.update(_op_figures(op, [t for fig in figs for t in fig[name][f"{op}_all_s"]], batch_bytes))
            merged[f"{op}_s_per_process"] = [fig[name][f"{op}_s"] for fig in figs]
        if "path" in f:  # counters of each process's store, summed
            merged["path"] = {k: (sum(fig[name]["path"][k] for fig in figs) if isinstance(v, int) else v)
                              for k, v in f["path"].items()}
        out[name] = merged
    return out


def _run_worker(cluster, params: dict, timeout: float) -> dict:
    return run_worker(cluster.exec_prefix(), "kvconnect.benchmarks.mooncake",
                      ["--master", cluster.master.address, "--params", json.dumps(params)], timeout, ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvconnect bench mooncake", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run for tests (~1 min)")
    ap.add_argument("--pages", type=int, default=None, help="pages per batch (default 64; quick 16)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per system and process (default 30; quick 6)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    ap.add_argument("--output", default=None, help="result JSON (default benchmarks/results/mooncake.json)")
    ap.add_argument("--processes", type=int, default=None,
                    help="worker processes, one after the other, each running every repetition (default 3; "
                         "quick 1); figures pool them: which threads share a CPU is settled per process and "
                         "sways a whole process's ratios by a few percent on a small host")
    ap.add_argument("--caller", choices=("thread", "main"), default="thread",
                    help="'thread' (default): each system is called from an I/O thread of its own that waits "
                         "between calls, as engines call a store; 'main': every system from the benchmark's main "
                         "thread (the method before 2026-11-30)")
    ap.add_argument("--shared-segment", action="store_true",
                    help="the segment holder is a `kvconnect mooncake-store -o shared_segment=true` process: the "
                         "kvconnect systems copy pages from its shared memory, raw and SGLang use TCP "
                         "(default output benchmarks/results/mooncake_shared.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)

    from tqdm import tqdm

    from kvconnect.connectors.testing.mooncake import MooncakeCluster
    from kvconnect.connectors.testing.netns import netns_available

    why = netns_available()
    if why:
        print(f"mooncake benchmark needs a network namespace: {why}", file=sys.stderr)
        return 2
    systems = systems_arg(ap, args.systems, SYSTEMS)
    params = {"pages": args.pages or (16 if args.quick else 64), "reps": args.reps or (6 if args.quick else 30),
              "caller": args.caller, "processes": args.processes or (1 if args.quick else 3),
              "page_size": 64, "layers": 8, "heads": 2, "head_dim": 128, "systems": systems}
    segment = "512mb" if args.quick else "2gb"
    res = BenchResult("mooncake", params=dict(params, segment=segment, transport="tcp over loopback (netns)",
                                              layout="page_first_direct bf16"))
    cluster = MooncakeCluster(lease_ttl_ms=10000)
    shm_dir = f"/dev/shm/kvc-bench-{secrets.token_hex(4)}" if args.shared_segment else ""
    try:
        if shm_dir:
            cluster.start_store_process(segment, shared_segment_dir=shm_dir)
            params["shared_segment_dir"] = shm_dir
            res.params.update(transport="kvconnect systems: shared memory of the store process; raw / sglang: "
                                        "tcp over loopback (netns)")
        else:
            cluster.start_holder(segment)
        figs = [_run_worker(cluster, params, timeout=170 if args.quick else 560)
                for _ in tqdm(range(params["processes"]), desc="worker processes", unit="proc",
                              file=sys.stderr, disable=params["processes"] < 2)]
        fig = _merge(figs, params["pages"] * figs[0]["page_nbytes"])
    finally:
        cluster.close()
        if shm_dir:
            shutil.rmtree(shm_dir, ignore_errors=True)
    res.figures = fig
    batch = params["pages"] * fig["page_nbytes"]
    res.params.update(page_nbytes=fig["page_nbytes"], batch_bytes=batch)
    def paired(ours: str, ref: str, op: str) -> float:
        """Median over repetitions of ref_time / ours_time (same round: adjacent runs)."""
        pairs = zip(fig[ours][f"{op}_all_s"], fig[ref][f"{op}_all_s"])
        return statistics.median(r / o for o, r in pairs)

    comparisons = [("kvc", "raw", "kvconnect MooncakeStore / raw",
                    "raw MooncakeDistributedStore multi-buffer calls (target >= 0.95)"),
                   ("kvc_inline", "raw", "kvconnect MooncakeStore call_mode=inline / raw",
                    "raw MooncakeDistributedStore multi-buffer calls (target >= 0.95)"),
                   ("kvc_hicache", "sglang", "kvconnect HiCache / SGLang MooncakeStore",
                    "SGLang 0.5.23 MooncakeStore backend (target >= 1.0)"),
                   ("kvc_hicache_inline", "sglang", "kvconnect HiCache call_mode=inline / SGLang MooncakeStore",
                    "SGLang 0.5.23 MooncakeStore backend (target >= 1.0)"),
                   ("raw", "raw_per_segment", "one object per page / one per segment (raw)",
                    "raw batch_put_from/batch_get_into, one object per segment")]
    if shm_dir:
        comparisons = [(o, r, f"{label} [kvconnect reads shared memory]", system)
                       for o, r, label, system in comparisons]
    for op in ("get", "put"):
        for ours, ref, label, system in comparisons:
            if ours in fig and ref in fig:
                row = res.ratio(f"{op}_gib_s {label}", fig[ours][f"{op}_gib_s"], fig[ref][f"{op}_gib_s"], system)
                row["ratio_of_medians"] = row["ratio"]
                row["ratio"] = round(paired(ours, ref, op), 4)  # robust to load drift on a shared box
    res.notes.append("ratio = median over repetitions of the paired (same-round) time ratio; "
                     "ours/reference are median GiB/s; ratio_of_medians is their quotient")
    res.notes.append("caller=thread: each system called from its own I/O thread that waits between calls (as "
                     "engines call a store); caller=main: every system from the benchmark's main thread"
                     if params["caller"] == "thread" else
                     "caller=main: every system called from the benchmark's main thread (not how engines call)")
    res.notes.append("all systems ran interleaved (rotating order per repetition) in each worker process, same pages; "
                     "the worker processes ran one after the other and their repetitions are pooled; "
                     "the machine is shared (see machine.loadavg): quote ratios, not absolute GiB/s")
    res.notes.append("engine side contributes no segment; pages live in a separate segment-holder process "
                     "(Transfer Engine TCP over loopback), as with SGLang + a standalone Mooncake store"
                     + ("; the holder lends shared memory, which kvconnect's gets copy from (puts still go "
                        "through Mooncake)" if shm_dir else ""))
    default_out = ROOT / "benchmarks" / "results" / "mooncake_shared.json" if shm_dir else None
    res.finish(args.output or default_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
