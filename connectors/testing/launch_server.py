"""A CPU stand-in for ``python -m sglang.launch_server`` as ``benchmarks/gpu/run_e2e.sh`` starts it.

``run_e2e.sh`` launches SGLang with ``--skip-tokenizer-init`` and either HiCache with an L3 backend
(measured by ``e2e_driver.py``) or one half of a PD pair (``--disaggregation-mode prefill|decode``,
driven by ``pd_driver.py``). This module accepts the same command line (flags it does not model
are ignored) so that the script and both drivers run on a machine without a GPU; the stand-in's
own knobs can also come from ``$KVC_STANDIN_ARGS``:

    python -m kvconnect.connectors.testing.launch_server --port P [--page-size 64] \\
        [--hicache-storage-backend B --hicache-storage-backend-extra-config JSON] \\
        [--disaggregation-mode prefill|decode --disaggregation-bootstrap-port P]

Mocked: the model, the GPU, SGLang's scheduler and, in PD mode, its KV transfer. Real, in HiCache mode: SGLang's storage factory and host KV pool
(``StorageBackendFactory.create_backend`` + ``register_mem_pool_host``), so ``file`` is SGLang's own
file backend and ``dynamic`` loads kvconnect's adapter with its store and ``/metrics`` endpoint.

HiCache mode: a prompt's full pages (all but its last token, as SGLang caches them) are keyed by
chained hashes. Leading pages in the "GPU" radix cache are device hits, the next ones found in L3
are read through the backend into host pool pages (storage hits), the rest are computed (bytes
derived from the page key) and written back to L3 after the response, on a writer thread, as
SGLang's write-through does; ``POST /flush_cache`` answers 400 while write-backs are in flight.
The output token is a digest of every page's bytes, so a torn or wrong page read from L3 changes
it. Prefill time is simulated per computed token.

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
        self.backend_name = None
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

    def _write_back(self, keys: list[str]) -> None:
        import torch

        try:
            time.sleep(self.write_back_delay_s)
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
        finally:
            with self.lock:
                self.pending -= 1

    def prefill(self, ids: list[int]) -> tuple[dict, bytes]:
        keys = page_keys(ids, self.page)
        with self.lock:
            dev = 0
            while dev < len(keys) and keys[dev] in self.device:
                self.device.move_to_end(keys[dev])
                dev += 1
            pages = [self.device[k] for k in keys[:dev]]
            rest = keys[dev:]
            loaded: list[bytes] = []
            if self.backend is not None and rest:
                found = int(self.backend.batch_exists(rest))
                if found:
                    loaded = self._read(rest[:found])
            pages += loaded
            computed = rest[len(loaded):]
            pages += [self.expected(k) for k in computed]
            for k, b in zip(keys, pages):
                self.device[k] = b
                self.device.move_to_end(k)
            while len(self.device) > self.device_pages:
                self.device.popitem(last=False)
            if self.backend is not None and computed:
                self.pending += 1
                self.writer.submit(self._write_back, computed)
        time.sleep(self.us_per_token * 1e-6 * (len(ids) - (dev + len(loaded)) * self.page))
        digest = hashlib.sha256(b"".join(pages) + json.dumps(ids[len(keys) * self.page:]).encode()).digest()
        return {"device": dev * self.page, "host": 0, "storage": len(loaded) * self.page}, digest

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
            cached = counts["device"] + counts["storage"]
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
        engine: Any = HiCacheEngine(a)  # in the main thread: SGLang's hf3fs backend installs signal handlers
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
    a, _ignored = parser().parse_known_args(argv)
    asyncio.run(serve(a))


if __name__ == "__main__":
    main()
