"""A peer-pool node with a real SGLang host KV pool, driven by JSON lines on stdin.

Run by ``peer_rdma_support.Worker`` inside a network namespace. Pages are written from
and read into the host pool's own memory (``get_page_buffer_meta``), and checked by a
BLAKE2b digest of SGLang's flat page bytes, so "byte-exact" means what SGLang would see.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvconnect.connectors.registry import create_store  # noqa: E402


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class HostPages:
    """Pages of a real SGLang host pool (or, with host_pool None, a plain HostBuffer)."""

    def __init__(self, spec: dict | None, n_pages: int = 256):
        self.lock = threading.Lock()
        if spec is None:
            from kvconnect.connectors.buffers import HostBuffer

            self.buf = HostBuffer(n_pages, 32 * 1024, 2)
            self.host = None
            self.free = list(range(n_pages))
            return
        from kvconnect.connectors.engines.sglang_testing import make_cpu_host_pool

        self.host = make_cpu_host_pool(host_tokens=n_pages * spec.get("page_size", 16), **spec)
        self.ps = self.host.page_size
        self.free = None

    def region(self) -> tuple[int, int]:
        if self.host is None:
            return self.buf.address, len(self.buf.raw)
        kv = self.host.kv_buffer
        return kv.data_ptr(), kv.numel() * kv.element_size()

    def alloc(self, n: int) -> list[int]:
        with self.lock:
            if self.host is None:
                got, self.free = self.free[:n], self.free[n:]
                if len(got) < n:
                    raise RuntimeError("out of pages")
                return got
            idx = self.host.alloc(n * self.ps)
            if idx is None:
                raise RuntimeError("host pool full")
            return [int(idx[i * self.ps]) for i in range(n)]

    def release(self, pages: list[int]) -> None:
        with self.lock:
            if self.host is None:
                self.free.extend(pages)
                return
            import torch

            self.host.free(torch.tensor([p + t for p in pages for t in range(self.ps)], dtype=torch.int64))

    def segments(self, pages: list[int]) -> list[list[tuple[int, int]]]:
        if self.host is None:
            return [self.buf.page(p) for p in pages]
        import torch

        idx = torch.tensor([p + t for p in pages for t in range(self.ps)], dtype=torch.int64)
        ptrs, sizes = self.host.get_page_buffer_meta(idx)
        per = len(ptrs) // len(pages)
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])) for i in range(len(pages))]

    def fill(self, pages: list[int], seed: int) -> None:
        if self.host is None:
            for j, p in enumerate(pages):
                rnd = random.Random(seed * 1_000_003 + j)
                self.buf.fill(p, rnd.randbytes(self.buf.page_bytes))
            return
        from kvconnect.connectors.engines.sglang_testing import fill_pages

        fill_pages(self.host, [p + t for p in pages for t in range(self.ps)], seed)

    def zero(self, pages: list[int]) -> None:
        if self.host is None:
            for p in pages:
                self.buf.zero(p)
            return
        from kvconnect.connectors.engines.sglang_testing import zero_pages

        zero_pages(self.host, [p + t for p in pages for t in range(self.ps)])

    def digest(self, page: int) -> str:
        if self.host is None:
            data = self.buf.read(page)
        else:
            from kvconnect.connectors.engines.sglang_testing import page_bytes

            data = page_bytes(self.host, page)
        return hashlib.blake2b(data, digest_size=16).hexdigest()


class Node:
    def __init__(self, spec: dict):
        self.name = spec["name"]
        # the host pool first: importing sglang takes seconds of GIL, which would stall
        # the node's heartbeats had it already joined
        self.pages = HostPages(spec.get("host_pool"))
        self.store = create_store("peer_rdma", spec["options"])
        if spec.get("register", True):
            self.store.register_memory(*self.pages.region())
        self.timeout = self.store.config.timeout
        self.load_thread: threading.Thread | None = None
        self.load_stop = threading.Event()
        self.load_report: dict = {}

    def write(self, keys: list[str], seed: int) -> dict:
        pages = self.pages.alloc(len(keys))
        try:
            self.pages.fill(pages, seed)
            digests = [self.pages.digest(p) for p in pages]
            t0 = time.monotonic()
            ok = self.store.put_from(keys, self.pages.segments(pages))
            return {"ok": ok, "digests": digests, "seconds": time.monotonic() - t0}
        finally:
            self.pages.release(pages)

    def read(self, keys: list[str], digests: list[str]) -> dict:
        pages = self.pages.alloc(len(keys))
        try:
            self.pages.zero(pages)
            t0 = time.monotonic()
            ok = self.store.get_into(keys, self.pages.segments(pages))
            dt = time.monotonic() - t0
            wrong = [k for k, p, hit, d in zip(keys, pages, ok, digests) if hit and self.pages.digest(p) != d]
            return {"ok": ok, "wrong": wrong, "seconds": dt}
        finally:
            self.pages.release(pages)

    def metrics(self) -> dict:
        m = self.store.node.metrics()
        m["node_id"] = self.store.node.node_id
        m["view"] = self.store.node.view.ids
        if self.store.metrics_port:
            url = f"http://{self.store.config.metrics_bind_host}:{self.store.metrics_port}/metrics"
            m["prometheus"] = urllib.request.urlopen(url, timeout=5).read().decode()
        return m

    # a background read/write mix, for the failure tests
    def load_start(self, known: dict, tag: str, batch: int, seed: int) -> dict:
        self.load_stop.clear()
        self.load_report = rep = {"reads": 0, "read_hits": 0, "writes": 0, "writes_ok": 0, "wrong": [],
                                  "max_call_s": 0.0, "slow_calls": 0, "written": {}, "errors": []}
        rng = random.Random(seed)
        keys = list(known)

        def loop() -> None:
            n = 0
            try:
                while not self.load_stop.is_set():
                    n += 1
                    if n % 3 == 0:
                        ks = [f"{tag}-{n}-{i}" for i in range(batch)]
                        r = self.write(ks, seed * 7919 + n)
                        rep["writes"] += len(ks)
                        rep["writes_ok"] += sum(r["ok"])
                        rep["written"].update({k: d for k, d, o in zip(ks, r["digests"], r["ok"]) if o})
                    elif keys:
                        ks = rng.sample(keys, min(batch, len(keys)))
                        r = self.read(ks, [known[k] for k in ks])
                        rep["reads"] += len(ks)
                        rep["read_hits"] += sum(r["ok"])
                        rep["wrong"] += r["wrong"]
                    dt = r["seconds"]
                    rep["max_call_s"] = max(rep["max_call_s"], dt)
                    rep["slow_calls"] += dt > self.timeout + 0.5
            except Exception:  # noqa: BLE001 - reported to the test
                rep["errors"].append(traceback.format_exc())

        self.load_thread = threading.Thread(target=loop, daemon=True)
        self.load_thread.start()
        return {"started": True}

    def load_report_now(self) -> dict:
        rep = dict(self.load_report)
        rep["written"] = len(rep.get("written", {}))
        return rep

    def load_end(self) -> dict:
        self.load_stop.set()
        if self.load_thread:
            self.load_thread.join(60)
        return self.load_report


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(sys.argv[1])
    node = Node(spec)
    out({"node_id": node.store.node.node_id})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req.pop("op")
            if op == "exit":
                node.store.close()
                out({"bye": True})
                return
            fn = {"write": lambda: node.write(req["keys"], req["seed"]),
                  "read": lambda: node.read(req["keys"], req["digests"]),
                  "exists": lambda: {"ok": node.store.exists(req["keys"])},
                  "metrics": node.metrics,
                  "load_start": lambda: node.load_start(req["known"], req["tag"], req.get("batch", 8),
                                                        req.get("seed", 1)),
                  "load_report": node.load_report_now,
                  "load_end": node.load_end}[op]
            out(fn())
        except Exception as e:  # noqa: BLE001
            out({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    main()
