"""``hf3fs``: KV pages at fixed offsets of one file per rank, indexed by a metadata service.

Layout: page ``slot`` of a data file lies at ``slot * page_bytes``; the file is
``{file_path_prefix}.{rank}.bin`` (``.0.bin`` for MLA, whose KV every rank shares and
rank 0 writes) plus ``.{pool}`` for side pools, exactly SGLang's naming. A whole page (all
its segments, e.g. K and V) is one contiguous slot, moved with one vectored syscall.

Write: reserve slots for the batch (one metadata call), write the pages in parallel on
``numjobs`` workers, then confirm (one call) — a key becomes visible only after its bytes
landed. Read: look the batch up (one call; leases the slots against reuse), read in
parallel, and accept a page only if it still belongs to its key: either the read finished
within the read lease, or a ``validate`` call confirms the (slot, generation) is unchanged;
with ``checksums`` the page's CRC32 must match too.

Page sizes ("lanes"): a file holds pages of one size. The first size a store meets (the
engine's ``page_bytes``, else the size the service recorded, else the first page written)
uses SGLang's file and namespace (``{rank}:{pool}``); pages of another size (a hybrid
model's side pools sent through the same store) get their own file ``….bin.p{bytes}`` and
namespace ``{rank}:{pool}:p{bytes}``. ``exists`` asks every lane this store knows.

The engine's ``EngineContext`` names the file and namespace: ``data_rank`` (the TP rank,
or the writer's for rank-replicated KV), ``pool`` (``"kv"``, ``"mamba"``, ...) and
``page_bytes`` (the first lane). Without a context (no engine: tests, tools) the store
takes rank 0 with a metadata service, else the first data file no other process holds.
Which ranks write is the integration's business (``EngineContext.is_writer``): the store
stores what it is given.

Capabilities: with a metadata service the pages are shared between processes and hosts
and durable (the index survives a restart of the engine and of the service); without one
the index lives in this process, and so do its LRU evictions, which the store reports to
eviction listeners (``EVICTION_EVENTS``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any, Mapping

from kvconnect.connectors.base import Capability, ConfigError, Page, PageStore, StoreUsage
from kvconnect.connectors.hf3fs.client import LocalMetadata, MetadataClient, MetadataError
from kvconnect.connectors.hf3fs.config import HF3FSConfig, merged_options
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.rate_limited_log import RateLimitedLog
from kvconnect.connectors.hf3fs.files import PosixFile, mount_fstype, on_3fs_mount
from kvconnect.connectors.hf3fs.lanes import Lanes
from kvconnect.connectors.hf3fs.ownership import LOCK_SUFFIX, Locked, lock_exclusive, unlock
from kvconnect.connectors.hf3fs.page_io import PageIO
from kvconnect.connectors.hf3fs.reads import Reader
from kvconnect.connectors.hf3fs.writes import Writer

log = logging.getLogger("kvconnect.hf3fs")
_rate_limited = RateLimitedLog(log, interval_s=10.0)
_LOOKS_3FS = re.compile(r"(^|/)(hf)?3fs(/|$)", re.IGNORECASE)  # /mnt/3fs/..., /3fs/...: where 3FS is mounted

class _LocalIndexes:
    """One in-process index per data file per process, guarded by an exclusive flock
    (``{file}.lock``, the holder's pid in it) so a second process cannot use the same file
    without a metadata service, and no index of a service adopts it meanwhile (``ownership.py``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[str, list] = {}  # path -> [LocalMetadata, lock fd, refs]

    def acquire(self, path: str) -> LocalMetadata:
        key = os.path.realpath(path)
        with self._lock:
            entry = self._by_path.get(key)
            if entry is None:
                lock_path = key + LOCK_SUFFIX
                try:
                    fd = lock_exclusive(lock_path)
                except Locked as e:
                    raise ConfigError(
                        "metadata_server_url",
                        f"data file {path!r} is used by another process with its own in-process index "
                        f"({e.holder}); processes sharing a file need a metadata service "
                        "(kvconnect hf3fs-meta serve)") from e
                except OSError as e:
                    raise ConfigError("file_path_prefix", f"cannot create {lock_path!r}: {e.strerror}") from e
                entry = self._by_path[key] = [LocalMetadata(), fd, 0]
            entry[2] += 1
            return entry[0]

    def release(self, path: str) -> None:
        key = os.path.realpath(path)
        with self._lock:
            entry = self._by_path.get(key)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] <= 0:
                del self._by_path[key]
                unlock(entry[1])


_LOCAL = _LocalIndexes()


class HF3FSStore(PageStore):
    """Pages in files (3FS via usrbio, or any POSIX filesystem) plus a page index.

    The store names its files and namespace, holds its index (``meta``: a metadata
    service's client or this process's own index) and runs the read and write protocols
    against it; it composes the objects that do the rest, each owning its state:

    * ``lanes`` (lanes.py): one data file and namespace per page size, found or laid out.
    * ``io`` (page_io.py): the read and write workers and the batches fanned out over them.
    * ``reader`` (reads.py) / ``writer`` (writes.py): one lane's reads and writes against the
      index (leases, validation, identities; reservations and commits).
    """

    name = "hf3fs"
    config_class = HF3FSConfig
    capabilities = frozenset({Capability.SHARED, Capability.DURABLE, Capability.ZERO_COPY,
                              Capability.EVICTION_EVENTS})
    metric_counters = frozenset({"validations", "rejected_reads", "stale_reads", "index_wait_shortfalls",
                                 "index_no_replica_writes"})
    # the Redis index's write counters (redis_index.py), in stats().extra as index_<name>
    _INDEX_COUNTERS = ("wait_shortfalls", "no_replica_writes")

    @classmethod
    def config_from_options(cls, options: Mapping[str, Any] | None = None) -> HF3FSConfig:
        """Options overlaid on SGLang's hf3fs JSON (``config_path`` / $SGLANG_HICACHE_HF3FS_CONFIG_PATH)."""
        from kvconnect.connectors.config import parse_config

        return parse_config(cls.config_class, merged_options(options), where=f"store {cls.name!r}")

    @classmethod
    def capabilities_of(cls, config: HF3FSConfig | None) -> frozenset[Capability]:
        have = set(cls.capabilities)
        if config is None or not config.metadata_server_url:
            have -= {Capability.SHARED, Capability.DURABLE}  # the index lives in this process
        else:
            have.discard(Capability.EVICTION_EVENTS)  # the service evicts, out of this process's sight
        if config is not None and config.client == "usrbio" and not config.use_mock_hf3fs_client:
            have.discard(Capability.ZERO_COPY)  # usrbio stages pages through its shared ring buffers
        return frozenset(have)

    @classmethod
    def capability_hint(cls, capability: Capability, config: Any) -> str:
        if capability in (Capability.SHARED, Capability.DURABLE):
            return "set metadata_server_url to a 'kvconnect hf3fs-meta serve' service"
        return ""

    def __init__(self, config: HF3FSConfig, context: EngineContext | None = None, *,
                 metadata: MetadataClient | None = None):
        super().__init__(context)
        self.config = config
        # None: no engine, or one process looks up every rank's keys: one file and namespace for all
        rank = context.data_rank if context is not None and not context.cross_rank_lookups else None
        self.file_rank = rank or 0
        self.pool = context.pool if context is not None else "kv"
        page_bytes = context.page_bytes if context is not None else None
        suffix = "" if self.pool == "kv" else f".{self.pool}"
        self.path = f"{config.file_path_prefix}.{self.file_rank}.bin{suffix}"
        self.client_kind = self._choose_client()
        # Striped POSIX files get names and a namespace of their own (".x{n}"): a process
        # striping differently never reads a slot number through another file layout.
        self.stripes = config.posix_files if self.client_kind == "posix" else 1
        self._stripe_tag = f"x{self.stripes}" if self.stripes > 1 else ""
        if self._stripe_tag:
            suffix += "." + self._stripe_tag
            self.path += "." + self._stripe_tag
        self.ns = self._namespace(self.file_rank)
        self.lanes = Lanes(self)
        self._local_path: str | None = None
        self.io: PageIO | None = None
        self._owns_meta = metadata is None
        self.reader = Reader(self)
        self.writer = Writer(self)

        # Metadata first: a wrong token or a dead service fails the start, before any file.
        if metadata is not None:
            self.meta = metadata
        elif config.metadata_server_url:
            from kvconnect.connectors.hf3fs.metadata import connect_metadata

            self.meta = connect_metadata(config, self.ns)
        else:
            # No service: the in-process index makes the file's old contents meaningless, so
            # any file no other process holds will do: the rank's own if free (SGLang's
            # naming), else the first free one (another process of the same TP rank, e.g. a
            # second pipeline stage, holds it). Without a rank: the first free one.
            self._take_free_local_file(config, suffix, prefer=rank)
        index = getattr(self.meta, "index", None)  # the in-process index evicts here: report it
        self._evict_index = index if index is not None and self.supports(Capability.EVICTION_EVENTS) else None
        if self._evict_index is not None:
            self._evict_index.evict_listeners += (self._index_evicted,)
        # Page identities: where the index may answer stale mappings (a Redis failover), or on request.
        self.verify = config.verify_pages == "on" or (config.verify_pages == "auto" and self.meta.may_serve_stale)
        try:
            # Open (create) the primary data file now: an unwritable path fails the start.
            PosixFile(self.path, 0).close()
            if _LOOKS_3FS.search(config.file_path_prefix) and not on_3fs_mount(self.path):
                log.warning("kvconnect hf3fs: file_path_prefix %s looks like a 3FS mount but %s is on %r, not "
                            "3FS: pages go to that file system, not to 3FS (is the mount missing?)",
                            config.file_path_prefix, self.path, mount_fstype(self.path))
            self.io = PageIO(config)
            hint = config.page_bytes or page_bytes
            if hint:
                self.lanes.lane(int(hint), create=True)
            self.lanes.discover()
        except BaseException:
            self._release()
            raise

    def _take_free_local_file(self, config: HF3FSConfig, suffix: str, prefer: int | None = None) -> None:
        last: ConfigError | None = None
        order = range(1024) if prefer is None else [int(prefer)] + [n for n in range(1024) if n != prefer]
        for n in order:
            path = f"{config.file_path_prefix}.{n}.bin{suffix}"
            try:
                self.meta = _LOCAL.acquire(path)
            except ConfigError as e:
                if "used by another process" not in str(e):
                    raise
                last = e
                continue
            self.file_rank, self.path, self._local_path = n, path, path
            self.ns = self._namespace(n)
            return
        raise last or ConfigError("file_path_prefix", "no free data file")

    # ------------------------------------------------------------------ lanes
    def _namespace(self, file_rank: int) -> str:
        return f"{file_rank}:{self.pool}" + (f":{self._stripe_tag}" if self._stripe_tag else "")

    def _choose_client(self) -> str:
        client = self.config.client
        if self.config.use_mock_hf3fs_client:
            client = "posix"
        if client == "auto":
            client = "usrbio" if on_3fs_mount(self.path) else "posix"
        return client

    @property
    def page_bytes(self) -> int:
        primary = self.lanes.primary
        return primary.page_bytes if primary else 0

    @property
    def num_pages(self) -> int:
        primary = self.lanes.primary
        return primary.num_pages if primary else 0

    @property
    def validations(self) -> int:
        return self.reader.validations

    @property
    def rejected_reads(self) -> int:
        return self.reader.rejected_reads

    @property
    def stale_reads(self) -> int:
        return self.reader.stale_reads

    # ------------------------------------------------------------------ primitives
    @staticmethod
    def _encode(keys: list[str]) -> list[bytes]:
        return [k.encode() for k in keys]  # the base class refused empty keys and newlines (the wire's separator)

    @staticmethod
    def _by_size(pages: list[Page]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(pages):
            groups.setdefault(sum(n for _, n in p), []).append(i)
        return groups

    def _exists(self, keys: list[str]) -> list[bool]:
        kb = self._encode(keys)
        # Until a lane is known ask the index every time (one small call); then look for
        # lanes other processes added (side pools) every few seconds.
        lanes = self.lanes
        if not lanes.by_size or time.monotonic() - lanes.discovered_at > 5.0:
            lanes.discover()
        out = [False] * len(keys)
        for lane in self.lanes.all():
            try:
                present = self.meta.exists(lane.ns, kb)
            except MetadataError as e:
                self._note_error("exists", e)
                continue
            out = [a or bool(b) for a, b in zip(out, present)]
        return out

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        out = [False] * len(keys)
        for size, idx in self._by_size(pages).items():
            try:
                lane = self.lanes.lane(size, create=False)
            except (MetadataError, ConfigError, OSError) as e:
                self._note_error("layout", e)
                self._miss("unavailable" if isinstance(e, MetadataError) else "mismatch", len(idx))
                continue
            if lane is None:
                continue
            ok = self.reader.read(lane, [keys[i] for i in idx], [pages[i] for i in idx])
            for i, o in zip(idx, ok):
                out[i] = o
        return out

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        out = [False] * len(keys)
        for size, idx in self._by_size(pages).items():
            try:
                lane = self.lanes.lane(size, create=True)
            except Exception as e:  # noqa: BLE001 - a page size that cannot be laid out fails its writes
                self._note_error("layout", e)
                continue
            if lane is None:
                continue
            ok = self.writer.write(lane, [keys[i] for i in idx], [pages[i] for i in idx])
            for i, o in zip(idx, ok):
                out[i] = o
        return out

    def _delete(self, keys: list[str]) -> list[bool]:
        kb = self._encode(keys)
        out = [False] * len(keys)
        for lane in self.lanes.all():
            try:
                gone = self.meta.delete(lane.ns, kb)
            except MetadataError as e:
                self._note_error("delete", e)
                continue
            out = [a or bool(b) for a, b in zip(out, gone)]
        return out

    def _clear(self) -> None:
        for lane in self.lanes.all():
            try:
                self.meta.clear(lane.ns)
            except MetadataError as e:
                self._note_error("clear", e)

    def _clear_prefix(self, prefix: str) -> None:
        self.lanes.discover()  # lanes other processes opened hold keys of the prefix too
        for lane in self.lanes.all():
            try:
                self.meta.clear(lane.ns, prefix.encode())
            except MetadataError as e:
                self._note_error("clear", e)

    def _usage(self) -> StoreUsage:
        keys = bytes_used = capacity = evictions = 0
        reserved = 0
        for lane in self.lanes.all():
            try:
                u = self.meta.usage(lane.ns)
            except MetadataError:
                continue
            keys += u.get("keys", 0)
            bytes_used += u.get("keys", 0) * lane.page_bytes
            capacity += lane.num_pages * lane.page_bytes
            evictions += u.get("evictions", 0)
            reserved += u.get("reserved", 0)
        if not self.lanes.by_size:
            # no data file open yet: the first one opens with the first page, file_size bytes
            capacity = int(self.config.file_size or 0)
        return StoreUsage(keys=keys, bytes_used=bytes_used, capacity_bytes=capacity, evictions=evictions,
                          extra={"files": [lane.path for lane in self.lanes.all()], "client": self.client_kind,
                                 "namespace": self.ns, "validations": self.validations,
                                 "rejected_reads": self.rejected_reads, "reserved": reserved,
                                 "verify_pages": self.verify, "stale_reads": self.stale_reads,
                                 **{f"index_{c}": getattr(self.meta, c) for c in self._INDEX_COUNTERS
                                    if isinstance(getattr(self.meta, c, None), int)}})

    def describe(self) -> str:
        mount = "on a 3FS mount" if on_3fs_mount(self.path) else "NOT a 3FS mount"
        url = self.config.metadata_server_url
        if not url:
            index = "in-process index (this process only)"
        else:
            auth = "on" if self.config.token() else "off"
            port = getattr(self.meta, "_tcp_port", None)  # RemoteMetadata: framed TCP port, once asked
            via = "redis" if url.startswith(("redis", "rediss")) else "framed tcp" if port else "grpc"
            index = f"index {url} (auth {auth}, {via})"
        return f"files {self.path} ({self.client_kind}, {mount}), {index}, key space {self.ns}"

    def _note_error(self, op: str, e: Exception) -> None:
        self.record_error()
        if isinstance(e, MetadataError):  # the index did not answer: the call's misses are not index misses
            self._miss("unavailable")
        # one line per operation and error kind per 10 s: a dead index fails every call
        _rate_limited.warning(f"{op}:{type(e).__name__}", "hf3fs: %s failed, treated as a miss: %s", op, e)

    # ------------------------------------------------------------------ lifecycle
    def _index_evicted(self, ns: str, keys: list) -> None:
        """The in-process index evicted ``keys`` of ``ns`` (under its lock: only report)."""
        if any(lane.ns == ns for lane in self.lanes.all()):
            self._report_evicted([k.decode() for k in keys])

    def _release(self) -> None:
        index = getattr(self, "_evict_index", None)
        if index is not None:
            index.evict_listeners = tuple(x for x in index.evict_listeners if x != self._index_evicted)
            self._evict_index = None
        if self.io is not None:
            self.io.close()
            self.io = None
        self.lanes.close()
        if self._local_path is not None:
            _LOCAL.release(self._local_path)
            self._local_path = None
        elif self._owns_meta and getattr(self, "meta", None) is not None:
            self.meta.close()

    def _close(self) -> None:
        self._release()
