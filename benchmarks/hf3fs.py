"""HF3FS store and metadata service vs SGLang 0.5.23's HiCacheHF3FS and mini_3fs_metadata_server.

Run: ``kvconnect bench hf3fs [--quick]`` or ``python -m kvconnect.benchmarks.hf3fs [--quick]``.

Store (same run, same machine, same host memory, files in one temporary directory, warm
page cache): kvconnect's ``HF3FSStore`` (POSIX client, in-process index) against SGLang's
``HiCacheHF3FS`` with its mock (plain-file) client and local metadata client, built as the
SGLang recipe says (signal/atexit hooks patched out). Page sizes 512 KiB and 8 MiB, batches
of 128 pages, several worker counts (``numjobs``, the same for both). Each page is one
contiguous host segment for both systems (SGLang's page_first zero-copy path hands its
client one contiguous tensor per object). Sets always write new keys; gets read the keys of
the last set (warm). memcpy of the same bytes (``ctypes.memmove``, one thread) in the same
run is the machine limit.

Metadata (same run): ``kvconnect hf3fs-meta serve`` (durable: journal, fsync every 50 ms)
against ``python -m sglang...mini_3fs_metadata_server`` (FastAPI, no persistence), each a
separate process bound to 127.0.0.1, each driven by its own client (``RemoteMetadata``, framed
TCP unless ``--meta-transport`` says otherwise / ``requests``) from this process, batches of
128 keys: the metadata work of writing new keys, then get, then exists; once with one client
thread, once with ``--meta-threads`` (8) threads sharing the batches (several engine ranks
calling one service). Both systems' passes are interleaved in tenths. The write row
("reserve+confirm") is, for SGLang, ``reserve_and_allocate_page_indices`` +
``confirm_write``; for kvconnect, what ``HF3FSStore.put_from`` calls: ``reserve`` (slots from
the client's write leases: a ``Lease`` call whenever they run out, ~1 per 33 batches, timed
with the rest) + ``commit`` (one ``Put``, answered once journaled). Leases taken during the
warm-up are given back before timing; the calls made are counted and recorded.

Ratios (ours / SGLang's; > 1 = kvconnect faster): ``store_set/<page>`` and
``store_get/<page>`` compare each system at its best worker count; ``store_set`` and
``store_get`` are the worse of the two page sizes (per-configuration rows follow as
``store_set/<page>/w<workers>``), ``meta_ops`` is reserve+confirm with one client thread
(``meta_ops/get``, ``meta_ops/exists``, and the 8-thread ``.../c8`` rows follow), ``get_vs_memcpy/8MiB`` is the best warm 8 MiB get over memcpy.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `connectors` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult, gib_per_s  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parent.parent


def _keys(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def _best(fn: Callable[[int], Any], reps: int) -> list[float]:
    out = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r)
        out.append(time.perf_counter() - t0)
    return out


def _fmt_size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


# ---------------------------------------------------------------------------------
# Store: set / get bandwidth
# ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_process_hooks():
    """HiCacheHF3FS installs SIGINT/SIGTERM handlers and an atexit hook: not in a benchmark."""
    sig, ae = signal.signal, atexit.register
    signal.signal = lambda *a, **k: None
    atexit.register = lambda *a, **k: None
    try:
        yield
    finally:
        signal.signal, atexit.register = sig, ae


def bench_store(result: BenchResult, page: int, batch: int, workers: list[int], reps: int, tmp: Path,
                options: dict[str, Any] | None = None) -> None:
    import torch
    from sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server import Hf3fsLocalMetadataClient
    from sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs import HiCacheHF3FS

    from kvconnect.connectors.buffers import HostBuffer
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.hf3fs.config import HF3FSConfig
    from kvconnect.connectors.hf3fs.store import HF3FSStore

    nbytes = page * batch
    file_size = page * batch * 2
    buf = HostBuffer(batch, page, 1)
    for i in range(batch):
        ctypes.memset(buf.page(i)[0][0], (i * 7 + 1) & 0xFF, page)
    pages = [buf.page(i) for i in range(batch)]
    tensors = [torch.frombuffer((ctypes.c_char * page).from_address(buf.page(i)[0][0]), dtype=torch.uint8)
               for i in range(batch)]
    scratch = bytearray(nbytes)
    saddr = ctypes.addressof(ctypes.c_char.from_buffer(scratch))
    mc = _best(lambda r: ctypes.memmove(saddr, buf.address, nbytes), reps + 1)
    memcpy = gib_per_s(nbytes, min(mc))
    tag = _fmt_size(page)
    result.figures.setdefault("memcpy_gib_s", {})[tag] = round(memcpy, 3)
    print(f"[store {tag}] memcpy (1 thread) {memcpy:.2f} GiB/s")

    for w in workers:
        ours_dir, ref_dir = tmp / f"ours-{tag}-{w}", tmp / f"ref-{tag}-{w}"
        ours = HF3FSStore(HF3FSConfig(file_path_prefix=str(ours_dir / "hicache"), file_size=file_size,
                                      numjobs=w, entries=max(1, batch // w), **(options or {})),
                          EngineContext(engine="bench", page_bytes=page))
        with _no_process_hooks():
            ref = HiCacheHF3FS(rank=0, file_path=str(ref_dir / "hicache.0.bin"), file_size=file_size, numjobs=w,
                               bytes_per_page=page, entries=8, client_timeout=5, dtype=torch.uint8,
                               metadata_client=Hf3fsLocalMetadataClient(), use_mock_client=True)
        try:
            fig: dict[str, Any] = {}
            last: dict[str, list[str]] = {}

            def ours_set(r):
                last["ours"] = _keys(batch, f"o{tag}{w}s{r}")
                assert all(ours.put_from(last["ours"], pages))

            def ref_set(r):
                last["ref"] = _keys(batch, f"r{tag}{w}s{r}")
                assert all(ref._batch_set(last["ref"], tensors))

            # one unmeasured round each: first writes allocate the files' page cache
            ours_set(99)
            ref_set(99)
            # interleaved repetitions, best of each: the machine is shared and its load moves
            t_ours, t_ref, g_ours, g_ref = [], [], [], []
            for r in range(reps):
                t_ours += _best(lambda _: ours_set(r), 1)
                t_ref += _best(lambda _: ref_set(r), 1)
            for r in range(reps + 1):
                g_ours += _best(lambda _: all(ours.get_into(last["ours"], pages)) or _fail("ours get"), 1)
                g_ref += _best(lambda _: all(ref._batch_get(last["ref"], tensors)) or _fail("ref get"), 1)
                mc += _best(lambda _: ctypes.memmove(saddr, buf.address, nbytes), 1)  # the limit, same moments
            memcpy = max(memcpy, gib_per_s(nbytes, min(mc)))
            result.figures["memcpy_gib_s"][tag] = round(memcpy, 3)
            fig["set_gib_s"] = {"kvconnect": gib_per_s(nbytes, min(t_ours)),
                                "sglang": gib_per_s(nbytes, min(t_ref))}
            fig["get_gib_s"] = {"kvconnect": gib_per_s(nbytes, min(g_ours)),
                                "sglang": gib_per_s(nbytes, min(g_ref))}
            fig["loadavg"] = os.getloadavg()
            fig["get_vs_memcpy"] = fig["get_gib_s"]["kvconnect"] / memcpy
            fig["set_vs_memcpy"] = fig["set_gib_s"]["kvconnect"] / memcpy
            result.figures.setdefault("store", {})[f"{tag}/w{w}"] = fig
            print(f"[store {tag} workers={w}] set ours {fig['set_gib_s']['kvconnect']:.2f} GiB/s, "
                  f"sglang {fig['set_gib_s']['sglang']:.2f}; get ours {fig['get_gib_s']['kvconnect']:.2f}, "
                  f"sglang {fig['get_gib_s']['sglang']:.2f} GiB/s (memcpy {memcpy:.2f})")
            result.ratio(f"store_set/{tag}/w{w}", fig["set_gib_s"]["kvconnect"], fig["set_gib_s"]["sglang"],
                         "SGLang 0.5.23 HiCacheHF3FS (mock client, local metadata)")
            result.ratio(f"store_get/{tag}/w{w}", fig["get_gib_s"]["kvconnect"], fig["get_gib_s"]["sglang"],
                         "SGLang 0.5.23 HiCacheHF3FS (mock client, local metadata)")
        finally:
            ours.close()
            ref.close()
            shutil.rmtree(ours_dir, ignore_errors=True)
            shutil.rmtree(ref_dir, ignore_errors=True)
    del scratch


def _fail(what: str):
    raise AssertionError(f"{what}: not every page was a hit")


# ---------------------------------------------------------------------------------
# Metadata service vs mini_3fs_metadata_server
# ---------------------------------------------------------------------------------


def _cpu(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def _timed_split(pool: ThreadPoolExecutor, fn, a: int, b: int, threads: int) -> float:
    """Seconds for ``fn`` over batches [a, b) split over ``threads`` client threads of ``pool``
    (one: the calling thread)."""
    if threads == 1:
        t0 = time.perf_counter()
        fn(a, b)
        return time.perf_counter() - t0
    step = -(-(b - a) // threads)
    t0 = time.perf_counter()
    for f in [pool.submit(fn, i, min(b, i + step)) for i in range(a, b, step)]:
        f.result()
    return time.perf_counter() - t0


def bench_meta(result: BenchResult, batches: int, tmp: Path, concurrency: int = 8, transport: str = "auto",
               lease_ahead: int = 4096) -> None:
    from sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server import Hf3fsGlobalMetadataClient

    from kvconnect.connectors.hf3fs.client import RemoteMetadata

    B = 128
    num_pages = batches * B * 3  # both passes write new keys; never evict under a read lease
    ours_port, ref_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    token = os.urandom(8).hex()
    (tmp / "token").write_text(token)
    ours_p = subprocess.Popen([sys.executable, "-m", "kvconnect.connectors.cli", "--log-level", "WARNING", "hf3fs-meta",
                               "serve", "--host", "127.0.0.1", "--port", str(ours_port), "--data-dir",
                               str(tmp / "meta"), "--token-file", str(tmp / "token")],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ref_p = subprocess.Popen([sys.executable, "-m", "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server",
                              "--host", "127.0.0.1", "--port", str(ref_port)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(ours_port, ours_p)
        _wait_port(ref_port, ref_p)
        ours = RemoteMetadata(f"127.0.0.1:{ours_port}", token, timeout=30, transport=transport,
                              lease_ahead=lease_ahead)
        ours.connect()
        calls: dict[str, int] = {}
        real_call = ours._call

        def counted(method, payload):  # what our write path really sends, per batch
            calls[method] = calls.get(method, 0) + 1
            return real_call(method, payload)

        ours._call = counted
        ref = Hf3fsGlobalMetadataClient(f"http://127.0.0.1:{ref_port}")
        ours.initialize("0:kv", num_pages, 4096)
        ref.initialize(0, num_pages)
        kb = [[k.encode() for k in _keys(B, f"m{b}")] for b in range(batches)]
        ks = [[k.decode() for k in batch] for batch in kb]
        # warm both (connections, code paths) on keys outside the measured set
        for w in range(3):
            wk = [k.encode() for k in _keys(B, f"warm{w}")]
            st, sl, gn = ours.reserve("0:kv", wk)
            ours.commit("0:kv", wk, sl, gn, [0] * B, b"\x01" * B)
            r = ref.reserve_and_allocate_page_indices(0, [(k.decode(), "") for k in wk])
            ref.confirm_write(0, [(k.decode(), i) for k, (_, i) in zip(wk, r)], [])
        ours.release_leases("0:kv")  # the timed passes lease what they use

        def ours_rc(a, b):
            for batch in kb[a:b]:
                st, sl, gn = ours.reserve("0:kv", batch)
                ok = ours.commit("0:kv", batch, sl, gn, [0] * B, b"\x01" * B)
                assert ok == b"\x01" * B

        def ref_rc(a, b):
            for batch in ks[a:b]:
                r = ref.reserve_and_allocate_page_indices(0, [(k, "") for k in batch])
                ref.confirm_write(0, [(k, i) for k, (_, i) in zip(batch, r)], [])

        def ours_get(a, b):
            for batch in kb[a:b]:
                sl, _, _ = ours.get("0:kv", batch)
                assert min(sl) >= 0

        def ref_get(a, b):
            for batch in ks[a:b]:
                assert None not in ref.get_page_indices(0, batch)

        def ours_exists(a, b):
            for batch in kb[a:b]:
                assert ours.exists("0:kv", batch) == b"\x01" * B

        def ref_exists(a, b):
            for batch in ks[a:b]:
                assert all(ref.exists(0, batch))

        n = batches * B
        fig: dict[str, Any] = {"batch": B, "batches": batches}
        chunk = max(1, batches // 10)

        # long-lived client threads (engine ranks exist before they call): starting threads
        # per chunk would time thread creation, not metadata calls
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="meta-client")
        barrier = threading.Barrier(concurrency)
        list(pool.map(lambda _: barrier.wait(), range(concurrency)))  # all threads up

        def timed(fn, a: int, b: int, threads: int) -> float:
            return _timed_split(pool, fn, a, b, threads)

        for threads in (1, concurrency):
            for op, o, r in (("reserve_confirm", ours_rc, ref_rc), ("get", ours_get, ref_get),
                             ("exists", ours_exists, ref_exists)):
                if op == "reserve_confirm" and threads != 1:
                    # fresh keys: the first pass confirmed them all; new ones for this pass
                    kb[:] = [[k.encode() for k in _keys(B, f"m{threads}-{b}")] for b in range(batches)]
                    ks[:] = [[k.decode() for k in batch] for batch in kb]
                # interleaved in tenths, so both systems see the same machine load; server CPU
                # time too, which the load of a shared machine does not inflate
                to = tr = 0.0
                calls.clear()
                co0, cr0 = _cpu(ours_p.pid), _cpu(ref_p.pid)
                for c in range(0, batches, chunk):
                    to += timed(o, c, min(batches, c + chunk), threads)
                    tr += timed(r, c, min(batches, c + chunk), threads)
                co, cr = _cpu(ours_p.pid) - co0, _cpu(ref_p.pid) - cr0
                order = ("Lease", "Reserve", "Put", "Commit")  # a write's calls in the order they happen
                per_batch = {m: round(calls[m] / batches, 3)
                             for m in sorted(calls, key=lambda m: order.index(m) if m in order else len(order))}
                fig[f"{op}/c{threads}"] = {"kvconnect_keys_s": n / to, "sglang_keys_s": n / tr, "client_threads": threads,
                                           "kvconnect_server_cpu_us_per_key": co / n * 1e6,
                                           "sglang_server_cpu_us_per_key": cr / n * 1e6,
                                           "kvconnect_calls_per_batch": per_batch}
                label = f"{op} (ours: {'+'.join(per_batch)})" if op == "reserve_confirm" else op
                print(f"[meta {label}, {threads} client thread(s)] ours {n / to:,.0f} keys/s, "
                      f"mini_3fs_metadata_server {n / tr:,.0f} keys/s ({tr / to:.1f}x); server CPU per key "
                      f"{co / n * 1e6:.2f} vs {cr / n * 1e6:.2f} us ({cr / co if co else 0:.1f}x); "
                      f"our calls per batch {per_batch}")
        fig["loadavg"] = os.getloadavg()
        fig["kvconnect_transport"] = "framed TCP" if ours._tcp_port else f"gRPC ({transport})"
        fig["kvconnect_lease_ahead"] = lease_ahead
        result.figures["meta"] = fig
        ref_name = "SGLang 0.5.23 mini_3fs_metadata_server (FastAPI, in-memory)"
        ours_write = "+".join(fig["reserve_confirm/c1"]["kvconnect_calls_per_batch"])
        result.ratio("meta_ops", fig["reserve_confirm/c1"]["kvconnect_keys_s"],
                     fig["reserve_confirm/c1"]["sglang_keys_s"],
                     ref_name + f", reserve+confirm (ours: {ours_write}), 1 client thread")
        for op in ("get", "exists"):
            result.ratio(f"meta_ops/{op}", fig[f"{op}/c1"]["kvconnect_keys_s"], fig[f"{op}/c1"]["sglang_keys_s"],
                         ref_name + ", 1 client thread")
        c = f"c{concurrency}"
        for op in ("reserve_confirm", "get", "exists"):
            result.ratio(f"meta_ops/{op}/{c}", fig[f"{op}/{c}"]["kvconnect_keys_s"], fig[f"{op}/{c}"]["sglang_keys_s"],
                         ref_name + f", {concurrency} client threads")
        ours.close()
        pool.shutdown()
    finally:
        for p in (ours_p, ref_p):
            _stop(p)


def _stop(p: subprocess.Popen) -> None:
    """Terminate a server process (killed if it has not exited after 15 s)."""
    p.terminate()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


# ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvconnect bench hf3fs", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="512 KiB pages, one worker count, fewer batches (~30 s)")
    ap.add_argument("--workers", default=None, help="comma-separated worker counts (default 1,4,16; quick: 4)")
    ap.add_argument("--batch", type=int, default=128, help="pages per batch (default 128)")
    ap.add_argument("--meta-batches", type=int, default=None, help="metadata batches of 128 keys (default 400)")
    ap.add_argument("--meta-threads", type=int, default=8,
                    help="client threads for the concurrent metadata pass (default 8: several engine ranks)")
    ap.add_argument("--meta-transport", default="auto", choices=("auto", "tcp", "stream", "unary"),
                    help="our metadata client's transport (default auto: framed TCP)")
    ap.add_argument("--meta-lease-ahead", type=int, default=4096,
                    help="slots our client leases ahead (default 4096, as the store; 0: Reserve+Commit per batch)")
    ap.add_argument("--skip-meta", action="store_true")
    ap.add_argument("--skip-store", action="store_true")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/hf3fs.json)")
    ap.add_argument("--dir", default=None, help="directory for data files (default: a temporary directory)")
    ap.add_argument("--store-options", default="{}", metavar="JSON",
                    help='extra kvconnect hf3fs options, e.g. \'{"posix_files": 2}\' (default: none, the defaults)')
    args = ap.parse_args(argv)

    os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
    import logging

    # sglang's mini server module calls logging.basicConfig(INFO) on import: keep output to figures
    import sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server  # noqa: F401

    logging.getLogger().setLevel(logging.WARNING)
    import json

    store_options = json.loads(args.store_options)
    workers = [int(w) for w in (args.workers or ("4" if args.quick else "1,4,16")).split(",")]
    page_sizes = [512 * KiB] if args.quick else [512 * KiB, 8 * MiB]
    reps = 3 if args.quick else 5
    meta_batches = args.meta_batches or (60 if args.quick else 400)
    result = BenchResult("hf3fs", params={"quick": args.quick, "page_sizes": page_sizes, "batch": args.batch,
                                          "workers": workers, "reps": reps, "meta_batches": meta_batches,
                                          "meta_batch_keys": 128, "meta_transport": args.meta_transport,
                                          "meta_lease_ahead": args.meta_lease_ahead, "page_cache": "warm",
                                          "layout": "page_first",
                                          "store_options": store_options})
    result.notes.append("machine shared with other work: figures move with load (see machine.loadavg); "
                        "compare ratios, which come from one run")
    tmp = Path(tempfile.mkdtemp(prefix="kvc-hf3fs-bench-", dir=args.dir))
    try:
        if not args.skip_store:
            for page in page_sizes:
                bench_store(result, page, args.batch, workers, reps, tmp, store_options)
            # headline: per page size, each system at its best worker count; then the worse page size
            ref_name = "SGLang 0.5.23 HiCacheHF3FS (mock client, local metadata), each at its best worker count"
            for op in ("set", "get"):
                rows = []
                for page in page_sizes:
                    tag = _fmt_size(page)
                    figs = [v[f"{op}_gib_s"] for k, v in result.figures["store"].items() if k.startswith(tag + "/")]
                    rows.append(result.ratio(f"store_{op}/{tag}", max(f["kvconnect"] for f in figs),
                                             max(f["sglang"] for f in figs), ref_name))
                worst = min(rows, key=lambda r: r["ratio"])
                result.ratios.append({**worst, "metric": f"store_{op}", "worse_page_size_of": worst["metric"]})
            if 8 * MiB in page_sizes:
                best = max(v["get_gib_s"]["kvconnect"] for k, v in result.figures["store"].items() if k.startswith("8MiB"))
                memcpy = result.figures["memcpy_gib_s"]["8MiB"]
                result.ratio("get_vs_memcpy/8MiB", best, memcpy, "memcpy (ctypes.memmove, 1 thread, best in this run)")
        if not args.skip_meta:
            bench_meta(result, meta_batches, tmp, args.meta_threads, args.meta_transport, args.meta_lease_ahead)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
