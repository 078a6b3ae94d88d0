"""Metadata clients: the in-process index and the gRPC service behind one interface.

Both take keys as ``bytes`` and answer in plain lists. ``RemoteMetadata`` retries with
exponential backoff inside one deadline (``client_timeout``), never waits longer, and after
a failed call stays "down" for a short cool-down so a dead service costs the engine a
fast miss per batch instead of a timeout per batch.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import queue
import random
import threading
import time
from typing import Sequence

from connectors.base import BackendUnavailable, ConfigError, KVStoreError
from connectors.hf3fs import protocol as P
from connectors.hf3fs.index import IndexError_, NamespaceInfo, PageIndex

log = logging.getLogger("kvconnect.hf3fs")


class MetadataError(KVStoreError):
    """A metadata call failed (after retries); the store turns it into misses."""


class AuthError(MetadataError):
    """The service rejected the token."""


class _StreamError(Exception):
    """An error status carried inside a session reply (or a session that ended)."""

    def __init__(self, code_name: str, message: str):
        super().__init__(f"{code_name}: {message}")
        self.code_name = code_name
        self.message = message


class MetadataClient:
    """What ``HF3FSStore`` needs from a page index."""

    def initialize(self, ns: str, num_pages: int, page_bytes: int) -> NamespaceInfo: ...
    def reserve(self, ns: str, keys: list[bytes]) -> tuple[bytes, list[int], list[int]]: ...
    def commit(self, ns: str, keys: list[bytes], slots: list[int], gens: list[int], crcs: list[int],
               confirm: bytes) -> bytes: ...
    def get(self, ns: str, keys: list[bytes]) -> tuple[list[int], list[int], list[int]]: ...
    def validate(self, ns: str, slots: list[int], gens: list[int]) -> bytes: ...
    def exists(self, ns: str, keys: list[bytes]) -> bytes: ...
    def delete(self, ns: str, keys: list[bytes]) -> bytes: ...
    def clear(self, ns: str) -> int: ...
    def usage(self, ns: str) -> dict: ...
    def spaces(self, prefix: str) -> list[list]: ...
    def close(self) -> None: ...


class LocalMetadata(MetadataClient):
    """The in-process index (single process per data file)."""

    def __init__(self, index: PageIndex | None = None):
        self.index = index or PageIndex()

    def initialize(self, ns, num_pages, page_bytes):
        try:
            return self.index.initialize(ns, num_pages, page_bytes)
        except IndexError_ as e:
            raise ConfigError("page_bytes", str(e)) from e

    def reserve(self, ns, keys):
        return self.index.reserve(ns, keys)

    def commit(self, ns, keys, slots, gens, crcs, confirm):
        return self.index.commit(ns, keys, slots, gens, crcs, confirm)

    def get(self, ns, keys):
        return self.index.get(ns, keys)

    def validate(self, ns, slots, gens):
        return self.index.validate(ns, slots, gens)

    def exists(self, ns, keys):
        return self.index.exists(ns, keys)

    def delete(self, ns, keys):
        return self.index.delete(ns, keys)

    def clear(self, ns):
        return self.index.clear(ns)

    def usage(self, ns):
        return self.index.usage(ns)

    def spaces(self, prefix):
        return self.index.spaces_with_prefix(prefix)

    def close(self):
        pass


class _Session:
    """One long-lived ``Session`` stream; one request at a time (its holder's)."""

    def __init__(self, stream_call, metadata):
        self._q: queue.SimpleQueue = queue.SimpleQueue()

        def requests():
            while True:
                m = self._q.get()
                if m is None:
                    return
                yield m

        self.responses = stream_call(requests(), metadata=metadata)
        self.broken = False

    def request(self, msg: bytes) -> bytes:
        self._q.put(msg)
        return next(self.responses)

    def close(self) -> None:
        self.broken = True
        self._q.put(None)
        self.responses.cancel()


class _Watchdog:
    """Cancels a session whose reply is late, so a caller blocked on it returns (never hangs)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list = []
        self._armed: dict[int, _Session] = {}
        self._seq = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hf3fs-meta-watchdog", daemon=True)
        self._thread.start()

    def arm(self, session: _Session, deadline: float) -> int:
        tok = next(self._seq)
        with self._cv:
            self._armed[tok] = session
            heapq.heappush(self._heap, (deadline, tok))
            if self._heap[0][1] == tok:
                self._cv.notify()
        return tok

    def disarm(self, tok: int) -> None:
        with self._cv:
            self._armed.pop(tok, None)

    def _run(self) -> None:
        with self._cv:
            while not self._stop:
                if not self._heap:
                    self._cv.wait()
                    continue
                deadline, tok = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)
                session = self._armed.pop(tok, None)
                if session is not None:
                    session.broken = True
                    session.responses.cancel()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5)


class RemoteMetadata(MetadataClient):
    """Client of ``kvconnect hf3fs-meta serve``.

    Calls go over ``Session`` streams (one per concurrently calling thread, kept open), or
    as unary calls with ``streams=False``.

    Args:
        address: ``host:port``.
        token: shared secret (None: no auth header).
        timeout: seconds; the deadline of one logical call including its retries.
        retries: attempts per call (transient errors only: unavailable, deadline, resource).
        cooldown: seconds during which calls fail fast after a call failed for good.
    """

    RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL", "UNKNOWN",
                 "CANCELLED")

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0, retries: int = 3,
                 cooldown: float = 1.0, streams: bool = True):
        import grpc

        self._grpc = grpc
        self.address = address
        self.timeout = timeout
        self.retries = max(1, retries)
        self.cooldown = cooldown
        self.streams = streams
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._metadata = ((P.AUTH_HEADER, f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.keepalive_time_ms", 30000)])
        self._calls = {m: self._channel.unary_unary(P.path(m)) for m in P.METHODS}
        self._stream_call = self._channel.stream_stream(P.path(P.SESSION))
        self._idle: list[_Session] = []
        self._watchdog = _Watchdog() if streams else None
        self._closed = False

    # -- plumbing -----------------------------------------------------------------------
    def connect(self) -> None:
        """Fail fast at start: BackendUnavailable if the service is not reachable in time."""
        try:
            self._grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except self._grpc.FutureTimeoutError as e:
            raise BackendUnavailable("hf3fs", f"metadata service at {self.address} not reachable "
                                              f"within {self.timeout:g}s (config key 'metadata_server_url')") from e

    def _session_call(self, method: str, payload: bytes, deadline: float) -> bytes:
        with self._lock:
            session = self._idle.pop() if self._idle else None
        if session is None:
            session = _Session(self._stream_call, self._metadata)
        tok = self._watchdog.arm(session, deadline)
        try:
            rep = session.request(bytes((P.METHOD_ID[method],)) + payload)
        except StopIteration as e:
            session.broken = True
            raise _StreamError("UNAVAILABLE", "session stream ended") from e
        except BaseException:
            session.broken = True
            raise
        finally:
            self._watchdog.disarm(tok)
            if session.broken:
                session.close()
            else:
                with self._lock:
                    if self._closed:
                        session.close()
                    else:
                        self._idle.append(session)
        if rep[:1] == P.OK:
            return rep[1:]
        code, _, message = rep[1:].decode(errors="replace").partition("\n")
        raise _StreamError(code, message)

    def _call(self, method: str, payload: bytes) -> bytes:
        now = time.monotonic()
        if now < self._down_until:
            raise MetadataError(f"metadata service at {self.address} is down (cooling off)")
        deadline = now + self.timeout
        delay = 0.02
        last: Exception | None = None
        for attempt in range(self.retries):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                if self.streams:
                    return self._session_call(method, payload, deadline)
                return self._calls[method](payload, timeout=remaining, metadata=self._metadata)
            except (self._grpc.RpcError, _StreamError) as e:
                code = e.code().name if isinstance(e, self._grpc.RpcError) else e.code_name
                details = e.details() if isinstance(e, self._grpc.RpcError) else e.message
                if code == "UNAUTHENTICATED":
                    raise AuthError(f"metadata service at {self.address} rejected the token "
                                    f"(config keys 'auth_token' / 'auth_token_file')") from e
                if code == "FAILED_PRECONDITION":
                    raise ConfigError("page_bytes", details or "rejected by the metadata service") from e
                last = e
                if code not in self.RETRYABLE:
                    break
            if attempt + 1 < self.retries:
                time.sleep(min(delay * (1 + random.random()), max(0.0, deadline - time.monotonic())))
                delay *= 2
        with self._lock:
            self._down_until = time.monotonic() + self.cooldown
        if isinstance(last, self._grpc.RpcError):
            detail = f"{last.code().name}: {last.details()}"
        elif isinstance(last, _StreamError):
            detail = f"{last.code_name}: {last.message}"
        else:
            detail = "deadline"
        raise MetadataError(f"metadata call {method} to {self.address} failed: {detail}")

    # -- methods --------------------------------------------------------------------------
    def initialize(self, ns, num_pages, page_bytes):
        rep = self._call("Initialize", P.pack_ns(ns) + P.INIT_REQ.pack(num_pages, page_bytes))
        n, b, rl, wl = P.INIT_REP.unpack(rep)
        return NamespaceInfo(ns, n, b, rl, wl)

    def reserve(self, ns, keys):
        n = len(keys)
        rep = self._call("Reserve", P.pack_ns(ns) + P.join_keys(keys))
        return rep[:n], P.read_i64(rep, n, n), P.read_i64(rep, 9 * n, n)

    def commit(self, ns, keys, slots, gens, crcs, confirm):
        n = len(keys)
        req = b"".join((P.pack_ns(ns), P.pack_u32(n), P.i64s(slots), P.i64s(gens), P.u32s(crcs),
                        bytes(confirm), P.join_keys(keys)))
        return self._call("Commit", req)

    def get(self, ns, keys):
        n = len(keys)
        rep = self._call("Get", P.pack_ns(ns) + P.join_keys(keys))
        return P.read_i64(rep, 0, n), P.read_i64(rep, 8 * n, n), P.read_u32(rep, 16 * n, n)

    def validate(self, ns, slots: Sequence[int], gens: Sequence[int]):
        req = b"".join((P.pack_ns(ns), P.pack_u32(len(slots)), P.i64s(slots), P.i64s(gens)))
        return self._call("Validate", req)

    def exists(self, ns, keys):
        return self._call("Exists", P.pack_ns(ns) + P.join_keys(keys))

    def delete(self, ns, keys):
        return self._call("Delete", P.pack_ns(ns) + P.join_keys(keys))

    def clear(self, ns):
        return P.I64.unpack(self._call("Clear", P.pack_ns(ns)))[0]

    def usage(self, ns):
        return json.loads(self._call("Usage", P.pack_ns(ns)))

    def spaces(self, prefix):
        return json.loads(self._call("Spaces", prefix.encode()))

    def close(self):
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for session in idle:
            session.close()
        if self._watchdog is not None:
            self._watchdog.close()
        self._channel.close()
