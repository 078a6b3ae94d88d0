"""batch_exists cost per key: kvconnect's HiCache backend vs SGLang 0.5.23's mooncake and hf3fs backends.

Run: ``kvconnect bench batch_exists [--quick]`` or ``python -m kvconnect.benchmarks.batch_exists [--quick]``
(root: it makes a loopback-only network namespace).

``batch_exists`` runs on SGLang's scheduler path (the prefetch thread asks it before every
L3 prefetch, and the scheduler waits on the answer when it decides what to load), so it must
be cheap. Every system here is a HiCache backend built the way SGLang builds it
(``StorageBackendFactory.create_backend``: ``"dynamic"`` for kvconnect, ``"mooncake"`` /
``"hf3fs"`` for SGLang's own) over the same real SGLang host pool (MHA, ``page_first``), pages
written through each backend's own ``batch_set_v1``, checked byte-exact through its own
``batch_get_v1`` before any timing, and then asked ``batch_exists`` for batches of
``--keys`` page keys (default 128), from an I/O thread of its own that waits between calls,
as SGLang's prefetch thread does:

* ``kvc_mooncake`` vs ``sglang_mooncake``: both clients of the same ``mooncake_master`` (and
  segment-holder process) in one loopback-only namespace, Transfer Engine over TCP, the
  engine side lending no memory (the Mooncake Store deployment guide's setup);
* ``kvc_mooncake_inline``: ``kvc_mooncake`` with ``call_mode="inline"`` (every Mooncake call on
  the caller's thread; the default ``"worker"`` runs gets and puts on worker threads so that
  ``op_timeout`` bounds them, and its lookups on the caller's thread too, bounded by
  Mooncake's RPC timeouts: one path for ``batch_exists`` in both modes);
* ``floor_kvc_mooncake`` / ``floor_sglang_mooncake``: the floor under each: its backend's own
  Mooncake client asked ``batch_is_exist`` for the object keys the backend asks (one a page
  for kvconnect, K and V for SGLang), derived before timing: the RPC alone;
* ``kvc_hf3fs`` vs ``sglang_hf3fs``: kvconnect's ``hf3fs`` store (POSIX client) with its
  metadata service (``kvconnect hf3fs-meta serve``, framed TCP) vs SGLang's ``HiCacheHF3FS``
  with its mock client and ``mini_3fs_metadata_server`` (``Hf3fsGlobalMetadataClient``,
  HTTP), each service a process of its own on 127.0.0.1 in the same namespace.

Three batches per system: ``hit`` (every key stored: answer ``keys``), ``prefix`` (the
first half stored: ``keys // 2``) and ``miss`` (none stored: 0); every answer is checked.
The cost per key is one call's seconds over the keys asked. Each repetition calls every
system ``--calls`` times per batch kind, systems in a rotating order (interleaved, so load
changes on the shared machine hit all alike); the ratio of a pair is the median over
repetitions of the same-repetition quotient ``SGLang's cost / kvconnect's`` (> 1: kvconnect
cheaper; target >= 1.0 against SGLang's ``mooncake`` on the same master), with its quartiles
and the share of repetitions kvconnect was cheaper in.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult, run_worker, systems_arg  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("kvc_mooncake", "sglang_mooncake", "kvc_hf3fs", "sglang_hf3fs", "kvc_mooncake_inline")
PAIRS = (("kvc_mooncake", "sglang_mooncake",
          "SGLang 0.5.23 MooncakeStore backend, same mooncake_master (target >= 1.0)"),
         ("kvc_mooncake_inline", "sglang_mooncake", "SGLang 0.5.23 MooncakeStore backend, same mooncake_master"),
         ("kvc_hf3fs", "sglang_hf3fs",
          "SGLang 0.5.23 HiCacheHF3FS (mock client) + mini_3fs_metadata_server (HTTP)"),
         ("floor_kvc_mooncake", "floor_sglang_mooncake",
          "the batch_is_exist RPC alone, each backend's object keys (1 a page / 2 a page), same master"))
KINDS = ("hit", "prefix", "miss")
MODEL = "bench/batch-exists"


# ---------------------------------------------------------------------------------
# worker side (runs inside the namespace)
# ---------------------------------------------------------------------------------


def _backends(p: dict, host, tmp: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Every system's HiCache backend over ``host``, built by SGLang's storage factory."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvconnect.benchmarks.hf3fs import _free_port, _no_process_hooks, _stop, _wait_port
    from kvconnect.connectors.testing.sglang import storage_config

    master = p["master"]
    file_size = max(64 << 20, 4 * p["stored"] * host.get_size_per_token() * host.page_size)
    out: dict[str, Any] = {}
    for name in p["systems"]:
        extra: dict[str, Any] | None
        if name in ("kvc_mooncake", "kvc_mooncake_inline"):
            extra = {"store": "mooncake", "master_server_address": master, "protocol": "tcp",
                     "local_hostname": "127.0.0.1", "global_segment_size": 0, "staging_size": "8mb",
                     "call_mode": "inline" if name.endswith("_inline") else "worker"}
        elif name == "kvc_hf3fs":
            from kvconnect.connectors.testing.hf3fs import MetaProcess

            meta = MetaProcess(tmp / "kvc-meta", log_path=tmp / "kvc-meta.log").start(timeout=60)
            stack.callback(meta.stop)
            extra = {"store": "hf3fs", "file_path_prefix": str(tmp / "kvc-files" / "kv"), "file_size": file_size,
                     "numjobs": 2, "entries": 8, "client": "posix", "metadata_server_url": meta.url}
        elif name == "sglang_mooncake":
            os.environ.update({"MOONCAKE_MASTER": master, "MOONCAKE_PROTOCOL": "tcp",
                               "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
                               "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0"})
            extra = None
        else:  # sglang_hf3fs
            port = _free_port()
            server = subprocess.Popen([sys.executable, "-m", "sglang.srt.mem_cache.storage.hf3fs."
                                       "mini_3fs_metadata_server", "--host", "127.0.0.1", "--port", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(_stop, server)
            _wait_port(port, server)
            config = tmp / "sglang-hf3fs.json"
            config.write_text(json.dumps({"file_path_prefix": str(tmp / "sglang-files" / "hicache"),
                                          "file_size": file_size, "numjobs": 2, "entries": 8,
                                          "metadata_server_url": f"http://127.0.0.1:{port}"}))
            (tmp / "sglang-files").mkdir(exist_ok=True)
            os.environ["SGLANG_HICACHE_HF3FS_CONFIG_PATH"] = str(config)
            extra = {"use_mock_hf3fs_client": True}
        cfg = storage_config(model_name=MODEL, layout=host.layout)
        cfg.extra_config = {**cfg.extra_config, **extra} if name.startswith("kvc_") else extra
        backend_name = "dynamic" if name.startswith("kvc_") else name.split("_")[1]
        with _no_process_hooks():  # HiCacheHF3FS hooks SIGINT/SIGTERM and atexit: not in a benchmark
            b = StorageBackendFactory.create_backend(backend_name, cfg, host)
        b.register_mem_pool_host(host)
        stack.callback(b.close)
        out[name] = b
    return out


def _leading_ones(codes: list[int]) -> int:
    n = 0
    for c in codes:
        if c != 1:
            break
        n += 1
    return n


def _floors(systems: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The floor of each Mooncake system's lookup: its own Mooncake client's ``batch_is_exist``
    of the object keys its backend would ask for a batch (derived before timing), answered as
    leading 1s: the RPC both backends make, without either backend's Python around it.
    ``(name, prepare, client)`` per system present."""
    out = []
    kvc = systems.get("kvc_mooncake")
    if kvc is not None:
        view = kvc.kv.store
        out.append(("floor_kvc_mooncake", view.inner_keys, view.inner.session.client))
    sg = systems.get("sglang_mooncake")
    if sg is not None and not sg.is_mla_backend and not sg.should_split_heads:
        suffix = sg.mha_suffix

        def objects(keys: list[str], sg=sg, suffix=suffix) -> list[str]:
            return [f"{key}_{suffix}_{kv}" for key in sg._tag_keys(keys) for kv in "kv"]

        out.append(("floor_sglang_mooncake", objects, sg.store))
    return out


