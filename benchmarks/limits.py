"""Machine limits: memcpy, loopback TCP, disk write+fsync and page-cache read bandwidth.

Every other benchmark quotes its figures as a ratio to these limits, measured in the same
run (``from kvconnect.benchmarks.limits import measure_all`` or the single ``measure_*`` functions),
because the machines are shared and absolute numbers drift with load.

* memcpy: ``ctypes.memmove`` between two large buffers (the call every kvconnect store
  uses to move page bytes; it releases the GIL), single thread and ``--threads`` threads,
  and one page at a time for 128 KiB and 8 MiB pages (the per-call cost a store pays).
* loopback TCP: one Python stream over 127.0.0.1 (``sendall`` / ``recv_into``, a receiver
  thread in this process), i.e. the best a Python TCP data path can do here.
* disk: sequential ``os.write`` of a file then ``fsync`` (write+fsync), then reading it
  back from the page cache with ``readinto`` (the file was just written, so reads are
  served from memory), in a temporary directory that is removed afterwards.

Ratios written to ``benchmarks/results/limits.json``: ``ctypes.memmove`` against
``numpy.copyto`` measured side by side in this run, and each limit against the figure
of an earlier quiet run on a machine of the same kind (``PUBLISHED``: orientation, not a
same-run comparison; the JSON says so).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvconnect.benchmarks.harness import BenchResult, gib_per_s  # noqa: E402

MiB = 1 << 20
# Page sizes for the per-page memcpy figures: the demo's tiny shape and a Llama-8B page (64 tokens).
PAGE_SIZES = (128 * 1024, 8 * MiB)

# Orientation figures (GiB/s) of an earlier quiet run on a machine of the same kind (2 cores, 24 GiB).
PUBLISHED = {
    "memcpy_gib_s": 20.0,
    "loopback_tcp_gib_s": 5.0,
    "disk_write_fsync_gib_s": 0.35,
    "pagecache_read_gib_s": 16.0,
}


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _summary(nbytes: int, seconds: list[float], **extra: Any) -> dict[str, Any]:
    med = statistics.median(seconds)
    return {"gib_per_s": round(gib_per_s(nbytes, med), 3), "best_gib_per_s": round(gib_per_s(nbytes, min(seconds)), 3),
            "nbytes": nbytes, "seconds": [round(s, 6) for s in seconds], **extra}


def _touch(buf: bytearray) -> None:
    """Fault every page in (first-touch costs are not copy bandwidth)."""
    ctypes.memset(_address(buf), 1, len(buf))


def measure_memcpy(nbytes: int = 256 * MiB, repeats: int = 5, threads: int = 1) -> dict[str, Any]:
    """``ctypes.memmove`` bandwidth (GiB/s) over ``nbytes``, split over ``threads`` threads."""
    src, dst = bytearray(nbytes), bytearray(nbytes)
    _touch(src)
    _touch(dst)
    s, d = _address(src), _address(dst)
    part = nbytes // threads

    def copy_part(i: int) -> None:
        n = part if i < threads - 1 else nbytes - part * (threads - 1)
        ctypes.memmove(d + i * part, s + i * part, n)

    def once() -> float:
        t0 = time.perf_counter()
        if threads == 1:
            ctypes.memmove(d, s, nbytes)
        else:
            ts = [threading.Thread(target=copy_part, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        return time.perf_counter() - t0

    once()  # warm-up
    times = [once() for _ in range(repeats)]
    return _summary(nbytes, times, threads=threads, how="ctypes.memmove")


def measure_memcpy_pages(page_bytes: int, nbytes: int = 256 * MiB, repeats: int = 5) -> dict[str, Any]:
    """``ctypes.memmove`` one page at a time (a store's copy pattern, per-call cost included)."""
    n_pages = max(1, nbytes // page_bytes)
    nbytes = n_pages * page_bytes
    src, dst = bytearray(nbytes), bytearray(nbytes)
    _touch(src)
    _touch(dst)
    s, d = _address(src), _address(dst)
    offsets = [i * page_bytes for i in range(n_pages)]
    mm = ctypes.memmove

    def once() -> float:
        t0 = time.perf_counter()
        for off in offsets:
            mm(d + off, s + off, page_bytes)
        return time.perf_counter() - t0

    once()
    times = [once() for _ in range(repeats)]
    return _summary(nbytes, times, page_bytes=page_bytes, how="ctypes.memmove per page")


def compare_memcpy_numpy(nbytes: int = 256 * MiB, repeats: int = 5) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``ctypes.memmove`` and ``numpy.copyto`` on the same two buffers, runs interleaved.

    Interleaving keeps a shared machine's load drift out of the ratio. None without numpy.
    """
    try:
        import numpy as np
    except ImportError:
        return None
    src, dst = bytearray(nbytes), bytearray(nbytes)
    _touch(src)
    _touch(dst)
    s, d = _address(src), _address(dst)
    a, b = np.frombuffer(src, dtype=np.uint8), np.frombuffer(dst, dtype=np.uint8)
    ctypes.memmove(d, s, nbytes)
    np.copyto(b, a)
    t_mm, t_np = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctypes.memmove(d, s, nbytes)
        t_mm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(b, a)
        t_np.append(time.perf_counter() - t0)
    return _summary(nbytes, t_mm, how="ctypes.memmove"), _summary(nbytes, t_np, how="numpy.copyto")


def measure_loopback_tcp(nbytes: int = 1 << 30, chunk: int = 4 * MiB, repeats: int = 3,
                         timeout_s: float = 60.0) -> dict[str, Any]:
    """One Python TCP stream over 127.0.0.1: sender ``sendall``, receiver ``recv_into``.

    Time runs from the first byte sent to the receiver's one-byte acknowledgement of the
    last one, so it is what a receiver actually got, not what the kernel buffered.
    """
    payload = bytearray(os.urandom(min(chunk, 1 << 16)) * (chunk // min(chunk, 1 << 16) + 1))[:chunk]
    view = memoryview(payload)
    times: list[float] = []
    errors: list[BaseException] = []

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(timeout_s)
        port = listener.getsockname()[1]

        def receive() -> None:
            try:
                for _ in range(repeats + 1):
                    conn, _ = listener.accept()
                    with conn:
                        conn.settimeout(timeout_s)
                        buf = bytearray(chunk)
                        rv = memoryview(buf)
                        got = 0
                        while got < nbytes:
                            n = conn.recv_into(rv, min(chunk, nbytes - got))
                            if n == 0:
                                raise ConnectionError("sender closed early")
                            got += n
                        conn.sendall(b"k")
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)

        receiver = threading.Thread(target=receive, name="limits-tcp-recv", daemon=True)
        receiver.start()
        try:
            for i in range(repeats + 1):  # the first run is a warm-up
                with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as c:
                    t0 = time.perf_counter()
                    sent = 0
                    while sent < nbytes:
                        n = min(chunk, nbytes - sent)
                        c.sendall(view[:n])
                        sent += n
                    if c.recv(1) != b"k":
                        raise ConnectionError("no acknowledgement from receiver")
                    dt = time.perf_counter() - t0
                if i:
                    times.append(dt)
        finally:
            receiver.join(timeout_s)
    if errors:
        raise RuntimeError(f"loopback TCP receiver failed: {errors[0]!r}")
    return _summary(nbytes, times, chunk=chunk, how="one Python TCP stream, 127.0.0.1")


def measure_disk(path: str | os.PathLike[str], nbytes: int = 512 * MiB, chunk: int = 8 * MiB,
                 repeats: int = 3) -> dict[str, Any]:
    """Sequential write+fsync and page-cache read bandwidth of a file under ``path``.

    The file is removed afterwards. Returns ``{"write_fsync": {...}, "pagecache_read": {...}}``.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    block = bytearray(os.urandom(1 << 16) * (chunk // (1 << 16) + 1))[:chunk]  # incompressible
    wv = memoryview(block)
    rbuf = bytearray(chunk)
    rv = memoryview(rbuf)
    write_times, read_times = [], []
    fd, name = tempfile.mkstemp(prefix="kvconnect-limits-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        for _ in range(repeats):
            fd = os.open(name, os.O_WRONLY | os.O_TRUNC)
            try:
                t0 = time.perf_counter()
                written = 0
                while written < nbytes:
                    written += os.write(fd, wv[: min(chunk, nbytes - written)])
                os.fsync(fd)
                write_times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
            with open(name, "rb", buffering=0) as f:
                t0 = time.perf_counter()
                got = 0
                while got < nbytes:
                    n = f.readinto(rv)
                    if not n:
                        raise OSError(f"short read of {name}: {got} of {nbytes} bytes")
                    got += n
                read_times.append(time.perf_counter() - t0)
    finally:
        os.unlink(name)
    return {
        "write_fsync": _summary(nbytes, write_times, chunk=chunk, how="os.write + fsync", dir=str(directory)),
        "pagecache_read": _summary(nbytes, read_times, chunk=chunk, how="readinto right after writing",
                                   dir=str(directory)),
    }


def measure_all(quick: bool = True, disk_dir: str | os.PathLike[str] | None = None,
                threads: int = 2) -> dict[str, Any]:
    """The four limits as a flat ``{"<limit>_gib_s": value}`` dict plus ``raw`` details.

    ``quick`` sizes the runs for a few seconds in total (what other benchmarks call to
    quote ratios to the machine's limits in their own run).
    """
    mem = 64 * MiB if quick else 256 * MiB
    tcp = 256 * MiB if quick else 1 << 30
    disk = 64 * MiB if quick else 512 * MiB
    rep = 3 if quick else 5
    raw: dict[str, Any] = {}
    pair = compare_memcpy_numpy(mem, rep)
    raw["memcpy"], raw["numpy_copy"] = pair if pair else (measure_memcpy(mem, rep), None)
    raw["memcpy_threads"] = measure_memcpy(mem, rep, threads=threads)
    for page in PAGE_SIZES:
        raw[f"memcpy_pages_{page // 1024}KiB"] = measure_memcpy_pages(page, mem, rep)
    raw["loopback_tcp"] = measure_loopback_tcp(tcp, repeats=rep if quick else 3)
    with tempfile.TemporaryDirectory(prefix="kvconnect-limits-", dir=disk_dir) as d:
        raw["disk"] = measure_disk(d, disk, repeats=2 if quick else 3)
    flat = {
        "memcpy_gib_s": raw["memcpy"]["gib_per_s"],
        f"memcpy_{threads}threads_gib_s": raw["memcpy_threads"]["gib_per_s"],
        **{f"memcpy_{p // 1024}KiB_pages_gib_s": raw[f"memcpy_pages_{p // 1024}KiB"]["gib_per_s"] for p in PAGE_SIZES},
        "loopback_tcp_gib_s": raw["loopback_tcp"]["gib_per_s"],
        "disk_write_fsync_gib_s": raw["disk"]["write_fsync"]["gib_per_s"],
        "pagecache_read_gib_s": raw["disk"]["pagecache_read"]["gib_per_s"],
    }
    if raw["numpy_copy"]:
        flat["numpy_copy_gib_s"] = raw["numpy_copy"]["gib_per_s"]
    flat["raw"] = raw
    return flat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvconnect bench limits", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds (tests)")
    p.add_argument("--dir", default=None, help="directory for the disk test (a temp dir is made inside; "
                                                 "default: the system temp dir)")
    p.add_argument("--threads", type=int, default=2, help="threads for the parallel memcpy figure (default 2)")
    p.add_argument("--out", default=None, help="result file (default benchmarks/results/limits.json)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    lim = measure_all(quick=args.quick, disk_dir=args.dir, threads=args.threads)
    raw = lim.pop("raw")
    res = BenchResult("limits")
    res.params = {"quick": args.quick, "threads": args.threads,
                  "memcpy_bytes": raw["memcpy"]["nbytes"], "tcp_bytes": raw["loopback_tcp"]["nbytes"],
                  "disk_bytes": raw["disk"]["write_fsync"]["nbytes"], "disk_dir": args.dir or tempfile.gettempdir()}
    res.figures = {**lim, "raw": raw, "wall_s": round(time.perf_counter() - t0, 2)}
    res.limits = dict(lim)
    if "numpy_copy_gib_s" in lim:
        res.ratio("memcpy_gib_s", lim["memcpy_gib_s"], lim["numpy_copy_gib_s"], "numpy.copyto on the same buffers, runs interleaved")
    for metric, published in PUBLISHED.items():
        res.ratio(metric, lim[metric], published,
                  "earlier quiet run on this machine kind (not the same run)")
    res.notes.append("Other work may share the machine while this runs: see machine.loadavg. "
                     "Ratios against the earlier run are orientation only (different run, different load).")
    res.notes.append("pagecache_read reads the file just written, so it measures page-cache copies, not the device.")

    print(f"{'limit':<28} {'GiB/s':>8}")
    for k, v in lim.items():
        print(f"{k:<28} {v:>8.3f}")
    res.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
