"""``kvconnect demo``: a multi-turn, shared-prefix workload through the SGLang HiCache adapter.

What it replays (the shape of SGLang's ``bench_serving --dataset-name generated-shared-prefix``
and ``benchmark/hicache/bench_multiturn.py`` that the deployment guides run): ``--groups``
groups each share a ``--prefix-tokens`` system prompt; ``--clients`` clients (client ``c``
in group ``c % groups``) each hold a conversation that grows by ``--turn-tokens`` tokens per
round, for ``--rounds`` rounds, with a barrier between rounds. Round ``r`` of a client
sends ``system prompt + turns 0..r``.

How each request is served, as SGLang's ``HiCacheController`` does for an engine whose own
GPU/host cache is cold (e.g. requests spread round-robin over many nodes):

1. page keys: prefix-chained SHA-256 of the full token pages (SGLang's own ``get_hash_str``
   when sglang is importable, else ``hashlib`` with the same scheme);
2. ``batch_exists`` per batch of 128 keys (leading hits), as ``_storage_hit_query``;
3. ``batch_get_v1`` of the hit pages into freshly allocated host-pool pages (poisoned
   first), per batch of 128, stopping at the first miss, as ``_page_transfer``;
4. every loaded byte is compared with the bytes that were written for that key: any
   difference stops the demo with exit status 1 and the page, key and byte offset;
5. "prefill" of the missing pages: their host memory is filled with bytes derived from the
   page's hash (hence from its tokens), then ``batch_set_v1`` writes them, per batch of 128,
   stopping at the first failure, as ``_page_backup``.

The workload and the engine it runs on are ``kvconnect.connectors.workload``; this module is
the command. With sglang installed the store is reached through the real adapter
``kvconnect.connectors.engines.sglang_hicache.KVConnectStorage``, built by SGLang's own
``StorageBackendFactory.create_backend("dynamic", ...)``, over a real SGLang CPU host pool
(``kvconnect.connectors.engines.sglang_host_pools.make_cpu_host_pool``). Without sglang (or with
``--no-sglang``) it drives the ``PageStore`` directly over a ``HostBuffer`` and says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import warnings
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from kvconnect.connectors.base import ConfigError, KVStoreError
from kvconnect.connectors.workload import (
    LAYOUTS_MHA,
    LAYOUTS_MLA,
    SHAPES,
    GiB,
    HostBufferPath,
    MiB,
    ModelShape,
    PageContent,
    SGLangPath,
    Totals,
    VerificationError,
    Workload,
    ideal_hit_pages,
    page_hasher,
    serve_request,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.description = ("Replay a multi-turn, shared-prefix workload (groups sharing a system prompt, many clients, "
                     "conversations growing per round) through the SGLang HiCache adapter over a real SGLang host "
                     "pool, verify every byte loaded from the store, and report hit rate, pages and GiB moved and "
                     "throughput. Exit status 1 on any wrong byte.")
    p.epilog = ("examples: kvconnect demo | kvconnect demo --model-shape llama-8b --clients 8 --groups 2 --rounds 3 | "
                "kvconnect demo --store memory --store-options '{\"capacity\": \"256mb\"}' --json")
    g = p.add_argument_group("store")
    g.add_argument("--store", default="memory", help="store name (see `kvconnect stores`)")
    g.add_argument("--store-options", default="{}", metavar="JSON",
                   help="store options as a JSON object (merged into the adapter's extra config)")
    g.add_argument("--clear", action="store_true", help="clear the store before replaying")
    w = p.add_argument_group("workload")
    w.add_argument("--clients", type=int, default=32, help="concurrent conversations")
    w.add_argument("--rounds", type=int, default=5, help="turns per conversation")
    w.add_argument("--groups", type=int, default=8, help="groups sharing one system prompt")
    w.add_argument("--prefix-tokens", type=int, default=2048, help="tokens of each group's system prompt")
    w.add_argument("--turn-tokens", type=int, default=256, help="tokens each round adds to a conversation")
    w.add_argument("--page-size", type=int, default=64, help="tokens per KV page (SGLang --page-size)")
    w.add_argument("--passes", type=int, default=1,
                   help="replay the whole workload this many times on the same store (the guides' 'run it again: "
                        "the hit rate goes up')")
    w.add_argument("--seed", type=int, default=0, help="workload seed")
    m = p.add_argument_group("engine")
    m.add_argument("--model-shape", default="tiny", choices=sorted(SHAPES),
                   help="KV geometry of one rank: " + "; ".join(s.describe() for s in SHAPES.values()))
    m.add_argument("--layout", default="page_first", choices=LAYOUTS_MHA,
                   help="host pool layout (SGLang --hicache-mem-layout); MLA shapes: no page_head")
    m.add_argument("--threads", type=int, default=2, help="requests served concurrently (controller I/O threads)")
    m.add_argument("--no-sglang", action="store_true",
                   help="drive the store directly over a HostBuffer even when sglang is installed")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check_args(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("clients", "rounds", "groups", "page_size", "threads", "passes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be >= 1, got {getattr(args, name)}")
    for name in ("prefix_tokens", "turn_tokens"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be >= 0, got {getattr(args, name)}")
    if args.groups > args.clients:
        raise ConfigError("--groups", f"{args.groups} groups need at least as many clients (got {args.clients})")
    shape = SHAPES[args.model_shape]
    if shape.mla and args.layout not in LAYOUTS_MLA:
        raise ConfigError("--layout", f"{args.layout!r} is not an MLA host layout", LAYOUTS_MLA)
    try:
        opts = json.loads(args.store_options)
    except json.JSONDecodeError as e:
        raise ConfigError("--store-options", f"not valid JSON: {e}") from None
    if not isinstance(opts, dict):
        raise ConfigError("--store-options", "must be a JSON object")
    return opts


def _quiet_engine_logs(args: argparse.Namespace) -> None:
    """SGLang's and the adapter's INFO lines would bury the demo's report; --log-level DEBUG keeps them."""
    if getattr(args, "log_level", "INFO") != "DEBUG":
        for name in ("sglang", "kvconnect"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GiB


def _gib(n: int) -> float:
    return n / GiB


def run(args: argparse.Namespace) -> int:
    store_options = _check_args(args)
    shape = SHAPES[args.model_shape]
    t_setup = time.perf_counter()
    wl = Workload(args.groups, args.clients, args.rounds, args.prefix_tokens, args.turn_tokens, args.seed)

    sglang_why = ""
    use_sglang = not args.no_sglang
    if use_sglang:
        _quiet_engine_logs(args)
        try:
            with warnings.catch_warnings():  # sglang's import warns about CUDA-only quantizers
                warnings.simplefilter("ignore")
                import sglang  # noqa: F401
                import sglang.srt.mem_cache.memory_pool  # noqa: F401
                import torch  # noqa: F401
        except ImportError as e:
            use_sglang = False
            sglang_why = f"sglang is not installed ({e}); install kvconnect[sglang] to use the real adapter"
    else:
        sglang_why = "--no-sglang"

    hasher, hash_desc = page_hasher(use_sglang)
    rounds = wl.requests()
    prompts = [[wl.prompt(c, r) for c, r in rnd] for rnd in rounds]
    hashes = [[hasher(toks, args.page_size) for toks in rnd] for rnd in prompts]
    max_pages = max(len(h) for rnd in hashes for h in rnd)
    host_pages = args.threads * max(max_pages, 1) + 1

    unique_pages = len({h for rnd in hashes for hs in rnd for h in hs})
    page_bytes_est = shape.bytes_per_token * args.page_size
    if args.store == "memory" and "capacity" not in store_options:
        # Size the embedded store to the working set so the demo shows reuse, not eviction,
        # but never to more than a quarter of the free memory of a (shared) machine.
        want = max(64 * MiB, int(unique_pages * page_bytes_est * 1.1))
        store_options["capacity"] = min(want, max(256 * MiB, _mem_available() // 4))

    if use_sglang:
        path: SGLangPath | HostBufferPath = SGLangPath(shape, args.layout, args.page_size, host_pages,
                                                        args.store, store_options)
    else:
        path = HostBufferPath(shape, args.page_size, host_pages, args.store, store_options, sglang_why)
    try:
        if args.clear:
            path.clear()
        content = PageContent(path.max_segment)
        setup_s = time.perf_counter() - t_setup
        return _replay(args, wl, shape, path, content, prompts, hashes, unique_pages, hash_desc, setup_s,
                       store_options)
    finally:
        path.close()


def _replay(args, wl: Workload, shape: ModelShape, path, content: PageContent, prompts, hashes,
            unique_pages: int, hash_desc: str, setup_s: float, store_options: dict[str, Any]) -> int:
    out = sys.stderr if args.json else sys.stdout
    page_bytes = path.page_bytes
    if not args.json:
        print(f"kvconnect demo: store {args.store!r} through {path.description}", file=out)
        print(f"  model shape  {shape.describe()}: {page_bytes / MiB:.3g} MiB per {args.page_size}-token page "
              f"in {path.segments_per_page} segment(s)", file=out)
        print(f"  workload     {wl.groups} groups x {wl.prefix_tokens}-token system prompt, {wl.clients} clients x "
              f"{wl.rounds} rounds, +{wl.turn_tokens} tokens per round, {args.threads} threads", file=out)
        print(f"  page keys    {hash_desc}" + (f" under key space {path.keyspace_prefix()}" if path.keyspace_prefix()
                                                   else ""), file=out)
        print(f"  working set  {unique_pages} distinct pages, {_gib(unique_pages * page_bytes):.3f} GiB"
              + (f"; store options {json.dumps(store_options)}" if store_options else ""), file=out)
        try:
            from kvconnect.connectors.config import parse_size

            cap = parse_size(store_options["capacity"]) if "capacity" in store_options else None
        except (KVStoreError, ValueError):
            cap = None  # the store validated it already; only the note is skipped
        if cap is not None and cap < unique_pages * page_bytes:
            print(f"  note         store capacity {_gib(cap):.2f} GiB < working set: expect LRU evictions and a "
                  f"lower hit rate", file=out)

    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        tqdm = None
    total = wl.clients * wl.rounds * args.passes
    bar = tqdm(total=total, unit="req", desc="replaying", file=sys.stderr, disable=args.no_progress,
               leave=False) if tqdm else None
    totals = Totals()
    per_pass: list[tuple[Totals, float]] = []
    lock = threading.Lock()
    failure: BaseException | None = None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.threads, thread_name_prefix="kvconnect-demo") as pool:
        for n in range(args.passes):  # a later pass replays the same workload on the warm store
            this_pass, t_pass = Totals(), time.perf_counter()
            for r, rnd in enumerate(wl.requests()):  # barrier between rounds, like --enable-round-barrier
                def one(i: int, rnd=rnd, r=r, n=n, this_pass=this_pass) -> None:
                    where = f"{'pass ' + str(n + 1) + ' ' if args.passes > 1 else ''}client {rnd[i][0]} round {r}"
                    t = serve_request(path, content, hashes[r][i], len(prompts[r][i]), where)
                    with lock:
                        totals.add(t)
                        this_pass.add(t)
                    if bar is not None:
                        bar.update(1)

                futures = [pool.submit(one, i) for i in range(len(rnd))]
                wait(futures, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in futures if f.done() and f.exception()]
                if errors:
                    for f in futures:
                        f.cancel()
                    failure = errors[0]
                    break
            per_pass.append((this_pass, time.perf_counter() - t_pass))
            if failure is not None:
                break
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    if failure is not None:
        if isinstance(failure, VerificationError):
            print(f"kvconnect demo: VERIFICATION FAILED: {failure}", file=sys.stderr)
            print(f"kvconnect demo: {totals.pages_verified} pages had verified before the failure; the store "
                  f"{args.store!r} returned bytes that were never written for that key", file=sys.stderr)
            return 1
        if isinstance(failure, KVStoreError):
            raise failure
        print(f"kvconnect demo: FAILED: {type(failure).__name__}: {failure}", file=sys.stderr)
        return 1

    ideal = ideal_hit_pages(hashes * args.passes)
    tp = totals
    ps = args.page_size
    loaded_b, stored_b = tp.pages_loaded * page_bytes, tp.pages_stored * page_bytes
    fig = {
        "store": args.store, "path": "sglang" if isinstance(path, SGLangPath) else "hostbuffer",
        "description": path.description, "page_keys": hash_desc,
        "model_shape": shape.name, "layout": args.layout if isinstance(path, SGLangPath) else None,
        "page_size": ps, "page_bytes": page_bytes, "segments_per_page": path.segments_per_page,
        "groups": wl.groups, "clients": wl.clients, "rounds": wl.rounds, "prefix_tokens": wl.prefix_tokens,
        "turn_tokens": wl.turn_tokens, "threads": args.threads, "passes_run": len(per_pass),
        "requests": tp.requests, "prompt_tokens": tp.prompt_tokens,
        "pages_looked_up": tp.pages_looked_up, "pages_exist": tp.pages_exist, "pages_loaded": tp.pages_loaded,
        "pages_verified": tp.pages_verified, "pages_prefilled": tp.pages_prefilled,
        "pages_stored": tp.pages_stored, "pages_store_failed": tp.pages_store_failed,
        "page_hit_rate": tp.pages_loaded / tp.pages_looked_up if tp.pages_looked_up else 0.0,
        "token_hit_rate": tp.pages_loaded * ps / tp.prompt_tokens if tp.prompt_tokens else 0.0,
        "ideal_page_hit_rate": ideal / tp.pages_looked_up if tp.pages_looked_up else 0.0,
        "tokens_from_store": tp.pages_loaded * ps,
        "tokens_prefilled": tp.prompt_tokens - tp.pages_loaded * ps,
        "gib_loaded": _gib(loaded_b), "gib_stored": _gib(stored_b),
        "get_seconds": tp.get.seconds, "get_calls": tp.get.calls,
        "set_seconds": tp.set.seconds, "set_calls": tp.set.calls,
        "exists_seconds": tp.exists.seconds, "exists_calls": tp.exists.calls,
        "get_gib_per_s": _gib(loaded_b) / tp.get.seconds if tp.get.seconds else 0.0,
        "set_gib_per_s": _gib(stored_b) / tp.set.seconds if tp.set.seconds else 0.0,
        "moved_gib_per_s_wall": _gib(loaded_b + stored_b) / wall if wall else 0.0,
        "requests_per_s": tp.requests / wall if wall else 0.0,
        "replay_seconds": wall, "setup_seconds": setup_s,
        "verify_seconds": tp.verify_seconds, "prefill_fill_seconds": tp.prefill_seconds,
        "passes": [{"pass": i + 1, "seconds": sec, "pages_looked_up": t.pages_looked_up,
                    "pages_loaded": t.pages_loaded, "pages_stored": t.pages_stored,
                    "page_hit_rate": t.pages_loaded / t.pages_looked_up if t.pages_looked_up else 0.0,
                    "token_hit_rate": t.pages_loaded * ps / t.prompt_tokens if t.prompt_tokens else 0.0}
                   for i, (t, sec) in enumerate(per_pass)],
        "adapter_errors": path.adapter_errors(),
        "store_stats": path.store_stats(),
    }
    if args.json:
        print(json.dumps(fig, indent=2, default=str))
        return 0
    f = fig
    print(f"\n  requests     {f['requests']} in {wall:.2f} s ({f['requests_per_s']:.1f} req/s; setup "
          f"{setup_s:.1f} s)", file=out)
    print(f"  hit rate     pages {tp.pages_loaded}/{tp.pages_looked_up} = {f['page_hit_rate']:.1%}   tokens "
          f"{f['tokens_from_store']}/{tp.prompt_tokens} = {f['token_hit_rate']:.1%}   (best possible "
          f"{f['ideal_page_hit_rate']:.1%} of pages)", file=out)
    print(f"  loaded       {tp.pages_loaded} pages, {f['gib_loaded']:.3f} GiB by {tp.get.calls} {path.ops[1]} calls "
          f"in {tp.get.seconds:.2f} s: {f['get_gib_per_s']:.2f} GiB/s", file=out)
    print(f"  stored       {tp.pages_stored} pages, {f['gib_stored']:.3f} GiB by {tp.set.calls} {path.ops[2]} calls "
          f"in {tp.set.seconds:.2f} s: {f['set_gib_per_s']:.2f} GiB/s"
          + (f"  ({tp.pages_store_failed} pages NOT stored)" if tp.pages_store_failed else ""), file=out)
    print(f"  lookups      {tp.exists.calls} {path.ops[0]} calls in {tp.exists.seconds:.3f} s; "
          f"{tp.pages_exist} pages reported present", file=out)
    print(f"  prefilled    {tp.pages_prefilled} pages ({f['tokens_prefilled']} tokens recomputed, incl. "
          f"partial last pages)", file=out)
    print(f"  verified     {tp.pages_verified} loaded pages byte-exact ({f['gib_loaded']:.3f} GiB compared) "
          f"- OK", file=out)
    print(f"  throughput   {f['moved_gib_per_s_wall']:.2f} GiB/s moved (both directions) over the replay's wall "
          f"time", file=out)
    if args.passes > 1:
        for row in f["passes"]:
            print(f"  pass {row['pass']:<7} hit rate pages {row['page_hit_rate']:.1%} tokens {row['token_hit_rate']:.1%}, "
                  f"{row['pages_loaded']} pages loaded, {row['pages_stored']} stored, {row['seconds']:.2f} s", file=out)
    if f["adapter_errors"]:
        print(f"  WARNING      the adapter turned {f['adapter_errors']} exceptions into misses / failed writes "
              f"(see the log; kvconnect_stats: {f['store_stats'].get('adapter_errors')})", file=out)
    return 0
