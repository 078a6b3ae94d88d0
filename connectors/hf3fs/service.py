"""``kvconnect hf3fs-meta serve``: the page index as a gRPC service.

Generic gRPC handlers over raw-bytes messages (``protocol.py``), one ``PageIndex`` made
durable by a ``Journal`` (``wal.py``), shared-secret auth on every call. Binds 127.0.0.1
unless told otherwise.
"""

from __future__ import annotations

import hmac
import json
import logging
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from connectors.hf3fs import protocol as P
from connectors.hf3fs.index import DEFAULT_READ_LEASE_S, DEFAULT_WRITE_LEASE_S, IndexError_, PageIndex
from connectors.hf3fs.wal import Journal

log = logging.getLogger("kvconnect.hf3fs.meta")


class _Abort(Exception):
    def __init__(self, code: "grpc.StatusCode", message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class MetaService:
    """Handlers for every method of ``protocol.METHODS`` over one ``PageIndex``."""

    def __init__(self, index: PageIndex, journal: Journal | None, token: str | None):
        self.index = index
        self.journal = journal
        self._token = f"Bearer {token}".encode() if token else None
        self.calls = 0

    # -- auth ---------------------------------------------------------------------------
    def _check(self, context: grpc.ServicerContext) -> None:
        if self._token is None:
            return
        for key, value in context.invocation_metadata():
            if key == P.AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._token):
                    return
                break
        raise _Abort(grpc.StatusCode.UNAUTHENTICATED, "hf3fs-meta: missing or wrong token")

    def _commit(self) -> None:
        if self.journal is not None:
            self.journal.commit()

    # -- methods ------------------------------------------------------------------------
    def Initialize(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, off = P.unpack_ns(req)
        num_pages, page_bytes = P.INIT_REQ.unpack_from(req, off)
        try:
            info = self.index.initialize(ns, num_pages, page_bytes)
        except IndexError_ as e:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        self._commit()
        return P.INIT_REP.pack(info.num_pages, info.page_bytes, info.read_lease_s, info.write_lease_s)

    def Reserve(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, off = P.unpack_ns(req)
        keys = P.split_keys(req[off:])
        try:
            status, slots, gens = self.index.reserve(ns, keys)
        except IndexError_ as e:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        self._commit()
        return status + P.i64s(slots) + P.i64s(gens)

    def Commit(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, off = P.unpack_ns(req)
        n = P.unpack_u32(req, off)
        off += 4
        slots = P.read_i64(req, off, n)
        off += 8 * n
        gens = P.read_i64(req, off, n)
        off += 8 * n
        crcs = P.read_u32(req, off, n)
        off += 4 * n
        confirm = req[off:off + n]
        keys = P.split_keys(req[off + n:])
        if len(keys) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"Commit: {len(keys)} keys for {n} items")
        try:
            ok = self.index.commit(ns, keys, slots, gens, crcs, confirm)
        except IndexError_ as e:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        self._commit()
        return ok

    def Get(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, off = P.unpack_ns(req)
        slots, gens, crcs = self.index.get(ns, P.split_keys(req[off:]))
        return P.i64s(slots) + P.i64s(gens) + P.u32s(crcs)

    def Validate(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, off = P.unpack_ns(req)
        n = P.unpack_u32(req, off)
        off += 4
        return self.index.validate(ns, P.read_i64(req, off, n), P.read_i64(req, off + 8 * n, n))

    def Exists(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, off = P.unpack_ns(req)
        return self.index.exists(ns, P.split_keys(req[off:]))

    def Delete(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, off = P.unpack_ns(req)
        out = self.index.delete(ns, P.split_keys(req[off:]))
        self._commit()
        return out

    def Clear(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, _ = P.unpack_ns(req)
        n = self.index.clear(ns)
        self._commit()
        return P.I64.pack(n)

    def Usage(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        ns, _ = P.unpack_ns(req)
        return json.dumps(self.index.usage(ns)).encode()

    def Spaces(self, req: bytes, ctx) -> bytes:
        self._check(ctx)
        return json.dumps(self.index.spaces_with_prefix(req.decode())).encode()

    def handler(self, blocking: bool) -> grpc.GenericRpcHandler:
        """Handlers for a ``grpc.aio`` server. The index calls are short and never wait, so
        they run on the event loop (no thread hand-off per call); with ``blocking`` (the
        journal fsyncs before answering) they run on the loop's executor instead."""
        import asyncio

        def wrap(fn):
            if blocking:
                async def handle(req, ctx):
                    try:
                        return await asyncio.get_running_loop().run_in_executor(None, fn, req, ctx)
                    except _Abort as a:
                        await ctx.abort(a.code, a.message)
            else:
                async def handle(req, ctx):
                    try:
                        return fn(req, ctx)
                    except _Abort as a:
                        await ctx.abort(a.code, a.message)
            return grpc.unary_unary_rpc_method_handler(handle)

        handlers = {m: wrap(getattr(self, m)) for m in P.METHODS}
        by_id = [getattr(self, m) for m in P.METHODS]

        async def session(requests, ctx):
            try:
                self._check(ctx)
            except _Abort as a:
                await ctx.abort(a.code, a.message)
            loop = asyncio.get_running_loop()
            async for msg in requests:
                try:
                    fn = by_id[msg[0]]
                    rep = await loop.run_in_executor(None, fn, msg[1:], ctx) if blocking else fn(msg[1:], ctx)
                    yield P.OK + rep
                except _Abort as a:
                    yield P.ERR + f"{a.code.name}\n{a.message}".encode()
                except Exception as e:  # noqa: BLE001 - a bad message must not end the stream
                    log.exception("hf3fs-meta: session call failed")
                    yield P.ERR + f"INTERNAL\n{type(e).__name__}: {e}".encode()

        handlers[P.SESSION] = grpc.stream_stream_rpc_method_handler(session)
        return grpc.method_handlers_generic_handler(P.SERVICE, handlers)


class MetaServer:
    """A running metadata service: a ``grpc.aio`` server on its own event-loop thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 18000, data_dir: str | None = None,
                 token: str | None = None, fsync: str = "interval", workers: int = 8,
                 read_lease_s: float = DEFAULT_READ_LEASE_S, write_lease_s: float = DEFAULT_WRITE_LEASE_S,
                 snapshot_interval_s: float = 60.0):
        import asyncio

        self.journal = Journal(data_dir, fsync=fsync, snapshot_interval_s=snapshot_interval_s) if data_dir else None
        self.index = PageIndex(read_lease_s=read_lease_s, write_lease_s=write_lease_s, journal=self.journal)
        self.recovery = self.journal.open(self.index) if self.journal else {}
        self.service = MetaService(self.index, self.journal, token)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(futures.ThreadPoolExecutor(max_workers=workers,
                                                                    thread_name_prefix="hf3fs-meta"))
        self._thread = threading.Thread(target=self._loop.run_forever, name="hf3fs-meta-loop", daemon=True)
        self._thread.start()

        async def build():
            server = grpc.aio.server(options=[
                ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0)])
            server.add_generic_rpc_handlers((self.service.handler(blocking=fsync == "always"),))
            return server, server.add_insecure_port(f"{host}:{port}")

        try:
            self.server, self.port = self._run(build())
        except Exception as e:
            self._shutdown_loop()
            raise OSError(f"hf3fs-meta: cannot bind {host}:{port}: {e}") from e
        if self.port == 0:
            self._shutdown_loop()
            raise OSError(f"hf3fs-meta: cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"

    def _run(self, coro, timeout: float = 30.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def start(self) -> "MetaServer":
        self._run(self.server.start())
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving and close the journal. Idempotent (the event loop is gone after the first)."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        try:
            self._run(self.server.stop(grace), timeout=grace + 10)
        finally:
            self._shutdown_loop()
            if self.journal is not None:
                self.journal.close()


def serve(host: str, port: int, data_dir: str, token: str | None, fsync: str = "interval",
          workers: int = 8, snapshot_interval_s: float = 60.0, ready_file: str | None = None,
          read_lease_s: float = DEFAULT_READ_LEASE_S, write_lease_s: float = DEFAULT_WRITE_LEASE_S) -> int:
    """Run until SIGTERM/SIGINT; a clean stop writes a final snapshot."""
    t0 = time.monotonic()
    srv = MetaServer(host, port, data_dir, token, fsync=fsync, workers=workers, read_lease_s=read_lease_s,
                     write_lease_s=write_lease_s, snapshot_interval_s=snapshot_interval_s).start()
    log.info("hf3fs-meta listening on %s (data dir %s, fsync %s, auth %s); recovered %s in %.2fs",
             srv.address, data_dir, fsync, "token" if token else "off", srv.recovery, time.monotonic() - t0)
    print(f"hf3fs-meta ready on {srv.address}", flush=True)
    if ready_file:
        Path(ready_file).write_text(json.dumps({"address": srv.address, "recovery": srv.recovery}))
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    log.info("hf3fs-meta stopping")
    if srv.journal is not None:
        srv.journal.snapshot()
    srv.stop(1.0)
    return 0
