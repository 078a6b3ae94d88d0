"""HF3FS store on the kvconnect metadata service: what the page identity check (verify_pages) costs.

Run: ``kvconnect bench hf3fs_verify [--quick]`` or ``python -m kvconnect.benchmarks.hf3fs_verify [--quick]``.

One ``kvconnect hf3fs-meta serve`` process on 127.0.0.1 (journal, fsync every 50 ms, its
defaults) and two ``HF3FSStore`` s in this process on it, the same in everything but
``verify_pages`` (``on``: a 16-byte identity record per slot in ``{file}.ids``, zeroed before
and written after each page write, read before and after each page read; ``off``): POSIX
client, one data file each (TP ranks 0 and 1 of one prefix, so each has its own file and
namespace), batches of 128 pages, 4 workers, pages of 512, 64 and 16 KiB (smaller pages show
a per-page cost more). Sets write new keys into a file of three batches (each set evicts the
keys of the set two before and overwrites their pages, so dirty page cache stays small and
the index runs its full-file path); gets read the last set's keys (warm page cache). The two
stores' repetitions alternate, the order flipping each time; the best and the median of each
are kept.

Ratios (verify on / off; 1.0 = free, below 1 = what the check costs): ``verify_set/<page>``,
``verify_get/<page>`` (best of each), ``.../median`` (medians), and ``verify_set`` /
``verify_get``: the worst page size's best-of ratio.
"""

from __future__ import annotations

import argparse
import ctypes
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

KiB = 1 << 10
SERVICE = "HF3FSStore on kvconnect hf3fs-meta serve, verify_pages off"


def bench_page(result: BenchResult, url: str, tmp: Path, page: int, batch: int, workers: int, reps: int) -> None:
    from kvconnect.connectors.buffers import HostBuffer
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.hf3fs.config import HF3FSConfig
    from kvconnect.connectors.hf3fs.store import HF3FSStore

    tag = f"{page // KiB}KiB"
    buf = HostBuffer(batch, page, 1)
    for i in range(batch):
        ctypes.memset(buf.page(i)[0][0], (i * 7 + 1) & 0xFF, page)
    pages = [buf.page(i) for i in range(batch)]
    common = {"file_path_prefix": str(tmp / tag / "hicache"), "file_size": page * batch * 3, "numjobs": workers,
              "entries": max(1, batch // workers), "metadata_server_url": url}
    stores = {mode: HF3FSStore(HF3FSConfig(**common, verify_pages=mode),
                               EngineContext(tp_rank=rank, tp_size=2, page_bytes=page))
              for rank, mode in enumerate(("on", "off"))}
    try:
        assert stores["on"].verify and not stores["off"].verify
        last: dict[str, list[str]] = {}

        def put(mode: str, r: int) -> None:
            last[mode] = _keys(batch, f"{tag}-{mode}-{r}")
            assert all(stores[mode].put_from(last[mode], pages))

        def get(mode: str) -> None:
            assert all(stores[mode].get_into(last[mode], pages))

        for mode in stores:
            put(mode, -1)  # the first writes allocate the files' page cache
            put(mode, -2)
        t_set: dict[str, list[float]] = {m: [] for m in stores}
        t_get: dict[str, list[float]] = {m: [] for m in stores}
        for r in range(reps):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                t_set[mode] += _best(lambda _: put(mode, r), 1)
        for r in range(reps):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                t_get[mode] += _best(lambda _: get(mode), 1)
        nbytes = page * batch
        fig = {}
        for op, t in (("set", t_set), ("get", t_get)):
            for mode in stores:
                fig[f"{op}_gib_s/{mode}"] = gib_per_s(nbytes, min(t[mode]))
                fig[f"{op}_gib_s_median/{mode}"] = gib_per_s(nbytes, statistics.median(t[mode]))
        fig["stale_reads"] = stores["on"].stale_reads
        fig["loadavg"] = os.getloadavg()
        result.figures.setdefault("store", {})[f"{tag}/w{workers}"] = fig
        print(f"[{tag}, {workers} workers] " + ", ".join(f"{k} {v:.2f}" for k, v in fig.items()
                                                        if isinstance(v, float)), flush=True)
        ref = f"{SERVICE} ({tag} pages, batch {batch}, {workers} workers)"
        for op in ("set", "get"):
            result.ratio(f"verify_{op}/{tag}", fig[f"{op}_gib_s/on"], fig[f"{op}_gib_s/off"], ref)
            result.ratio(f"verify_{op}/{tag}/median", fig[f"{op}_gib_s_median/on"], fig[f"{op}_gib_s_median/off"],
                         ref + ", medians")
    finally:
        for s in stores.values():
            s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvconnect bench hf3fs_verify", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, one page size (~20 s)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each store (default 41; quick 4)")
    ap.add_argument("--pages", default=None, help="comma-separated page sizes in KiB (default 512,64,16; quick 512)")
    ap.add_argument("--workers", type=int, default=4, help="numjobs of both stores (default 4)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/hf3fs_verify.json)")
    args = ap.parse_args(argv)

    from kvconnect.connectors.testing.hf3fs import MetaProcess

    reps = args.reps or (4 if args.quick else 41)
    sizes = [int(x) * KiB for x in (args.pages or ("512" if args.quick else "512,64,16")).split(",")]
    result = BenchResult("hf3fs_verify", params={"quick": args.quick, "reps": reps, "pages": sizes, "batch": 128,
                                                 "workers": args.workers, "service_fsync": "interval"})
    result.notes.append("machine shared with other work: absolute figures move with load (machine.loadavg); "
                        "the on/off ratios come from alternating repetitions in one run")
    tmp = Path(tempfile.mkdtemp(prefix="kvc-hf3fs-verify-bench-"))
    meta = MetaProcess(tmp / "meta").start()
    try:
        for page in sizes:
            bench_page(result, meta.url, tmp, page, 128, args.workers, reps)
        for op in ("set", "get"):
            rows = [r for r in result.ratios if r["metric"] in {f"verify_{op}/{p // KiB}KiB" for p in sizes}]
            worst = min(rows, key=lambda r: r["ratio"])
            result.ratio(f"verify_{op}", worst["ours"], worst["reference"], worst["reference_system"] + " (worst size)")
    finally:
        meta.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
