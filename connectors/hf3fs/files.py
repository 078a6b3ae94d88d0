"""File clients: move pages between caller segments and fixed offsets of a data file.

* ``PosixFile`` (any filesystem; the embedded default and what CI tests): ``os.pwritev``
  straight from the caller's segments, one syscall per page; reads with ``os.preadv`` into
  the segments or, by default, one ``memmove`` per segment from a shared mapping of the file.
  No intermediate buffer either way, and the GIL is released, so a pool of workers runs
  them in parallel.
* ``UsrbioFile`` (3FS mounts): the 3FS user-space ring API of ``hf3fs_fuse.io``
  (package ``hf3fs-py-usrbio``). usrbio only does I/O into memory registered with the
  mount (an iov), so pages are staged through one iov per client (one memcpy each way,
  as SGLang's client). Needs a 3FS mount: not exercised on machines without one.

O_DIRECT / io_uring: not used (see docs/hf3fs.md): reads from a warm page cache are what
HiCache L3 on local or cached file systems lives on, O_DIRECT bypasses that cache and needs
4 KiB-aligned host segments SGLang does not guarantee, and Python has no io_uring binding in
the standard library (3FS's own ring API is the usrbio client).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import zlib
from typing import Sequence

from connectors.base import ConfigError, Page

log = logging.getLogger("kvconnect.hf3fs")


def segment_views(page: Page) -> list[memoryview]:
    """Writable byte views over a page's segments (no copy)."""
    return [memoryview((ctypes.c_char * n).from_address(addr)).cast("B") for addr, n in page]


def crc_of(views: Sequence[memoryview]) -> int:
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """The part of ``views`` after the first ``done`` bytes (after a short preadv/pwritev)."""
    out = []
    for v in views:
        if done >= len(v):
            done -= len(v)
            continue
        out.append(v[done:])
        done = 0
    return out


