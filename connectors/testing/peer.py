"""Peer-pool nodes as processes in network namespaces, driven by a test.

Mooncake's Transfer Engine listens on every interface whatever it is told, so every
process that runs a pool node runs inside a namespace the test made
(``kvconnect.connectors.testing.netns``). ``Worker`` starts ``python -m
kvconnect.connectors.testing.peer SPEC`` there: a node with a real SGLang host KV pool (or a
plain ``HostBuffer``) that answers JSON requests on stdin. Pages are written from and read
into the host pool's own memory (``get_page_buffer_meta``) and checked by a BLAKE2b digest
of SGLang's flat page bytes, so "byte-exact" means what SGLang would see.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

from kvconnect.connectors.registry import create_store
from kvconnect.connectors.testing.netns import Netns, netns_available
from kvconnect.connectors.testing.processes import MOONCAKE_QUIET_ENV, JsonWorker, child_env, python, serve_json_lines


def skip_reason(*modules: str) -> str | None:
    """Why a peer-pool test cannot run here (a module missing, no network namespaces), or None."""
    import importlib.util

    for mod in modules:
        if importlib.util.find_spec(mod) is None:
            return f"needs {mod} (installed by scripts/install.sh)"
    return netns_available()


def exec_in(ns: Netns | str, argv: list[str], **kw) -> subprocess.Popen:
    """``argv`` as a process inside namespace ``ns`` (a ``Netns`` or a name)."""
    env = child_env({**MOONCAKE_QUIET_ENV, **kw.pop("env", {})})
    return subprocess.Popen(["ip", "netns", "exec", getattr(ns, "name", ns), *argv], env=env, **kw)


class Worker(JsonWorker):
    """A pool node in namespace ``ns``, driven by JSON lines (``worker_main`` is its side).

    ``store``: another store in place of the pool node (any registry name; ``node_id`` is
    then None and ``metrics`` is the pool's only); ``ns`` None: this process's namespace."""

    def __init__(self, ns: Netns | str | None, options: dict, host_pool: dict | None = None, name: str = "w",
                 log_dir: Path | None = None, store: str = "peer_rdma"):
        self.ns = ns
        spec = json.dumps({"options": options, "host_pool": host_pool, "name": name, "store": store})
        prefix = ["ip", "netns", "exec", getattr(ns, "name", ns)] if ns is not None else []
        super().__init__([python(), "-u", "-m", "kvconnect.connectors.testing.peer", spec], name=name,
                         log_dir=log_dir, prefix=prefix, env=MOONCAKE_QUIET_ENV)
        self.node_id = self.ready["node_id"]


# ---------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------


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
        from kvconnect.connectors.testing.sglang import make_cpu_host_pool

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
        from kvconnect.connectors.testing.sglang import fill_pages

        fill_pages(self.host, [p + t for p in pages for t in range(self.ps)], seed)

    def zero(self, pages: list[int]) -> None:
        if self.host is None:
            for p in pages:
                self.buf.zero(p)
            return
        from kvconnect.connectors.testing.sglang import zero_pages

        zero_pages(self.host, [p + t for p in pages for t in range(self.ps)])

    def digest(self, page: int) -> str:
        if self.host is None:
            data = self.buf.read(page)
        else:
            from kvconnect.connectors.testing.sglang import page_bytes

            data = page_bytes(self.host, page)
        return hashlib.blake2b(data, digest_size=16).hexdigest()


class WorkerNode:
    def __init__(self, spec: dict):
        self.name = spec["name"]
        # the host pool first: importing sglang takes seconds of GIL, which would stall
        # the node's heartbeats had it already joined
        self.pages = HostPages(spec.get("host_pool"))
        options = dict(spec["options"])
        self.metrics_port = options.pop("metrics_port", None)  # the process's /metrics, as an engine serves it
        self.metrics_host = options.pop("metrics_host", options.pop("metrics_bind_host", "127.0.0.1"))
        self.store = create_store(options.pop("store", None) or spec.get("store", "peer_rdma"), options)
        if self.metrics_port is not None:
            from kvconnect.connectors import metrics

            metrics.export_store(self.store, node=self.store.node.node_id)
            self.metrics_port = metrics.serve_metrics(self.metrics_port, host=self.metrics_host)
        if spec.get("register", True):
            self.store.register_memory(*self.pages.region())
        self.timeout = getattr(self.store.config, "timeout", 5.0)
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
        if self.metrics_port:
            url = f"http://{self.metrics_host}:{self.metrics_port}/metrics"
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


def worker_main() -> None:
    """The worker process: one pool node, JSON requests on stdin, JSON answers on stdout."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(sys.argv[1])
    node: WorkerNode | None = None

    def ready() -> dict:
        nonlocal node
        node = WorkerNode(spec)
        peer = getattr(node.store, "node", None)
        return {"node_id": peer.node_id if peer is not None else None}

    serve_json_lines(ready, {
        "write": lambda keys, seed: node.write(keys, seed),
        "read": lambda keys, digests: node.read(keys, digests),
        "exists": lambda keys: {"ok": node.store.exists(keys)},
        "metrics": lambda: node.metrics(),
        "load_start": lambda known, tag, batch=8, seed=1: node.load_start(known, tag, batch, seed),
        "load_report": lambda: node.load_report_now(),
        "load_end": lambda: node.load_end(),
    }, on_exit=lambda: node.store.close())


if __name__ == "__main__":
    worker_main()