def _worker(args: argparse.Namespace) -> int:
    from kvconnect.benchmarks.mooncake import _IOThread
    from kvconnect.connectors.testing.sglang import fill_pages, make_cpu_host_pool, page_bytes, zero_pages

    p = json.loads(args.params)
    n, k, ps = p["stored"], p["keys"], p["page_size"]
    host = make_cpu_host_pool("page_first", page_size=ps, layer_num=p["layers"], head_num=p["heads"],
                              head_dim=p["head_dim"], host_tokens=ps * 2 * n)
    src, dst = host.alloc(n * ps), host.alloc(n * ps)
    fill_pages(host, src, seed=7)
    written = [page_bytes(host, src[i * ps]) for i in range(n)]
    out: dict[str, Any] = {"page_nbytes": len(written[0])}
    with tempfile.TemporaryDirectory(prefix="kvc-bench-exists-") as tmp, contextlib.ExitStack() as stack:
        systems = _backends(p, host, Path(tmp), stack)
        stored: dict[str, list[str]] = {}
        for name, b in systems.items():
            keys = [hashlib.sha256(f"{name}-{os.getpid()}-{i}".encode()).hexdigest() for i in range(n)]
            assert all(b.batch_set_v1(keys, src)), f"{name}: batch_set_v1 failed"
            # what batch_exists will claim loads, byte-exact, through the backend's own get
            zero_pages(host, dst)
            assert all(b.batch_get_v1(keys, dst)), f"{name}: batch_get_v1 failed"
            bad = [i for i in range(n) if page_bytes(host, dst[i * ps]) != written[i]]
            if bad:
                raise RuntimeError(f"{name}: {len(bad)} of {n} pages read back differ from the pages written")
            stored[name] = keys
        fresh = lambda name, r, j, m: [hashlib.sha256(f"miss-{name}-{r}-{j}-{i}".encode()).hexdigest()  # noqa: E731
                                       for i in range(m)]
        want = {"hit": k, "prefix": k // 2, "miss": 0}
        # name -> (prepare a batch of page keys before timing, ask it: leading hits)
        asks: dict[str, tuple[Any, Any]] = {name: (None, b.batch_exists) for name, b in systems.items()}
        for name, prep, client in _floors(systems):
            asks[name] = (prep, lambda ks, client=client: _leading_ones(client.batch_is_exist(ks)))
            stored[name] = stored[name.split("floor_", 1)[1]]
        names = list(asks)
        timers = {name: _IOThread(name).timed for name in names}
        times: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in KINDS} for name in names}
        for r in range(p["reps"] + 1):  # repetition 0 warms up
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                (prep, ask), keys = asks[name], stored[name]
                for kind in KINDS:
                    batches = []
                    for j in range(p["calls"]):
                        start = ((r * p["calls"] + j) * k) % (n - k + 1)
                        hit = keys[start:start + k]
                        batch = (hit if kind == "hit" else fresh(name, r, j, k) if kind == "miss" else
                                 hit[:k // 2] + fresh(name, r, j, k - k // 2))
                        batches.append(batch if prep is None else prep(batch))
                    got: list[int] = []

                    def calls(ask=ask, batches=batches, got=got):
                        for keys_ in batches:
                            got.append(ask(keys_))

                    dt = timers[name](calls)
                    per_page = 2 if name == "floor_sglang_mooncake" else 1  # its K and V objects
                    if [g // per_page for g in got] != [want[kind]] * len(batches):
                        raise RuntimeError(f"{name}: batch_exists of a {kind} batch of {k} answered {got[:4]}, "
                                           f"not {want[kind]}")
                    if r:
                        times[name][kind].append(dt / (len(batches) * k))
        for name in names:
            out[name] = {kind: {"us_per_key": statistics.median(times[name][kind]) * 1e6,
                                "us_per_key_all": [t * 1e6 for t in times[name][kind]]} for kind in KINDS}
            print("# " + name + ": " + ", ".join(f"{kind} {out[name][kind]['us_per_key']:.2f} us/key"
                                                 for kind in KINDS), file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------------------------
# orchestrator
# ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvconnect bench batch_exists", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run for tests (~30 s)")
    ap.add_argument("--keys", type=int, default=128, help="page keys per batch_exists call (default 128)")
    ap.add_argument("--stored", type=int, default=None, help="pages each system stores (default 512; quick 160)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 30; quick 3)")
    ap.add_argument("--calls", type=int, default=None, help="calls per system, batch kind and repetition "
                                                             "(default 20; quick 4)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    ap.add_argument("--output", default=None, help="result JSON (default benchmarks/results/batch_exists.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)

    from kvconnect.connectors.testing.mooncake import MooncakeCluster, mooncake_skip_reason
    from kvconnect.connectors.testing.netns import netns_available

    why = netns_available() or mooncake_skip_reason()
    if why:
        print(f"batch_exists benchmark needs a network namespace and Mooncake: {why}", file=sys.stderr)
        return 2
    systems = systems_arg(ap, args.systems, SYSTEMS)
    stored = args.stored or (160 if args.quick else 512)
    if args.keys < 2 or args.keys > stored:
        ap.error(f"--keys must be between 2 and --stored ({stored})")
    params = {"keys": args.keys, "stored": stored, "reps": args.reps or (3 if args.quick else 30),
              "calls": args.calls or (4 if args.quick else 20), "page_size": 64, "layers": 4, "heads": 2,
              "head_dim": 64, "systems": systems}
    res = BenchResult("batch_exists", params=dict(params, layout="page_first MHA bf16",
                                                  caller="an I/O thread of each system's own, waiting between calls",
                                                  transport="mooncake: Transfer Engine TCP over loopback (netns); "
                                                            "hf3fs metadata: 127.0.0.1 (netns)"))
    cluster = MooncakeCluster(lease_ttl_ms=10000)
    try:
        cluster.start_holder("256mb")
        params["master"] = cluster.master.address
        t0 = time.monotonic()
        fig = run_worker(cluster.exec_prefix(), "kvconnect.benchmarks.batch_exists",
                         ["--params", json.dumps(params)], 240 if args.quick else 560, ROOT)
        res.params["worker_s"] = round(time.monotonic() - t0, 1)
    finally:
        cluster.close()
    res.figures = fig
    res.params["page_nbytes"] = fig["page_nbytes"]
    for ours, ref, system in PAIRS:
        if ours not in fig or ref not in fig:
            continue
        for kind in KINDS:
            o, f = fig[ours][kind], fig[ref][kind]
            row = res.ratio(f"us_per_key {kind} {ours} / {ref}", o["us_per_key"], f["us_per_key"], system,
                            higher_is_better=False)
            row["ratio_of_medians"] = row["ratio"]
            q = sorted(rv / ov for ov, rv in zip(o["us_per_key_all"], f["us_per_key_all"]))
            row["ratio"] = round(statistics.median(q), 4)
            row["ratio_q25_q75"] = [round(x, 4) for x in statistics.quantiles(q, n=4)[::2]] if len(q) > 1 else None
            row["reps_kvconnect_cheaper"] = round(sum(x > 1 for x in q) / len(q), 4)
    over: dict[str, Any] = {}
    for name in ("kvc_mooncake", "kvc_mooncake_inline", "sglang_mooncake"):
        floor = fig.get("floor_" + ("kvc_mooncake" if name.startswith("kvc_") else name))
        if name in fig and floor is not None:
            over[name] = {kind: round(statistics.median(a - b for a, b in zip(fig[name][kind]["us_per_key_all"],
                                                                              floor[kind]["us_per_key_all"])), 4)
                          for kind in KINDS}
    if over:
        res.figures["overhead_us_per_key"] = over
    res.notes.append("overhead_us_per_key: median over repetitions of a Mooncake system's cost per key minus its "
                     "floor's in the same repetition (the backend's own Python: key derivation, checks, result "
                     "conversion, hand-offs)")
    res.notes.append("ratio = median over repetitions of the same-repetition quotient reference cost / kvconnect "
                     "cost per key (> 1: kvconnect cheaper); ours/reference are median microseconds per key; "
                     "ratio_of_medians is their quotient")
    res.notes.append("every system is a HiCache backend built by SGLang's StorageBackendFactory over the same host "
                     "pool; its pages were written by its own batch_set_v1 and read back byte-exact by its own "
                     "batch_get_v1 before timing; every batch_exists answer was checked (hit: all keys, prefix: "
                     "half, miss: 0)")
    res.notes.append("ratio_q25_q75: quartiles of those same-repetition quotients; reps_kvconnect_cheaper: the "
                     "share of repetitions in which kvconnect's cost per key was the lower")
    res.notes.append("floor_kvc_mooncake / floor_sglang_mooncake: each Mooncake backend's own client asked "
                     "batch_is_exist for the object keys its backend asks (derived before timing), in the same "
                     "rotation: the RPC without either backend's Python; a system's cost minus its floor is its "
                     "own overhead")
    res.notes.append("SGLang's mooncake backend asks two objects per MHA page (K and V) and its hf3fs backend two "
                     "keys per page (zero-copy page_first); kvconnect one key per page")
    res.notes.append("the machine is shared (see machine.loadavg): quote ratios, not absolute microseconds")
    res.finish(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
