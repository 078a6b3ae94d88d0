"""Metadata clients: the in-process index and the gRPC service behind one interface.

Both take keys as ``bytes`` and answer in plain lists. ``RemoteMetadata`` retries with
exponential backoff inside one deadline (``client_timeout``), never waits longer, and after
a failed call stays "down" for a short cool-down so a dead service costs the engine a
fast miss per batch instead of a timeout per batch.

``RemoteMetadata`` talks framed TCP when the service offers it (``protocol.py``), else gRPC,
and writes with one call per batch: ``reserve`` hands out slots the client leased ahead
(``Lease``, one call per ~``lease_ahead`` pages, at most 1/16 of the file) and ``commit`` stores the written keys with
one ``Put``. A ``Put`` that finds keys already stored switches the next few batches back to
the service's ``Reserve`` (which tells the writer to skip pages that exist) — a writer
meeting duplicates should not write them.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import queue
import socket
import threading
import time
from collections import deque
from typing import Sequence

from kvconnect.connectors.base import BackendUnavailable, ConfigError, KVStoreError
from kvconnect.connectors.auth import grpc_metadata
from kvconnect.connectors.hf3fs import protocol as P
from kvconnect.connectors.hf3fs.index import EXISTS, INFLIGHT, PUT_DUP, IndexError_, NamespaceInfo, PageIndex
from kvconnect.connectors.retry import GIVE_UP, RETRY, CoolOff, RetriesFailed, call_with_retries

log = logging.getLogger("kvconnect.hf3fs")


class MetadataError(KVStoreError):
    """A metadata call failed (after retries); the store turns it into misses."""


class AuthError(MetadataError):
    """The service rejected the token."""


class _StreamError(Exception):
    """An error status carried inside a session reply (or a session that ended)."""

    def __init__(self, code_name: str, message: str, connect_failed: bool = False):
        super().__init__(f"{code_name}: {message}")
        self.code_name = code_name
        self.message = message
        self.connect_failed = connect_failed  # framed TCP: no connection could be made


def _reply_body(rep: bytes) -> bytes:
    """The body of an ``<u8 OK><reply>`` message, or the ``<u8 ERR><code>\\n<text>`` it carries raised."""
    if rep[:1] == P.OK:
        return rep[1:]
    code, _, message = rep[1:].decode(errors="replace").partition("\n")
    raise _StreamError(code, message)


class MetadataClient:
    """What ``HF3FSStore`` needs from a page index.

    ``may_serve_stale``: the index can answer a mapping that the bytes in this host's file do
    not match (a replica promoted after a failover maps a key to a slot since given to
    another key; a shared index over files it did not map: per-host disks under one
    ``file_path_prefix``, a copy of a service's data dir serving the same files); the store
    then checks every page's identity on read (``verify_pages: auto``). Only an index that
    lives and dies with its one process cannot.
    """

    may_serve_stale = False

    def connect(self) -> None:
        """Fail fast at start if the index cannot be reached (``MetadataError``)."""

    def identity(self) -> str | None:
        """The index's identity, the same across its restarts, that data files are stamped
        with (``ownership.py``); None: an index without one (in-process, an older service),
        which uses only files no index stamped."""
        return None

    def validate_keys(self, ns: str, keys: list[bytes], slots: list[int], gens: list[int]) -> bytes:
        """Whether each key still maps to the (slot, generation) it was read at (default:
        whether each (slot, generation) is still that confirmed page: ``validate``)."""
        return self.validate(ns, slots, gens)

    def forget(self, ns: str, keys: list[bytes], slots: list[int], gens: list[int]) -> bytes:
        """Drop keys whose page failed its identity check on read (default: delete them)."""
        return self.delete(ns, keys)

    def initialize(self, ns: str, num_pages: int, page_bytes: int) -> NamespaceInfo: ...
    def reserve(self, ns: str, keys: list[bytes]) -> tuple[bytes, list[int], list[int]]: ...
    def commit(self, ns: str, keys: list[bytes], slots: list[int], gens: list[int], crcs: list[int],
               confirm: bytes) -> bytes: ...
    def get(self, ns: str, keys: list[bytes]) -> tuple[list[int], list[int], list[int]]: ...
    def validate(self, ns: str, slots: list[int], gens: list[int]) -> bytes: ...
    def exists(self, ns: str, keys: list[bytes]) -> bytes: ...
    def delete(self, ns: str, keys: list[bytes]) -> bytes: ...
    def clear(self, ns: str, prefix: bytes = b"") -> int: ...
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

    def clear(self, ns, prefix=b""):
        return self.index.clear(ns, prefix)

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


class _Framed:
    """One framed TCP connection (``protocol.py``); one request at a time (its holder's)."""

    __slots__ = ("sock",)

    def __init__(self, host: str, port: int, secret: bytes, timeout: float):
        self.sock = socket.create_connection((host, port), timeout=max(0.001, timeout))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            rep = self.request(bytes((P.HELLO,)) + secret, timeout)
        except BaseException:
            self.close()
            raise
        if rep[:1] != P.OK:
            self.close()
            _reply_body(rep)  # raises the error the service answered with

    def request(self, msg: bytes, timeout: float) -> bytes:
        sock = self.sock
        sock.settimeout(max(0.001, timeout))
        sock.sendall(P.FRAME.pack(len(msg)) + msg)
        data = sock.recv(1 << 16)  # usually the whole reply: one syscall
        while len(data) < 4 or len(data) < 4 + P.FRAME.unpack_from(data)[0]:
            more = sock.recv(1 << 20)
            if not more:
                raise ConnectionError("hf3fs-meta closed the connection")
            data += more
        return data[4:]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Leases:
    """A namespace's slots leased ahead (``[asked_at, slots, gens]`` chunks, oldest
    first), those handed to writers but not yet put, and those to give back to the service
    (too old to hand out, failed writes, keys another writer stored first)."""

    __slots__ = ("chunks", "out", "stale", "reserve_credit", "full_credit")

    def __init__(self, credit: int) -> None:
        self.chunks: deque = deque()
        self.out: dict[int, int] = {}  # slot -> generation
        self.stale: tuple[list[int], list[int]] = ([], [])  # to give back with the next Lease
        self.reserve_credit = 0  # batches to send through Reserve (stored keys met, or no free pages)
        self.full_credit = credit  # the next reserve_credit for a file without free pages: doubles


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


class LeasedWrites(MetadataClient):
    """The one-call write path over an index that offers write leases (the kvconnect service,
    Redis): ``reserve`` hands out slots this client leased ahead (``lease``, one call per
    ~``lease_ahead`` pages), ``commit`` stores the written keys with one ``put``; after
    meeting stored keys, or a file without free pages, the next batches go through the
    index's ``reserve_call`` / ``commit_call`` instead (which skip keys already stored and
    may evict). A subclass provides those five calls, ``self._lock``, and calls
    ``_init_leases``; ``lease`` sets ``self._ttl`` (the index's write lease, seconds)."""

    LEASE_USE = 0.1  # hand out a leased slot only within this fraction of its lease (see reserve)
    RESERVE_CREDIT = 8  # batches through Reserve after meeting stored keys or a file without free pages

    def _init_leases(self, lease_ahead: int) -> None:
        self.lease_ahead = lease_ahead
        self._leases: dict[str, _Leases] = {}
        self._ttl = 0.0  # the index's write lease (s), from lease replies

    def reserve_call(self, ns, keys): ...
    def commit_call(self, ns, keys, slots, gens, crcs, confirm): ...
    def lease(self, ns, need, extra=0, give_back=((), ())): ...
    def put(self, ns, keys, slots, gens, crcs): ...
    def unlease(self, ns, slots, gens): ...

    def reserve(self, ns, keys):
        """Slots for a batch about to be written: from this client's write leases (no call
        unless they ran out), or the service's ``Reserve`` after meeting duplicates."""
        pool = self._leases.get(ns)
        if pool is None:
            pool = self._leases.setdefault(ns, _Leases(self.RESERVE_CREDIT))
        if self.lease_ahead <= 0 or pool.reserve_credit > 0:
            status, slots, gens = self.reserve_call(ns, keys)
            with self._lock:
                if EXISTS in status or INFLIGHT in status:
                    pool.reserve_credit = self.RESERVE_CREDIT
                else:
                    pool.reserve_credit = max(0, pool.reserve_credit - 1)
            return status, slots, gens
        n = len(keys)
        if len(set(keys)) == n:  # the common case: all NEW
            got_s, got_g = self._take(ns, pool, n)
            if len(got_s) == n:
                return bytes(n), got_s, got_g
            want = range(n)
            status = bytearray(n)
        else:  # the same key twice in one batch: one page
            status, want, seen = bytearray(n), [], set()
            for i, k in enumerate(keys):
                if k in seen:
                    status[i] = INFLIGHT
                else:
                    seen.add(k)
                    want.append(i)
            got_s, got_g = self._take(ns, pool, len(want))
        m = len(got_s)
        if m < len(want):
            # No free pages for the batch (leases never evict): Reserve, which tells
            # which keys are stored already and evicts only for the others, for the next
            # few batches too (twice as many each time the file is still full): a full file
            # costs two calls per batch, as before leases, plus a Lease now and then.
            with self._lock:
                for sl in got_s:
                    pool.out.pop(sl, None)
            self._give_back(pool, got_s, got_g)
            self._to_reserve_mode(ns, pool, full=True)
            return self.reserve(ns, keys)
        slots, gens = [-1] * n, [0] * n
        for i, sl, g in zip(want, got_s, got_g):
            slots[i] = sl
            gens[i] = g
        return bytes(status), slots, gens

    def _take(self, ns: str, pool: _Leases, m: int) -> tuple[list[int], list[int]]:
        """``m`` leased slots (fewer if the file has no room), leasing more when needed.

        A slot is handed out only within the first ``LEASE_USE`` of its lease: the writer's
        deadline (``lanes.LEASE_TRUST`` of the lease, counted from now) then still ends
        before the service could take the slot back. Older slots go back with the next Lease."""
        slots: list[int] = []
        gens: list[int] = []
        with self._lock:
            fresh_after = time.monotonic() - self._ttl * self.LEASE_USE
            chunks = pool.chunks
            while chunks and len(slots) < m:
                c = chunks[0]
                if c[0] < fresh_after:
                    chunks.popleft()
                    pool.stale[0].extend(c[1])
                    pool.stale[1].extend(c[2])
                    continue
                k = m - len(slots)
                slots += c[1][:k]
                gens += c[2][:k]
                if k >= len(c[1]):
                    chunks.popleft()
                else:
                    del c[1][:k], c[2][:k]
            back, pool.stale = pool.stale, ([], [])
        if len(slots) < m:
            t0 = time.monotonic()
            try:
                ls, lg = self.lease(ns, m - len(slots), self.lease_ahead, back)
            except MetadataError:
                self._give_back(pool, slots + back[0], gens + back[1])
                raise
            k = m - len(slots)
            if len(ls) >= k:
                pool.full_credit = self.RESERVE_CREDIT  # free pages again
            slots += ls[:k]
            gens += lg[:k]
            if len(ls) > k:
                with self._lock:
                    pool.chunks.append([t0, ls[k:], lg[k:]])
        elif back[0]:
            with self._lock:
                pool.stale[0].extend(back[0])
                pool.stale[1].extend(back[1])
        with self._lock:
            pool.out.update(zip(slots, gens))
        return slots, gens

    def _give_back(self, pool: _Leases, slots, gens) -> None:
        """Leased slots not used after all: back to the service with the next Lease (or
        ``close``); how old they are is not tracked, so they are not handed out again."""
        if slots:
            with self._lock:
                pool.stale[0].extend(slots)
                pool.stale[1].extend(gens)

    def commit(self, ns, keys, slots, gens, crcs, confirm):
        """Written pages: leased slots are stored with one ``Put``; slots of failed writes
        and of keys someone else stored meanwhile go back to the service (with the next
        ``Lease``). Reserved slots (the ``Reserve`` path) are confirmed or released with
        ``Commit``."""
        pool = self._leases.get(ns)
        n = len(keys)
        if pool is None or not pool.out:
            return self.commit_call(ns, keys, slots, gens, crcs, confirm)
        with self._lock:
            taken = list(map(pool.out.pop, slots, itertools.repeat(None)))
        confirm = bytes(confirm)
        if taken == list(gens) and 0 not in confirm:
            st = self.put(ns, keys, slots, gens, crcs)  # the common case: every page written
            if PUT_DUP not in st:
                return st if 0 in st else b"\x01" * n
            ok, put, back = bytearray(n), list(range(n)), []
        else:
            mine = [i for i in range(n) if taken[i] == gens[i]]
            ok = bytearray(n)
            if len(mine) < n:  # not from this client's leases: the Reserve path
                ours = set(mine)
                other = [i for i in range(n) if i not in ours]
                rep = self.commit_call(ns, [keys[i] for i in other], [slots[i] for i in other],
                                       [gens[i] for i in other], [crcs[i] for i in other],
                                       bytes(confirm[i] for i in other))
                for i, o in zip(other, rep):
                    ok[i] = o
            put = [i for i in mine if confirm[i]]
            st = self.put(ns, [keys[i] for i in put], [slots[i] for i in put], [gens[i] for i in put],
                          [crcs[i] for i in put]) if put else b""
            back = [i for i in mine if not confirm[i]]
        for i, x in zip(put, st):
            ok[i] = 1 if x else 0
            if x == PUT_DUP:
                back.append(i)
        for i in back:
            ok[i] = 1  # released (failed write) or stored by another writer
        self._give_back(pool, [slots[i] for i in back], [gens[i] for i in back])
        if PUT_DUP in st:
            self._to_reserve_mode(ns, pool)
        return bytes(ok)

    def _to_reserve_mode(self, ns: str, pool: _Leases, full: bool = False) -> None:
        """Send the next batches through Reserve (``RESERVE_CREDIT`` of them; after a lease
        came back short, twice as many as the last time, up to 256), giving every slot
        leased ahead back now: a writer that does not lease must not keep pages from the
        others."""
        with self._lock:
            if full:
                pool.reserve_credit = pool.full_credit
                pool.full_credit = min(2 * pool.full_credit, 256)
            else:
                pool.reserve_credit = self.RESERVE_CREDIT
        self.release_leases(ns)

    def release_leases(self, ns: str) -> None:
        """Give back the slots leased ahead for ``ns`` and not handed out (best effort: else
        they expire after the service's write lease)."""
        pool = self._leases.get(ns)
        if pool is None:
            return
        with self._lock:
            sl = pool.stale[0] + [x for c in pool.chunks for x in c[1]]
            gn = pool.stale[1] + [x for c in pool.chunks for x in c[2]]
            pool.chunks.clear()
            pool.stale = ([], [])
        if sl:
            try:
                self.unlease(ns, sl, gn)
            except (MetadataError, ConfigError):
                pass


class RemoteMetadata(LeasedWrites):
    """Client of ``kvconnect hf3fs-meta serve``.

    Args:
        address: ``host:port`` (the gRPC port).
        token: shared secret (None: no auth header).
        timeout: seconds; the deadline of one logical call including its retries.
        retries: attempts per call (transient errors only: unavailable, deadline, resource).
        cooldown: seconds during which calls fail fast after a call failed for good.
        transport: ``auto`` (framed TCP where the service announces it, else gRPC streams),
            ``tcp``, ``stream`` (gRPC ``Session`` streams) or ``unary`` (gRPC unary calls).
        lease_ahead: slots leased ahead per namespace for writes (0: every write reserves).
    """

    # Shared and durable: engines on other hosts, a copied data dir, a restored backup can all
    # name slots whose bytes in this host's file are another key's (verify_pages: auto).
    may_serve_stale = True
    RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL", "UNKNOWN",
                 "CANCELLED")
    TCP_RETRY_S = 30.0  # auto: how long to use gRPC after the framed TCP port was unreachable

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0, retries: int = 3,
                 cooldown: float = 1.0, transport: str = "auto", lease_ahead: int = 4096):
        import grpc

        if transport not in ("auto", "tcp", "stream", "unary"):
            raise ValueError(f"transport must be auto, tcp, stream or unary, got {transport!r}")
        self._grpc = grpc
        self.address = address
        self.timeout = timeout
        self.retries = max(1, retries)
        self.cooldown = cooldown
        self.transport = transport
        self._cool_off = CoolOff(cooldown)
        self._lock = threading.Lock()
        self._init_leases(lease_ahead)
        self._metadata = grpc_metadata(token)
        self._secret = token.encode() if token else b""
        from kvconnect.connectors.rpc import channel

        self._channel = channel(address, [("grpc.enable_retries", 0), ("grpc.keepalive_time_ms", 30000)])
        self._calls = {m: self._channel.unary_unary(P.path(m)) for m in P.METHODS}
        self._stream_call = self._channel.stream_stream(P.path(P.SESSION))
        self._idle: list[_Session] = []
        self._idle_tcp: list[_Framed] = []
        self._tcp_port: int | None = None  # None: not asked yet (or lost: ask again); 0: none offered
        self._tcp_off_until = 0.0  # auto: gRPC until then (the TCP port was unreachable)
        self._watchdog = _Watchdog() if transport in ("auto", "stream") else None  # auto: a service without TCP
        self._closed = False

    # -- plumbing -----------------------------------------------------------------------
    def connect(self) -> None:
        """Fail fast at start: BackendUnavailable if the service is not reachable in time."""
        try:
            self._grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except self._grpc.FutureTimeoutError as e:
            raise BackendUnavailable("hf3fs", f"metadata service at {self.address} not reachable "
                                              f"within {self.timeout:g}s (config key 'metadata_server_url')") from e

    def _grpc_call(self, method: str, payload: bytes, deadline: float) -> bytes:
        if self.transport == "unary":
            return self._calls[method](payload, timeout=max(0.001, deadline - time.monotonic()),
                                       metadata=self._metadata)
        return self._session_call(method, payload, deadline)

    def _endpoint(self, deadline: float) -> int:
        """The framed TCP port the service offers (0: none), asked over gRPC once per
        connection of the service (it may move when the service restarts)."""
        port = self._tcp_port
        if port is None:
            try:
                rep = self._calls["Endpoint"](b"", timeout=max(0.001, deadline - time.monotonic()),
                                              metadata=self._metadata)  # unary: no stream left open
                port = P.U16.unpack(rep)[0]
            except self._grpc.RpcError as e:
                if e.code() != self._grpc.StatusCode.UNIMPLEMENTED:
                    raise
                port = 0  # a service from before framed TCP
            self._tcp_port = port
        return port

    def identity(self) -> str | None:
        """The service's identity (``Identity``, a unary gRPC call: a service from before it
        answers UNIMPLEMENTED, None here); retried within ``timeout`` like any call."""
        def once(deadline: float) -> bytes:
            try:
                return self._calls["Identity"](b"", timeout=max(0.001, deadline - time.monotonic()),
                                               metadata=self._metadata)
            except self._grpc.RpcError as e:
                if e.code() == self._grpc.StatusCode.UNIMPLEMENTED:
                    return b""
                raise

        try:
            rep = call_with_retries(once, attempts=self.retries, timeout=self.timeout, on_error=self._retryable)
        except RetriesFailed as failed:
            last = failed.last
            raise MetadataError(f"metadata call Identity to {self.address} failed: "
                                + (f"{last.code().name}: {last.details()}" if last is not None else "deadline")) from last
        return rep.decode() or None

    def _tcp_call(self, port: int, payload: bytes, deadline: float) -> bytes:
        with self._lock:
            conn = self._idle_tcp.pop() if self._idle_tcp else None
        reused = conn is not None
        try:
            if conn is None:
                host = self.address.rsplit(":", 1)[0].strip("[]")
                # at most 1 s: a port that drops packets costs one call 1 s, then gRPC serves
                conn = _Framed(host, port, self._secret, min(1.0, deadline - time.monotonic()))
            rep = conn.request(payload, deadline - time.monotonic())
        except socket.timeout as e:
            if conn is not None:
                conn.close()
            raise _StreamError("DEADLINE_EXCEEDED", "no reply in time", connect_failed=conn is None) from e
        except OSError as e:
            if conn is not None:
                conn.close()
            if reused:  # the service went away since: its other idle connections are dead too
                with self._lock:
                    stale, self._idle_tcp = self._idle_tcp, []
                for c in stale:
                    c.close()
            self._tcp_port = None  # the service may be back on another port: ask again
            raise _StreamError("UNAVAILABLE", f"framed TCP: {e}", connect_failed=conn is None) from e
        with self._lock:
            if self._closed:
                conn.close()
            else:
                self._idle_tcp.append(conn)
        return _reply_body(rep)

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
        return _reply_body(rep)

    def _call(self, method: str, payload: bytes) -> bytes:
        """One call, retried within ``timeout`` (``connectors/retry.py``); then ``cooldown``
        seconds of fast failures."""
        if not self._cool_off.allow():
            raise MetadataError(f"metadata service at {self.address} is down (cooling off)")
        try:
            return call_with_retries(lambda deadline: self._call_once(method, payload, deadline),
                                     attempts=self.retries, timeout=self.timeout, on_error=self._retryable)
        except RetriesFailed as failed:
            last = failed.last
        self._cool_off.trip()
        if isinstance(last, self._grpc.RpcError):
            detail = f"{last.code().name}: {last.details()}"
        elif isinstance(last, _StreamError):
            detail = f"{last.code_name}: {last.message}"
        else:
            detail = "deadline"
        raise MetadataError(f"metadata call {method} to {self.address} failed: {detail}")

    def _call_once(self, method: str, payload: bytes, deadline: float) -> bytes:
        if self.transport == "tcp" or (self.transport == "auto" and time.monotonic() >= self._tcp_off_until):
            port = self._endpoint(deadline)
            if port:
                try:
                    return self._tcp_call(port, bytes((P.METHOD_ID[method],)) + payload, deadline)
                except _StreamError as e:
                    if self.transport == "tcp" or not e.connect_failed:
                        raise
                    # gRPC answered (Endpoint) but the TCP port does not (a firewall,
                    # a port forward of the gRPC port only): gRPC for a while
                    rep = self._grpc_call(method, payload, deadline)
                    self._tcp_off_until = time.monotonic() + self.TCP_RETRY_S
                    log.warning("hf3fs-meta at %s: framed TCP port %d unreachable (%s); using gRPC "
                                "for %g s", self.address, port, e.message, self.TCP_RETRY_S)
                    return rep
            if self.transport == "tcp":
                raise MetadataError(f"metadata service at {self.address} offers no framed TCP port")
        return self._grpc_call(method, payload, deadline)

    def _retryable(self, e: Exception) -> str | None:
        """What a failed try means (``call_with_retries``' ``on_error``)."""
        if not isinstance(e, (self._grpc.RpcError, _StreamError)):
            return None  # not a transport error: passed on as it is
        code = e.code().name if isinstance(e, self._grpc.RpcError) else e.code_name
        if code == "UNAUTHENTICATED":
            raise AuthError(f"metadata service at {self.address} rejected the token "
                            f"(config keys 'auth_token' / 'auth_token_file')") from e
        if code == "FAILED_PRECONDITION":
            details = e.details() if isinstance(e, self._grpc.RpcError) else e.message
            raise ConfigError("page_bytes", details or "rejected by the metadata service") from e
        return RETRY if code in self.RETRYABLE else GIVE_UP

    # -- methods --------------------------------------------------------------------------
    def initialize(self, ns, num_pages, page_bytes):
        rep = self._call("Initialize", P.pack_ns(ns) + P.INIT_REQ.pack(num_pages, page_bytes))
        n, b, rl, wl = P.INIT_REP.unpack(rep)
        return NamespaceInfo(ns, n, b, rl, wl)

    # the service's calls, one each
    def reserve_call(self, ns, keys):
        n = len(keys)
        rep = self._call("Reserve", P.pack_ns(ns) + P.join_keys(keys))
        return rep[:n], P.read_i64(rep, n, n), P.read_i64(rep, 9 * n, n)

    def commit_call(self, ns, keys, slots, gens, crcs, confirm):
        n = len(keys)
        req = b"".join((P.pack_ns(ns), P.pack_u32(n), P.i64s(slots), P.i64s(gens), P.u32s(crcs),
                        bytes(confirm), P.join_keys(keys)))
        return self._call("Commit", req)

    def lease(self, ns, need, extra=0, give_back=((), ())):
        m = len(give_back[0])
        rep = self._call("Lease", b"".join((P.pack_ns(ns), P.LEASE_REQ.pack(need, extra, m), P.i64s(give_back[0]),
                                            P.i64s(give_back[1]))))
        ttl, n = P.LEASE_REP.unpack_from(rep)
        self._ttl = ttl
        off = P.LEASE_REP.size
        return P.read_i64(rep, off, n), P.read_i64(rep, off + 8 * n, n)

    def put(self, ns, keys, slots, gens, crcs):
        return self._call("Put", b"".join((P.pack_ns(ns), P.pack_u32(len(keys)), P.i64s(slots), P.i64s(gens),
                                           P.u32s(crcs), P.join_keys(keys))))

    def unlease(self, ns, slots, gens):
        return self._call("Unlease", b"".join((P.pack_ns(ns), P.pack_u32(len(slots)), P.i64s(slots), P.i64s(gens))))

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

    def clear(self, ns, prefix=b""):
        return P.I64.unpack(self._call("Clear", P.pack_ns(ns) + prefix))[0]

    def usage(self, ns):
        return json.loads(self._call("Usage", P.pack_ns(ns)))

    def spaces(self, prefix):
        return json.loads(self._call("Spaces", prefix.encode()))

    def close(self):
        """Give unused leased slots back (best effort, within 1 s: else they expire), close
        connections."""
        self.timeout = min(self.timeout, 1.0)
        for ns in list(self._leases):
            self.release_leases(ns)
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            idle_tcp, self._idle_tcp = self._idle_tcp, []
        for session in idle:
            session.close()
        for conn in idle_tcp:
            conn.close()
        if self._watchdog is not None:
            self._watchdog.close()
        from kvconnect.connectors.rpc import close_channels

        close_channels([self._channel])
