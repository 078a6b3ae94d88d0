"""The hf3fs store's lanes: one page size each, with its data file and its namespace of the
index (see "Page sizes" in ``kvconnect.connectors.hf3fs.store``).

The first size registered in the store's namespace, by anyone, is the primary lane
(SGLang's file and namespace); another size gets ``….bin.p{bytes}`` and ``{ns}:p{bytes}``.
A lane is opened once its namespace exists in the index: created here by a writer, or
registered by another process (adopted by readers that never wrote).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.hf3fs.client import MetadataError
from kvconnect.connectors.hf3fs.config import check_page_count
from kvconnect.connectors.hf3fs.files import STAGE_BYTES, PosixFile, StripedFile, UsrbioFile, on_local_fs, usable_cpus
from kvconnect.connectors.hf3fs.ownership import LOCK_SUFFIX, claim
from kvconnect.connectors.hf3fs.pageid import PageIds

log = logging.getLogger("kvconnect.hf3fs")

# Fraction of a lease a client trusts: the service's clock started it a little after ours.
LEASE_TRUST = 0.8


class Lane:
    """One page size: a data file, its namespace, its geometry and leases."""

    __slots__ = ("page_bytes", "ns", "path", "file", "kind", "num_pages", "read_lease_s", "write_lease_s", "ids")

    def __init__(self, page_bytes, ns, path, file, kind, info, ids=None):
        self.page_bytes = page_bytes
        self.ns = ns
        self.path = path
        self.file = file
        self.kind = kind
        self.num_pages = info.num_pages
        self.read_lease_s = info.read_lease_s
        self.write_lease_s = info.write_lease_s
        self.ids = ids  # PageIds (verify_pages) or None


class Lanes:
    """The lanes a store knows, by page size, and how a new one is found or laid out."""

    def __init__(self, store):  # the HF3FSStore this is part of: its index, names and file layout
        self.store = store
        self.config = store.config
        self.by_size: dict[int, Lane] = {}
        self.primary: Lane | None = None
        self._lock = threading.Lock()
        self._unknown_sizes: dict[int, float] = {}  # size -> when a lookup last found no lane
        self._refused: dict[int, tuple[float, ConfigError]] = {}  # size -> when its file was refused, why
        self.discovered_at = 0.0

    def all(self) -> list[Lane]:
        return list(self.by_size.values())

    def _names(self, page_bytes: int, primary: bool) -> tuple[str, str]:
        s = self.store
        if primary:
            return s.ns, s.path
        return f"{s.ns}:p{page_bytes}", f"{s.path}.p{page_bytes}"

    def _open(self, page_bytes: int, ns: str, path: str, info) -> Lane:
        s = self.store
        # One index per data file: the file must be this index's (its stamp), or no index's
        # yet (adopted now); another index's file is refused (ConfigError), never shared.
        claim(path, s.meta.identity(), ns, lock_path=os.path.realpath(s.path) + LOCK_SUFFIX,
              index=self.config.metadata_server_url or "in-process index")
        size = info.num_pages * info.page_bytes
        if s.client_kind == "usrbio":
            f = UsrbioFile(path, size, page_bytes, self.config.entries, self.config.numjobs,
                           self.config.client_timeout)
        else:
            local = on_local_fs(path)
            cfg = self.config
            # auto: stage when another worker's locked copy can overlap ours (one file, two or
            # more workers and cores); striped files already copy in parallel, and a second
            # copy per byte then only costs memory bandwidth (measured: docs/hf3fs.md)
            staged = cfg.posix_write == "staged" or (cfg.posix_write == "auto" and s.stripes == 1
                                                     and cfg.numjobs >= 2 and usable_cpus() >= 2)
            posix = {"mmap_reads": cfg.posix_read == "mmap" or (cfg.posix_read == "auto" and local),
                     "stage_bytes": STAGE_BYTES if staged else 0}
            if s.stripes > 1:
                f = StripedFile(path, size, page_bytes, s.stripes, **posix)
            else:
                f = PosixFile(path, size, **posix)
        ids = None
        if s.verify:
            try:
                ids = PageIds(path + ".ids", info.num_pages, mapped=getattr(f, "mapped", False))
            except BaseException:
                f.close()
                raise
        lane = Lane(page_bytes, ns, path, f, s.client_kind, info, ids)
        log.info("hf3fs: %s (%s client) holds %d pages of %d bytes, namespace %s", path, s.client_kind,
                 info.num_pages, page_bytes, ns)
        return lane

    def lane(self, page_bytes: int, create: bool) -> Lane | None:
        """The lane of ``page_bytes``: known, registered by another process, or (``create``) new."""
        lane = self.by_size.get(page_bytes)
        if lane is not None:
            return lane
        if not create:
            seen = self._unknown_sizes.get(page_bytes)
            if seen is not None and time.monotonic() - seen < 2.0:
                return None
        refused = self._refused.get(page_bytes)
        if refused is not None and time.monotonic() - refused[0] < 5.0:
            raise refused[1]  # another index's file: no index calls per batch to hear it again
        meta = self.store.meta
        with self._lock:
            lane = self.by_size.get(page_bytes)
            if lane is not None:
                return lane
            num_pages = self.config.file_size // page_bytes
            if create and num_pages < 1:
                raise ConfigError("file_size", f"{self.config.file_size} bytes hold no page of {page_bytes} bytes",
                                  "a file_size of at least one page")
            check_page_count(self.config.file_size, page_bytes)
            # The primary namespace takes the first size registered in it, by anyone.
            for primary in (True, False):
                ns, path = self._names(page_bytes, primary)
                info = meta.initialize(ns, 0, 0)
                if info.page_bytes == page_bytes:
                    break
                if info.page_bytes or not create or (primary and self.primary is not None):
                    continue
                try:
                    info = meta.initialize(ns, num_pages, page_bytes)
                except ConfigError:
                    if primary:  # another process registered another size first
                        continue
                    raise
                break
            else:
                self._unknown_sizes[page_bytes] = time.monotonic()
                return None
            try:
                lane = self._open(page_bytes, ns, path, info)
            except ConfigError as e:
                self._refused[page_bytes] = (time.monotonic(), e)
                raise
            self.by_size[page_bytes] = lane
            if ns == self.store.ns:
                self.primary = lane
            self._unknown_sizes.pop(page_bytes, None)
            return lane

    def discover(self) -> None:
        """Adopt lanes other processes registered for this rank and pool (readers that never wrote)."""
        self.discovered_at = time.monotonic()
        ns = self.store.ns
        try:
            spaces = self.store.meta.spaces(ns)
        except MetadataError:
            return
        for name, _num, pb in spaces:
            if (name == ns or name.startswith(ns + ":p")) and pb and pb not in self.by_size:
                try:
                    self.lane(int(pb), create=False)
                except (MetadataError, ConfigError, OSError) as e:
                    log.warning("hf3fs: cannot open lane %s: %s", name, e)

    def close(self) -> None:
        for lane in self.by_size.values():
            lane.file.close()
            if lane.ids is not None:
                lane.ids.close()
        self.by_size.clear()
        self.primary = None
