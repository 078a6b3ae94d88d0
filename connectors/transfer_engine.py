"""The Mooncake Transfer Engine as every kvconnect user of it sees it.

Three users: the peer pool (one-sided reads and writes between nodes), the PD direct data
plane (one-sided writes into decode's slots) and the Mooncake store (whose client runs an
engine inside). They share, from here:

* the process settings kvconnect chooses (environment variables the engine and the store
  client read when they are created; a user's own values are always kept);
* ``RegisteredRegions``: which caller memory is registered, asked on the data path;
* ``StagingMemory``: registered memory that pages outside it pass through;
* ``EngineClient``: an engine of this process (P2PHANDSHAKE, no metadata service) with its
  registered memory and batched one-sided transfers.

Importing this module imports nothing heavy; ``mooncake`` loads with ``EngineClient``.

TCP queues (``apply_engine_defaults``): Mooncake's TCP transport admits at most
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024) queued plus
``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (1024) transfers per peer and fails every
transfer beyond that at once (QUEUE_FULL; the store reports TRANSFER_FAIL, -800). One
transfer is one buffer segment, and kvconnect hands Mooncake whole batches: 64 pages of a
32-layer ``page_first_direct`` pool are 4096 segments, one 8k-token PD room of an 8B model
8192. Measured (0.3.13, TCP, one batch of 8192 4 KiB segments): with the defaults most of
the batch fails; with 65535 every segment lands byte-exact.

Store timeouts (``apply_inline_timeouts``, for a Mooncake store with ``call_mode="inline"``):
derived from its ``op_timeout``; a later inline store's values replace an earlier one's. A
store with ``call_mode="worker"`` sets only the master-RPC ones (``apply_rpc_timeouts``):
they bound its lookups, which run on the caller's thread.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import threading
import time
from typing import Any, Callable, Sequence

log = logging.getLogger("kvconnect.transfer_engine")

# ---------------------------------------------------------------------------------
# Process settings
# ---------------------------------------------------------------------------------

TCP_QUEUE_DEFAULTS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",  # Mooncake's upper limit for both
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}


def apply_engine_defaults() -> None:
    """Set the TCP queue variables unless the environment already has them."""
    for name, value in TCP_QUEUE_DEFAULTS.items():
        os.environ.setdefault(name, value)


def set_rdma_port(protocol: str, gid_index: int, ib_port: int, user: str) -> None:
    """The RDMA GID index and HCA port (-1 / 0: the engine's choice). The engine reads them
    from ``MC_GID_INDEX`` / ``MC_IB_PORT`` when it is created; over TCP they mean nothing."""
    given = {}
    if gid_index >= 0:
        given["MC_GID_INDEX"] = gid_index
    if ib_port > 0:
        given["MC_IB_PORT"] = ib_port
    if not given:
        return
    if protocol == "tcp":
        import logging

        logging.getLogger(__name__).info("%s: gid_index / ib_port ignored: protocol is tcp", user)
        return
    for name, value in given.items():
        os.environ[name] = str(value)


def set_transfer_timeout(seconds: float) -> None:
    """The engine's transfer timeout, read once when it is created (whole seconds, >= 5)."""
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(round(seconds)))))


def mooncake_timeouts(op_timeout: float) -> dict[str, str]:
    """Mooncake's own timeouts (environment variables, default 30 s each) that bound an
    inline store call: a stalled master fails the RPC, a stalled peer the transfer (TCP).
    Not always within ``op_timeout``: transfers queued behind a dropped lane wait their turn
    (measured bounds in ``docs/mooncake.md``). ``MC_TCP_STATUS_TIMEOUT_SEC`` is left alone:
    the progress timeout already ends such transfers, and a short status timeout makes
    Mooncake take a slow peer for one speaking its legacy protocol."""
    half_ms = max(int(op_timeout * 500), 200)
    # whole seconds, minimum 1; a stall is noticed within ~2 s more than this (measured)
    progress_s = max(int(op_timeout / 2) - 1, 1)
    return {
        "MC_RPC_TIMEOUT_MS": str(half_ms),  # every client->master RPC
        "MC_RPC_CONNECT_TIMEOUT_MS": str(half_ms),
        "MC_TCP_PROGRESS_TIMEOUT_SEC": str(progress_s),  # no payload progress on a transfer
        "MC_TCP_ADMISSION_TIMEOUT_MS": str(half_ms),  # waiting for a lane to the peer
    }


