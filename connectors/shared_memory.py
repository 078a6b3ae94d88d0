"""Segments in shared memory: same-host readers copy pages instead of a TCP transfer.

A process that lends memory to a store (a standalone Mooncake store process with
``shared_segment``, a peer-pool node with ``shared_segment``) lends it from a file in
``/dev/shm`` mapped ``MAP_SHARED`` and publishes, in ``shared_segment_dir``, which transport
endpoint owns that file and at which address it is mapped. A process on the same host that
finds a page at a published endpoint maps the file read-only and copies the page itself
(kvconnect's copy threads) instead of moving it through the Transfer Engine's loopback TCP.
Shared by the stores that lend memory; each adds its own proof that the bytes copied are
the key's (Mooncake: the read lease and the holder alive after the copy; the peer pool:
the page's published checksum).

Why the bytes at an address are the holder's, never another process's:
  * the registry entry is keyed by the network namespace *and* the endpoint: an endpoint
    (``host:port``) names one bound socket, so one live process, only within a namespace;
  * the entry names the holder's pid and its start time; after every copy the reader
    checks that this very process is still alive. A live holder still owns its port, so
    every replica the master reported at that endpoint before the check was the holder's,
    at an address inside the published mapping. A dead holder's pages are misses;
  * the holder publishes the endpoint of its own Transfer Engine (Mooncake: proven with a
    probe object whose replica lies inside the mapped file) and its own address of the file.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvconnect.shared_memory")

_LIST_EVERY_S = 2.0      # how often a reader looks for newly published segments
_UNMAP_AFTER_S = 60.0    # a dead holder's mapping is unmapped this long after it was dropped

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_READ, _MAP_SHARED, _MAP_FAILED = 1, 1, ctypes.c_void_p(-1).value


def netns_id() -> int:
    """Inode of this process's network namespace."""
    return os.stat("/proc/self/ns/net").st_ino


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot), or None if it is not running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if fields[0] in ("Z", "X"):  # a zombie no longer holds its sockets
        return None
    return int(fields[19])


def _entry_name(netns: int, endpoint: str) -> str:
    return f"{netns}-{endpoint.replace(':', '_').replace('/', '_')}.json"


class SharedSegmentFile:
    """Holder side: the shared-memory file a segment is mounted from, and its registry entry."""

    def __init__(self, directory: str, nbytes: int, user: str = "kvconnect"):
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        sweep_dead(self.directory, netns_id(), user)
        stat = os.statvfs(self.directory)
        free = stat.f_bavail * stat.f_frsize
        if free < nbytes:
            raise OSError(f"{self.directory} has {free} bytes free, the shared segment needs {nbytes} "
                          f"(a container's /dev/shm is often 64 MB: raise --shm-size)")
        try:
            fd, self.path = tempfile.mkstemp(prefix="segment-", suffix=".mem", dir=self.directory)
        except PermissionError as e:
            raise PermissionError(f"{e}: the directory is another user's (it is 0700, so neither could read "
                                  f"the other's segments); give each user its own shared_segment_dir") from e
        self.nbytes = nbytes
        self.entry: Path | None = None
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full tmpfs would SIGBUS on first touch
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)

    def publish(self, endpoint: str, base: int) -> None:
        entry = self.directory / _entry_name(netns_id(), endpoint)
        record = {"endpoint": endpoint, "path": self.path, "base": base, "size": self.nbytes,
                  "pid": os.getpid(), "start": process_start(os.getpid())}
        tmp = entry.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, entry)
        self.entry = entry

    def close(self) -> None:
        for p in (self.entry, Path(self.path)):
            if p is not None:
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass


def sweep_dead(directory: Path, netns: int, user: str = "kvconnect") -> None:
    """Remove entries (and their files) of holders in network namespace ``netns`` that died
    without closing (other namespaces' holders may live in another PID namespace)."""
    for entry in directory.glob(f"{netns}-*.json"):
        try:
            rec = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if process_start(rec.get("pid", -1)) != rec.get("start"):
            for p in (Path(rec.get("path", "")), entry):
                try:
                    if p.name:
                        p.unlink()
                except OSError:
                    pass
            log.info("%s: removed the shared segment of dead holder pid %s", user, rec.get("pid"))


@dataclass
class _Mapped:
    base: int       # the holder's address of the file's first byte
    size: int
    local: int      # this process's address of it
    pid: int
    start: int


