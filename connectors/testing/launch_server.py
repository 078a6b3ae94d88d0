"""A CPU stand-in for ``python -m sglang.launch_server`` as ``benchmarks/gpu/run_e2e.sh`` starts it.

``run_e2e.sh`` launches SGLang with ``--skip-tokenizer-init`` and either HiCache with an L3 backend
(measured by ``e2e_driver.py``) or one half of a PD pair (``--disaggregation-mode prefill|decode``,
driven by ``pd_driver.py``). This module accepts the same command line (flags it does not model
are ignored) so that the script and both drivers run on a machine without a GPU; the stand-in's
own knobs can also come from ``$KVC_STANDIN_ARGS``:

    python -m kvconnect.connectors.testing.launch_server --port P [--page-size 64] \\
        [--hicache-storage-backend B --hicache-storage-backend-extra-config JSON] \\
        [--enable-lmcache --lmcache-config-file YAML] \\
        [--disaggregation-mode prefill|decode --disaggregation-bootstrap-port P]

Mocked: the model, the GPU, SGLang's scheduler and, in PD mode, its KV transfer. Real, in HiCache mode: SGLang's storage factory and host KV pool
(``StorageBackendFactory.create_backend`` + ``register_mem_pool_host``), so ``file`` is SGLang's own
file backend and ``dynamic`` loads kvconnect's adapter with its store and ``/metrics`` endpoint.
Real, in LMCache mode: the standalone ``lmcache server`` and LMCache's client protocol (its engine
client, the one ``lmcache bench server`` uses, with CPU KV tensors shared over POSIX SHM).

HiCache mode: a prompt's full pages (all but its last token, as SGLang caches them) are keyed by
chained hashes. Leading pages in the "GPU" radix cache are device hits, the next ones found in L3
are read through the backend into host pool pages (storage hits), the rest are computed (bytes
derived from the page key) and written back to L3 after the response, on a writer thread, as
SGLang's write-through does; ``POST /flush_cache`` answers 400 while write-backs are in flight.
The output token is a digest of every page's bytes, so a torn or wrong page read from L3 changes
it. Prefill time is simulated per computed token.

LMCache mode (``--enable-lmcache``, instead of an L3 backend; SGLang's ``LMCRadixCache``): the YAML
names the server (``mp_host``, ``tcp://`` optional, and ``mp_port``). After the "GPU" prefix, a
prompt's tokens but the last, in full LMCache chunks, are LOOKUPed; the hit chunks from the one
holding the GPU prefix's end on are RETRIEVEd into the shared KV and their checksums compared with
those of what they should hold (bytes derived from each chunk's chained key): a chunk that arrived
wrong is logged and its pages hold other bytes, so the output changes. The
chunks LMCache lacked are STOREd after the response on the writer thread (``/flush_cache`` answers
400 until then; a flush clears the "GPU" only). ``cached_tokens_details`` reports LMCache's tokens as
``host``, with ``storage_backend`` ``lmcache``. An unreachable server makes requests misses, not errors.

PD mode: the prefill server keeps each request's page digests under its ``bootstrap_room`` on its
bootstrap port (a room is used once); the decode server fetches them from
``bootstrap_host:bootstrap_port``, checks that they belong to its own prompt, and streams tokens
derived from them (SSE ``data:`` chunks with cumulative ``output_ids``). Outputs therefore depend
only on the prompt, whatever ``--disaggregation-transfer-backend`` says.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import os
import shlex
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import OrderedDict
from typing import Any, Optional

from kvconnect.connectors.testing.hash_model import (attach_backend, output_tokens, page_bytes, read_into_host,
                                                     write_from_host)
from kvconnect.connectors.testing.hash_model import page_keys as _chained_page_keys


def page_keys(ids: list[int], page: int) -> list[str]:
    """Chained page hashes of the pages SGLang would cache: full pages of all tokens but the last."""
    return _chained_page_keys(ids, page, spare_last=True)


class HiCacheEngine:
    """GPU radix cache (an LRU of page keys) + SGLang host pool + an optional L3 backend."""

    hit_tier = "storage"  # where meta_info counts the pages L3 gave

    def __init__(self, a: argparse.Namespace):
        from kvconnect.connectors.testing.sglang import make_cpu_host_pool

        self.page = a.page_size
        self.layout = a.hicache_mem_layout
        self.host = make_cpu_host_pool(self.layout, page_size=self.page, layer_num=2, head_num=2, head_dim=8,
                                       host_tokens=self.page * a.host_pages)
        template = self.host.get_dummy_flat_data_page()
        self.page_nbytes = template.numel() * template.element_size()
        self.device: OrderedDict[str, bytes] = OrderedDict()
        self.device_pages = max(1, a.max_total_tokens // self.page)
        self.us_per_token = a.us_per_token
        self.write_back_delay_s = a.write_back_delay_s
        self.lock = threading.Lock()        # the radix cache and L3 lookups of one request at a time
        self.pool_lock = threading.Lock()   # host pool slots (requests and the writer thread)
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="write-back")
        self.pending = 0
        self.backend = None
        self.backend_name: Optional[str] = None
        self.zero_copy = False
        if a.hicache_storage_backend:
            self.attach(a.hicache_storage_backend, json.loads(a.hicache_storage_backend_extra_config or "{}"))

    def attach(self, backend: str, extra: dict) -> None:
        b, self.zero_copy = attach_backend(self.host, backend, extra, "gpu-bench-standin",
                                           page_first=self.layout.startswith("page_first"))
        self.backend, self.backend_name = b, type(b).__name__

    def expected(self, key: str) -> bytes:
        return page_bytes(key, self.page_nbytes)

    def _read(self, keys: list[str]) -> list[bytes]:
        """The leading pages of ``keys`` that L3 returns, read into host pool pages."""
        import torch

        with self.pool_lock:
            idx = self.host.alloc(len(keys) * self.page)
        try:
            ok = read_into_host(self.host, self.backend, self.zero_copy, keys, idx, self.page)
            good = next((i for i, g in enumerate(ok) if not g), len(ok))
            return [self.host.get_data_page(int(idx[i * self.page]), flat=True).contiguous()
                    .view(torch.uint8).numpy().tobytes() for i in range(min(good, len(keys)))]
        finally:
            with self.pool_lock:
                self.host.free(idx)

    def _store(self, keys: Any) -> None:
        import torch

        with self.pool_lock:
            idx = self.host.alloc(len(keys) * self.page)
        dtype = self.host.get_dummy_flat_data_page().dtype
        try:
            for i, k in enumerate(keys):
                raw = torch.frombuffer(bytearray(self.expected(k)), dtype=torch.uint8).view(dtype)
                self.host.set_from_flat_data_page(int(idx[i * self.page]), raw)
            write_from_host(self.host, self.backend, self.zero_copy, keys, idx, self.page)
        finally:
            with self.pool_lock:
                self.host.free(idx)

    def _write_back(self, job: Any) -> None:
        try:
            time.sleep(self.write_back_delay_s)
            self._store(job)
        finally:
            with self.lock:
                self.pending -= 1

    def _fetch(self, ids: list[int], keys: list[str], dev: int) -> tuple[list[bytes], Any]:
        """The pages after the device prefix that L3 has, read into host pool pages, and the
        write-back job for the rest (None: nothing to write)."""
        rest = keys[dev:]
        if self.backend is None or not rest:
            return [], None
        found = int(self.backend.batch_exists(rest))
        loaded = self._read(rest[:found]) if found else []
        return loaded, rest[len(loaded):] or None

    def prefill(self, ids: list[int]) -> tuple[dict, bytes]:
        keys = page_keys(ids, self.page)
        with self.lock:
            dev = 0
            while dev < len(keys) and keys[dev] in self.device:
                self.device.move_to_end(keys[dev])
                dev += 1
            pages = [self.device[k] for k in keys[:dev]]
            loaded, job = self._fetch(ids, keys, dev)
            pages += loaded
            pages += [self.expected(k) for k in keys[dev + len(loaded):]]
            for k, b in zip(keys, pages):
                self.device[k] = b
                self.device.move_to_end(k)
            while len(self.device) > self.device_pages:
                self.device.popitem(last=False)
            if job is not None:
                self.pending += 1
                self.writer.submit(self._write_back, job)
        time.sleep(self.us_per_token * 1e-6 * (len(ids) - (dev + len(loaded)) * self.page))
        digest = hashlib.sha256(b"".join(pages) + json.dumps(ids[len(keys) * self.page:]).encode()).digest()
        counts = {"device": dev * self.page, "host": 0, "storage": 0}
        counts[self.hit_tier] = len(loaded) * self.page
        return counts, digest

    def flush(self) -> Optional[str]:
        with self.lock:
            if self.pending:
                return f"Cache not flushed: {self.pending} write-back(s) to storage in flight"
            self.device.clear()
        return None

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        if self.backend is not None and hasattr(self.backend, "close"):
            self.backend.close()


def lmcache_endpoint(config_file: str) -> Any:
    """The ``lmcache server`` an ``--lmcache-config-file`` names: ``mp_host`` (``tcp://`` optional)
    and ``mp_port`` (defaults: ``lmcache server``'s own)."""
    import yaml

    from kvconnect.connectors.testing.lmcache import Endpoint

    cfg: dict = {}
    if config_file:
        with open(config_file) as f:
            cfg = yaml.safe_load(f) or {}
    host = str(cfg.get("mp_host", "127.0.0.1")).removeprefix("tcp://")
    return Endpoint(f"tcp://{host}:{int(cfg.get('mp_port', 5555))}", http_url="")  # no HTTP API needed


class LMCacheTier:
    """A standalone ``lmcache server`` reached through LMCache's engine client, as SGLang's
    ``LMCRadixCache`` reaches it. Connects in the background: while the first attempt runs a request
    waits for it at most ``CONNECT_WAIT_S``; later ones (after a failure) cost requests nothing, and a
    server that dies while connected costs one request one RPC timeout (10 s). Meanwhile requests miss."""

    SHAPE = "(2,1024,16,1,16):float16:2"  # 2 layers, 16384 tokens in blocks of 16: 32 KiB per 256-token chunk
    CONNECT_WAIT_S = 3.0
    RETRY_S = 2.0

    def __init__(self, endpoint: Any):
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        self.endpoint = endpoint
        self.client: Any = None
        self.lock = threading.Lock()  # LMCache's client: one operation at a time
        self.connecting: Optional[threading.Thread] = None
        self.next_try = 0.0
        self._connect_async()
        self.first_connect = self.connecting

    def _connect_async(self) -> None:
        if (self.connecting is None or not self.connecting.is_alive()) and time.monotonic() >= self.next_try:
            self.connecting = threading.Thread(target=self._connect, daemon=True, name="lmcache-connect")
            self.connecting.start()

    def _connect(self) -> None:
        from kvconnect.connectors.testing.lmcache import EngineClient

        try:
            # one engine instance per server process, as SGLang's: servers sharing one lmcache server
            self.client = EngineClient(self.endpoint, shape=self.SHAPE, instance_id=os.getpid())
            print(f"lmcache: connected to {self.endpoint.rpc_url}", flush=True)
        except Exception as e:  # noqa: BLE001 - unreachable: requests recompute
            self.next_try = time.monotonic() + self.RETRY_S
            print(f"lmcache: cannot connect to {self.endpoint.rpc_url}: {e}", flush=True)

    def _ready(self) -> Any:
        if self.client is None:
            self._connect_async()
            if self.first_connect is not None and self.connecting is self.first_connect:
                self.first_connect.join(self.CONNECT_WAIT_S)  # a server started with us may be coming up
        return self.client

    def _drop(self, why: Any) -> None:
        client, self.client = self.client, None
        print(f"lmcache: {why}; reconnecting", flush=True)
        if client is not None:  # its close waits on RPCs a dead server never answers
            threading.Thread(target=client.close, daemon=True).start()

    @staticmethod
    def chunk_bytes(key: str, layer: int, nbytes: int) -> bytes:
        """What one layer of a chunk should hold: bytes derived from the chunk's chained key."""
        return hashlib.shake_256(f"{key}/{layer}".encode()).digest(nbytes)

    def _fill(self, client: Any, req: Any, first: int, last: int, zero: bool = False) -> None:
        """Chunks ``first``..``last - 1`` of ``req``'s KV: their expected bytes, or zeros."""
        import torch

        keys = _chained_page_keys(list(req.token_ids), req.chunk_size)
        for c in range(first, last):
            for layer, view in enumerate(client.chunk_views(req, c)):
                if zero:
                    view.zero_()
                    continue
                raw = self.chunk_bytes(keys[c], layer, view.numel() * view.element_size())
                view.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(view.dtype).view(view.shape))

    def load(self, ids: list[int], start: int) -> Optional[tuple[int, int, list[tuple[int, int]]]]:
        """LOOKUP ``ids``; RETRIEVE the hit chunks from the one holding token ``start`` on (SGLang
        aligns its load down to a chunk) and check what arrived against the expected bytes.
        (hit tokens, tokens LMCache keys, token ranges of chunks that arrived wrong), or None if
        LMCache is unreachable."""
        with self.lock:
            client = self._ready()
            req = client.request_for(ids, "load") if client is not None else None
            if req is None:
                return None
            try:
                res = client.client.lookup(req)
                if not res.succeeded:
                    raise RuntimeError(f"LOOKUP {res.error}")
                first, hit, bad = start // req.chunk_size, res.hit_chunks, []
                if hit > first:
                    span = (first * req.chunk_size, (hit - first) * req.chunk_size)
                    self._fill(client, req, first, hit)
                    want = client.kv_checksums(req, *span)
                    self._fill(client, req, first, hit, zero=True)  # what is there next came from the server
                    got = client.client.retrieve(req, *span)
                    if got is None or not got.succeeded:
                        raise RuntimeError(f"RETRIEVE failed: {got}")
                    sums = client.kv_checksums(req, *span)
                    bad = [((first + i) * req.chunk_size, (first + i + 1) * req.chunk_size)
                           for i in range(hit - first) if want[i] != sums[i]]
                    if bad:
                        print(f"lmcache: token ranges {bad} arrived wrong (checksums {sums}, expected {want})",
                              flush=True)
                client.client.end_session(req)
                return hit * req.chunk_size, req.num_full_tokens, bad
            except Exception as e:  # noqa: BLE001 - any failure is a miss, as SGLang recomputes
                self._drop(e)
                return None

    def store(self, ids: list[int], start: int) -> None:
        """STORE the chunks of ``ids`` from token ``start`` on (those LMCache did not have)."""
        with self.lock:
            client = self._ready()
            req = client.request_for(ids, "store") if client is not None else None
            if req is None or start >= req.num_full_tokens:
                return
            try:
                self._fill(client, req, start // req.chunk_size, req.total_chunks)
                res = client.client.store(req, start, req.num_full_tokens - start)
                client.client.end_session(req)
                if res is None or not res.succeeded:
                    print(f"lmcache: STORE failed: {res}", flush=True)
            except Exception as e:  # noqa: BLE001 - a lost write-back, as in SGLang
                self._drop(e)

    def close(self) -> None:
        with self.lock:
            if self.client is not None:
                self.client.close()
                self.client = None


class LMCacheEngine(HiCacheEngine):
    """SGLang with ``--enable-lmcache`` (``LMCRadixCache``): the GPU radix cache, then a standalone
    ``lmcache server`` for what is not on the GPU; SGLang reports LMCache's tokens as host hits."""

    hit_tier = "host"

    def __init__(self, a: argparse.Namespace):
        super().__init__(a)
        self.tier = LMCacheTier(lmcache_endpoint(a.lmcache_config_file))
        self.backend_name = "lmcache"

    def _fetch(self, ids: list[int], keys: list[str], dev: int) -> tuple[list[bytes], Any]:
        """Pages LMCache gives after the device prefix (a page of a chunk that arrived wrong holds
        other bytes) and the tokens from which to STORE afterwards."""
        if dev == len(keys):
            return [], None
        got = self.tier.load(ids[:-1], dev * self.page)  # the last token is always computed
        if got is None:
            return [], None
        hit, full, bad = got
        loaded = []
        for i in range(dev, min(hit // self.page, len(keys))):
            torn = any(s < (i + 1) * self.page and i * self.page < e for s, e in bad)
            loaded.append(page_bytes(keys[i] + "/torn", self.page_nbytes) if torn else self.expected(keys[i]))
        return loaded, ((ids[:-1], hit) if hit < full else None)

    def _store(self, job: Any) -> None:
        """``job``: (tokens, the first one LMCache lacked)."""
        self.tier.store(*job)

    def close(self) -> None:
        super().close()
        self.tier.close()


class PrefillRole:
    """Keeps each room's page digests for the decode server (the bootstrap server's side)."""

    def __init__(self, a: argparse.Namespace):
        self.page, self.us_per_token = a.page_size, a.us_per_token
        self.rooms: dict[int, dict] = {}
        self.used: set[int] = set()

    def prefill(self, ids: list[int], room: int) -> None:
        if room in self.used:
            raise ValueError(f"bootstrap room {room} already used")
        self.used.add(room)
        time.sleep(self.us_per_token * 1e-6 * len(ids))
        self.rooms[room] = {"prompt": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
                            "pages": page_keys(ids, self.page)}

    def take(self, room: int) -> Optional[dict]:
        return self.rooms.pop(room, None)


def fetch_room(host: str, port: int, room: int, timeout: float) -> dict:
    end = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/kv/{room}", timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 404 or time.time() > end:
                raise RuntimeError(f"room {room}: bootstrap server answered {e.code}") from e
        except OSError as e:
            if time.time() > end:
                raise RuntimeError(f"room {room}: bootstrap server {host}:{port} unreachable: {e}") from e
        time.sleep(0.01)


def make_app(a: argparse.Namespace, engine: Any) -> Any:
    from aiohttp import web

    mode = a.disaggregation_mode

    def authorized(request) -> bool:
        return not a.admin_api_key or request.headers.get("Authorization") == f"Bearer {a.admin_api_key}"

    async def health(request):
        return web.Response(text="ok")

    async def info(request):
        return web.json_response({"model_path": a.model_path, "is_generation": True, "page_size": a.page_size,
                                  "disaggregation_mode": mode})

    async def flush(request):
        if not authorized(request):
            return web.Response(status=401)
        if mode != "null":
            return web.Response(text="Cache flushed.\n")
        refused = engine.flush()
        if refused:
            return web.Response(status=400, text=refused + "\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def generate(request):
        body = await request.json()
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return web.Response(status=400, text="--skip-tokenizer-init: input_ids required\n")
        sp = body.get("sampling_params") or {}
        n = int(sp.get("max_new_tokens", 16))
        t0 = time.perf_counter()
        meta: dict[str, Any] = {"id": uuid.uuid4().hex, "prompt_tokens": len(ids)}
        if mode == "null":
            counts, digest = await asyncio.to_thread(engine.prefill, ids)
            cached = counts["device"] + counts["host"] + counts["storage"]
            meta["cached_tokens"] = cached
            # SGLang reports no details for a request that hit nothing
            meta["cached_tokens_details"] = ({**counts, "storage_backend": engine.backend_name} if cached else None)
        elif mode == "prefill":
            try:
                await asyncio.to_thread(engine.prefill, ids, int(body["bootstrap_room"]))
            except (KeyError, ValueError) as e:
                return web.Response(status=400, text=f"{e}\n")
            digest = hashlib.sha256(json.dumps(ids).encode()).digest()
            n = 1
        else:
            try:
                kv = await asyncio.to_thread(fetch_room, body["bootstrap_host"], int(body["bootstrap_port"]),
                                             int(body["bootstrap_room"]), a.pd_timeout_s)
            except (KeyError, RuntimeError) as e:
                return web.Response(status=500, text=f"KV transfer failed: {e}\n")
            if kv["prompt"] != hashlib.sha256(json.dumps(ids).encode()).hexdigest():
                return web.Response(status=500, text="KV transfer failed: the room's KV is another prompt's\n")
            digest = hashlib.sha256("".join(kv["pages"]).encode() + json.dumps(ids[-1:]).encode()).digest()
        out = output_tokens(digest, n)

        def meta_at(j: int) -> dict:
            return {**meta, "completion_tokens": j, "e2e_latency": time.perf_counter() - t0,
                    "finish_reason": {"type": "length", "length": n} if j == n else None}

        if not body.get("stream"):
            await asyncio.sleep(a.s_per_output_token * n)
            return web.json_response({"output_ids": out, "meta_info": meta_at(n)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for j in range(n):
            await asyncio.sleep(a.s_per_output_token)
            await resp.write(b"data: " + json.dumps({"output_ids": out[: j + 1], "meta_info": meta_at(j + 1)}).encode()
                             + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application(client_max_size=256 << 20)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    for path in ("/get_model_info", "/get_server_info", "/model_info", "/server_info"):
        app.router.add_get(path, info)
    app.router.add_post("/flush_cache", flush)
    app.router.add_post("/generate", generate)
    return app


def make_bootstrap_app(role: PrefillRole) -> Any:
    from aiohttp import web

    async def kv(request):
        got = role.take(int(request.match_info["room"]))
        return web.json_response(got) if got is not None else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/kv/{room}", kv)
    return app


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model-path", default="")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--admin-api-key", default="")
    p.add_argument("--hicache-storage-backend", default="")
    p.add_argument("--hicache-storage-backend-extra-config", default="")
    p.add_argument("--hicache-mem-layout", default="page_first")
    p.add_argument("--enable-lmcache", action="store_true", help="L3: a standalone lmcache server (MP mode)")
    p.add_argument("--lmcache-config-file", default="", help="YAML with mp_host, mp_port")
    p.add_argument("--disaggregation-mode", default="null", choices=("null", "prefill", "decode"))
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disaggregation-transfer-backend", default="mooncake")
    # the stand-in's own knobs
    p.add_argument("--host-pages", type=int, default=1024, help="host pool pages (L3 reads and write-backs)")
    p.add_argument("--us-per-token", type=float, default=100.0, help="simulated prefill time per computed token")
    p.add_argument("--s-per-output-token", type=float, default=0.002, help="simulated decode time per token")
    p.add_argument("--pd-timeout-s", type=float, default=60.0, help="decode: how long to wait for a room's KV")
    p.add_argument("--write-back-delay-s", type=float, default=0.0, help="delay before each write-back to L3")
    return p


async def serve(a: argparse.Namespace) -> None:
    from aiohttp import web

    if a.disaggregation_mode == "null":
        # in the main thread: SGLang's hf3fs backend installs signal handlers
        engine: Any = (LMCacheEngine if a.enable_lmcache else HiCacheEngine)(a)
    elif a.disaggregation_mode == "prefill":
        engine = PrefillRole(a)
    else:
        engine = None
    runners = []
    if a.disaggregation_mode == "prefill":  # the bootstrap server first: decode may ask as soon as we are up
        boot = web.AppRunner(make_bootstrap_app(engine))
        await boot.setup()
        await web.TCPSite(boot, a.host, a.disaggregation_bootstrap_port).start()
        runners.append(boot)
    main_runner = web.AppRunner(make_app(a, engine))
    await main_runner.setup()
    await web.TCPSite(main_runner, a.host, a.port).start()
    runners.append(main_runner)
    print(f"stand-in server ({a.disaggregation_mode}) ready on {a.host}:{a.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for r in reversed(runners):
        await r.cleanup()
    if isinstance(engine, HiCacheEngine):
        engine.close()


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the stand-in's own knobs for a server started by a script that only passes SGLang's flags
    argv += shlex.split(os.environ.get("KVC_STANDIN_ARGS", ""))
    p = parser()
    a, _ignored = p.parse_known_args(argv)
    if a.enable_lmcache and a.hicache_storage_backend:
        p.error("--enable-lmcache and --hicache-storage-backend exclude each other: LMCache is the L3 tier")
    asyncio.run(serve(a))


if __name__ == "__main__":
    main()
