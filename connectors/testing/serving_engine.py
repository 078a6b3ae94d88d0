"""A CPU stand-in for ``python -m sglang.launch_server``, for the serving benchmark's CI test.

Mocked because no GPU exists in CI: the model. Real: SGLang 0.5.23's storage factory and host pool
(``StorageBackendFactory.create_backend`` + ``register_mem_pool_host``, what SGLang's runtime attach
does), kvconnect's HiCache adapter and the store behind it, and the HTTP surface the benchmark and
``sglang_router`` use (``/generate`` streaming, ``/health``, ``/flush_cache``, the admin-key-guarded
``PUT/DELETE /hicache/storage-backend``), including SGLang's refusals: an attach, detach or flush is
answered HTTP 400 ("Reject detach: scheduler is not idle. #queue-req=0 #running-req=0") while a
request runs and for ``--idle-lag-s`` after the last response, as SGLang's ``is_fully_idle()`` lags
the last response by a scheduler loop or more.

A request's pages are keyed like SGLang's (chained hashes of page tokens). Leading pages found in
the local "GPU" cache are device hits; the next ones found in the attached store are read into host
pool pages through the adapter (storage hits); the rest are "computed" (page bytes derived from the
page key) and written through to the store. The generated tokens are a digest of every page's bytes,
so a wrong or torn page read from the store changes the output, as wrong KV does on a GPU. Prefill
time is simulated per computed token, so hits shorten TTFT.

LMCache mode (``--enable-lmcache --lmcache-config-file YAML``, instead of HiCache, as SGLang's
``LMCRadixCache``): after the "GPU" prefix, the prompt's chunks are looked up and retrieved from a
real standalone ``lmcache server`` through LMCache's engine client (``launch_server.LMCacheTier``,
bytes checked per chunk) and reported as host hits; the chunks it lacked are stored after the
response on a writer thread, and ``/flush_cache`` is refused until those stores are done.

PD mode (``--disaggregation-mode prefill|decode``, as ``sglang_router --pd-disaggregation`` drives a
1P1D pair): real SGLang 0.5.23 PD classes under the transfer backend named by
``--disaggregation-transfer-backend`` (kvconnect's, with ``KVCONNECT_PD_CONFIG``, or SGLang's own),
through ``kvconnect.connectors.testing.pd.Node``: ``ServerArgs`` + ``publish``, the plugin loader,
``get_kv_class``, the prefill's bootstrap server, an ``MHATokenToKVPool`` on ``device="cpu"`` as the
KV memory. Both halves of a request carry the router's ``bootstrap_host/port/room``. Prefill writes
the prompt's page bytes (the hash model's, as above) into KV slots and sends them with a real sender;
decode receives them into its own slots with a real receiver and answers with the digest of the
bytes it received, so its tokens equal the non-disaggregated server's only if every byte arrived.
One thread drives every sender and receiver, as SGLang's scheduler loop does.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import threading
import time
from collections import OrderedDict

from aiohttp import web

from kvconnect.connectors.testing.hash_model import (attach_backend, output_tokens, page_bytes, page_keys,
                                                     read_into_host, write_from_host)


class Engine:
    def __init__(self, a):
        from kvconnect.connectors.testing.sglang import make_cpu_host_pool

        self.page = a.page_size
        self.host = make_cpu_host_pool("page_first", page_size=self.page, layer_num=2, head_num=2, head_dim=8,
                                       host_tokens=self.page * 512)
        self.page_nbytes = self.host.get_dummy_flat_data_page().numel() * 2
        self.device: OrderedDict[str, bytes] = OrderedDict()
        self.device_pages = max(1, a.max_total_tokens // self.page)
        self.backend = None
        self.zero_copy = False
        self.lock = threading.Lock()
        self.us_per_token = a.us_per_token
        self.served = 0
        self.running = 0
        self.idle_lag_s = a.idle_lag_s
        self.busy_until = 0.0          # monotonic time before which the "scheduler" is not fully idle
        self.refusals = 0
        self.lmcache = None            # --enable-lmcache: the lmcache server, below the "GPU" cache
        self.stores_pending = 0        # LMCache STOREs queued after responses (a flush waits for them)
        if a.enable_lmcache:
            from concurrent.futures import ThreadPoolExecutor

            from kvconnect.connectors.testing.launch_server import LMCacheTier, lmcache_endpoint

            self.lmcache = LMCacheTier(lmcache_endpoint(a.lmcache_config_file))
            self.lmcache_writer = ThreadPoolExecutor(1, thread_name_prefix="lmcache-store")

    def flush_refusal(self) -> str:
        """Why a flush is refused now ("" if it is not): a request in flight, SGLang's idle lag, or an
        LMCache STORE of an answered request not yet done (its chunks would be missing afterwards)."""
        busy = self.stores_pending or self.not_idle("flush")
        return "Cache not flushed because there are pending requests.\n" if busy else ""

    def not_idle(self, action: str) -> str:
        """SGLang's refusal text while a request runs or the last one ended under ``idle_lag_s`` ago."""
        if self.running or time.monotonic() < self.busy_until:
            self.refusals += 1
            return f"Reject {action}: scheduler is not idle. #queue-req=0 #running-req={self.running}"
        return ""

    # -- storage ---------------------------------------------------------------------
    def attach(self, backend: str, extra: dict) -> None:
        with self.lock:
            if self.backend is not None:
                raise RuntimeError("HiCache storage backend already attached")
            self.backend, self.zero_copy = attach_backend(self.host, backend, extra, "serving-test", page_first=True)

    def _get(self, keys: list[str], idx) -> list[bool]:
        return read_into_host(self.host, self.backend, self.zero_copy, keys, idx, self.page)

    def _set(self, keys: list[str], idx) -> None:
        write_from_host(self.host, self.backend, self.zero_copy, keys, idx, self.page)

    def detach(self) -> None:
        with self.lock:
            if self.backend is not None and hasattr(self.backend, "close"):
                self.backend.close()
            self.backend = None

    def expected(self, key: str) -> bytes:
        return page_bytes(key, self.page_nbytes)

    def prefill(self, ids: list[int]) -> tuple[dict, bytes]:
        """Device hits, storage hits and computed pages; returns the counts and a digest of all page bytes."""
        import torch

        keys = page_keys(ids, self.page)
        with self.lock:
            dev = 0
            while dev < len(keys) and keys[dev] in self.device:
                self.device.move_to_end(keys[dev])
                dev += 1
            pages = [self.device[k] for k in keys[:dev]]
            rest = keys[dev:]
            stored = host = 0
            if self.lmcache is not None and rest:
                loaded = self._lmcache_load(ids, keys, dev)
                pages += loaded
                host = len(loaded)
                rest = keys[dev + host:]
            if self.backend is not None and rest:
                stored = int(self.backend.batch_exists(rest))
            if stored:
                idx = self.host.alloc(stored * self.page)
                ok = self._get(rest[:stored], idx)
                stored = next((i for i, good in enumerate(ok) if not good), stored)
                for i in range(stored):
                    flat = self.host.get_data_page(int(idx[i * self.page]), flat=True)
                    pages.append(flat.contiguous().view(torch.uint8).numpy().tobytes())
                self.host.free(idx)
            computed = rest[stored:]
            pages += [self.expected(k) for k in computed]
            if self.backend is not None and computed:
                idx = self.host.alloc(len(computed) * self.page)
                for i, k in enumerate(computed):
                    raw = torch.frombuffer(bytearray(self.expected(k)), dtype=torch.uint8)
                    self.host.set_from_flat_data_page(int(idx[i * self.page]),
                                                      raw.view(self.host.get_dummy_flat_data_page().dtype))
                self._set(computed, idx)
                self.host.free(idx)
            for k, b in zip(keys, pages):
                self.device[k] = b
                self.device.move_to_end(k)
            while len(self.device) > self.device_pages:
                self.device.popitem(last=False)
        digest = hashlib.sha256(b"".join(pages) + json.dumps(ids[len(keys) * self.page:]).encode()).digest()
        counts = {"device": dev * self.page, "host": host * self.page, "storage": stored * self.page}
        time.sleep(self.us_per_token * 1e-6 * (len(ids) - (dev + host + stored) * self.page))
        return counts, digest

    def _lmcache_load(self, ids: list[int], keys: list[str], dev: int) -> list[bytes]:
        """Pages after the "GPU" prefix that the lmcache server holds (SGLang reports them as host
        hits); a page of a chunk that arrived wrong holds other bytes, so the output changes. The
        chunks it lacked are STOREd after the response, on one writer thread."""
        got = self.lmcache.load(ids[:-1], dev * self.page)   # the last token is always computed
        if got is None:
            return []
        hit, full, bad = got
        loaded = []
        for i in range(dev, min(hit // self.page, len(keys))):
            torn = any(s < (i + 1) * self.page and i * self.page < e for s, e in bad)
            loaded.append(page_bytes(keys[i] + "/torn", self.page_nbytes) if torn else self.expected(keys[i]))
        if hit < full:
            self.stores_pending += 1
            self.lmcache_writer.submit(self._lmcache_store, ids[:-1], hit)
        return loaded

    def _lmcache_store(self, ids: list[int], start: int) -> None:
        try:
            self.lmcache.store(ids, start)
        finally:
            with self.lock:
                self.stores_pending -= 1


class PDRole:
    """One PD half (``prefill`` or ``decode``) on real SGLang PD classes; see the module docstring."""

    LAYERS, HEADS, HEAD_DIM = 2, 2, 8   # the host pool's geometry above: a KV page has the same bytes

    def __init__(self, a, engine: Engine):
        from kvconnect.connectors.testing.pd import Node

        self.engine, self.role, self.page = engine, a.disaggregation_mode, a.page_size
        self.timeout_s = a.pd_timeout_s
        self.node = Node({"role": self.role, "backend": a.disaggregation_transfer_backend,
                          "bootstrap_port": a.disaggregation_bootstrap_port, "http_port": a.port,
                          "layers": self.LAYERS, "heads": self.HEADS, "head_dim": self.HEAD_DIM,
                          "page_size": self.page, "dtype": "bfloat16", "pool_pages": a.pd_pool_pages,
                          "aux_slots": a.pd_aux_slots, "verify": False, "alloc": "sequential"})
        assert self.node.page_bytes == engine.page_nbytes, (self.node.page_bytes, engine.page_nbytes)
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.KVPoll = KVPoll
        self.free_pages = list(range(1, a.pd_pool_pages))   # page 0 is SGLang's padding page
        self.free_aux = list(range(a.pd_aux_slots))
        self.jobs: dict[int, dict] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, daemon=True, name="pd-scheduler-loop").start()

    # -- the "scheduler loop" --------------------------------------------------------
    def submit(self, room: int, job: dict):
        import concurrent.futures

        job.update(future=concurrent.futures.Future(), state="new", deadline=time.monotonic() + self.timeout_s,
                   room=room)
        with self.lock:
            if room in self.jobs:
                raise ValueError(f"bootstrap_room {room} already in flight")
            self.jobs[room] = job
        return asyncio.wrap_future(job["future"])

    def _loop(self) -> None:
        while True:
            with self.lock:
                jobs = list(self.jobs.values())
            for job in jobs:
                try:
                    done = self._step(job) if time.monotonic() < job["deadline"] else \
                        self._fail(job, f"room {job['room']}: no result within {self.timeout_s:.0f} s "
                                        f"(state {job['state']})")
                except Exception as e:  # noqa: BLE001 - the request fails, the loop goes on
                    done = self._fail(job, f"{type(e).__name__}: {e}")
                if done:
                    self._release(job)
            time.sleep(0.001 if jobs else 0.005)

    def _fail(self, job: dict, reason: str) -> bool:
        job["error"] = reason
        return True

    def _release(self, job: dict) -> None:
        with self.lock:
            self.jobs.pop(job["room"], None)
            self.free_pages.extend(job.get("pages", []))
            if job.get("aux") is not None:
                self.free_aux.append(job["aux"])
        if "error" in job:
            job["future"].set_exception(RuntimeError(job["error"]))
        else:
            job["future"].set_result(job.get("result"))

    def _alloc(self, job: dict, n: int) -> bool:
        with self.lock:
            if n > len(self.free_pages) or not self.free_aux:
                return False   # wait for others to finish, as SGLang's queues do
            job["pages"], self.free_pages = self.free_pages[:n], self.free_pages[n:]
            job["aux"] = self.free_aux.pop()
        return True

    def _step(self, job: dict) -> bool:
        import numpy as np

        P, node = self.KVPoll, self.node
        if job["state"] == "new":
            cls = node.get_kv_class(node.backend, node.KVClassType.SENDER if self.role == "prefill"
                                    else node.KVClassType.RECEIVER)
            if self.role == "prefill":
                job["kv"] = cls(mgr=node.mgr, bootstrap_addr=job["addr"], bootstrap_room=job["room"])
            else:
                if not node.mgr.try_ensure_parallel_info(job["addr"]):   # SGLang's decode asks /route first
                    return False
                job["kv"] = cls(mgr=node.mgr, bootstrap_addr=job["addr"], bootstrap_room=job["room"])
                job["kv"].init(0)
            job["state"] = "bootstrap"
            return False
        kv = job["kv"]
        st = int(kv.poll())
        if st == P.Failed:
            try:
                kv.failure_exception()
                reason = "failed"
            except Exception as e:  # noqa: BLE001 - SGLang's KVTransferError with the reason
                reason = str(e)
            return self._fail(job, f"room {job['room']}: KV transfer failed: {reason}")
        if job["state"] == "bootstrap" and st == P.WaitingForInput:
            if not self._alloc(job, job["npages"]):
                return False
            pages = np.asarray(job["pages"], dtype=np.int64)
            if self.role == "prefill":
                self._write(pages, job["page_bytes"])
                node.write_aux(job["room"], job["aux"], job["room"])
                kv.init(len(pages), job["aux"])
                kv.send(pages.astype(np.int32), None)
            else:
                kv.send_metadata(pages.astype(np.int32), job["aux"], None)
            job["state"] = "transfer"
        elif job["state"] == "transfer" and st == P.Success:
            if self.role == "decode":
                job["result"] = self._read(np.asarray(job["pages"], dtype=np.int64))
            kv.clear()
            return True
        return False

    def _write(self, pages, page_bytes: list[bytes]) -> None:
        import numpy as np

        from kvconnect.connectors.testing.pd import _view

        raw = np.frombuffer(b"".join(page_bytes), dtype=np.uint8).reshape(len(page_bytes), -1)
        off = 0
        for ptr, n, item in self.node.kv:
            _view(ptr, n).reshape(-1, item)[pages] = raw[:, off:off + item]
            off += item

    def _read(self, pages) -> list[bytes]:
        from kvconnect.connectors.testing.pd import _view

        parts = [_view(ptr, n).reshape(-1, item)[pages] for ptr, n, item in self.node.kv]
        return [b"".join(p[i].tobytes() for p in parts) for i in range(len(pages))]

    # -- one request -------------------------------------------------------------------
    async def generate(self, body: dict, ids: list[int]) -> tuple[dict, bytes]:
        for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            if body.get(k) is None:
                raise web.HTTPBadRequest(text=f"PD {self.role}: the request has no {k} (send it through the "
                                              "router, or give all three)\n")
        room, addr = int(body["bootstrap_room"]), f"{body['bootstrap_host']}:{int(body['bootstrap_port'])}"
        keys = page_keys(ids, self.page)
        npages = max(1, len(keys))   # SGLang sends a request's last page even when partial
        if self.role == "prefill":
            await asyncio.sleep(self.engine.us_per_token * 1e-6 * len(ids))   # the prefill's compute
            data = [self.engine.expected(k) for k in keys] or [bytes(self.engine.page_nbytes)]
            await self.submit(room, {"addr": addr, "npages": npages, "page_bytes": data})
            return {"device": 0, "host": 0, "storage": 0}, b""
        received = await self.submit(room, {"addr": addr, "npages": npages})
        pages = received[:len(keys)]
        digest = hashlib.sha256(b"".join(pages) + json.dumps(ids[len(keys) * self.page:]).encode()).digest()
        return {"device": 0, "host": 0, "storage": 0}, digest


def make_app(engine: Engine, admin_key: str, pd: "PDRole | None" = None) -> web.Application:
    def authorized(request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {admin_key}"

    async def health(request):
        return web.Response(text="ok")

    async def info(request):
        return web.json_response({"model_path": "serving-test", "is_generation": True, "page_size": engine.page,
                                  "requests_served": engine.served, "admin_refusals": engine.refusals,
                                  "disaggregation_mode": pd.role if pd else "null", "tp_size": 1, "dp_size": 1})

    async def flush(request):
        if not authorized(request):
            return web.Response(status=401)
        refusal = engine.flush_refusal()
        if refusal:
            return web.Response(status=400, text=refusal)
        with engine.lock:
            engine.device.clear()
        return web.Response(text="Cache flushed.\n")

    async def storage(request):
        if not authorized(request):
            return web.Response(status=401)
        refusal = engine.not_idle("attach" if request.method == "PUT" else "detach")
        if refusal:
            return web.Response(status=400, text=refusal + "\n")
        try:
            if request.method == "PUT":
                body = await request.json()
                extra = json.loads(body.get("hicache_storage_backend_extra_config_json") or "{}")
                # on the main thread, as SGLang's scheduler attaches (its hf3fs backend installs
                # signal handlers, which only the main thread may)
                engine.attach(body["hicache_storage_backend"], extra)
                return web.Response(text="HiCache storage backend attached.\n")
            engine.detach()
            return web.Response(text="HiCache storage backend detached.\n")
        except Exception as e:  # noqa: BLE001 - SGLang answers a failed attach with 400 and the reason
            return web.Response(status=400, text=f"Failed: {e}\n")

    async def generate(request):
        body = await request.json()
        ids = [int(w[1:]) for w in body["text"].split()]
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 16))
        engine.running += 1
        try:
            return await respond(request, body, ids, n)
        finally:
            engine.running -= 1
            engine.busy_until = time.monotonic() + engine.idle_lag_s

    async def respond(request, body, ids, n):
        if pd is not None:
            try:
                counts, digest = await pd.generate(body, ids)
            except RuntimeError as e:   # a failed transfer: SGLang aborts the request with the reason
                return web.json_response({"error": {"message": str(e)}}, status=500)
            if pd.role == "prefill":   # its answer carries no tokens; the router streams decode's
                n = 1
        else:
            counts, digest = await asyncio.to_thread(engine.prefill, ids)
        engine.served += 1
        out = output_tokens(digest, n)
        meta = {"prompt_tokens": len(ids), "cached_tokens": counts["device"] + counts["storage"],
                "cached_tokens_details": counts}
        if not body.get("stream"):
            return web.json_response({"text": " ".join(f"w{t}" for t in out),
                                      "meta_info": {**meta, "completion_tokens": n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for j in range(n):
            chunk = {"text": " ".join(f"w{t}" for t in out[: j + 1]), "meta_info": {**meta, "completion_tokens": j + 1}}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.001)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/get_model_info", info)
    app.router.add_get("/server_info", info)
    app.router.add_get("/model_info", info)
    app.router.add_post("/flush_cache", flush)
    app.router.add_route("PUT", "/hicache/storage-backend", storage)
    app.router.add_route("DELETE", "/hicache/storage-backend", storage)
    app.router.add_post("/generate", generate)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--admin-api-key", required=True)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--us-per-token", type=float, default=50.0, help="simulated prefill time per computed token")
    p.add_argument("--idle-lag-s", type=float, default=0.5,
                   help="attach/detach/flush refused this long after the last response (SGLang's idle lag)")
    p.add_argument("--enable-lmcache", action="store_true", help="a standalone lmcache server below the GPU cache")
    p.add_argument("--lmcache-config-file", default="", help="YAML with mp_host, mp_port")
    p.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"])
    p.add_argument("--disaggregation-transfer-backend", default="mooncake")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--pd-pool-pages", type=int, default=4096, help="PD: KV pages of the CPU KV pool")
    p.add_argument("--pd-aux-slots", type=int, default=256, help="PD: aux rows (requests in flight)")
    p.add_argument("--pd-timeout-s", type=float, default=120.0, help="PD: a request's transfer bound")
    a, _sglang_args = p.parse_known_args()
    engine = Engine(a)
    pd = PDRole(a, engine) if a.disaggregation_mode != "null" else None
    web.run_app(make_app(engine, a.admin_api_key, pd), host=a.host, port=a.port, print=None)
    if pd is not None:   # SGLang's PD threads (bootstrap server, heartbeats, transfer workers) never end
        import os

        os._exit(0)


if __name__ == "__main__":
    main()
