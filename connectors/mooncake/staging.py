"""A registered staging buffer: where pages outside registered memory pass through.

Mooncake's zero-copy calls need memory registered with its transfer engine (with RDMA,
pinned and known to the NIC). Pages the caller never registered are gathered into (puts)
or read through (gets) extents of one buffer that the store registered at start.

An extent whose Mooncake call was abandoned at its deadline stays allocated until that
call really returns (``release`` is then called from the call's completion), so a late
transfer only ever lands in memory nobody else uses.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading
import time
from typing import Any, Callable


class StagingBuffer:
    """First-fit extents of one anonymous mapping; thread-safe; waits are bounded."""

    ALIGN = 64

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}

    def acquire(self, n: int, deadline: float) -> int | None:
        """Offset of an extent of ``n`` bytes, or None if none frees up before ``deadline``."""
        n = (n + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        if n > self.nbytes:
            return None
        with self._cond:
            while True:
                for i, (off, size) in enumerate(self._free):
                    if size >= n:
                        if size == n:
                            del self._free[i]
                        else:
                            self._free[i] = (off + n, size - n)
                        self._used[off] = n
                        return off
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def release(self, off: int) -> None:
        with self._cond:
            n = self._used.pop(off)
            i = bisect.bisect(self._free, (off, n))
            self._free.insert(i, (off, n))
            # merge with neighbours
            if i + 1 < len(self._free) and off + n == self._free[i + 1][0]:
                self._free[i] = (off, n + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]
            self._cond.notify_all()

    def releaser(self, off: int) -> Callable[[Any], None]:
        """``release(off)`` as a callback that acts once however often it is called: the
        caller and an abandoned call's completion may both run it."""
        released = threading.Event()

        def release(_result: Any = None) -> None:
            if not released.is_set():
                released.set()
                self.release(off)

        return release

    @property
    def in_use(self) -> int:
        with self._cond:
            return sum(self._used.values())

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # an address view is alive; the mapping goes with the process
            pass
