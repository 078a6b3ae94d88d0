"""Optional write-through disk tier under the lent segment.

Pages written to the segment are queued and written to one file per key (a background
thread, so the write path never waits for the disk). When the segment evicts a page that
is on disk, the node keeps its directory entry as *non-resident*; a reader that finds such
an entry asks the holder to promote it, which reads the file back into a fresh slot. Each
file starts with a header holding the key and the checksum, checked on promotion. The
directory is per process incarnation: it is emptied at start and at close.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import struct
import threading
from collections import OrderedDict
from typing import Callable

log = logging.getLogger(__name__)

_HDR = struct.Struct("<4sIQQ")  # magic, key length, payload length, checksum
_MAGIC = b"KVP1"


class DiskTier:
    def __init__(self, path: str, capacity: int, on_evict: Callable[[str], None] | None = None):
        self.path = path
        self.capacity = capacity
        self.on_evict = on_evict
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (length, checksum)
        self.used = 0
        self.evictions = 0
        self.writes = 0
        self._queue: queue.Queue = queue.Queue(maxsize=4096)
        self._thread = threading.Thread(target=self._writer, name="peer-disk", daemon=True)
        self._thread.start()

    def _file(self, key: str) -> str:
        return os.path.join(self.path, hashlib.sha1(key.encode()).hexdigest())

    def contains(self, key: str) -> tuple[int, int] | None:
        with self._lock:
            return self._index.get(key)

    def submit(self, key: str, data: bytes, checksum: int) -> None:
        """Queue a page for write-through (dropped, not blocking, when the queue is full)."""
        try:
            self._queue.put_nowait((key, data, checksum))
        except queue.Full:
            log.debug("disk tier queue full; %s not written through", key)

    def flush(self) -> None:
        """Wait until every queued page is on disk (tests, clean shutdown)."""
        self._queue.join()

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, data, checksum = item
                self._write(key, data, checksum)
            except Exception:  # noqa: BLE001 - a disk error loses the disk copy, nothing else
                log.exception("disk tier write failed")
            finally:
                self._queue.task_done()

    def _write(self, key: str, data: bytes, checksum: int) -> None:
        n = len(data)
        if n > self.capacity:
            return
        with self._lock:
            if key in self._index:
                return
        kb = key.encode()
        tmp = self._file(key) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_HDR.pack(_MAGIC, len(kb), n, checksum) + kb)
            f.write(data)
        os.replace(tmp, self._file(key))
        evicted = []
        with self._lock:
            self._index[key] = (n, checksum)
            self.used += n
            self.writes += 1
            while self.used > self.capacity and self._index:
                old, (ln, _) = self._index.popitem(last=False)
                self.used -= ln
                self.evictions += 1
                evicted.append(old)
        for old in evicted:
            try:
                os.unlink(self._file(old))
            except OSError:
                pass
            if self.on_evict:
                self.on_evict(old)

    def read_into(self, key: str, address: int, nbytes: int) -> int | None:
        """Read the page into ``address``; its checksum, or None (absent, wrong size, corrupt)."""
        import ctypes

        with self._lock:
            meta = self._index.get(key)
            if meta is not None:
                self._index.move_to_end(key)
        if meta is None or meta[0] != nbytes:
            return None
        try:
            with open(self._file(key), "rb") as f:
                magic, klen, n, checksum = _HDR.unpack(f.read(_HDR.size))
                if magic != _MAGIC or n != nbytes or f.read(klen) != key.encode():
                    return None
                view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
                if f.readinto(view) != nbytes:
                    return None
                return checksum
        except OSError:
            return None

    def remove(self, key: str) -> None:
        with self._lock:
            meta = self._index.pop(key, None)
            if meta:
                self.used -= meta[0]
        if meta:
            try:
                os.unlink(self._file(key))
            except OSError:
                pass

    def clear(self, prefix: str = "") -> None:
        with self._lock:
            keys = [k for k in self._index if k.startswith(prefix)]
            for k in keys:
                self.used -= self._index.pop(k)[0]
        for k in keys:
            try:
                os.unlink(self._file(k))
            except OSError:
                pass

    @property
    def keys(self) -> int:
        return len(self._index)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)
        shutil.rmtree(self.path, ignore_errors=True)
