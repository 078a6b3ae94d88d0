"""The peer pool's control plane: unary gRPC calls carrying msgpack bodies.

No generated stubs and no protoc: each method is registered through a generic handler
whose (de)serialisers are msgpack, so adding a method is one entry in a dict. Every call
carries the shared token as kvconnect's control planes do (``kvconnect.connectors.auth``:
``authorization: Bearer <token>``); a server with a token refuses calls without the same
token (UNAUTHENTICATED) before its body is read (``kvconnect.connectors.rpc``).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from typing import Any, Callable, Mapping

import grpc
import msgpack

from kvconnect.connectors.auth import grpc_metadata
from kvconnect.connectors.rpc import AuthInterceptor, close_channels, server_options
from kvconnect.connectors.rpc import channel as new_channel

log = logging.getLogger(__name__)

SERVICE = "kvconnect.peer.Peer"

def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class RpcError(Exception):
    """A control-plane call failed (unreachable, timed out, refused)."""

    def __init__(self, method: str, target: str, code: str, detail: str = ""):
        self.method, self.target, self.code = method, target, code
        super().__init__(f"{method} to {target}: {code} {detail}".strip())


def serve(handlers: Mapping[str, Callable[[Any], Any]], host: str, port: int, token: str,
          workers: int = 32) -> tuple["_Server", int]:
    """Start a gRPC server exposing ``handlers`` (name -> fn(request) -> response)."""
    def wrap(name: str, fn: Callable[[Any], Any]):
        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return fn(request)
            except Exception as e:  # noqa: BLE001 - an error becomes a status, never a dead server
                log.exception("peer rpc %s failed", name)
                context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

        return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=unpack,
                                                   response_serializer=pack)

    generic = grpc.method_handlers_generic_handler(SERVICE, {n: wrap(n, f) for n, f in handlers.items()})
    from kvconnect.connectors import grpc_health

    pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="peer-rpc")
    server = _Server(grpc.server(pool, handlers=[generic, grpc_health.handler((SERVICE,))],
                                 interceptors=[AuthInterceptor(token)], options=server_options()), pool)
    try:
        bound = server.server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        server.stop(0)
        raise OSError(f"cannot bind the peer control port {host}:{port} (in use? control_port, discovery_addr)")
    server.server.start()
    return server, bound


class _Server:
    """A gRPC server that also ends its handler threads when stopped (gRPC leaves them)."""

    def __init__(self, server: grpc.Server, pool: futures.ThreadPoolExecutor):
        self.server, self.pool = server, pool

    def stop(self, grace: float | None) -> threading.Event:
        done = self.server.stop(grace)
        done.wait((grace or 0) + 2)
        self.pool.shutdown(wait=False)
        return done


class Clients:
    """Pooled channels to peers; ``call``/``fan_out`` with deadlines and the token."""

    def __init__(self, token: str, timeout: float):
        self.token = token
        self.timeout = timeout
        self.on_reply: Callable[[str], None] | None = None  # any answer proves the peer is alive
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, dict[str, Any]]] = {}
        self._metadata = grpc_metadata(token)
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer-call")
        self._member_pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="peer-hb")

    def _method(self, target: str, method: str):
        with self._lock:
            entry = self._channels.get(target)
            if entry is None:
                entry = (new_channel(target), {})
                self._channels[target] = entry
            channel, stubs = entry
            stub = stubs.get(method)
            if stub is None:
                stub = stubs[method] = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=pack,
                                                          response_deserializer=unpack)
            return stub

    def call(self, target: str, method: str, request: Any, timeout: float | None = None) -> Any:
        """A blocking call (no thread is spawned, unlike gRPC futures); raises ``RpcError``."""
        try:
            rep = self._method(target, method)(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise RpcError(method, target, e.code().name if e.code() else "UNKNOWN", e.details() or "") from None
        except ValueError as e:  # the channel was closed under us (the peer was just dropped)
            raise RpcError(method, target, "CANCELLED", str(e)) from None
        if self.on_reply is not None:
            self.on_reply(target)
        return rep

    def _call_or_error(self, target: str, method: str, request: Any, timeout: float | None) -> Any:
        try:
            return self.call(target, method, request, timeout)
        except RpcError as e:
            return e

    def fan_out(self, requests: Mapping[str, Any], method: str, timeout: float | None = None
                ) -> dict[str, Any | RpcError]:
        """The same method to several targets at once: target -> response or RpcError.

        The first target is called on this thread, the others on a pool of reused threads.
        """
        items = list(requests.items())
        if not items:
            return {}
        # membership traffic has threads of its own: busy data calls must not delay heartbeats
        pool = self._member_pool if method in ("Heartbeat", "Leave") else self._pool
        jobs = [(t, pool.submit(self._call_or_error, t, method, r, timeout)) for t, r in items[1:]]
        out = {items[0][0]: self._call_or_error(items[0][0], method, items[0][1], timeout)}
        for t, j in jobs:
            out[t] = j.result()
        return out

    def forget(self, target: str) -> None:
        with self._lock:
            entry = self._channels.pop(target, None)
        if entry:
            close_channels([entry[0]])

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._member_pool.shutdown(wait=False)
        with self._lock:
            chans, self._channels = list(self._channels.values()), {}
        close_channels(ch for ch, _ in chans)
