"""Data plane: Mooncake Transfer Engine, one-sided batched reads and writes.

The engine runs in P2PHANDSHAKE mode (no metadata service): a node's segment name is
``"<local_hostname>:<te rpc port>"``, carried in its membership record. RDMA is used
where the engine finds an RDMA NIC, TCP otherwise (the engine decides; ``protocol`` and
``device_name`` are passed through).

Caller memory that was not registered (``register``) is served through a registered
bounce pool: the engine reads into the bounce buffer and the page is copied out after the
read has been validated.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import threading
import time
from typing import Callable

from kvconnect.connectors.mooncake.engine_env import apply_engine_defaults

log = logging.getLogger(__name__)


class Staging:
    """Registered staging memory, in chunks of up to 64 MiB, made on first use.

    A chunk whose transfer failed or timed out is *retired*: never handed out again (the
    engine may still write into it), and a fresh chunk may replace it.
    """

    def __init__(self, transport: "Transport", total_bytes: int):
        self.transport = transport
        self.chunk_bytes = max(1 << 20, min(64 << 20, total_bytes))
        self.max_chunks = max(1, total_bytes // self.chunk_bytes)
        self._cond = threading.Condition()
        self._free: list[int] = []
        self._live = 0
        self._maps: list[mmap.mmap] = []
        self.retired = 0

    def borrow(self, timeout: float | None) -> int | None:
        """A chunk address; None if none is free within ``timeout`` seconds (0: do not wait)."""
        with self._cond:
            while True:
                if self._free:
                    return self._free.pop()
                if self._live < self.max_chunks:
                    self._live += 1
                    break
                if timeout == 0 or not self._cond.wait(timeout):
                    return None
        try:
            m = mmap.mmap(-1, self.chunk_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                          | getattr(mmap, "MAP_POPULATE", 0))
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            self.transport.register(addr, self.chunk_bytes)
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._maps.append(m)  # kept for the life of the process (retired ones too)
        return addr

    def give_back(self, addr: int) -> None:
        with self._cond:
            self._free.append(addr)
            self._cond.notify()

    def retire(self, addr: int) -> None:
        with self._cond:
            self._live -= 1  # room for a replacement; this one is never reused
            self.retired += 1
            self._cond.notify()


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


class Transport:
    def __init__(self, hostname: str, protocol: str, device: str, transfer_timeout_s: float,
                 bounce_bytes: int):
        # The engine reads its transfer timeout once, from the environment (seconds, >= 5).
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(round(transfer_timeout_s)))))
        apply_engine_defaults()
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Transfer Engine initialize({hostname!r}, {protocol!r}, {device!r}) = {rc}")
        self.name = f"{hostname}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []  # sorted (start, end)
        self._last: tuple[int, int] = (0, 0)
        self.staging = Staging(self, bounce_bytes)
        self.timeout = max(5.0, float(transfer_timeout_s))
        self._olock = threading.Lock()
        self._orphans: list[int] = []

    # -- registration ---------------------------------------------------------------
    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            if self.is_registered(address, nbytes):
                return
            rc = self.engine.register_memory(address, nbytes)
            if rc != 0:
                raise RuntimeError(f"Transfer Engine register_memory({address:#x}, {nbytes}) = {rc}")
            bisect.insort(self._regions, (address, address + nbytes))

    def is_registered(self, address: int, nbytes: int) -> bool:
        last = self._last  # pages of one batch nearly always lie in one region
        if last[0] <= address and address + nbytes <= last[1]:
            return True
        regions = self._regions
        i = bisect.bisect_right(regions, (address, float("inf"))) - 1
        if i >= 0 and regions[i][0] <= address and address + nbytes <= regions[i][1]:
            self._last = regions[i]
            return True
        return False

    def page_registered(self, page) -> bool:
        return all(self.is_registered(a, n) for a, n in page)

    # -- transfers ------------------------------------------------------------------
    MERGE_MAX = 2 << 20  # the engine runs the transfers of a batch in parallel: keep several

    @staticmethod
    def merge(local: list[int], remote: list[int], lengths: list[int]):
        """Coalesce transfers that are adjacent on both sides (pages written in one batch sit
        back to back in the holder's segment; a fresh host-pool range is contiguous too): one
        large transfer costs far less than many small ones, over TCP above all."""
        ml, mr, mn = [local[0]], [remote[0]], [lengths[0]]
        cap = Transport.MERGE_MAX
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

    def _submit(self, target: str, local, remote, lengths, write: bool) -> "Pending":
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

    def read_async(self, target: str, local: list[int], remote: list[int], lengths: list[int]) -> "Pending":
        """Start one-sided reads from ``target``; ``wait`` for them."""
        return self._submit(target, local, remote, lengths, write=False)

    def write_async(self, target: str, local: list[int], remote: list[int], lengths: list[int]) -> "Pending":
        return self._submit(target, local, remote, lengths, write=True)

    def wait(self, pending: "Pending", landed: Callable[[int, int], None] | None = None,
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
            for start, _ in self._regions:
                try:
                    self.engine.unregister_memory(start)
                except Exception:  # noqa: BLE001 - shutting down
                    pass
            self._regions.clear()
            self._last = (0, 0)
