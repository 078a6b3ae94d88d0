"""File clients: move pages between caller segments and fixed offsets of a data file.

* ``PosixFile`` (any filesystem; the embedded default and what CI tests): a batch's pages
  sorted by offset and merged into runs of adjacent slots; writes with ``os.pwritev``
  straight from the caller's segments or staged through a small per-worker buffer; reads
  with ``os.preadv`` into the segments or, by default, one ``memmove`` per run from a shared
  mapping of the file. The GIL is released throughout, so a pool of workers runs in parallel.
* ``StripedFile``: a lane's slots round-robin over several ``PosixFile`` s (opt-in), so
  buffered writes are not serialized by one file's inode lock.
* ``UsrbioFile`` (3FS mounts): the 3FS user-space ring API of ``hf3fs_fuse.io``
  (package ``hf3fs-py-usrbio``). usrbio only does I/O into memory registered with the
  mount (an iov), so pages are staged through one iov per client (one memcpy each way,
  as SGLang's client). Needs a 3FS mount: not exercised on machines without one.

O_DIRECT / io_uring / mapped writes / fallocate: measured and not used (docs/hf3fs.md, "File
clients"): O_DIRECT runs at disk speed and drops the page-cache copy the next get reads;
io_uring has no standard-library binding and its buffered writes take the same inode lock;
mapped writes fault per 4 KiB once writeback has cleaned a page.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time

from kvconnect.connectors.base import ConfigError, Page
from kvconnect.connectors.buffers import page_view

log = logging.getLogger("kvconnect.hf3fs")


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


# Bytes a staged write copies per pwrite: the chunk stays in the writer core's L2 between
# the user-space copy and the kernel's (measured 256 KiB-1 MiB alike; 128 KiB slower).
STAGE_BYTES = 512 << 10


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# File-offset runs: a batch's pages grouped into ranges of the file written/read back to back.
IOV_MAX = 1024  # Linux UIO_MAXIOV: the most segments one preadv/pwritev takes


def _runs(items: list[tuple[int, Page]]) -> list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]]:
    """Group ``(offset, page)`` items into runs of adjacent file ranges.

    Returns ``(run_offset, segments, ends)`` per run, ``segments`` the run's (address, bytes)
    in file order and ``ends`` one ``(item index, end of the item relative to the run)`` per
    item: an item is stored once a run's first ``end`` bytes are. A batch's slots are often
    consecutive (the free list hands them out in order), so a batch usually becomes a few
    large vectored calls instead of one per page.
    """
    order = sorted(range(len(items)), key=lambda i: items[i][0])
    runs: list = []
    end = -1
    for i in order:
        off, page = items[i]
        if off != end:
            runs.append((off, [], []))
            rel = 0
        else:
            rel = runs[-1][2][-1][1]
        segs = runs[-1][1]
        for addr, n in page:
            if segs and segs[-1][0] + segs[-1][1] == addr:
                segs[-1] = (segs[-1][0], segs[-1][1] + n)  # adjacent in memory too: one segment
            else:
                segs.append((addr, n))
            rel += n
        runs[-1][2].append((i, rel))
        end = off + sum(n for _, n in page)
    return runs


class PosixFile:
    """Pages at offsets of one file: writes with ``pwritev`` (straight from the caller's
    segments, or staged through a small per-thread buffer), reads with ``preadv`` or from a
    shared read mapping of the file (``mmap_reads``).

    Both read paths copy page-cache bytes straight into the caller's segments once. The
    mapping is faster where the kernel's copy is slower than a user-space memcpy (measured
    on this machine kind: 8 MiB pages, one thread, 11.7 vs 5.1 GiB/s); its risk is SIGBUS if
    someone truncates the file under a reader, which kvconnect never does (files only grow).
    Writes never go through the mapping: a full disk must be an error, not SIGBUS, and in
    steady state (pages reused after writeback cleaned them) every 4 KiB of a mapped write
    takes a fault: measured 0.4-1 GiB/s against 4-9 GiB/s for pwritev, with or without
    MADV_POPULATE_WRITE.

    Staged writes (``stage_bytes`` > 0): buffered writes to one file are serialized by the
    file system (ext4, xfs and tmpfs hold the inode lock across the copy), so more writer
    threads do not copy in parallel; and the kernel copies faster from a cache-resident
    source than from DRAM (measured here: 512 KiB from a hot buffer 10-14 GiB/s, from a 64 MiB
    host buffer 6-8). Each writer therefore copies the next ``stage_bytes`` of its pages into
    its own small buffer (user-space memcpy, outside the lock, in parallel with the other
    writers) and ``pwrite``s that buffer. Pays off only with two or more writers on two or
    more cores; one writer writes straight from the segments.
    """

    kind = "posix"

    def __init__(self, path: str, size: int, mmap_reads: bool = False, stage_bytes: int = 0):
        self.path = path
        self.size = size
        self.fd = open_data_file(path, size)
        self.stage_bytes = stage_bytes
        self._tls = threading.local()
        self._map = None
        self._map_ref = None
        self._map_base = 0
        self._map_len = 0
        if mmap_reads and size > 0:
            import mmap

            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._map_ref = ctypes.c_char.from_buffer(self._map)
            self._map_base = ctypes.addressof(self._map_ref)
            self._map_len = size

    @property
    def mapped(self) -> bool:
        return self._map is not None

    def sync(self) -> None:
        os.fdatasync(self.fd)

    # -------------------------------------------------------------- reads
    def read_batch(self, items: list[tuple[int, Page]]) -> list[bool]:
        """Copy each ``(offset, page)`` from the file into the page's segments."""
        out = [False] * len(items)
        for off, segs, ends in _runs(items):
            try:
                done = (self._read_mapped(off, segs) if self._map is not None
                        else self._vectored(os.preadv, off, segs))
            except OSError as e:
                log.error("hf3fs: read of %s at %d failed: %s", self.path, off, e)
                done = 0
            for i, end in ends:
                out[i] = end <= done
        return out

    def _read_mapped(self, off: int, segs: list[tuple[int, int]]) -> int:
        """memmove from the mapping (GIL released per call); bytes copied."""
        total = sum(n for _, n in segs)
        if off + total > self._map_len:
            return 0  # beyond what this process mapped: a miss, never a fault
        src = self._map_base + off
        for addr, n in segs:
            ctypes.memmove(addr, src, n)
            src += n
        return total

    def _vectored(self, call, off: int, segs: list[tuple[int, int]], deadline: float | None = None) -> int:
        """Bytes moved by ``call`` (``os.preadv`` / ``os.pwritev``) between the file at ``off`` and a
        run's segments, IOV_MAX at a time; stops short at end of file or once ``deadline`` passed."""
        done = 0
        for j in range(0, len(segs), IOV_MAX):
            views = page_view(segs[j:j + IOV_MAX])
            want = sum(len(v) for v in views)
            got = 0
            while got < want:
                if deadline is not None and time.monotonic() > deadline:
                    return done + got
                n = call(self.fd, views if got == 0 else _advance(views, got), off + done + got)
                if n <= 0:
                    return done + got  # reads: end of file, never written
                got += n
            done += got
        return done

    # -------------------------------------------------------------- writes
    def write_batch(self, items: list[tuple[int, Page]], deadline: float | None = None) -> list[bool]:
        """Write each ``(offset, page)``. No write starts after ``deadline`` (monotonic): the
        reservation is about to expire and the page may no longer be ours."""
        out = [False] * len(items)
        for off, segs, ends in _runs(items):
            try:
                if self.stage_bytes:
                    done = self._write_staged(off, segs, deadline)
                else:
                    done = self._vectored(os.pwritev, off, segs, deadline)
            except OSError as e:
                log.error("hf3fs: write of %s at %d failed: %s", self.path, off, e)
                done = 0  # how far it got is unknown to us; the whole run fails
            for i, end in ends:
                out[i] = end <= done
        return out

    def _stage(self) -> tuple[int, memoryview]:
        st = getattr(self._tls, "stage", None)
        if st is None:
            import mmap

            buf = mmap.mmap(-1, self.stage_bytes)  # page-aligned, this thread's alone
            st = self._tls.stage = (ctypes.addressof(ctypes.c_char.from_buffer(buf)), memoryview(buf), buf)
        return st[0], st[1]

    def _write_staged(self, off: int, segs: list[tuple[int, int]], deadline: float | None) -> int:
        base, view = self._stage()
        cap = self.stage_bytes
        done = fill = 0
        memmove = ctypes.memmove
        for addr, n in segs:
            o = 0
            while o < n:
                k = min(n - o, cap - fill)
                memmove(base + fill, addr + o, k)
                fill += k
                o += k
                if fill == cap:
                    w = self._flush(view, fill, off + done, deadline)
                    done += w
                    if w < fill:
                        return done
                    fill = 0
        if fill:
            done += self._flush(view, fill, off + done, deadline)
        return done

    def _flush(self, view: memoryview, n: int, off: int, deadline: float | None) -> int:
        got = 0
        while got < n:
            if deadline is not None and time.monotonic() > deadline:
                break
            w = os.pwrite(self.fd, view[got:n], off + got)
            if w <= 0:
                break
            got += w
        return got

    def close(self) -> None:
        if self._map is not None:
            self._map_ref = None
            self._map.close()
            self._map = None
            self._map_len = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StripedFile:
    """Pages striped over ``stripes`` POSIX files: slot ``s`` lies in file ``s % stripes`` at
    ``(s // stripes) * unit``. Files are ``path`` and ``path.1`` ... ``path.{stripes-1}``.

    Why: a buffered write holds the file's inode lock for the whole copy (ext4, xfs, tmpfs),
    so one file takes one writer at a time however many workers there are; writers of
    different files copy in parallel (measured here, 512 KiB pages: two threads, one file
    6.8 GiB/s, two files 9.7 GiB/s; on a quiet 16-core host 4.8 vs 8.7). Same interface as
    ``PosixFile``: offsets are ``slot * unit``.
    """

    kind = "posix"

    def __init__(self, path: str, size: int, unit: int, stripes: int, **posix: object):
        self.path = path
        self.unit = unit
        self.stripes = stripes
        per = -(-(size // unit) // stripes) * unit
        self.files: list[PosixFile] = []
        try:
            for i in range(stripes):
                self.files.append(PosixFile(path if i == 0 else f"{path}.{i}", per, **posix))
        except BaseException:
            self.close()
            raise
        self.stage_bytes = self.files[0].stage_bytes
        self.mapped = self.files[0].mapped

    def _split(self, items: list[tuple[int, Page]]) -> list[list[tuple[int, tuple[int, Page]]]]:
        by: list[list] = [[] for _ in range(self.stripes)]
        for i, (off, page) in enumerate(items):
            slot, rem = divmod(off, self.unit)
            by[slot % self.stripes].append((i, ((slot // self.stripes) * self.unit + rem, page)))
        return by

    def _each(self, items: list[tuple[int, Page]], op) -> list[bool]:
        out = [False] * len(items)
        for f, part in zip(self.files, self._split(items)):
            if part:
                for (i, _), ok in zip(part, op(f, [it for _, it in part])):
                    out[i] = ok
        return out

    def read_batch(self, items: list[tuple[int, Page]]) -> list[bool]:
        return self._each(items, lambda f, part: f.read_batch(part))

    def write_batch(self, items: list[tuple[int, Page]], deadline: float | None = None) -> list[bool]:
        return self._each(items, lambda f, part: f.write_batch(part, deadline))

    def sync(self) -> None:
        for f in self.files:
            f.sync()

    def close(self) -> None:
        for f in self.files:
            f.close()


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
            from kvconnect.connectors.base import MissingDependency

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

    def _batch(self, items: list[tuple[int, Page]], for_read: bool, deadline: float | None = None) -> list[bool]:
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
            for i, (off, page) in enumerate(items):
                n = sum(s for _, s in page)
                if pos + n > self.page_bytes * self.entries or (deadline is not None and time.monotonic() > deadline):
                    continue
                if not for_read:
                    o = pos
                    for addr, s in page:
                        ctypes.memmove(base + o, addr, s)
                        o += s
                ior.prepare(iov[pos:pos + n], for_read, self.fd, off)
                prepared.append((i, pos, n, page))
                pos += n
            if not prepared:
                return out
            results = ior.submit().wait(min_results=len(prepared), timeout=self._timeout)
            for (i, p, n, page), res in zip(prepared, results):
                if res.result != n:
                    continue
                if for_read:
                    o = p
                    for addr, s in page:
                        ctypes.memmove(addr, base + o, s)
                        o += s
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