class SameHostSegments:
    """Reader side: published segments of live holders in this network namespace, mapped
    read-only on first use. Thread-safe."""

    def __init__(self, directory: str, user: str = "kvconnect"):
        self.directory = Path(directory)
        self.user = user  # the store, in log lines
        self._netns = netns_id()
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapped] = {}
        self._listed_at = -_LIST_EVERY_S
        self._entries: dict[str, Path] = {}
        self._graveyard: list[tuple[float, int, int]] = []  # (dropped at, address, size)
        # endpoints whose segment could not be mapped, and when: not tried again for a listing
        # period (each try reads the registry; a reader runs source() for every page)
        self._refused: dict[str, float] = {}
        self._warned: set[str] = set()

    def present(self) -> bool:
        """Whether any holder published a segment in this namespace (re-listed every 2 s)."""
        now = time.monotonic()
        if now - self._listed_at >= _LIST_EVERY_S:
            prefix = f"{self._netns}-"
            try:
                names = list(self.directory.glob(prefix + "*.json"))
            except OSError:
                names = []
            with self._lock:
                self._entries = {p.name: p for p in names}
                self._listed_at = now
                self._bury_old(now)
            # a holder that left (entry gone) or died: let go of its memory (an unlinked
            # file's pages stay allocated while anyone maps them)
            for endpoint, m in list(self._maps.items()):
                if _entry_name(self._netns, endpoint) not in self._entries or \
                        process_start(m.pid) != m.start:
                    self._drop(endpoint)
        return bool(self._entries)

    @property
    def mapped(self) -> int:
        """Same-host segments mapped now."""
        return len(self._maps)

    def source(self, endpoint: str, address: int, nbytes: int) -> int | None:
        """This process's address of ``[address, address + nbytes)`` at ``endpoint``, if a
        live same-host holder published it."""
        m = self._maps.get(endpoint)
        if m is None:
            m = self._open(endpoint)
            if m is None:
                return None
        if m.base <= address and address + nbytes <= m.base + m.size:
            return m.local + (address - m.base)
        return None

    def alive(self, endpoint: str) -> bool:
        """Whether the holder mapped for ``endpoint`` still runs (checked after a copy)."""
        m = self._maps.get(endpoint)
        if m is not None and process_start(m.pid) == m.start:
            return True
        self._drop(endpoint)
        return False

    def _open(self, endpoint: str) -> _Mapped | None:
        entry = self._entries.get(_entry_name(self._netns, endpoint))
        if entry is None:
            return None
        with self._lock:
            if endpoint in self._maps:
                return self._maps[endpoint]
            refused = self._refused.get(endpoint)
            if refused is not None and time.monotonic() - refused < _LIST_EVERY_S:
                return None
            why = ""
            try:
                rec = json.loads(entry.read_text())
                if rec["endpoint"] != endpoint or process_start(rec["pid"]) != rec["start"]:
                    return self._refuse(endpoint, "")
                fd = os.open(rec["path"], os.O_RDONLY)
            except (OSError, ValueError, KeyError) as e:
                # EACCES: the holder runs as another user (its file is 0600); its pages take the transport
                return self._refuse(endpoint, f"{e}" if isinstance(e, PermissionError) else "")
            try:
                if os.fstat(fd).st_size < rec["size"]:
                    return self._refuse(endpoint, "")
                local = _libc.mmap(None, rec["size"], _PROT_READ, _MAP_SHARED, fd, 0)
                if local in (None, _MAP_FAILED):
                    why = f"mmap errno {ctypes.get_errno()}"
            finally:
                os.close(fd)
            if why:
                return self._refuse(endpoint, f"cannot map {rec['path']}: {why}")
            self._refused.pop(endpoint, None)
            m = _Mapped(base=int(rec["base"]), size=int(rec["size"]), local=local, pid=int(rec["pid"]),
                        start=int(rec["start"]))
            self._maps[endpoint] = m
            log.info("%s: reading the pages of same-host pid %d (%s) from shared memory",
                     self.user, m.pid, endpoint)
            return m

    def _refuse(self, endpoint: str, why: str) -> None:
        """Remembers (lock held) that ``endpoint``'s segment cannot be mapped now; ``why``, when
        an operator should hear it, is logged once per endpoint."""
        self._refused[endpoint] = time.monotonic()
        if why and endpoint not in self._warned:
            self._warned.add(endpoint)
            log.warning("%s: the pages of same-host %s are not read from shared memory (%s); "
                        "they take the transport", self.user, endpoint, why)
        return None

    def _drop(self, endpoint: str) -> None:
        with self._lock:
            m = self._maps.pop(endpoint, None)
            if m is not None:
                # a copy of another thread may still read it: unmapped later, not now
                self._graveyard.append((time.monotonic(), m.local, m.size))
                log.warning("%s: same-host pid %d (%s) is gone; its pages are no longer "
                            "read from shared memory", self.user, m.pid, endpoint)

    def _bury_old(self, now: float) -> None:
        keep = []
        for dropped, address, size in self._graveyard:
            if now - dropped >= _UNMAP_AFTER_S:
                _libc.munmap(address, size)
            else:
                keep.append((dropped, address, size))
        self._graveyard = keep

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                self._graveyard.append((-_UNMAP_AFTER_S, m.local, m.size))
            self._maps.clear()
            self._bury_old(time.monotonic())
