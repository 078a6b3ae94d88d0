"""``kvconnect hf3fs-meta serve``: the page index as a gRPC service.

Generic gRPC handlers over raw-bytes messages (``protocol.py``) and the same messages over
framed TCP (a second port, announced by ``Endpoint``), one ``PageIndex`` made durable by a
``Journal`` (``wal.py``), shared-secret auth on every call or connection. Binds 127.0.0.1
unless told otherwise. Also answers the standard gRPC health check (``grpc_health.py``) and,
with ``--metrics-port``, serves its own ``/metrics`` (``ServiceMetrics``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from kvconnect.connectors.auth import token_matches
from kvconnect.connectors.rpc import AioAuthInterceptor, raise_nofile_limit, server_options, warn_if_open
from kvconnect.connectors.hf3fs import protocol as P
from kvconnect.connectors.hf3fs.index import DEFAULT_READ_LEASE_S, DEFAULT_WRITE_LEASE_S, IndexError_, PageIndex
from kvconnect.connectors.hf3fs.ownership import new_identity
from kvconnect.connectors.hf3fs.wal import Journal

log = logging.getLogger("kvconnect.hf3fs.meta")


class ServiceMetrics:
    """The service's ``/metrics``: calls and latency per method (every transport funnels
    through ``MetaService._run``), open connections, and at scrape time the index's keys
    and namespaces. Built only when a metrics port is asked for: no cost otherwise."""

    def __init__(self, index: PageIndex):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from kvconnect.connectors.base import LATENCY_BUCKETS

        self.index = index
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvconnect_meta_requests", "calls by method and status", ["method", "code"],
                                registry=r)
        self.latency = Histogram("kvconnect_meta_request_seconds", "call latency by method", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.connections = Gauge("kvconnect_meta_connections", "open client connections (grpc: Session streams)",
                                 ["transport"], registry=r)
        r.register(self)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        with self.index.lock:
            spaces = list(self.index.spaces.items())
            keys = sum(len(sp.index) for _, sp in spaces)
            slots = sum(sp.num_pages for _, sp in spaces)
        yield GaugeMetricFamily("kvconnect_meta_namespaces", "namespaces in the index", value=len(spaces))
        yield GaugeMetricFamily("kvconnect_meta_keys", "keys in the index", value=keys)
        yield GaugeMetricFamily("kvconnect_meta_slots", "page slots of all namespaces", value=slots)

    def observe(self, method: str, seconds: float, code: str) -> None:
        self.requests.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)


class _Abort(Exception):
    def __init__(self, code: "grpc.StatusCode", message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class MetaService:
    """Handlers for every method of ``protocol.METHODS`` over one ``PageIndex``."""

    def __init__(self, index: PageIndex, journal: Journal | None, token: str | None,
                 hello_timeout_s: float = 2.0, max_unauthenticated: int = 256, identity: str | None = None):
        self.index = index
        self.journal = journal
        # what data files are stamped with (ownership.py): the data dir's, else this process's alone
        self.identity = identity or (journal.identity if journal is not None else None) or new_identity("hf3fs-meta")
        self._token = token or None
        self.tcp_port = 0  # the framed TCP listener's port, once bound (0: none)
        self.metrics: ServiceMetrics | None = None
        # framed TCP connections that have not sent HELLO yet, oldest first (event loop only)
        self.hello_timeout_s = hello_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self.unauthenticated: dict["_Framed", None] = {}
        self.by_id = [getattr(self, m) for m in P.METHODS]

    def hello_ok(self, secret: bytes) -> bool:
        """Framed TCP: the token a connection presented first."""
        return token_matches(self._token, secret)

    def dispatch(self, msg: bytes) -> bytes:
        """One ``<u8 method><request>`` message -> ``<u8 OK><reply>`` or ``<u8 ERR><code>\\n<text>``
        (the Session stream and framed TCP share it)."""
        method = self.by_id[msg[0]] if msg and msg[0] < len(self.by_id) else None
        if method is None:  # a frame from something that is not a kvconnect client: say so, not a traceback
            return P.ERR + f"INVALID_ARGUMENT\nunknown method id {msg[0] if msg else 'none'}".encode()
        try:
            return P.OK + self._run(method, msg[1:])
        except _Abort as a:
            return P.ERR + f"{a.code.name}\n{a.message}".encode()
        except Exception as e:  # noqa: BLE001 - a bad message must not end the stream
            log.exception("hf3fs-meta: call failed")
            return P.ERR + f"INTERNAL\n{type(e).__name__}: {e}".encode()

    def _run(self, method, req: bytes) -> bytes:
        """One method call; the index's IndexError_ (namespace not initialized, other page
        geometry) is the caller's failed precondition on every transport."""
        t0 = time.perf_counter()
        code = "INTERNAL"
        try:
            rep = method(req)
            code = "OK"
            return rep
        except IndexError_ as e:
            code = "FAILED_PRECONDITION"
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        except _Abort as a:
            code = a.code.name
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe(method.__name__, time.perf_counter() - t0, code)

    def _connected(self, transport: str, delta: int) -> None:
        if self.metrics is not None:
            self.metrics.connections.labels(transport).inc(delta)

    def _commit(self) -> None:
        if self.journal is not None:
            self.journal.commit()

    # -- methods ------------------------------------------------------------------------
    def Initialize(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        num_pages, page_bytes = P.INIT_REQ.unpack_from(req, off)
        info = self.index.initialize(ns, num_pages, page_bytes)
        self._commit()
        return P.INIT_REP.pack(info.num_pages, info.page_bytes, info.read_lease_s, info.write_lease_s)

    def Reserve(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        keys = P.split_keys(req[off:])
        status, slots, gens = self.index.reserve(ns, keys)
        self._commit()
        return status + P.i64s(slots) + P.i64s(gens)

    def Commit(self, req: bytes) -> bytes:
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
        ok = self.index.commit(ns, keys, slots, gens, crcs, confirm)
        self._commit()
        return ok

    def Get(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        slots, gens, crcs = self.index.get(ns, P.split_keys(req[off:]))
        return P.i64s(slots) + P.i64s(gens) + P.u32s(crcs)

    def Validate(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        n = P.unpack_u32(req, off)
        off += 4
        return self.index.validate(ns, P.read_i64(req, off, n), P.read_i64(req, off + 8 * n, n))

    def Exists(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        return self.index.exists(ns, P.split_keys(req[off:]))

    def Delete(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        out = self.index.delete(ns, P.split_keys(req[off:]))
        self._commit()
        return out

    def Clear(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        n = self.index.clear(ns, req[off:])
        self._commit()
        return P.I64.pack(n)

    def Usage(self, req: bytes) -> bytes:
        ns, _ = P.unpack_ns(req)
        return json.dumps(self.index.usage(ns)).encode()

    def Spaces(self, req: bytes) -> bytes:
        return json.dumps(self.index.spaces_with_prefix(req.decode())).encode()

    def Lease(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        need, extra, m = P.LEASE_REQ.unpack_from(req, off)
        off += P.LEASE_REQ.size
        back = (P.read_i64(req, off, m), P.read_i64(req, off + 8 * m, m))
        slots, gens = self.index.lease(ns, need, extra, back)
        self._commit()
        return b"".join((P.LEASE_REP.pack(self.index.write_lease_s, len(slots)), P.i64s(slots), P.i64s(gens)))

    def Put(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        n = P.unpack_u32(req, off)
        off += 4
        slots = P.read_i64(req, off, n)
        gens = P.read_i64(req, off + 8 * n, n)
        crcs = P.read_u32(req, off + 16 * n, n)
        keys = P.split_keys(req[off + 20 * n:])
        if len(keys) != n or len(crcs) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"Put: {len(keys)} keys for {n} items")
        out = self.index.put(ns, keys, slots, gens, crcs, wire=req[off:])
        self._commit()
        return out

    def Unlease(self, req: bytes) -> bytes:
        ns, off = P.unpack_ns(req)
        n = P.unpack_u32(req, off)
        off += 4
        out = self.index.unlease(ns, P.read_i64(req, off, n), P.read_i64(req, off + 8 * n, n))
        self._commit()
        return out

    def Endpoint(self, req: bytes) -> bytes:
        return P.U16.pack(self.tcp_port)

    def Identity(self, req: bytes) -> bytes:
        return self.identity.encode()

    def handler(self, blocking: bool) -> grpc.GenericRpcHandler:
        """Handlers for a ``grpc.aio`` server. The index calls are short and never wait, so
        they run on the event loop (no thread hand-off per call); with ``blocking`` (the
        journal fsyncs before answering) they run on the loop's executor instead."""
        import asyncio

        def wrap(fn):
            def call(req, ctx):  # the token was checked from the metadata (AioAuthInterceptor)
                return self._run(fn, req)

            if blocking:
                async def handle(req, ctx):
                    try:
                        return await asyncio.get_running_loop().run_in_executor(None, call, req, ctx)
                    except _Abort as a:
                        await ctx.abort(a.code, a.message)
            else:
                async def handle(req, ctx):
                    try:
                        return call(req, ctx)
                    except _Abort as a:
                        await ctx.abort(a.code, a.message)
            return grpc.unary_unary_rpc_method_handler(handle)

        handlers = {m: wrap(getattr(self, m)) for m in P.METHODS}

        async def session(requests, ctx):
            loop = asyncio.get_running_loop()
            self._connected("grpc", 1)
            try:
                async for msg in requests:
                    yield await loop.run_in_executor(None, self.dispatch, msg) if blocking else self.dispatch(msg)
            finally:
                self._connected("grpc", -1)

        handlers[P.SESSION] = grpc.stream_stream_rpc_method_handler(session)
        return grpc.method_handlers_generic_handler(P.SERVICE, handlers)


class _Framed:
    """One framed TCP connection (``protocol.py``): HELLO first, then one reply per message,
    in order. Runs on the server's event loop; with ``blocking`` (fsync before answering) each
    call runs on the executor and the connection reads nothing more until it is answered."""

    def __init__(self, service: MetaService, blocking: bool):
        self.service = service
        self.blocking = blocking
        self.buf = bytearray()
        self.authed = False
        self.busy = False
        self.transport = None
        self.hello_timer = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.service._connected("tcp", 1)
        # Before HELLO a connection is bounded in time and in number: idle or slow
        # connections must not use up the process's descriptors. Past the cap the oldest
        # waiting one goes (a real client sends HELLO at once, so it is rarely the oldest).
        pending = self.service.unauthenticated
        while len(pending) >= self.service.max_unauthenticated:
            oldest = next(iter(pending))
            pending.pop(oldest)
            oldest._abort()
        pending[self] = None
        import asyncio

        self.hello_timer = asyncio.get_running_loop().call_later(self.service.hello_timeout_s, self._expire)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.service._connected("tcp", -1)
        self._authenticated()

    def _authenticated(self) -> None:
        self.service.unauthenticated.pop(self, None)
        if self.hello_timer is not None:
            self.hello_timer.cancel()
            self.hello_timer = None

    def _expire(self) -> None:
        self.hello_timer = None
        if not self.authed:
            self._abort()

    def _abort(self) -> None:
        self.service.unauthenticated.pop(self, None)
        if self.transport is not None:
            self.transport.abort()  # no lingering close: the descriptor is freed now

    def eof_received(self):
        return False

    # A client that sends without reading its replies stops being read (bounded buffers).
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.busy:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._drain()

    def _drain(self) -> None:
        buf = self.buf
        while self.transport is not None and len(buf) >= 4:
            (n,) = P.FRAME.unpack_from(buf)
            if n > (P.MAX_FRAME if self.authed else 4096) or n == 0:  # no big frames before the token
                self.transport.close()
                return
            if len(buf) < 4 + n:
                return
            msg = bytes(buf[4:4 + n])
            del buf[:4 + n]
            if not self.authed:
                self.authed = msg[0] == P.HELLO and self.service.hello_ok(msg[1:])
                self._authenticated()
                self._reply(P.OK if self.authed else P.ERR + b"UNAUTHENTICATED\nhf3fs-meta: missing or wrong token")
                if not self.authed:
                    self.transport.close()
                continue
            if self.blocking:
                import asyncio

                self.busy = True
                self.transport.pause_reading()
                fut = asyncio.get_running_loop().run_in_executor(None, self.service.dispatch, msg)
                fut.add_done_callback(self._done)
                return
            self._reply(self.service.dispatch(msg))

    def _done(self, fut) -> None:
        self.busy = False
        if self.transport is None:
            return
        self._reply(fut.result())
        self.transport.resume_reading()
        self._drain()

    def _reply(self, rep: bytes) -> None:
        if self.transport is not None:
            self.transport.write(P.FRAME.pack(len(rep)) + rep)


class MetaServer:
    """A running metadata service: a ``grpc.aio`` server on its own event-loop thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 18000, data_dir: str | None = None,
                 token: str | None = None, fsync: str = "interval", workers: int = 8,
                 read_lease_s: float = DEFAULT_READ_LEASE_S, write_lease_s: float = DEFAULT_WRITE_LEASE_S,
                 snapshot_interval_s: float = 60.0, tcp_port: int | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 hello_timeout_s: float = 2.0, max_unauthenticated: int = 256):
        """``tcp_port``: the framed TCP listener's port (``None`` or 0: any free port, which
        clients learn from ``Endpoint``; -1: none, gRPC only). ``metrics_port``: serve
        ``/metrics`` there, on ``metrics_host`` (None: no metrics). ``hello_timeout_s`` /
        ``max_unauthenticated``: a framed TCP connection without HELLO is closed after that
        long, and at most that many wait for theirs. ``data_dir`` is locked for as long as the
        server runs (``ownership.Locked`` if another holds it); its ``identity`` is the data
        dir's (``index.id``), or this process's alone without one."""
        self.journal = Journal(data_dir, fsync=fsync, snapshot_interval_s=snapshot_interval_s) if data_dir else None
        self.index = PageIndex(read_lease_s=read_lease_s, write_lease_s=write_lease_s, journal=self.journal)
        # the journal locks the data dir first: a second service on it stops here (ownership.Locked)
        self.recovery = self.journal.open(self.index) if self.journal else {}
        try:
            self._start(host, port, token, fsync, workers, tcp_port, metrics_port, metrics_host, hello_timeout_s,
                        max_unauthenticated)
        except BaseException:
            if self.journal is not None:
                self.journal.close()  # the data dir is free again
            raise

    def _start(self, host, port, token, fsync, workers, tcp_port, metrics_port, metrics_host, hello_timeout_s,
               max_unauthenticated) -> None:
        import asyncio

        self.service = MetaService(self.index, self.journal, token, hello_timeout_s, max_unauthenticated)
        self.identity = self.service.identity
        self.metrics_port, self._metrics_host = None, metrics_host
        if metrics_port is not None:
            from kvconnect.connectors.metrics import serve_metrics

            self.service.metrics = ServiceMetrics(self.index)
            self.metrics_port = serve_metrics(metrics_port, metrics_host, registry=self.service.metrics.registry)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(futures.ThreadPoolExecutor(max_workers=workers,
                                                                    thread_name_prefix="hf3fs-meta"))
        self._thread = threading.Thread(target=self._loop.run_forever, name="hf3fs-meta-loop", daemon=True)
        self._thread.start()

        async def build():
            server = grpc.aio.server(options=server_options(), interceptors=[AioAuthInterceptor(token)])
            from kvconnect.connectors import grpc_health

            server.add_generic_rpc_handlers((self.service.handler(blocking=fsync == "always"),
                                             grpc_health.handler((P.SERVICE,), aio=True)))
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
        self._tcp = None
        if tcp_port is None:
            tcp_port = 0
        if tcp_port >= 0:
            async def listen():
                loop = asyncio.get_running_loop()
                return await loop.create_server(lambda: _Framed(self.service, fsync == "always"), host, tcp_port)

            try:
                self._tcp = self._run(listen())
            except Exception as e:
                self._shutdown_loop()
                raise OSError(f"hf3fs-meta: cannot bind the framed TCP port {host}:{tcp_port} "
                              f"(--tcp-port; -1 serves gRPC only): {e}") from e
            self.service.tcp_port = self._tcp.sockets[0].getsockname()[1]

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
            if self.metrics_port is not None:
                from kvconnect.connectors.metrics import stop_metrics

                stop_metrics(self.metrics_port, self._metrics_host)
            if self._tcp is not None:
                self._loop.call_soon_threadsafe(self._tcp.close)
            self._run(self.server.stop(grace), timeout=grace + 10)
        finally:
            self._shutdown_loop()
            if self.journal is not None:
                self.journal.close()


def serve(host: str, port: int, data_dir: str, token: str | None, fsync: str = "interval",
          workers: int = 8, snapshot_interval_s: float = 60.0, ready_file: str | None = None,
          read_lease_s: float = DEFAULT_READ_LEASE_S, write_lease_s: float = DEFAULT_WRITE_LEASE_S,
          tcp_port: int | None = None, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
          hello_timeout_s: float = 2.0, max_unauthenticated: int = 256) -> int:
    """Run until SIGTERM/SIGINT; a clean stop writes a final snapshot."""
    t0 = time.monotonic()
    raise_nofile_limit(log)
    warn_if_open("hf3fs-meta", host, token, log)
    srv = MetaServer(host, port, data_dir, token, fsync=fsync, workers=workers, read_lease_s=read_lease_s,
                     write_lease_s=write_lease_s, snapshot_interval_s=snapshot_interval_s, tcp_port=tcp_port,
                     metrics_port=metrics_port, metrics_host=metrics_host, hello_timeout_s=hello_timeout_s,
                     max_unauthenticated=max_unauthenticated).start()
    log.info("hf3fs-meta listening on %s (framed TCP port %s; data dir %s, index %s, fsync %s, auth %s; "
             "metrics %s); recovered %s in %.2fs", srv.address, srv.service.tcp_port or "off", data_dir,
             srv.identity, fsync, "token" if token else "off",
             f"http://{metrics_host}:{srv.metrics_port}/metrics" if srv.metrics_port else "off", srv.recovery,
             time.monotonic() - t0)
    print(f"hf3fs-meta ready on {srv.address}", flush=True)
    if ready_file:
        # whole or absent: a script polling for the file must never read half of it
        Path(ready_file + ".tmp").write_text(json.dumps({"address": srv.address, "recovery": srv.recovery,
                                                         "metrics_port": srv.metrics_port,
                                                         "identity": srv.identity, "pid": os.getpid()}))
        os.replace(ready_file + ".tmp", ready_file)
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
