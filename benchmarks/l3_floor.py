"""The floor of an L3 hit's load path on this host: store reads into pinned host pages, the copy to the GPU, memcpy.

An L3 hit in SGLang HiCache pays a store read into host-pool pages, then the same host-to-device
copy an L2 hit pays. This measures, for one prefix (``--tokens`` tokens of ``--bytes-per-token``,
64-token pages: a Llama-3-8B prefix of 2,048 tokens is 32 pages of 8 MiB by default), on the
machine it runs on:

* ``memcpy``: ``ctypes.memmove`` of the prefix's bytes, one thread and ``--threads`` threads
  (``limits.measure_memcpy``): the most any host-memory store can do here;
* ``get``: each store (``memory``; ``hf3fs`` with ``numjobs`` 16 and ``entries`` 8 on ``--dir``,
  ``hf3fs_e16`` with the serving benchmark's ``entries`` 16, ``hf3fs_2t`` with two workers;
  ``peer_shm``: a ``peer_rdma`` node reading another node's pages from its shared segment on this
  host, each page copied and hashed in one pass, its reads alternating with the same reads in
  two passes, every page copied, then every page hashed: ``two_pass``) reading the prefix's pages into one host buffer (pinned when a
  GPU is there, as SGLang's host pool is), alone and while another thread keeps writing other
  pages into the same store (write-through puts of other requests); every read is checked byte
  for byte on its first and last page;
* ``xxh3``: the xxh3-64 of every page (what the peer pool checks after a same-host copy or a
  transfer), on one thread and shared out over the copy threads;
* ``h2d``: the same bytes from that pinned buffer to the GPU, one copy per page on one stream
  (torch): what an L2 hit costs in copies.

Ratios (``benchmarks/results/l3_floor.json``): each store's read against memcpy with as many
threads; reads under puts against reads alone; ``peer_shm``'s one pass against its two passes;
the L3 floor (store read + h2d) against the L2 floor (h2d). The serving benchmark's measured store time per L3 hit can be set beside them.
Without CUDA the h2d figures are left out (the JSON says so).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult, gib_per_s  # noqa: E402
from kvconnect.benchmarks.limits import measure_memcpy  # noqa: E402
from kvconnect.connectors.config import parse_size  # noqa: E402

MiB = 1 << 20


class PinnedPages:
    """``n`` pages of ``page_bytes`` in one host buffer: pinned torch memory where CUDA is
    there (``tensor``), else anonymous memory (page-aligned, as pinned memory is)."""

    def __init__(self, n: int, page_bytes: int, torch: Any = None, segments: int = 1):
        from kvconnect.connectors.buffers import buffer_address

        if page_bytes % segments:
            raise ValueError(f"page_bytes {page_bytes} is not a multiple of segments {segments}")
        self.n, self.page_bytes, self.tensor, self.segments = n, page_bytes, None, segments
        self.seg_bytes = page_bytes // segments
        if torch is not None:
            self.tensor = torch.empty(n * page_bytes, dtype=torch.uint8, pin_memory=True)
            self.address = self.tensor.data_ptr()
        else:
            import mmap

            self._raw = mmap.mmap(-1, max(1, n * page_bytes))
            self.address = buffer_address(self._raw)

    def page(self, i: int) -> list[tuple[int, int]]:
        """One segment, or ``segments`` of them in separate regions (SGLang's layer_first host
        layout: a page is one piece per layer and K/V, each in its layer's buffer)."""
        region = self.n * self.seg_bytes
        return [(self.address + s * region + i * self.seg_bytes, self.seg_bytes) for s in range(self.segments)]

    def read(self, i: int) -> bytes:
        import ctypes

        return b"".join(ctypes.string_at(a, n) for a, n in self.page(i))


def page_pattern(i: int, page_bytes: int) -> bytes:
    """A page's bytes that differ from every other page's (its index in the first 8 bytes)."""
    head = i.to_bytes(8, "little")
    return (head + bytes(((i * 7 + j) & 0xFF for j in range(56)))) * (page_bytes // 64)


def open_stores(names: list[str], directory: Path, page_bytes: int, pages: int) -> dict[str, Any]:
    from kvconnect.connectors.registry import create_store

    room = (pages + 64) * page_bytes  # the prefix, the writer's batches, slack
    unknown = [n for n in names if n not in FLOOR_STORES]
    if unknown:
        raise SystemExit(f"--stores: unknown {', '.join(unknown)}; accepted values: {', '.join(FLOOR_STORES)}")
    stores = {}
    for n in names:
        store, options = FLOOR_STORES[n]
        if store == "peer_rdma":
            stores[n] = PeerPair(directory / n, room)
            continue
        if store == "memory":
            options = {**options, "capacity": room}
        else:
            options = {**options, "file_path_prefix": str(directory / n), "file_size": room, "page_bytes": page_bytes}
        stores[n] = create_store(store, options)
        if n.endswith("_1pool"):
            # before reads and writes had workers of their own: the writes' tasks on the read workers
            st = stores[n]
            st.io.writes.shutdown(wait=True)
            st.io.writes = st.io.reads
    return stores


# name -> (store, options): the stores a floor run can read from
FLOOR_STORES = {
    "memory": ("memory", {}),
    "hf3fs": ("hf3fs", {"numjobs": 16, "entries": 8}),
    # the serving benchmark's kvc_hf3fs (benchmarks/serving/configs.py): entries 16
    "hf3fs_e16": ("hf3fs", {"numjobs": 16, "entries": 16}),
    # two workers: the threads a 32-page batch had with entries 16 before batches were spread over numjobs
    "hf3fs_2t": ("hf3fs", {"numjobs": 2, "entries": 16}),
    # hf3fs_e16 with one pool of workers for reads and writes (as before they had pools of their own)
    "hf3fs_e16_1pool": ("hf3fs", {"numjobs": 16, "entries": 16}),
    # peer_rdma, two nodes of one host with shared_segment (the serving benchmark's kvc_peer_rdma_shm);
    # its reads alternate with the two-pass reads the one-pass copy and hash replaced
    "peer_shm": ("peer_rdma", {}),
}


class PeerPair:
    """Two ``peer_rdma`` nodes in this process, both with ``shared_segment`` in ``directory``
    (on /dev/shm): ``holder`` lends the memory and keeps the pages it is given (``placement``
    local); ``reader`` lends none and reads them as a server reads another same-host server's
    pages: a directory lookup, then a copy out of the holder's mapped file, checked against the
    published checksums (no Transfer Engine transfer). Puts and deletes go to the holder, gets to
    the reader. ``fused`` False: the reader copies every page, then hashes every page.

    Mooncake's Transfer Engine (started by each node, TCP, not used by these reads) listens on
    every interface of this network namespace while the run lasts."""

    def __init__(self, directory: Path, room: int):
        import socket

        from kvconnect.connectors.registry import create_store

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common = {"discovery_addr": f"127.0.0.1:{port}", "protocol": "tcp", "local_hostname": "127.0.0.1",
                  "shared_segment": True, "shared_segment_dir": str(directory)}
        self.holder = create_store("peer_rdma", {**common, "control_port": port, "global_segment_size": room,
                                                 "placement": "local"})
        try:
            self.reader = create_store("peer_rdma", {**common, "control_port": 0, "global_segment_size": 0})
            deadline = time.monotonic() + 10
            while len(self.reader.node.view.members) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("peer_shm: the reader never saw the holder join")
                time.sleep(0.02)
        except BaseException:
            self.holder.close()
            raise

    @property
    def fused(self) -> bool:
        return self.reader.node.reader.fused_same_host

    @fused.setter
    def fused(self, on: bool) -> None:
        self.reader.node.reader.fused_same_host = on

    @property
    def chunk(self) -> int:
        """Bytes copied then hashed per step of the one pass."""
        return self.reader.node.reader.fused_chunk_bytes

    @chunk.setter
    def chunk(self, nbytes: int) -> None:
        self.reader.node.reader.fused_chunk_bytes = nbytes

    def put_from(self, keys: list[str], pages: list) -> list[bool]:
        return self.holder.put_from(keys, pages)

    def get_into(self, keys: list[str], pages: list) -> list[bool]:
        return self.reader.get_into(keys, pages)

    def delete(self, keys: list[str]) -> list[bool]:
        return self.holder.delete(keys)

    def metrics(self) -> dict[str, Any]:
        m = self.reader.node.metrics()
        return {k: m[k] for k in ("shared_reads", "staged_reads", "read_stale")}

    def close(self) -> None:
        self.reader.close()
        self.holder.close()


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    med = statistics.median(seconds)
    return {"ms_median": round(med * 1e3, 3), "ms_best": round(min(seconds) * 1e3, 3),
            "gib_per_s": round(gib_per_s(nbytes, med), 3), "repeats": len(seconds)}


class BackgroundWriter:
    """A thread writing batches of fresh keys into ``store`` (deleting each after it is stored)
    until stopped: the write-through puts that run beside a prefetch on a busy server."""

    def __init__(self, store: Any, page_bytes: int, batch: int, torch: Any = None):
        self.store, self.batch = store, batch
        self.src = PinnedPages(batch, page_bytes, torch)
        self.page_bytes = page_bytes
        self.written = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="floor-writer", daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            keys = [f"writer-{n}-{i}" for i in range(self.batch)]
            ok = self.store.put_from(keys, [self.src.page(i) for i in range(self.batch)])
            self.written += sum(1 for x in ok if x) * self.page_bytes
            self.store.delete(keys)
            n += 1

    def __enter__(self) -> "BackgroundWriter":
        self.t0 = time.perf_counter()
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(timeout=30)
        self.seconds = time.perf_counter() - self.t0


def measure_store(store: Any, name: str, dst: PinnedPages, pages: int, repeats: int,
                  torch: Any, peer_chunks: tuple[int, ...] = ()) -> dict[str, Any]:
    pb = dst.page_bytes
    keys = [f"prefix-{i}" for i in range(pages)]
    src = PinnedPages(pages, pb)
    import ctypes

    for i in range(pages):
        data = page_pattern(i, pb)
        ctypes.memmove(src.address + i * pb, data, pb)
    assert all(store.put_from(keys, [src.page(i) for i in range(pages)])), f"{name}: the prefix was not stored"
    want = {0: src.read(0), pages - 1: src.read(pages - 1)}

    def read() -> None:
        for a, n in dst.page(0):
            ctypes.memset(a, 0, n)
        ok = store.get_into(keys, [dst.page(i) for i in range(pages)])
        if not all(ok) or any(dst.read(i) != b for i, b in want.items()):
            raise AssertionError(f"{name}: a read missed or returned other bytes ({sum(ok)}/{pages} hits)")

    read()  # warm: files mapped, pages faulted in
    nbytes = pages * pb
    if isinstance(store, PeerPair):
        return measure_peer(store, name, read, keys, pb, nbytes, repeats, torch, peer_chunks)
    alone = summary(nbytes, timed(read, repeats))
    with BackgroundWriter(store, pb, 8, torch) as w:
        under = summary(nbytes, timed(read, repeats))
    under["writer_gib_per_s"] = round(gib_per_s(w.written, w.seconds), 3)
    store.delete(keys)
    return {"get": alone, "get_under_puts": under}


def timed_alternating(store: "PeerPair", read: Callable[[], Any], repeats: int) -> dict[bool, list[float]]:
    """``repeats`` reads in one pass and as many in two, alternating (which goes first alternates
    too), so that what else runs on the host weighs on both alike. Keyed by ``fused``."""
    out: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(repeats):
            for fused in (True, False) if r % 2 == 0 else (False, True):
                store.fused = fused
                out[fused] += timed(read, 1)
    finally:
        store.fused = True
    return out


def measure_peer(store: "PeerPair", name: str, read: Callable[[], Any], keys: list[str], page_bytes: int,
                 nbytes: int, repeats: int, torch: Any, chunks: tuple[int, ...] = ()) -> dict[str, Any]:
    """The same-host peer's reads: one pass (``get``) and two passes (``two_pass``) alternating,
    alone and under a writer; then, for each of ``chunks``, the one pass with that many bytes
    copied then hashed per step, alternating with two passes again (``chunks``); its reader's
    counters say every read came out of the shared segment."""
    store.fused = False
    read()  # the two-pass path's bytes are checked too
    store.fused = True
    by_chunk: dict[str, Any] = {}
    default = store.chunk
    try:
        for c in chunks:
            store.chunk = c
            read()  # this chunk's bytes are checked too
            t = timed_alternating(store, read, repeats)
            by_chunk[f"{c >> 10}k"] = {"chunk_bytes": c, "get": summary(nbytes, t[True]),
                                       "two_pass_get": summary(nbytes, t[False])}
    finally:
        store.chunk = default
    alone = timed_alternating(store, read, repeats)
    with BackgroundWriter(store, page_bytes, 8, torch) as w:
        under = timed_alternating(store, read, repeats)
    writer = {"writer_gib_per_s": round(gib_per_s(w.written, w.seconds), 3)}
    store.delete(keys)
    out = {"get": summary(nbytes, alone[True]), "get_under_puts": {**summary(nbytes, under[True]), **writer},
           "two_pass": {"get": summary(nbytes, alone[False]),
                        "get_under_puts": {**summary(nbytes, under[False]), **writer}}}
    if by_chunk:
        out["chunks"] = by_chunk
    m = out["reader_counters"] = store.metrics()
    if m["shared_reads"] == 0 or m["staged_reads"]:
        raise AssertionError(f"{name}: the reads did not all come from the shared segment ({m})")
    return out


def measure_checksums(pages: PinnedPages, n: int, repeats: int) -> dict[str, Any]:
    """xxh3-64 of every page of the prefix (what a validated read checks: peer_rdma's same-host
    and remote reads), on the calling thread alone and shared out over the copy threads."""
    from kvconnect.connectors.peer_rdma.segment import checksum_page, checksum_pages

    all_pages = [pages.page(i) for i in range(n)]
    want = [checksum_page(p) for p in all_pages]
    assert checksum_pages(all_pages) == want, "spread checksums differ from one thread's"
    nbytes = n * pages.page_bytes
    return {"one_thread": summary(nbytes, timed(lambda: [checksum_page(p) for p in all_pages], repeats)),
            "copy_threads": summary(nbytes, timed(lambda: checksum_pages(all_pages), repeats))}


def measure_h2d(torch: Any, src: PinnedPages, repeats: int) -> dict[str, Any]:
    """One copy per host piece (a page, or a page's layer piece), on one stream."""
    dev = torch.empty(src.n * src.page_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    pb, sb = src.page_bytes, src.seg_bytes
    base = src.address

    def copy() -> None:
        with torch.cuda.stream(stream):
            for i in range(src.n):
                for a, n in src.page(i):
                    off = a - base
                    dev[off:off + n].copy_(src.tensor[off:off + n], non_blocking=True)
        stream.synchronize()

    copy()
    out = summary(src.n * pb, timed(copy, repeats))
    if not torch.equal(dev[:sb].cpu(), src.tensor[:sb]):
        raise AssertionError("h2d: the device copy differs from the host page")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvconnect bench l3_floor", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="256 tokens, 3 repeats (seconds; for CI)")
    p.add_argument("--tokens", type=int, default=2048, help="prefix tokens (default 2048)")
    p.add_argument("--bytes-per-token", type=int, default=128 << 10,
                   help="KV bytes per token, all layers (default 131072: Llama-3-8B, bf16)")
    p.add_argument("--page-tokens", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--repeats", type=int, default=10, help="timed reads per figure (default 10)")
    p.add_argument("--threads", type=int, default=16, help="memcpy threads beside one (default 16: hf3fs numjobs)")
    p.add_argument("--segments", type=int, default=1,
                   help="pieces per host page (default 1: SGLang's page_first layout; 2 x layers, e.g. 64: "
                        "layer_first, where each page is one piece per layer and K/V)")
    p.add_argument("--stores", default="memory,hf3fs", help="stores to read from, of " + ", ".join(FLOOR_STORES)
                   + " (default memory,hf3fs; hf3fs: numjobs 16, entries 8; hf3fs_e16: entries 16, the serving "
                   "benchmark's; hf3fs_2t: 2 workers; hf3fs_e16_1pool: reads and writes on one pool; peer_shm: "
                   "peer_rdma's same-host read from another node's shared segment, one pass and two alternating)")
    p.add_argument("--dir", default=None, help="hf3fs data directory (default: a temporary one under /dev/shm "
                                               "where it exists, so the file system is not the limit)")
    p.add_argument("--store-s-per-l3-hit", type=float, default=None,
                   help="the serving benchmark's measured store seconds per L3 hit, set beside the floor")
    p.add_argument("--peer-chunks", default="",
                   help="peer_shm: also time the one pass with these bytes copied then hashed per step, each "
                        "alternating with two passes (comma-separated sizes, e.g. 256k,1m,4m; default none)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/l3_floor.json)")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.repeats = 256, 3
    try:
        chunks = tuple(parse_size(x, "--peer-chunks") for x in a.peer_chunks.split(",") if x.strip())
    except ValueError as e:
        p.error(str(e))
    if any(c <= 0 for c in chunks):
        p.error("--peer-chunks: sizes must be positive (for example 256k,1m,4m)")
    if a.tokens % a.page_tokens:
        p.error(f"--tokens must be a multiple of --page-tokens ({a.page_tokens})")
    try:
        import torch

        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    pages, pb = a.tokens // a.page_tokens, a.page_tokens * a.bytes_per_token
    nbytes = pages * pb
    base = a.dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    res = BenchResult("l3_floor", params={"tokens": a.tokens, "bytes_per_token": a.bytes_per_token,
                                          "page_tokens": a.page_tokens, "pages": pages, "page_bytes": pb,
                                          "repeats": a.repeats, "threads": a.threads, "segments": a.segments,
                                          "cuda": torch is not None})
    figs: dict[str, Any] = {}
    t0 = time.perf_counter()
    print(f"[l3_floor] {pages} pages of {pb / MiB:.1f} MiB ({nbytes / MiB:.0f} MiB), cuda={torch is not None}",
          flush=True)
    figs["memcpy_1t"] = measure_memcpy(nbytes, a.repeats, 1)
    figs["memcpy_nt"] = measure_memcpy(nbytes, a.repeats, a.threads)
    dst = PinnedPages(pages, pb, torch, a.segments)
    with tempfile.TemporaryDirectory(prefix="kvc-floor-", dir=base) as d:
        stores = open_stores([s for s in a.stores.split(",") if s], Path(d), pb, pages)
        try:
            for name, store in stores.items():
                print(f"[l3_floor] {name} ...", flush=True)
                figs[name] = measure_store(store, name, dst, pages, a.repeats, torch, chunks)
        finally:
            for store in stores.values():
                store.close()
    if torch is not None:
        figs["h2d"] = measure_h2d(torch, dst, a.repeats)
        figs["gpu"] = torch.cuda.get_device_name(0)
    else:
        res.notes.append("no CUDA here: the host-to-device figures (h2d, the L2 and L3 floors) are not measured")
    mem = figs["memcpy_nt"]["gib_per_s"]
    for name in stores:
        g, u = figs[name]["get"], figs[name]["get_under_puts"]
        res.ratio(f"{name}_get_over_memcpy_{a.threads}t", g["gib_per_s"], mem,
                  f"ctypes.memmove with {a.threads} threads, same bytes, same run")
        res.ratio(f"{name}_get_under_puts_over_alone", u["gib_per_s"], g["gib_per_s"],
                  f"{name} reads with no writer, same run")
        if torch is not None:
            l3 = g["ms_median"] + figs["h2d"]["ms_median"]
            figs[name]["l3_floor_ms"] = round(l3, 3)
            res.ratio(f"{name}_l3_floor_over_l2_floor", l3, figs["h2d"]["ms_median"],
                      "host-to-device copy alone (what an L2 hit copies), same run", higher_is_better=False)
    try:
        import xxhash  # noqa: F401  (the peer pool's checksum)

        figs["xxh3"] = measure_checksums(dst, pages, a.repeats)
        res.ratio("xxh3_copy_threads_over_one_thread", figs["xxh3"]["copy_threads"]["gib_per_s"],
                  figs["xxh3"]["one_thread"]["gib_per_s"], "the same pages hashed on one thread, same run")
    except ImportError:
        res.notes.append("xxhash is not installed: no checksum figures")
    for name in stores:
        for label, f in figs[name].get("chunks", {}).items():
            res.ratio(f"{name}_get_chunk_{label}_over_2pass", f["get"]["gib_per_s"], f["two_pass_get"]["gib_per_s"],
                      f"the same reads in two passes, alternating with the one pass copying and hashing {label} "
                      "per step, same run")
        two = figs[name].get("two_pass")
        if two:
            res.ratio(f"{name}_get_over_2pass", figs[name]["get"]["gib_per_s"], two["get"]["gib_per_s"],
                      "the same same-host reads copying every page, then hashing every page (the path the "
                      "one-pass copy and hash replaced), alternating with them, same run")
            res.ratio(f"{name}_get_under_puts_over_2pass", figs[name]["get_under_puts"]["gib_per_s"],
                      two["get_under_puts"]["gib_per_s"], "the same, under puts, alternating, same run")
    if "hf3fs_e16" in stores and "hf3fs_e16_1pool" in stores:
        res.ratio("hf3fs_e16_get_under_puts_over_one_pool", figs["hf3fs_e16"]["get_under_puts"]["gib_per_s"],
                  figs["hf3fs_e16_1pool"]["get_under_puts"]["gib_per_s"],
                  "the same reads under puts with reads and writes on one pool of workers, same run")
    if "hf3fs_e16" in stores and "hf3fs_2t" in stores:
        res.ratio("hf3fs_e16_get_over_2_workers", figs["hf3fs_e16"]["get"]["gib_per_s"],
                  figs["hf3fs_2t"]["get"]["gib_per_s"],
                  "the same reads on two workers (what entries 16 gave a 32-page batch before), same run")
    if a.store_s_per_l3_hit:
        figs["serving_store_ms_per_l3_hit"] = round(a.store_s_per_l3_hit * 1e3, 3)
        for name in stores:
            res.ratio(f"serving_store_time_over_{name}_get_floor", figs[name]["get"]["ms_median"],
                      a.store_s_per_l3_hit * 1e3, "the serving benchmark's store time per L3 hit (another run)",
                      higher_is_better=False)
    figs["wall_s"] = round(time.perf_counter() - t0, 2)
    res.figures = figs
    res.notes.append("get: one get_into of every page of the prefix into one (pinned) host buffer; get_under_puts: "
                     "the same while a thread writes 8-page batches of other keys into the same store")
    res.finish(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