# Timeout variables the user set before kvconnect ran (not those an earlier inline store set)
_USER_TIMEOUTS = frozenset(k for k in mooncake_timeouts(1.0) if k in os.environ)


def apply_inline_timeouts(op_timeout: float) -> None:
    """Set ``mooncake_timeouts(op_timeout)``, except the variables the user set."""
    for name, value in mooncake_timeouts(op_timeout).items():
        if name not in _USER_TIMEOUTS:
            os.environ[name] = value


RPC_TIMEOUTS = ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS")
"""The variables of ``mooncake_timeouts`` that bound a call to the master (no transfer)."""

MOONCAKE_RPC_DEFAULT_S = 30.0
"""Mooncake's own value of each of ``RPC_TIMEOUTS``."""


def apply_rpc_timeouts(op_timeout: float) -> None:
    """Set the master-RPC variables of ``mooncake_timeouts(op_timeout)`` only (a store with
    ``call_mode="worker"``, whose lookups run on the caller's thread), except those the
    user set."""
    values = mooncake_timeouts(op_timeout)
    for name in RPC_TIMEOUTS:
        if name not in _USER_TIMEOUTS:
            os.environ[name] = values[name]


def rpc_timeout_s() -> float:
    """The longest master-RPC timeout in effect, in seconds (Mooncake's default where unset)."""
    out = 0.0
    for name in RPC_TIMEOUTS:
        try:
            out = max(out, float(os.environ[name]) / 1000)
        except (KeyError, ValueError):
            out = max(out, MOONCAKE_RPC_DEFAULT_S)
    return out


# ---------------------------------------------------------------------------------
# Registered memory
# ---------------------------------------------------------------------------------