def open_data_file(path: str, min_size: int) -> int:
    """Open (create) the data file and grow it to ``min_size`` (never shrinks: shared file)."""
    d = os.path.dirname(path)
    try:
        if d:
            os.makedirs(d, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError("file_path_prefix", f"cannot create or open data file {path!r}: {e.strerror}") from e
    try:
        if os.fstat(fd).st_size < min_size:
            os.ftruncate(fd, min_size)
    except OSError as e:
        os.close(fd)
        raise ConfigError("file_size", f"cannot size {path!r} to {min_size} bytes: {e.strerror}") from e
    return fd


class PosixFile:
    """Pages at offsets of one file: writes with ``pwritev``, reads with ``preadv`` or from a
    shared read mapping of the file (``mmap=True``).

    Both read paths copy page-cache bytes straight into the caller's segments once. The
    mapping is faster where the kernel's copy is slower than a user-space memcpy (measured
    on this machine kind: 8 MiB pages, one thread, 11.7 vs 5.1 GiB/s); its risk is SIGBUS if
    someone truncates the file under a reader, which kvconnect never does (files only grow).
    Writes never go through the mapping: a full disk must be an error, not SIGBUS, and in
    steady state (pages reused after writeback cleaned them) every 4 KiB of a mapped write
    takes a fault: measured 8 MiB pages, 4-16 workers, median 0.6-1.1 GiB/s against 4-5.6
    GiB/s for pwritev.
    """

    kind = "posix"

    def __init__(self, path: str, size: int, mmap_reads: bool = False):
        self.path = path
        self.size = size
        self.fd = open_data_file(path, size)
        self._map = None
        self._map_ref = None
        self._map_base = 0
        if mmap_reads and size > 0:
            import mmap

            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._map_ref = ctypes.c_char.from_buffer(self._map)
            self._map_base = ctypes.addressof(self._map_ref)

    def grow(self, size: int) -> None:
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        self.size = max(self.size, size)

    def read_mapped(self, offset: int, page) -> bool:
        """Copy one page from the mapping into its segments (GIL released per memmove)."""
        n = sum(s for _, s in page)
        if offset + n > self.size:
            return False
        src = self._map_base + offset
        for addr, size in page:
            ctypes.memmove(addr, src, size)
            src += size
        return True

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def read(self, offset: int, views: list[memoryview]) -> bool:
        want = sum(len(v) for v in views)
        done = 0
        while done < want:
            n = os.preadv(self.fd, views if done == 0 else _advance(views, done), offset + done)
            if n <= 0:
                return False  # end of file: never written
            done += n
        return True

    def write(self, offset: int, views: list[memoryview]) -> bool:
        want = sum(len(v) for v in views)
        done = 0
        while done < want:
            n = os.pwritev(self.fd, views if done == 0 else _advance(views, done), offset + done)
            if n <= 0:
                return False
            done += n
        return True

    def read_batch(self, items: list[tuple[int, list[memoryview]]]) -> list[bool]:
        out = []
        for off, views in items:
            try:
                out.append(self.read(off, views))
            except OSError as e:
                log.error("hf3fs: read of %s at %d failed: %s", self.path, off, e)
                out.append(False)
        return out

    def write_batch(self, items: list[tuple[int, list[memoryview]]], deadline: float | None = None) -> list[bool]:
        import time

        out = []
        for off, views in items:
            if deadline is not None and time.monotonic() > deadline:
                out.append(False)  # reservation about to expire: never write a page we may no longer own
                continue
            try:
                out.append(self.write(off, views))
            except OSError as e:
                log.error("hf3fs: write of %s at %d failed: %s", self.path, off, e)
                out.append(False)
        return out

    def close(self) -> None:
        if self._map is not None:
            self._map_ref = None
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mount_fstype(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts; '' if unknown)."""
    try:
        real = os.path.realpath(os.path.dirname(path) or ".")
        best, fstype = "", ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, fstype = mnt, parts[2]
        return fstype
    except OSError:
        return ""


def on_3fs_mount(path: str) -> bool:
    return "3fs" in mount_fstype(path).lower()


# File systems whose page cache is this machine's alone and whose I/O errors are rare
# enough that a shared mapping is safe (no SIGBUS from a flaky server, as NFS or FUSE).
LOCAL_FILESYSTEMS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "overlay", "zfs")


def on_local_fs(path: str) -> bool:
    return mount_fstype(path) in LOCAL_FILESYSTEMS


class UsrbioFile:
    """3FS usrbio: a pool of (read ring, write ring, staging iov) sets, one per worker."""

    kind = "usrbio"

    def __init__(self, path: str, size: int, page_bytes: int, entries: int, jobs: int, timeout: float):
        try:
            from hf3fs_fuse import io as h3io  # package hf3fs-py-usrbio
        except ImportError as e:
            from connectors.base import MissingDependency

            raise MissingDependency("hf3fs", "hf3fs", e) from e
        import datetime
        import multiprocessing.shared_memory as shm

        self._io = h3io
        self._timeout = datetime.timedelta(seconds=timeout)
        self.path = path
        self.size = size
        self.page_bytes = page_bytes
        self.entries = entries
        self.fd = open_data_file(path, size)
        h3io.register_fd(self.fd)
        mount = h3io.extract_mount_point(path)
        self._rings: queue.SimpleQueue = queue.SimpleQueue()
        self._all = []
        for _ in range(jobs):
            mem = shm.SharedMemory(size=page_bytes * entries, create=True)
            iov = h3io.make_iovec(mem, mount)
            mem.unlink()
            r = h3io.make_ioring(mount, entries, for_read=True, timeout=1, numa=-1)
            w = h3io.make_ioring(mount, entries, for_read=False, timeout=1, numa=-1)
            base = ctypes.addressof(ctypes.c_char.from_buffer(mem.buf))
            ring = (r, w, iov, mem, base)
            self._all.append(ring)
            self._rings.put(ring)

    def grow(self, size: int) -> None:
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)

    def _batch(self, items, for_read: bool, deadline: float | None = None) -> list[bool]:
        import time

        out = [False] * len(items)
        try:
            ring = self._rings.get(timeout=self._timeout.total_seconds())
        except queue.Empty:
            return out
        broken = False
        try:
            r, w, iov, mem, base = ring
            ior = r if for_read else w
            pos = 0
            prepared = []
            for i, (off, views) in enumerate(items):
                n = sum(len(v) for v in views)
                if n > self.page_bytes or (deadline is not None and time.monotonic() > deadline):
                    continue
                if not for_read:
                    o = pos
                    for v in views:
                        ctypes.memmove(base + o, ctypes.addressof(ctypes.c_char.from_buffer(v)), len(v))
                        o += len(v)
                ior.prepare(iov[pos:pos + n], for_read, self.fd, off)
                prepared.append((i, pos, n, views))
                pos += n
            if not prepared:
                return out
            results = ior.submit().wait(min_results=len(prepared), timeout=self._timeout)
            for (i, p, n, views), res in zip(prepared, results):
                if res.result != n:
                    continue
                if for_read:
                    o = p
                    for v in views:
                        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(v)), base + o, len(v))
                        o += len(v)
                out[i] = True
            return out
        except Exception as e:  # noqa: BLE001 - a failed ring op is a miss
            # I/O may still land in this ring's iov later: retire the ring, never reuse it
            broken = True
            log.error("hf3fs: usrbio %s failed, retiring one ring: %s", "read" if for_read else "write", e)
            return out
        finally:
            if not broken:
                self._rings.put(ring)

    def read_batch(self, items):
        return self._batch(items, True)

    def write_batch(self, items, deadline=None):
        return self._batch(items, False, deadline)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self._io.deregister_fd(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
            for _, _, _, mem, _ in self._all:
                mem.close()
