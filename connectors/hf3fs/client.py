"""Metadata clients: the in-process index and the gRPC service behind one interface.

Both take keys as ``bytes`` and answer in plain lists. ``RemoteMetadata`` retries with
exponential backoff inside one deadline (``client_timeout``), never waits longer, and after
a failed call stays "down" for a short cool-down so a dead service costs the engine a
fast miss per batch instead of a timeout per batch.
"""

from __future__ import annotations

import json
import logging
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


class RemoteMetadata(MetadataClient):
    """Client of ``kvconnect hf3fs-meta serve``.

    Args:
        address: ``host:port``.
        token: shared secret (None: no auth header).
        timeout: seconds; the deadline of one logical call including its retries.
        retries: attempts per call (transient errors only: unavailable, deadline, resource).
        cooldown: seconds during which calls fail fast after a call failed for good.
    """

    RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL", "UNKNOWN")

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0, retries: int = 3,
                 cooldown: float = 1.0):
        import grpc

        self._grpc = grpc
        self.address = address
        self.timeout = timeout
        self.retries = max(1, retries)
        self.cooldown = cooldown
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._metadata = ((P.AUTH_HEADER, f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.keepalive_time_ms", 30000)])
        self._calls = {m: self._channel.unary_unary(P.path(m)) for m in P.METHODS}

    # -- plumbing -----------------------------------------------------------------------
    def connect(self) -> None:
        """Fail fast at start: BackendUnavailable if the service is not reachable in time."""
        try:
            self._grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except self._grpc.FutureTimeoutError as e:
            raise BackendUnavailable("hf3fs", f"metadata service at {self.address} not reachable "
                                              f"within {self.timeout:g}s (config key 'metadata_server_url')") from e

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
                return self._calls[method](payload, timeout=remaining, metadata=self._metadata)
            except self._grpc.RpcError as e:
                code = e.code()
                if code == self._grpc.StatusCode.UNAUTHENTICATED:
                    raise AuthError(f"metadata service at {self.address} rejected the token "
                                    f"(config keys 'auth_token' / 'auth_token_file')") from e
                if code == self._grpc.StatusCode.FAILED_PRECONDITION:
                    raise ConfigError("page_bytes", e.details() or "rejected by the metadata service") from e
                last = e
                if code.name not in self.RETRYABLE:
                    break
            if attempt + 1 < self.retries:
                time.sleep(min(delay * (1 + random.random()), max(0.0, deadline - time.monotonic())))
                delay *= 2
        with self._lock:
            self._down_until = time.monotonic() + self.cooldown
        detail = f"{last.code().name}: {last.details()}" if isinstance(last, self._grpc.RpcError) else "deadline"
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
        self._channel.close()