class RegisteredRegions:
    """Which ``[start, end)`` spans are registered; lock-free reads on the data path.

    The sorted tuple is replaced, never changed in place, so a reader needs no lock; the
    span that answered last is tried first (the pages of one batch nearly always lie in one
    host pool).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: tuple[tuple[int, int], ...] = ()
        self._last: tuple[int, int] = (0, 0)

    def add(self, address: int, nbytes: int) -> None:
        with self._lock:
            self.spans = tuple(sorted(self.spans + ((address, address + nbytes),)))

    def covers(self, address: int, nbytes: int) -> bool:
        last = self._last
        if last[0] <= address and address + nbytes <= last[1]:
            return True
        spans = self.spans
        i = bisect.bisect_right(spans, (address, float("inf"))) - 1
        if i >= 0 and spans[i][0] <= address and address + nbytes <= spans[i][1]:
            self._last = spans[i]
            return True
        return False

    def covers_page(self, page: Sequence[tuple[int, int]]) -> bool:
        return all(self.covers(a, n) for a, n in page)

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in self.spans)

    def clear(self) -> list[int]:
        """Forget every span; their start addresses (to unregister)."""
        with self._lock:
            starts = [s for s, _ in self.spans]
            self.spans = ()
            self._last = (0, 0)
            return starts

    def __bool__(self) -> bool:
        return bool(self.spans)


# ---------------------------------------------------------------------------------
# Staging memory
# ---------------------------------------------------------------------------------


class StagingMemory:
    """Registered memory handed out in extents, first fit; thread-safe; waits are bounded.

    Pages outside registered memory are gathered into (writes) or read through (reads) an
    extent. Memory comes in arenas of ``arena_bytes`` (anonymous mappings), made when first
    needed and registered through ``register``; at most ``nbytes`` are usable at a time.

    An extent whose transfer may still land later (abandoned at a deadline, failed in a way
    the engine cannot rule out) is either released only once that transfer really ended
    (``releaser``: the Mooncake store's calls report their end) or ``retire``d: never handed
    out again, its bytes replaced by a new arena (engine transfers that timed out cannot be
    waited for), so a late transfer only ever lands in memory nobody else uses.
    """

    ALIGN = 64

    def __init__(self, nbytes: int, *, register: Callable[[int, int], Any] | None = None,
                 arena_bytes: int | None = None, populate: bool = False):
        self.nbytes = nbytes
        self.arena_bytes = min(arena_bytes or nbytes, nbytes)
        self._register = register
        self._populate = populate
        self._cond = threading.Condition()
        self._arenas: list[tuple[int, int, mmap.mmap]] = []  # (address, size, mapping)
        self._free: list[tuple[int, int]] = []  # (address, size), sorted by address
        self._used: dict[int, int] = {}
        self._usable = 0  # bytes of arenas not retired
        self._making = 0  # bytes of arenas being made (outside the lock)
        self.retired = 0

    @property
    def addresses(self) -> list[int]:
        """Start of every arena (to unregister)."""
        with self._cond:
            return [a for a, _, _ in self._arenas]

    def prepare(self) -> None:
        """Make (and register) the first arena now: a failure fails the caller's start."""
        with self._cond:
            if self._arenas:
                return
            self._making += self.arena_bytes
        self._add_arena()

    def _add_arena(self) -> None:
        """Map and register one arena; ``_making`` already counts it."""
        size = self.arena_bytes
        try:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if self._populate else 0)
            m = mmap.mmap(-1, size, flags=flags)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            if self._register is not None:
                self._register(addr, size)
        except BaseException:
            with self._cond:
                self._making -= size
                self._cond.notify_all()
            raise
        with self._cond:
            self._making -= size
            self._usable += size
            self._arenas.append((addr, size, m))
            self._insert(addr, size)
            self._cond.notify_all()

    def _take(self, n: int) -> int | None:
        for i, (addr, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (addr + n, size - n)
                self._used[addr] = n
                return addr
        return None

    def acquire(self, n: int, deadline: float) -> int | None:
        """Address of an extent of ``n`` bytes, or None if none frees up before ``deadline``."""
        n = (n + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        if n > self.arena_bytes:
            return None
        while True:
            with self._cond:
                while True:
                    addr = self._take(n)
                    if addr is not None:
                        return addr
                    if self._usable + self._making + self.arena_bytes <= self.nbytes:
                        self._making += self.arena_bytes
                        break  # make an arena, outside the lock
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
            self._add_arena()

    def _insert(self, addr: int, n: int) -> None:
        i = bisect.bisect(self._free, (addr, n))
        self._free.insert(i, (addr, n))
        # merge with neighbours (only within an arena: arenas are never adjacent by design)
        if i + 1 < len(self._free) and addr + n == self._free[i + 1][0] and self._same_arena(addr, self._free[i + 1][0]):
            self._free[i] = (addr, n + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == addr and self._same_arena(self._free[i - 1][0], addr):
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def _same_arena(self, a: int, b: int) -> bool:
        for start, size, _ in self._arenas:
            if start <= a < start + size:
                return start <= b < start + size
        return False

    def release(self, addr: int) -> None:
        with self._cond:
            n = self._used.pop(addr)
            self._insert(addr, n)
            self._cond.notify_all()

    def releaser(self, addr: int) -> Callable[[Any], None]:
        """``release(addr)`` as a callback that acts once however often it is called: the
        caller and an abandoned call's completion may both run it."""
        released = threading.Event()

        def release(_result: Any = None) -> None:
            if not released.is_set():
                released.set()
                self.release(addr)

        return release

    def retire(self, addr: int) -> None:
        """Never hand this extent out again; a new arena may replace its bytes."""
        with self._cond:
            n = self._used.pop(addr)
            self._usable -= n
            self.retired += 1
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return sum(self._used.values())

    def close(self) -> None:
        with self._cond:
            arenas, self._arenas = self._arenas, []
            self._free.clear()
        for _, _, m in arenas:
            try:
                m.close()
            except BufferError:  # an address view is alive; the mapping goes with the process
                pass


# ---------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------


def load_transfer_engine(user: str, extra: str) -> type:
    """Mooncake's ``TransferEngine`` class; ``MissingDependency`` naming ``extra`` if absent."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        from kvconnect.connectors.errors import MissingDependency

        raise MissingDependency(user, extra, e, kind="the Transfer Engine of") from e
    return TransferEngine


class TransferFailed(Exception):
    """A one-sided transfer, a registration or (PD relay) a store operation did not complete."""


class Pending:
    """Transfers started together: one engine batch id per transfer."""

    __slots__ = ("ids", "spans", "t0", "failed")

    def __init__(self, t0: float):
        self.ids: list[int] = []
        self.spans: list[tuple[int, int]] = []  # (local address, length) of each transfer
        self.t0 = t0
        self.failed = False

    def __bool__(self) -> bool:
        return bool(self.ids) or not self.failed


def rdma_devices() -> list[str]:
    """The RDMA NICs the kernel knows (what the Transfer Engine's RDMA transport needs)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


class EngineClient:
    """One Transfer Engine of this process (P2PHANDSHAKE: no metadata service) and the
    memory registered with it. Its session name is ``"<hostname>:<rpc port>"``; RDMA is used
    where the engine finds a NIC, TCP otherwise (the engine decides; ``protocol`` and
    ``device`` are passed through).

    Two call styles: ``write_sync`` (batches of blocks, the engine's own blocking call: the
    PD plane's bulk writes) and ``read_async`` / ``write_async`` + ``wait`` (one batch per
    coalesced transfer, polled with naps: the peer pool's reads, validated as they land).
    """

    def __init__(self, hostname: str, protocol: str = "tcp", device: str = "", *, user: str = "transfer engine",
                 extra: str = "peer", transfer_timeout_s: float | None = None):
        if transfer_timeout_s is not None:
            set_transfer_timeout(transfer_timeout_s)
        apply_engine_defaults()
        engine_class = load_transfer_engine(user, extra)
        self.engine = engine_class()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferFailed(f"Transfer Engine initialize({hostname!r}, {protocol!r}, {device!r}) returned {rc}")
        self.name = f"{hostname}:{self.engine.get_rpc_port()}"
        self.protocol = protocol
        if protocol == "rdma" and not rdma_devices():
            # the engine falls back to TCP by itself, silently: a pool meant for RDMA would
            # run at a fraction of its speed with nothing in the log to say why
            self.protocol = "tcp"
            log.warning("kvconnect %s: protocol rdma asked for, but this machine has no RDMA NIC "
                        "(/sys/class/infiniband is empty): pages move over TCP", user)
        self.regions = RegisteredRegions()
        self._lock = threading.Lock()
        self.timeout = max(5.0, float(transfer_timeout_s or 30.0))
        self._olock = threading.Lock()
        self._orphans: list[int] = []

    # -- registration ---------------------------------------------------------------
    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            if self.regions.covers(address, nbytes):
                return
            rc = self.engine.register_memory(address, nbytes)
            if rc != 0:
                raise TransferFailed(f"Transfer Engine register_memory({address:#x}, {nbytes}) returned {rc}")
            self.regions.add(address, nbytes)

    def register_many(self, spans: Sequence[tuple[int, int]]) -> None:
        """Distinct spans in one engine call (the engine refuses a span registered twice)."""
        todo = [(a, n) for a, n in dict.fromkeys(spans) if n > 0 and not self.regions.covers(a, n)]
        if not todo:
            return
        with self._lock:
            ptrs, lens = zip(*todo)
            rc = self.engine.batch_register_memory(list(ptrs), list(lens))
            if rc != 0:
                raise TransferFailed(f"Transfer Engine could not register {len(todo)} buffers (rc={rc})")
            for a, n in todo:
                self.regions.add(a, n)

    def page_registered(self, page: Sequence[tuple[int, int]]) -> bool:
        return self.regions.covers_page(page)

    # -- blocking batches -------------------------------------------------------------
    def write_sync(self, target: str, blocks: Sequence[tuple[int, int, int]], max_batch: int) -> None:
        """One-sided writes ``(local_src, remote_dst, nbytes)``; raises ``TransferFailed``.

        One engine call per ``max_batch`` blocks: the engine spreads a batch over its own
        workers, and concurrent calls were slower (loopback TCP, 2 cores: 1.7 GiB/s for one
        call of 2 x 16 MiB, 1.3 GiB/s for two parallel calls, 1.0 GiB/s for four).
        """
        for i in range(0, len(blocks), max_batch):
            piece = blocks[i:i + max_batch]
            srcs, dsts, lens = (list(x) for x in zip(*piece))
            rc = self.engine.batch_transfer_sync_write(target, srcs, dsts, lens)
            if rc != 0:
                raise TransferFailed(f"Transfer Engine write of {len(piece)} blocks "
                                     f"({sum(lens)} bytes) to {target} returned {rc}")

    # -- asynchronous transfers ---------------------------------------------------------
    MERGE_MAX = 2 << 20  # the engine runs the transfers of a batch in parallel: keep several

    @staticmethod
    def merge(local: list[int], remote: list[int], lengths: list[int]):
        """Coalesce transfers that are adjacent on both sides (pages written in one batch sit
        back to back in the holder's segment; a fresh host-pool range is contiguous too): one
        large transfer costs far less than many small ones, over TCP above all."""
        ml, mr, mn = [local[0]], [remote[0]], [lengths[0]]
        cap = EngineClient.MERGE_MAX
        for lo, re, n in zip(local[1:], remote[1:], lengths[1:]):
            if ml[-1] + mn[-1] == lo and mr[-1] + mn[-1] == re and mn[-1] + n <= cap:
                mn[-1] += n
            else:
                ml.append(lo)
                mr.append(re)
                mn.append(n)
        return ml, mr, mn

    # Waiting: the engine's own blocking waits (``batch_transfer_sync_*``,
    # ``get_batch_transfer_status``) spin on a core until the batch is done. Measured on 2 cores
    # over TCP: the spinning thread took half of the reader's CPU, starving the engine threads
    # that move the bytes (and the holder's), and capped a 2 MiB x 128 read at ~1.6 GiB/s;
    # sleeping between polls moved the same bytes at ~2.4 GiB/s. The only non-blocking poll,
    # ``transfer_check_status``, looks at task 0 of a batch alone, so every (coalesced)
    # transfer is submitted as a batch of its own.
    NAP_MIN, NAP_MAX = 20e-6, 1e-3

    def _submit(self, target: str, local, remote, lengths, write: bool) -> Pending:
        local, remote, lengths = self.merge(local, remote, lengths)
        start = self.engine.batch_transfer_async_write if write else self.engine.batch_transfer_async_read
        p = Pending(time.monotonic())
        for lo, re, n in zip(local, remote, lengths):
            try:
                bid = start(target, [lo], [re], [n])
            except Exception:  # noqa: BLE001 - as a refusal: the ones started are still waited for
                bid = 0
            if not bid:
                p.failed = True  # the rest is not started; those already started are waited for
                break
            p.ids.append(bid)
            p.spans.append((lo, n))
        return p

    def read_async(self, target: str, local: list[int], remote: list[int], lengths: list[int]) -> Pending:
        """Start one-sided reads from ``target``; ``wait`` for them."""
        return self._submit(target, local, remote, lengths, write=False)

    def write_async(self, target: str, local: list[int], remote: list[int], lengths: list[int]) -> Pending:
        return self._submit(target, local, remote, lengths, write=True)

    def wait(self, pending: Pending, landed: Callable[[int, int], None] | None = None,
             deadline: float | None = None) -> int:
        """0: every transfer completed; -1: one failed or could not start; -2: the transfer
        timeout passed first (those transfers may still land later). Returns only once no
        transfer of ``pending`` is in flight, or at the timeout. ``landed(local, length)`` is
        called for each transfer as soon as it completed (its bytes are final), so the
        caller can consume them while later ones are still moving. ``deadline`` (monotonic)
        can only shorten the transfer timeout."""
        check = self.engine.transfer_check_status
        deadline = min(pending.t0 + self.timeout, deadline or float("inf"))
        rc = -1 if pending.failed else 0
        ids, i, nap = pending.ids, 0, self.NAP_MIN
        while i < len(ids):
            st = check(ids[i])
            if st == 0:
                if time.monotonic() >= deadline:
                    self._orphan(ids[i:])
                    return -2
                time.sleep(nap)
                nap = min(2 * nap, self.NAP_MAX)
                continue
            if st == 1 and landed is not None:
                landed(*pending.spans[i])
            elif st == -2:  # the engine timed it out (its batch is not freed): -2 wins over -1
                self._orphan(ids[i:i + 1])
                rc = -2
            elif st < 0 and rc == 0:
                rc = -1
            i += 1
            nap = self.NAP_MIN
        if self._orphans:
            self._reap()
        return rc

    def read(self, target: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        """One batch of one-sided reads from ``target``; 0 when every transfer completed."""
        return self.wait(self.read_async(target, local, remote, lengths))

    def write(self, target: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        return self.wait(self.write_async(target, local, remote, lengths))

    def _orphan(self, ids: list[int]) -> None:
        """Batches given up on: their ids are freed by the engine once polled as finished."""
        with self._olock:
            self._orphans.extend(ids)
            del self._orphans[:-4096]  # a peer that never answers: the oldest are leaked, not polled

    def _reap(self) -> None:
        with self._olock:
            self._orphans = [b for b in self._orphans if self.engine.transfer_check_status(b) in (0, -2)]

    def close(self) -> None:
        with self._lock:
            for start in self.regions.clear():
                try:
                    self.engine.unregister_memory(start)
                except Exception:  # noqa: BLE001 - shutting down
                    pass
